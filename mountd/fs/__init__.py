"""The FUSE side: the datasets' connection and ``ROOT/.quiver``'s (the job control files
and the views)."""
