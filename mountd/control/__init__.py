"""The control socket (register, unregister, status, prefetch) and mountd's metrics."""
