"""Every suite of `python -m benchmarks`: its name (the figure's command in docs/benchmarks.md),
the module that runs it, a line on what it measures and where it runs. A suite's module is
imported only when that suite runs, so the list costs nothing to print."""

from __future__ import annotations

import enum
import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.harness.table import Table


class Device(enum.Enum):
    """Where a suite runs by default."""

    CPU = "CPU"
    GPU = "GPU"
    """Needs a CUDA GPU (without one, some say so and exit 2)."""

    @property
    def other(self) -> Device:
        return Device.CPU if self is Device.GPU else Device.GPU


@dataclass(frozen=True)
class Suite:
    name: str
    module: str
    """Under benchmarks.suites; it has `main(argv)`, which returns its exit status or None."""
    summary: str
    device: Device
    switch: str = ""
    """The arguments that run it (or a check of it) on the other kind of device, if any."""

    @property
    def where(self) -> str:
        if not self.switch:
            return self.device.value
        return f"{self.device.value} ({self.device.other.value}: {self.switch})"


SUITES = (
    Suite("attention", "attention", "paged decode attention kernels vs their KV-read floor",
          Device.GPU),
    Suite("auth_tls", "auth_tls", "TTFT through plain, API-key, TLS and key+TLS routers (A/B)",
          Device.CPU),
    Suite("block_hash", "block_hash", "xxh3-128 vs SHA-256 over one prompt's hash chain",
          Device.CPU),
    Suite("detokenize", "detokenize", "the engine thread's detokenization cost per token",
          Device.CPU),
    Suite("engine", "engine", "decode and prefill steps vs the HBM and matmul floors",
          Device.GPU, "--cpu"),
    Suite("engine_loop", "engine_loop",
          "continuous batching through LLMEngine vs transformers.generate", Device.CPU,
          "--device cuda"),
    Suite("engine_step", "engine_step",
          "LLMEngine.step(), overlap on/off, vs the pure decode; host profile",
          Device.GPU, "--cpu"),
    Suite("fp8", "fp8", "FP8 weights and KV vs bf16: decode, prefill, logit error", Device.GPU),
    Suite("goodput", "goodput", "disaggregated vs colocated goodput under an SLO sweep",
          Device.GPU),
    Suite("host_tier", "host_tier", "host KV tier: copy rates, chat with the tier on vs off",
          Device.GPU, "plan, copy --smoke"),
    Suite("http", "http", "TTFT/TPOT through the OpenAI HTTP door vs gRPC (A/B)", Device.CPU),
    Suite("int", "int_quant", "INT8 W8A8 and INT4 W4A16 vs bf16: decode, prefill, logits",
          Device.GPU),
    Suite("kv_transfer", "kv_transfer", "NIXL READ GB/s vs a plain copy; Redis lookup latency",
          Device.CPU, "--gpu"),
    Suite("local_prefill", "local_prefill",
          "local prefill by predicted cost vs the fixed threshold, cluster and simulator",
          Device.CPU),
    Suite("lora", "lora", "multi-LoRA decode vs the base model; adapter loads",
          Device.GPU, "--smoke"),
    Suite("planner", "planner",
          "reactive vs predictive planner on a ramp-and-burst trace, simulated", Device.CPU),
    Suite("pp", "pp", "pipeline parallelism: prefill 8k/32k and decode, PP=2 vs TP=2 vs 1 GPU",
          Device.GPU, "--cpu"),
    Suite("role_switch", "role_switch",
          "rebalance time: a worker switching role in place vs a restart", Device.CPU,
          "--model DIR"),
    Suite("router", "router", "router overhead: TTFT via gRPC minus straight to the workers",
          Device.CPU),
    Suite("sim_scale", "sim_scale",
          "pdserve simulate's CPU and wall time for a large cluster at a high rate", Device.CPU),
    Suite("simulator", "simulator",
          "pdserve simulate vs a real 1P1D tiny cluster: TTFT, TPOT, goodput", Device.CPU),
    Suite("sm_partition", "sm_partition",
          "SM partitions (green contexts): matmul and decode GEMM rates, alone and together",
          Device.GPU),
    Suite("split_goodput", "split_goodput",
          "split engine vs colocated: goodput under Poisson load, TPOT under a burst",
          Device.GPU, "--cpu"),
    Suite("soak", "soak", "steady load for a long time, every process's memory sampled",
          Device.CPU),
    Suite("step_outliers", "step_outliers",
          "every engine step timed: the slow ones, their phases, batch and profiler table",
          Device.GPU, "--cpu"),
    Suite("structured", "structured",
          "engine step with half the batch under a JSON schema vs all free; schema compile",
          Device.GPU, "--cpu"),
    Suite("tp", "tp.overhead", "tensor-parallel step overhead on gloo (control, all-reduce)",
          Device.CPU),
    Suite("tp_gpu", "tp.gpu", "TP=2 decode vs TP=1 and hand-offs between PP x TP layouts",
          Device.GPU, "--cpu"),
    Suite("tp_handoff", "tp.handoff_plan",
          "hand-off descriptors and bytes between TP layouts (NIXL with --measure)", Device.CPU),
    Suite("tracing", "tracing", "TTFT with the router's tracing on vs paused (A/B)", Device.CPU),
    Suite("workers", "workers", "what the Ray actor path adds to the engine; hand-off latency",
          Device.CPU),
)  # fmt: skip
BY_NAME = {s.name: s for s in SUITES}


def listing() -> str:
    """The suites as a table: name, where it runs, what it measures."""
    rows = [(s.name, s.where, s.summary) for s in SUITES]
    return Table.of(("suite", "runs on", "measures"), rows, "lll").plain()


def run(name: str, argv: Sequence[str]) -> int:
    """Run suite `name` with its command-line arguments `argv`; its exit status."""
    suite = BY_NAME[name]
    # argparse names the program after argv[0]; spawned rank processes inherit it too
    sys.argv = [f"python -m benchmarks {name}", *argv]
    module = importlib.import_module(f"benchmarks.suites.{suite.module}")
    status = module.main(list(argv))
    return int(status or 0)
