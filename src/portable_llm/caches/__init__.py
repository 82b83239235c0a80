"""KV caches: growing buffers (KVCache, RotatingKVCache), page pools, paged and prefix caches."""
