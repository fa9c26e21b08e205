"""The tensor-parallel suites: `tp` (step overhead on CPU), `tp_handoff` (hand-off
descriptors and bytes) and `tp_gpu` (TP decode and hand-offs on GPUs, with its plan, rank
processes and pipe RPC)."""
