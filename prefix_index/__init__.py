"""prefix_index: the Redis prefix-cache index (lookups for the router, KV-event publishing
for workers)."""
