"""Shared fixtures: real redis-server, real local Ray, the tiny checkpoint.

Everything a test needs is started here (never by hand in CI): the embedded redis-server,
a loopback-only local Ray, and the tiny model written by `pdserve make-model`.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
from directory_scope import stop_finished_directories
from references import (
    LogitsReference,
    LogprobsReference,
    Reference,
    greedy_reference,
    logits_reference,
    logprobs_reference,
)

from vocabulary.tokenizer import Tokenizer

# Loopback-only Ray and UCX, before anything imports them.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# No Ray of its own behind a test's back: a unit test whose code path touches a Ray API (a
# fake call cancelled with `ray.cancel`) would otherwise start a default local Ray, slow and
# not on loopback, and the session's `ray_cluster` could not start after it.
os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")


def _has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


HAS_CUDA = _has_cuda()
if not HAS_CUDA:  # on a GPU host UCX must pick cuda_ipc itself: a UCX_TLS without it is slow
    os.environ.setdefault("UCX_TLS", "shm,tcp")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")


def _one_torch_thread() -> None:
    """One intra-op torch thread in each test process of a CPU machine, as the CPU workers run
    (`WorkerConfig.torch_threads`): the transformers references and the in-process engines
    gain nothing from a second thread on the tiny model, and with two xdist workers on 2
    shared cores a descheduled second OpenMP thread stalls every small op at its barrier
    (docs/benchmarks.md, "Engine (CPU)")."""
    import torch

    torch.set_num_threads(1)


# Directories whose tests share one session-scoped cluster: under pytest-xdist
# (`scripts/test.sh` runs `-n 2`) each runs on one worker, which starts that cluster once;
# every other test file is a unit of its own (its module fixtures start once).
SHARED_CLUSTER_DIRS = ("tests/integration/observability", "tests/integration/router",
                       "tests/integration/security", "tests/integration/workers")  # fmt: skip
OWN_CLUSTER_FILES = (
    "tests/integration/router/test_role_switch_cluster.py",
    "tests/integration/router/test_split_cluster.py",
)
"""Files in a shared-cluster directory that start a cluster of their own and never use the
directory's: units of their own, so that the other worker can run them meanwhile."""


LONG_FIRST = (
    "tests/integration/router",
    "tests/integration/workers",
    "tests/integration/chaos/test_chaos_run.py",
    "tests/integration/deploy/test_autoscaling.py",
    "tests/integration/router/test_role_switch_cluster.py",
    "tests/integration/deploy/test_cli_cluster.py",
    "tests/integration/engine/test_engine_pp.py",
    "tests/integration/engine/test_engine_int_checkpoint.py",
    "tests/integration/observability",
    "tests/integration/deploy/test_cli_secure.py",
    "tests/unit/engine/test_triton_decode.py",
    "tests/integration/engine/test_engine_tp.py",
)
"""Units that take half a minute or more, longest first, started before the rest so that no
worker is left with one of them at the end (`scripts/test.sh` keeps the collection's order:
--no-loadscope-reorder)."""


def xdist_scope(nodeid: str) -> str:
    """The unit pytest-xdist sends to one worker: the test's shared-cluster directory, or its
    file."""
    path = nodeid.split("::", 1)[0]
    if path in OWN_CLUSTER_FILES:
        return path
    return next((d for d in SHARED_CLUSTER_DIRS if path.startswith(d + "/")), path)


class _UnitScheduling:
    """pytest-xdist's loadscope scheduling over `xdist_scope`'s units (registered only where
    the xdist plugin runs: the GPU machine has none, `-p no:xdist` turns it off)."""

    def pytest_xdist_make_scheduler(self, config: pytest.Config, log: object) -> object:
        from xdist.scheduler import LoadScopeScheduling

        class UnitScope(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return xdist_scope(nodeid)

        return UnitScope(config, log)


def pytest_configure(config: pytest.Config) -> None:
    if not HAS_CUDA:
        _one_torch_thread()
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_UnitScheduling(), "pdserve-unit-scheduling")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, None, None]:
    """After the item's own teardown (its function fixtures' finalizers, which may still use
    the directory's cluster), stop what a directory it ends holds."""
    try:
        return (yield)
    finally:
        stop_finished_directories(item, nextitem)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        scope = xdist_scope(item.nodeid)
        return LONG_FIRST.index(scope) if scope in LONG_FIRST else len(LONG_FIRST)

    items.sort(key=rank)  # stable: the rest keep their order
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny trained checkpoint (written once per session, seed 0)."""
    from deploy.checkpoints.make_model import cached_tiny_model

    return cached_tiny_model()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a real redis-server on a free loopback port, for the whole session."""
    from deploy.control.embedded_redis import EmbeddedRedis

    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture()
def redis_server() -> Iterator[object]:
    """A redis-server owned by one test (for restart/outage tests)."""
    from deploy.control.embedded_redis import EmbeddedRedis

    with EmbeddedRedis() as server:
        yield server


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """A local Ray on loopback, shared by the session (2.5-5 s to start)."""
    import ray

    ray.init(
        num_cpus=8,
        include_dashboard=False,
        object_store_memory=200 * 1024 * 1024,
        log_to_driver=True,
        _node_ip_address="127.0.0.1",
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(tiny_model_dir)


@pytest.fixture(scope="session")
def hf_greedy(tiny_model_dir: Path) -> Reference:
    """transformers float32 greedy continuation, eos ignored (a full recompute), memoized."""
    return greedy_reference(tiny_model_dir, stop_at_eos=False)


@pytest.fixture(scope="session")
def hf_greedy_to_eos(tiny_model_dir: Path) -> Reference:
    """transformers float32 `generate`: greedy, stops after eos, memoized per prompt."""
    return greedy_reference(tiny_model_dir, stop_at_eos=True)


@pytest.fixture(scope="session")
def hf_logprobs(hf_logits: LogitsReference) -> LogprobsReference:
    """transformers float32 log-softmax at every position of a sequence."""
    return logprobs_reference(hf_logits)


@pytest.fixture(scope="session")
def hf_logits(tiny_model_dir: Path) -> LogitsReference:
    """transformers float32 logits at every position of a sequence."""
    return logits_reference(tiny_model_dir)


@pytest.fixture(scope="session")
def corpus_ids(tokenizer: Tokenizer) -> list[int]:
    """The bundled training text as token ids (~2,000 tokens): long text-like prompts."""
    from deploy.checkpoints.checkpoint_files import CORPUS

    return tokenizer.encode(CORPUS.read_text())


@pytest.fixture(scope="session")
def corpus_prompts(tokenizer: Tokenizer) -> list[list[int]]:
    """32 text-like prompts of 3 to ~90 tokens from the bundled corpus; several share whole
    leading blocks (same paragraph opening, different lengths)."""
    from deploy.checkpoints.checkpoint_files import CORPUS

    paragraphs = [p.strip() for p in CORPUS.read_text().split("\n\n") if p.strip()]
    prompts: list[list[int]] = []
    lengths = (3, 9, 17, 33, 48, 61, 75, 90)
    i = 0
    while len(prompts) < 32:
        ids = tokenizer.encode(paragraphs[i % len(paragraphs)])
        prompts.append(ids[: lengths[i % len(lengths)]])
        i += 1
    return prompts
