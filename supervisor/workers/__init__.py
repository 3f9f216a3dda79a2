"""Model workers: the pool, each worker's handle, engine checks."""
