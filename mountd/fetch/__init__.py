"""The read path: an item from the store, a peer or the bucket, fetched once however
many readers want it; the loader processes; what reads count."""
