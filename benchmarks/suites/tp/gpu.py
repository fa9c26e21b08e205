"""Tensor parallelism on GPUs: the TP=2 decode step vs TP=1, and KV hand-off GB/s
between pipeline- and tensor-parallel layouts. Needs two GPUs (device kind nvidia-h200-x2);
four let every hand-off rank have a GPU of its own.

decode (benchmarks/suites/tp/gpu_decode.py): a Llama-3-8B-shaped model from its config alone (dummy
bf16 weights made on the device, as `--load-format dummy`), TP=1 on GPU 0, then TP=N (`--tp`,
default 2) on GPUs 0..N-1, one process per rank as a TP worker runs them (NCCL, flashinfer
attention, CUDA graphs with the all-reduces inside); the decode step at B = 1 / 16 / 64 with
2048 tokens of context, each against its HBM floor: the weight and KV bytes one rank reads
(`rank_step_bytes`) over the copy bandwidth measured on that rank's GPU in the same run (the
slowest rank's). Also one eager all-reduce of [B, hidden], and the logits of one check step
(a decode over KV written the same for each model KV head) at TP=N against TP=1 (the same
dummy weights: they agree to bf16 rounding, or the part fails: its times would be of a model
that computes something else).

handoff (benchmarks/suites/tp/gpu_handoff.py): one hand-off of a 2048-token prompt of the same
shape per prefill → decode pair of layouts (`--pairs`, also spelt `--handoff-pairs`: `P-D`
for TP sizes with one stage each side, `ppAtpB:ppCtpD` for PP stages x TP ranks each side;
default 1-1 the reference, 1-2, 2-1, 2-2, pp2tp1:pp1tp1, pp2tp1:pp1tp2), every rank its own
process and NIXL agent with its pool in VRAM (a prefill stage's rank holds only its stage's
layers, a TP rank only its heads), pools in the layout `pdserve up` gives the pair (head-major
when the TP sizes differ, else block-major), UCX picking cuda_ipc (UCX_TLS is never set here),
pulled by decode rank 0's transfer manager as a worker does (each decode rank reads each layer
range of its stage from the prefill stage holding it, its heads from the TP ranks holding
them): bytes, descriptors (checked against a count from kv_transfer/tp_plan.py's plan), ms
and GB/s (median and best of `--repeats`), against a plain copy of the same bytes between the
same two GPUs in the same run; every decode rank checks that each head and layer it holds
arrived intact. Placement (`--placement`): spread (each rank its own GPU: a pair needs as many
as its ranks, PP x TP each side), packed (prefill ranks on GPU 0, decode ranks on GPU 1: every
byte crosses the same link, so the pairs differ only by descriptors and ranks), auto (spread
when every pair fits, else packed), single (every rank on GPU 0: on a one-GPU machine, a check
of the VRAM path whose GB/s are a copy inside one GPU; only when asked for).

A part the machine has too few GPUs for prints what it skips and why. Exit status: 0 when
every part that could run ran and passed its checks; 1 when one failed (the others still
run); 2 with no CUDA GPU at all (nothing run) or bad arguments. `--cpu` runs the same code on
the CPU with the tiny model (gloo, torch attention, host pools over UCX shm/tcp): a check
that the script works, on a machine without a GPU; its figures mean nothing.

    python -m benchmarks tp_gpu                      # both parts (2 GPUs)
    python -m benchmarks tp_gpu --parts handoff --placement spread   # 4 GPUs
    python -m benchmarks tp_gpu --parts handoff --pairs pp2tp1:pp1tp1,pp2tp1:pp1tp2,2-1
    python -m benchmarks tp_gpu --cpu                # the plumbing, no GPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch

from benchmarks.harness.table import Table
from benchmarks.suites.tp.gpu_plan import (
    DEFAULT_PAIRS,
    LOGITS_REL_TOL,
    HandoffPair,
    PairPlacement,
    Skip,
    expected_reads,
    floor_s,
    logits_rel_diff,
    parse_ints,
    parse_pairs,
    plan_decode,
    plan_pairs,
    rank_step_bytes,
)
from vocabulary.model_config import ModelConfig

if TYPE_CHECKING:
    from benchmarks.suites.tp.gpu_decode import DecodeRun
    from benchmarks.suites.tp.gpu_handoff import PairResult

T = TypeVar("T")

PARTS = ("decode", "handoff")
PLACEMENTS = ("auto", "spread", "packed", "single")
CPU_DEVICES = 8
"""The GPUs a `--cpu` run plans for by default (every rank then runs on the host)."""
NO_GPU = (
    "tp_gpu: no CUDA GPU here, nothing run. It measures tensor parallelism on GPUs "
    "(the TP=2 decode and the hand-offs need 2: device kind nvidia-h200-x2); --cpu checks "
    "the script itself on the CPU."
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])

    def parts(text: str) -> tuple[str, ...]:
        names = tuple(t.strip() for t in text.split(","))
        bad = [n for n in names if n not in PARTS]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown part {bad[0]!r}: {', '.join(PARTS)}")
        return names

    def typed(fn: Callable[[str], T]) -> Callable[[str], T]:
        def convert(text: str) -> T:
            try:
                return fn(text)
            except ValueError as e:
                raise argparse.ArgumentTypeError(str(e)) from None

        return convert

    add = parser.add_argument
    add("--parts", type=parts, default=PARTS, help="decode,handoff (default both)")
    add("--cpu", action="store_true", help="the same code on the CPU, tiny model (a check)")
    add(
        "--cpu-devices",
        type=int,
        default=CPU_DEVICES,
        help="--cpu: the GPUs the plan may place ranks on, as if the host had that many (all "
        "run on the host; fewer check the skips)",
    )
    add(
        "--model",
        type=Path,
        help="config folder (default: Llama-3-8B's, written to a temp "
        "folder; --cpu: the tiny model)",
    )
    add("--tp", type=int, default=2, help="the decode part's TP size (vs TP=1)")
    add("--batches", type=typed(parse_ints), help="decode batches (default 1,16,64; --cpu 1,4)")
    add("--context", type=int, help="tokens of context per sequence (default 2048; --cpu 256)")
    add("--iters", type=int, help="timed decode steps per batch (default 30; --cpu 3)")
    add(
        "--kv-layout",
        default="block_major",
        choices=("block_major", "head_major"),
        help="the decode part's KV pool layout",
    )
    add(
        "--pairs",
        "--handoff-pairs",
        type=typed(parse_pairs),
        default=DEFAULT_PAIRS,
        help="hand-off pairs, comma-separated: PREFILL_TP-DECODE_TP (one stage each side) or "
        "PREFILL:DECODE layouts ppSTAGEStpRANKS (default "
        "1-1,1-2,2-1,2-2,pp2tp1:pp1tp1,pp2tp1:pp1tp2)",
    )
    add("--placement", default="auto", choices=PLACEMENTS)
    add("--prompt-tokens", type=int, default=2048, help="tokens handed off per pull")
    add("--repeats", type=int, help="timed pulls per pair (default 10; --cpu 3)")
    add(
        "--busy-poll-us",
        type=float,
        default=200.0,
        help="the transfer loops' poll interval while reads run (KVTransferConfig.busy_poll_s; "
        "adds up to this to a pull)",
    )
    add("--block-size", type=int, default=16)
    add(
        "--part-timeout",
        type=float,
        default=240.0,
        help="seconds for one decode run (all its ranks) or one hand-off pair",
    )
    args = parser.parse_args(argv)
    cpu = args.cpu
    defaults = {
        "batches": ((1, 16, 64), (1, 4)),
        "context": (2048, 256),
        "iters": (30, 3),
        "repeats": (10, 3),
    }
    for name, (gpu_value, cpu_value) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, cpu_value if cpu else gpu_value)
    if args.cpu_devices < 0:
        parser.error("--cpu-devices: must be >= 0")
    for name in ("tp", "context", "iters", "repeats", "prompt_tokens", "block_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be >= 1")
    return args


# ---- the parts --------------------------------------------------------------------------------


def element_size(cpu: bool) -> int:
    return 4 if cpu else 2  # float32 on the CPU, bf16 on GPUs


def decode_part(
    args: argparse.Namespace, cfg: ModelConfig, model_dir: Path, num_devices: int
) -> tuple[list[str], list[Skip]]:
    """Run and print the decode part; (failures, skips)."""
    from benchmarks.suites.tp.gpu_decode import DecodeSetup, run_decode

    sizes, skips = plan_decode(args.tp, num_devices)
    for s in skips:
        print(f"-- skipped {s.what}: {s.why}")
    setup = DecodeSetup(
        str(model_dir),
        not args.cpu,
        tuple(args.batches),
        args.context,
        args.block_size,
        args.iters,
        args.kv_layout,
        64 if args.cpu else 2048,
        args.part_timeout,
    )
    es = element_size(args.cpu)
    failures: list[str] = []
    runs: dict[int, DecodeRun] = {}
    for size in sizes:
        print(
            f"\n== decode TP={size} (ranks on {'the CPU' if args.cpu else f'GPUs 0..{size - 1}'})",
            flush=True,
        )
        t0 = time.perf_counter()
        try:
            run = run_decode(setup, size, args.part_timeout)
        except Exception as e:
            print(f"!! decode TP={size} FAILED after {time.perf_counter() - t0:.0f} s: {e}")
            failures.append(f"decode TP={size}: {str(e).splitlines()[0]}")
            continue
        runs[size] = run
        bw = ", ".join(f"{r.device} {r.copy_bytes_per_s / 1e9:.0f} GB/s" for r in run.ranks)
        want = rank_step_bytes(cfg, size, 1, 1, es)
        print(
            f"   done in {time.perf_counter() - t0:.0f} s: attention {run.attention}, layer ops "
            f"{run.layer_ops}, graphs {run.graph_sizes or 'none'}; weights read per rank "
            f"{want.weights / 1e9:.3f} GB; copy (read+write) {bw}"
        )
        for r in run.ranks:
            kv_token = want.kv  # one sequence, one token
            if r.weight_bytes != want.weights or r.kv_bytes_per_token != kv_token:
                failures.append(
                    f"decode TP={size} rank {r.rank}: the model built reads "
                    f"{r.weight_bytes} weight bytes and {r.kv_bytes_per_token} KV "
                    f"bytes a token, the floors count {want.weights} and "
                    f"{kv_token}"
                )
                print(f"!! {failures[-1]}")
        if not args.cpu and any(t.graph_replays == 0 for t in run.timings):
            failures.append(f"decode TP={size}: a batch ran without its CUDA graph")
            print(f"!! {failures[-1]}")
    if 1 in runs and args.tp in runs and args.tp != 1:
        rel = logits_rel_diff(runs[args.tp].check_logits, runs[1].check_logits)
        same = int(runs[args.tp].check_logits.argmax()) == int(runs[1].check_logits.argmax())
        verdict = "agree" if rel <= LOGITS_REL_TOL else "DISAGREE"
        print(
            f"\n   the check step's logits, TP={args.tp} vs TP=1: ||diff|| / ||TP=1|| = {rel:.4f} "
            f"({verdict}, tolerance {LOGITS_REL_TOL}); same argmax: {same}"
        )
        if rel > LOGITS_REL_TOL:
            failures.append(f"decode: TP={args.tp} logits differ from TP=1 by {rel:.3f}")
    _print_decode_table(args, cfg, runs, es)
    return failures, skips


def _print_decode_table(
    args: argparse.Namespace, cfg: ModelConfig, runs: dict[int, DecodeRun], es: int
) -> None:
    if not runs:
        return
    sizes = sorted(runs)
    print(
        f"\ndecode step, ctx {args.context}, {args.kv_layout}, mean of {args.iters} steps; floor: "
        "one rank's weight + KV bytes over its GPU's copy bandwidth; AR us: one eager all-reduce "
        "of [B, hidden] (a step runs 2 a layer, inside its graph); graphs: replays per TP size"
    )
    header = ["B"]
    for s in sizes:
        header += [f"TP={s} ms", "floor", "x"]
    if len(sizes) > 1:
        header += [f"TP1/TP{sizes[-1]}", "AR us"]
    header.append("graphs")
    rows = []
    for b in args.batches:
        row, steps = [f"{b}"], {}
        for s in sizes:
            run = runs[s]
            timing = next(t for t in run.timings if t.batch == b)
            steps[s] = timing
            floor = floor_s(
                rank_step_bytes(cfg, s, b, args.context, es).total,
                [r.copy_bytes_per_s for r in run.ranks],
            )
            row += [
                f"{timing.step_s * 1e3:.3f}",
                f"{floor * 1e3:.3f}",
                f"{timing.step_s / floor:.2f}",
            ]
        if len(sizes) > 1:
            big = steps[sizes[-1]]
            row += [f"{steps[1].step_s / big.step_s:.2f}", f"{big.all_reduce_s * 1e6:.1f}"]
        row.append("/".join(str(steps[s].graph_replays) for s in sizes))
        rows.append(row)
    print(Table.of(header, rows, "r" * len(header)).plain())


def handoff_part(
    args: argparse.Namespace, cfg: ModelConfig, num_devices: int
) -> tuple[list[str], list[Skip]]:
    """Run and print the hand-off part; (failures, skips)."""
    from benchmarks.suites.tp.gpu_handoff import PoolShape, run_pair
    from kv_transfer.config import KVTransferConfig
    from kv_transfer.tp_plan import HeadPlan

    placed, skips = plan_pairs(args.pairs, num_devices, args.placement)
    plans: dict[HandoffPair, HeadPlan] = {}
    for pair in list(placed):
        try:
            plans[pair] = pair.plan(cfg.num_layers, cfg.num_kv_heads)
        except ValueError as e:  # (UnsupportedSplit is one)
            del placed[pair]
            skips.append(Skip(f"hand-off {pair.name}", str(e)))
    for s in skips:
        print(f"-- skipped {s.what}: {s.why}")
    blocks = -(-args.prompt_tokens // args.block_size)
    es = element_size(args.cpu)
    pool = PoolShape(
        cfg.num_layers,
        cfg.num_kv_heads,
        cfg.head_dim,
        args.block_size,
        "float32" if args.cpu else "bfloat16",
        blocks,
    )
    config = KVTransferConfig(capture_telemetry=True, busy_poll_s=args.busy_poll_us * 1e-6)
    failures: list[str] = []
    rows = []

    def dev(i: int) -> str:
        return "cpu" if args.cpu else f"cuda:{i}"

    for pair, where in placed.items():
        plan = plans[pair]
        print(
            f"\n== hand-off {pair.name}: prefill {plan.prefill.describe()} on "
            f"{[dev(i) for i in where.prefill]} -> decode {plan.decode.describe()} on "
            f"{[dev(i) for i in where.decode]} ({where.mode})",
            flush=True,
        )
        t0 = time.perf_counter()
        try:
            result = run_pair(
                pool,
                plan.prefill,
                plan.decode,
                [dev(i) for i in where.prefill],
                [dev(i) for i in where.decode],
                config,
                args.repeats,
                args.part_timeout,
            )
        except Exception as e:
            print(f"!! hand-off {pair.name} FAILED after {time.perf_counter() - t0:.0f} s: {e}")
            failures.append(f"hand-off {pair.name}: {str(e).splitlines()[0]}")
            continue
        print(f"   done in {time.perf_counter() - t0:.0f} s")
        # the prompt's blocks [0, n) into [n, 2n): one run adjacent on both sides
        unit = 2 * args.block_size * cfg.head_dim * es  # one head's K and V of one layer
        expected = expected_reads(plan, blocks, 1, unit)
        pull = result.pulls[0]
        problems = []
        if (
            pull.descriptors != expected.descriptors
            or pull.rank_descriptors != expected.per_rank
            or pull.nbytes != expected.nbytes
        ):
            problems.append(
                f"plan posts {pull.descriptors} descriptors "
                f"({'/'.join(map(str, pull.rank_descriptors))}) of {pull.nbytes} bytes, "
                f"tp_plan's pieces count {expected.descriptors} "
                f"({'/'.join(map(str, expected.per_rank))}) of {expected.nbytes}"
            )
        if pull.posted is not None and pull.posted != pull.descriptors:
            problems.append(f"NIXL posted {pull.posted} descriptors, the plan {pull.descriptors}")
        if result.mismatched:
            problems.append(f"{result.mismatched} elements of the pulled blocks differ")
        if result.mem_type != ("DRAM" if args.cpu else "VRAM"):
            problems.append(f"the pools were registered as {result.mem_type}")
        for problem in problems:
            failures.append(f"hand-off {pair.name}: {problem}")
            print(f"!! {failures[-1]}")
        rows.append((pair, where, result))
    _print_handoff_table(args, rows)
    return failures, skips


def _print_handoff_table(
    args: argparse.Namespace, rows: list[tuple[HandoffPair, PairPlacement, PairResult]]
) -> None:
    if not rows:
        return
    print(
        f"\nhand-off of a {args.prompt_tokens}-token prompt (KV: the pools' layout), median / "
        f"best of {args.repeats} pulls (ms, GB/s: start_read called to the outcome; mgr ms: the "
        "manager's transfer_s, which starts after start_read returned; wall: submit to outcome; "
        f"the transfer loops poll every {args.busy_poll_us:g} us, which each may add; copy: a "
        "plain copy of the same bytes from prefill rank 0's GPU to decode rank 0's)"
    )
    header = ("P->D", "KV", "GPUs P/D", "MiB", "descriptors", "posted", "ms", "GB/s", "best",
              "mgr ms", "wall ms", "copy GB/s", "intact")  # fmt: skip
    lines = []
    for pair, where, result in rows:
        pulls = result.pulls
        t = statistics.median(x.read_s for x in pulls)
        best = min(x.read_s for x in pulls)
        mgr = statistics.median(x.transfer_s for x in pulls)
        wall = statistics.median(x.wall_s for x in pulls)
        copy = statistics.median(result.peer_copy_s)
        n = pulls[0].nbytes
        desc = f"{pulls[0].descriptors} ({'/'.join(map(str, pulls[0].rank_descriptors))})"
        gpus = (
            "cpu"
            if args.cpu
            else f"{''.join(map(str, where.prefill))}/" + "".join(map(str, where.decode))
        )
        posted = "-" if pulls[0].posted is None else str(pulls[0].posted)
        lines.append((
            pair.name, pair.kv_layout.removesuffix("_major_v1"), gpus, f"{n / 2**20:.1f}", desc,
            posted, f"{t * 1e3:.3f}",
            f"{n / t / 1e9:.1f}", f"{n / best / 1e9:.1f}", f"{mgr * 1e3:.3f}", f"{wall * 1e3:.3f}",
            f"{n / copy / 1e9:.1f}", "yes" if result.mismatched == 0 else "NO",
        ))  # fmt: skip
    print(Table.of(header, lines).plain())


def model_folder(args: argparse.Namespace) -> Path:
    if args.model is not None:
        return Path(args.model)
    if args.cpu:
        from deploy.checkpoints.make_model import cached_tiny_model

        return cached_tiny_model()
    from deploy.checkpoints.make_model import make_model

    return make_model(
        Path(tempfile.mkdtemp(prefix="bench-tp-gpu-")) / "llama3-8b",
        preset="llama3-8b",
        config_only=True,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu:
        os.environ.setdefault("UCX_TLS", "shm,tcp")  # host memory on loopback (never on GPUs)
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
        num_devices = args.cpu_devices
    else:
        num_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if num_devices == 0:
            print(NO_GPU, flush=True)
            return 2
    failures: list[str] = []
    skips: list[Skip] = []
    tls = os.environ.get("UCX_TLS")
    if not args.cpu and "handoff" in args.parts and tls is not None and "cuda_ipc" not in tls:
        failures.append(
            f"UCX_TLS={tls!r} leaves out cuda_ipc: NIXL then reads VRAM through host memory "
            "(~0.4 GB/s); unset UCX_TLS on a GPU machine, so UCX picks cuda_ipc between its GPUs"
        )
        print(f"!! {failures[-1]}")
    model_dir = model_folder(args)
    cfg = ModelConfig.from_pretrained(model_dir)
    where = (
        "the CPU (--cpu: a check of the script, not a measurement)"
        if args.cpu
        else (f"{num_devices} GPU(s)")
    )
    print(
        f"tp_gpu: torch {torch.__version__}, {where}; model {model_dir} "
        f"({cfg.num_layers} layers, {cfg.num_heads} heads, {cfg.num_kv_heads} KV heads)",
        flush=True,
    )
    for part in args.parts:
        print(f"\n======== {part}", flush=True)
        if part == "decode":
            got = decode_part(args, cfg, model_dir, num_devices)
        else:
            got = handoff_part(args, cfg, num_devices)
        failures += got[0]
        skips += got[1]
    print("\n======== summary")
    for s in skips:
        print(f"skipped {s.what}: {s.why}")
    for f in failures:
        print(f"FAILED {f}")
    if failures:
        print(f"{len(failures)} failure(s)")
    else:
        print(f"every part that ran passed its checks ({len(skips)} skipped)")
    return 1 if failures else 0
