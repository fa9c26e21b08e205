"""kv_transfer: the prefill → decode KV hand-off over NIXL: handshake, notices, the in-flight
budget, leases and the transfer manager (see docs/structure.md)."""
