"""Environment of a one-machine Ray without a GPU: Ray and UCX on loopback.

Ray reads `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER` when it is imported, so `loopback_env()` must run
before the first `import ray` of the process (the CLI calls it before importing the launcher);
it is only for a local Ray (`pdserve up` without `--address`), never for a multi-node cluster.
"""

from __future__ import annotations

import os


def loopback_env() -> None:
    """Ray and UCX on loopback for one-machine clusters without a GPU (set before ray.init)."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # loopback-only local Ray
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if not has_gpu:
        os.environ.setdefault("UCX_TLS", "shm,tcp")
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
