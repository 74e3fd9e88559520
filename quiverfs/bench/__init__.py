"""Benchmarks and test harnesses: ``quiver bench``, the demo, the GCS emulator, the
bandwidth-capped proxy, mountd and coordinator child processes, and benchmark jobs.

Nothing in the product imports this package; it imports the product.
"""
