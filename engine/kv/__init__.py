"""engine.kv: the paged KV pool (block pool with prefix hashing, the KV tensors and their
layouts, sizing) and its host tier."""
