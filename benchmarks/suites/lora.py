"""Multi-LoRA decode and adapter loads: a decode step with 1, 4 and 16 distinct adapters against
the base model, in one run; adapter load time from the host cache and from disk.

GPU (one H200, the default): a Llama-3-8B-shaped model with random bf16 weights
(benchmarks/harness/decode_model.py), a KV pool of random values, flashinfer attention and
CUDA graphs. Random rank-16 PEFT adapters on all seven projections (q/k/v/o/gate/up/down) are
written to a temporary folder and served by the adapter cache (engine/lora/lora_cache.py, one slot
per adapter, slots padded to `--max-rank`). For each graph LoRA kernel (`--kernels`: torch's
dense-over-slots; engine/lora/lora_triton.py's Triton expand after its dense shrink (cuBLAS, every
slot) or its BGMV shrink (a program per token); flashinfer's segment GEMM)
one runner captures the base and the LoRA decode graphs; then, side by side at batch B (64)
with `--context` tokens per sequence:
- base: every row the base model (the base graph);
- N adapters: row i reads adapter i % N (the LoRA graph), for N in `--adapters` (1, 4, 16);
each as `ModelRunner.execute` (staging, plan, replay) and as a pure replay of the graph, with
its ratio to base (goal: <= 1.15x at 4 adapters).
Loads: an adapter from disk (register, then acquire until resident: read, pin, upload; the
OS page cache may hold the file, it was just written) and from the host cache (evicted from
its slot, read back), each over `--load-repeats` adapters.

CPU (`--smoke`): the same on the tiny shape with dummy weights, eager steps (no graphs), to
check that the script runs.

    python -m benchmarks lora [--batch 64] [--adapters 1,4,16]
        [--kernels torch,triton-dot,triton-dot-serial,triton-dense,triton-bgmv,flashinfer]
    python -m benchmarks lora --smoke
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from benchmarks.harness.cuda_timing import kernel_profile, seconds_per_call
from benchmarks.harness.decode_model import decode_batch, random_llama3_8b
from benchmarks.harness.steps import StepLog
from engine.config import EngineConfig
from engine.core.runner import ModelRunner
from engine.kv.kv_cache import KVCache
from engine.kv.kv_sizing import kv_cache_spec
from engine.lora.lora_adapter import LORA_MODULES, module_shape, tensor_name
from engine.lora.lora_cache import LoraCache, LoraCacheConfig
from engine.modeling.llama import LlamaModel
from vocabulary.model_config import ModelConfig
from vocabulary.numeric import cdiv


def write_adapter(root: Path, name: str, cfg: ModelConfig, rank: int, seed: int) -> Path:
    """A random PEFT adapter (bf16) of `rank` on every projection, in peft's file layout."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(cfg.num_layers):
        for module in LORA_MODULES:
            fan_in, fan_out = module_shape(cfg, module)
            a = torch.randn(rank, fan_in, generator=gen) * fan_in**-0.5
            tensors[tensor_name(layer, module, "A")] = a.bfloat16()
            tensors[tensor_name(layer, module, "B")] = (
                torch.randn(fan_out, rank, generator=gen) * 0.01
            ).bfloat16()
    out = root / name
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "bias": "none",
        "target_modules": list(LORA_MODULES),
    }
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def acquire_blocking(cache: LoraCache, name: str) -> int:
    """Acquire `name`, asking again every 0.5 ms (as a waiting request does each step)."""
    while True:
        slot = cache.acquire(name)
        if slot is not None:
            return slot
        time.sleep(5e-4)


def build(smoke: bool) -> tuple[LlamaModel, torch.device]:
    if smoke:
        from deploy.checkpoints.make_model import PRESETS, hf_config
        from engine.loading.dummy_weights import dummy_model

        cfg = ModelConfig.from_dict(hf_config(PRESETS["tiny"], 0, 1))
        return dummy_model(cfg, torch.float32, "cpu").eval(), torch.device("cpu")
    return random_llama3_8b(), torch.device("cuda", torch.cuda.current_device())


def bench_decode(
    log: StepLog,
    args: argparse.Namespace,
    model: LlamaModel,
    kv: KVCache,
    adapters: list[Path],
    kernel: str,
) -> dict[str, float]:
    """Decode step times of base and N adapters with one runner (one graph kernel; a
    "triton-SHRINK" kernel runs triton with that shrink of engine/lora_triton.SHRINKS, and
    "triton-dot-serial" the dot shrink in line after the base GEMM instead of beside it)."""
    device = kv.device
    cuda = device.type == "cuda"
    name, _, shrink = kernel.partition("-")
    shrink, _, mode = shrink.partition("-")
    if shrink:
        import engine.lora.lora_apply as lora_apply
        import engine.lora.lora_triton as lora_triton

        lora_triton.DEFAULT_SHRINK = shrink  # read at each launch; graphs capture it
        lora_apply.OVERLAP_SHRINK = mode != "serial"  # read when a step is made
    config = LoraCacheConfig(
        max_loras=len(adapters),
        max_cpu_loras=len(adapters),
        max_lora_rank=args.max_rank,
        kernel=name,
    )
    cache = LoraCache(model.cfg, config, model.dtype, device)
    for i, path in enumerate(adapters):
        cache.register(f"a{i}", path)
    slots = [acquire_blocking(cache, f"a{i}") for i in range(len(adapters))]
    print(f"   {len(adapters)} adapters resident, slots {cache.weights.nbytes / 2**30:.2f} GiB")
    engine_config = EngineConfig(
        model_dir="random",
        block_size=args.block_size,
        attention_backend="flashinfer" if cuda else "torch",
        cuda_graphs=cuda,
        cuda_graph_max_batch=args.batch,
        max_num_seqs=args.batch,
    )
    runner = ModelRunner(model, kv, engine_config, lora_weights=cache.weights)
    out: dict[str, float] = {}
    b = args.batch
    cases = [("base", [-1] * b)] + [
        (f"{n} adapters", [slots[i % n] for i in range(b)]) for n in args.adapters
    ]
    for label, row_slots in cases:
        batch = decode_batch(b, args.context, args.block_size, lora_slots=row_slots)
        run = functools.partial(runner.execute, batch)
        sec = log.step(
            f"{kernel}: decode B={b} {label}",
            functools.partial(seconds_per_call, run, args.iters, device),
        )
        if sec is None:
            continue
        out[label] = sec
        if runner.graphs is not None:
            runner.execute(batch)  # stage this batch, then replay alone: device time only
            with_lora = label != "base"
            replay = functools.partial(runner.graphs.replay, b, with_lora)
            out[f"{label} replay"] = seconds_per_call(replay, args.iters, device)
            if label == f"{args.profile} adapters":
                log.step(f"{kernel}: profile {label}", functools.partial(kernel_profile, replay))
    for label, sec in out.items():
        ref = out.get("base replay" if label.endswith("replay") else "base")
        ratio = f"{sec / ref:.3f}x" if ref else ""
        log.add(f"{kernel}: decode B={b} {label}", f"{sec * 1e3:.3f} ms", "base", ratio)
    runner.graphs = None  # free the captured graphs before the next runner captures
    cache.close()
    if cuda:
        torch.cuda.empty_cache()
    return out


def bench_loads(
    log: StepLog, args: argparse.Namespace, model: LlamaModel, root: Path
) -> dict[str, float]:
    """Seconds from the first acquire to a resident slot: from disk, and from the host cache."""
    device = model.device
    config = LoraCacheConfig(
        max_loras=1,
        max_cpu_loras=args.load_repeats + 1,
        max_lora_rank=args.max_rank,
        kernel="torch",
    )
    cache = LoraCache(model.cfg, config, model.dtype, device)
    paths = [
        write_adapter(root, f"load{i}", model.cfg, args.rank, 100 + i)
        for i in range(args.load_repeats)
    ]
    disk, host = [], []
    for i, path in enumerate(paths):
        cache.register(f"l{i}", path)
        t0 = time.perf_counter()
        acquire_blocking(cache, f"l{i}")
        disk.append(time.perf_counter() - t0)
        cache.release(f"l{i}")
    for i in range(len(paths)):  # each evicts the one before from the single slot
        t0 = time.perf_counter()
        acquire_blocking(cache, f"l{i}")
        host.append(time.perf_counter() - t0)
        cache.release(f"l{i}")
    stats = cache.stats
    cache.close()
    nbytes = sum(p.stat().st_size for p in (q / "adapter_model.safetensors" for q in paths))
    out = {
        "disk_s": sum(disk) / len(disk),
        "disk_read_s": stats.disk_load_seconds / max(stats.num_disk_loads, 1),
        "host_s": sum(host) / len(host),
        "adapter_bytes": nbytes / len(paths),
    }
    mb = out["adapter_bytes"] / 2**20
    log.add(
        "adapter load from disk (read+pin+upload)",
        f"{out['disk_s'] * 1e3:.1f} ms",
        f"{mb:.0f} MiB file",
        f"read {out['disk_read_s'] * 1e3:.1f} ms",
    )
    log.add(
        "adapter load from host cache (upload)",
        f"{out['host_s'] * 1e3:.1f} ms",
        f"{stats.num_host_loads} host loads",
    )
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shape, eager steps")
    parser.add_argument("--batch", type=int, default=0, help="decode batch (64; smoke 8)")
    parser.add_argument("--adapters", default="", help="distinct adapters (1,4,16; smoke 1,2,4)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-rank", type=int, default=16, help="slot rank (max_lora_rank)")
    parser.add_argument("--context", type=int, default=0, help="tokens per sequence (2048)")
    parser.add_argument(
        "--kernels",
        default="",
        help="graph LoRA kernels: torch,triton-dot,triton-dot-serial,triton-dense,triton-bgmv,"
        "flashinfer",
    )
    parser.add_argument("--iters", type=int, default=0)
    parser.add_argument(
        "--profile", type=int, default=0,
        help="also print the CUDA time per kernel of the graph replay with this many adapters",
    )  # fmt: skip
    parser.add_argument("--load-repeats", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args(argv)
    log = StepLog()
    results: dict[str, Any] = {}
    smoke = args.smoke
    args.batch = args.batch or (8 if smoke else 64)
    args.adapters = [int(n) for n in (args.adapters or ("1,2,4" if smoke else "1,4,16")).split(",")]
    args.context = args.context or (64 if smoke else 2048)
    args.iters = args.iters or (5 if smoke else 50)
    default_kernels = "torch" if smoke else "torch,triton-dot,triton-dot-serial,flashinfer"
    kernels = (args.kernels or default_kernels).split(",")
    t_start = time.perf_counter()
    model_and_device = log.step("build the model (random weights)", functools.partial(build, smoke))
    if model_and_device is None:
        log.print_table()
        return
    model, device = model_and_device
    pages = args.batch * cdiv(args.context, args.block_size)
    kv = KVCache(kv_cache_spec(model.cfg, args.block_size, model.dtype, pages + 8), device)
    kv.tensor.normal_()
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        root = Path(tmp)
        adapters = log.step(
            f"write {max(args.adapters)} random rank-{args.rank} adapters",
            lambda: [
                write_adapter(root, f"a{i}", model.cfg, args.rank, i)
                for i in range(max(args.adapters))
            ],
        )
        for kernel in kernels if adapters is not None else []:
            assert adapters is not None
            run = functools.partial(bench_decode, log, args, model, kv, adapters, kernel)
            decode = log.step(f"{kernel}: adapter cache, runner, graphs and decode steps", run)
            if decode is not None:
                results[f"decode_{kernel}"] = decode
        loads = log.step("adapter loads", functools.partial(bench_loads, log, args, model, root))
        if loads is not None:
            results["loads"] = loads
    results["config"] = {
        "batch": args.batch,
        "context": args.context,
        "rank": args.rank,
        "max_rank": args.max_rank,
        "device": str(device),
    }
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    log.print_table()
    print(json.dumps(results, indent=2))
