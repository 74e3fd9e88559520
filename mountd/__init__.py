"""The per-VM mount daemon: a read-only FUSE filesystem over a content-addressed cache."""
