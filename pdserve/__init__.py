"""pdserve's public API namespace: generated protobuf/gRPC modules live under `pdserve.v1`."""
