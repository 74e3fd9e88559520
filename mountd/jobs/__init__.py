"""Sampler jobs on this node: their registry, batch planning and probes, and the chunk
cycle as this node carries it out."""
