"""The cluster coordinator: membership, datasets by digest identity, chunk cycles."""
