"""INT8 W8A8 and INT4 W4A16 projections vs bf16 on one GPU: decode step, prefill and logit
agreement, side by side in one run.

A Llama-3-8B-shaped model with random bf16 weights made on the GPU
(benchmarks/harness/decode_model.py), the engine's ModelRunner with CUDA graphs and flashinfer
attention over a bf16 KV pool, timed three ways, the projections swapped in place:
- bf16;
- int8: compressed-tensors' W8A8 (engine/quantization/int8_linear.py): int8 weights with one
  scale per row, each input token quantized to int8 at run time, `torch._int_mm` (cuBLASLt int8
  → int32) and the rescale;
- int4: compressed-tensors' W4A16 (engine/quantization/int4_linear.py), groups of
  `--group-size` columns: PyTorch's tinygemm int4 GEMM over bf16 inputs;
each quantized from the same bf16 weights as a checkpoint writer would
(engine/loading/dummy_weights.py `int_linear`). Measured: decode step at batch 1, 16, 64
with 2048 tokens of context per sequence against each format's HBM floor (its weight bytes +
the KV read, over the copy bandwidth measured here); prefill of one 4096-token prompt in
TFLOP/s; the logits of a 256-token random prompt against bf16's (relative error, argmax
agreement: random weights amplify rounding layer by layer, so this says the path is sound,
not how a trained model's quality moves).

`--shape llama3-70b`: the Llama-3-70B shape with INT4 dummy weights made layer by layer
(~35 GB; its bf16 weights would not fit one GPU), INT4 only, with an e.g. `--layers 40`
for a card that cannot hold all 80 beside its pool.

    python -m benchmarks int [--batches 1,16,64] [--group-size 128]
    python -m benchmarks int --shape llama3-70b
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Sequence

import torch
from torch import nn

from benchmarks.harness.cuda_timing import seconds_per_call
from benchmarks.harness.decode_model import decode_batch, random_llama3_8b, weight_read_bytes
from benchmarks.harness.steps import StepLog
from benchmarks.suites.engine import CUDA, measure_hbm, measure_matmul
from benchmarks.suites.fp8 import logit_agreement, logits_of, matmul_flops
from engine.batch import ScheduledBatch, SeqChunk
from engine.config import EngineConfig
from engine.core.runner import ModelRunner
from engine.kv.kv_cache import KVCache
from engine.kv.kv_sizing import kv_cache_spec
from engine.loading.dummy_weights import dummy_model, int_linear
from engine.loading.hf_checkpoint import PROJECTIONS
from engine.loading.int_checkpoint import IntScheme
from engine.modeling.llama import DecoderLayer, LlamaModel
from vocabulary.model_config import ModelConfig
from vocabulary.numeric import cdiv


def dense_projection_bytes(model: LlamaModel) -> int:
    """Bytes of the dense projection weights (kept beside a quantized copy: not read)."""
    return sum(
        getattr(layer, name).numel() * getattr(layer, name).element_size()
        for layer in model.layers
        for name in PROJECTIONS
    )


@torch.no_grad()
def quantize_in_place(model: LlamaModel, scheme: IntScheme) -> str:
    """Every layer's projections in `scheme`, made from its dense (bf16) weights; returns the
    model's new weight format."""
    for module in model.layers:
        layer: DecoderLayer = module  # type: ignore[assignment]
        layer.quantized = nn.ModuleDict(
            {
                name: int_linear(getattr(layer, name).float(), scheme, layer.projection_bias(name))
                for name in PROJECTIONS
            }
        )
    model.quantization = scheme.name
    return model.quantization


def dense_again(model: LlamaModel) -> None:
    for module in model.layers:
        module.quantized = None  # type: ignore[assignment]
    model.quantization = "none"
    torch.cuda.empty_cache()


def llama3_70b_int4(layers: int, group_size: int) -> LlamaModel:
    from deploy.checkpoints.make_model import PRESETS, hf_config

    shape = PRESETS["llama3-70b"]
    if layers:
        shape = shape.with_options(num_layers=layers)
    cfg = ModelConfig.from_dict(hf_config(shape, 0, 1))
    model = dummy_model(cfg, torch.bfloat16, "cuda", int_scheme=IntScheme(4, group_size))
    print(f"   {torch.cuda.memory_allocated() / 2**30:.1f} GiB on the device")
    return model


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--prefill-tokens", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--shape", default="llama3-8b", choices=("llama3-8b", "llama3-70b"))
    parser.add_argument("--layers", type=int, default=0, help="llama3-70b: this many layers")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA GPU: this suite times the GPU paths")
        raise SystemExit(2)
    log = StepLog()
    t_start = time.perf_counter()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    hbm = log.step("measure HBM bandwidth", functools.partial(measure_hbm, log)) or float("nan")
    bf16_rate = log.step("measure bf16 matmul rate", functools.partial(measure_matmul, log))
    big = args.shape == "llama3-70b"
    build = (
        functools.partial(llama3_70b_int4, args.layers, args.group_size) if big
        else random_llama3_8b
    )  # fmt: skip
    model = log.step(f"build the {args.shape} shape", build)
    if model is None:
        log.print_table()
        return
    cfg, bs, context, prompt = model.cfg, args.block_size, args.context, args.prefill_tokens
    batches = [int(b) for b in args.batches.split(",")]
    pages = max(batches) * cdiv(context, bs)
    kv = KVCache(kv_cache_spec(cfg, bs, torch.bfloat16, pages + cdiv(prompt, bs) + 8), "cuda")
    kv.tensor.normal_()
    kv_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    ids = torch.randint(1, cfg.vocab_size, (256,), device="cuda")
    dense_logits = None if big else logits_of(model, ids)
    results: dict[str, dict[int, float]] = {}

    def bench(label: str) -> None:
        config = EngineConfig(
            model_dir=f"random:{args.shape}", block_size=bs, attention_backend="flashinfer",
            layer_ops="flashinfer", cuda_graphs=True, cuda_graph_max_batch=max(batches),
            max_num_seqs=max(batches),
        )  # fmt: skip
        runner = log.step(f"{label}: CUDA-graph runner", lambda: _runner(model, kv, config))
        if runner is None:
            return
        weights = weight_read_bytes(model)
        if model.quantization != "none" and not big:
            weights -= dense_projection_bytes(model)
        secs = results.setdefault(label, {})
        for b in batches:
            run = functools.partial(runner.execute, decode_batch(b, context, bs))
            sec = log.step(f"{label}: decode B={b}",
                           functools.partial(seconds_per_call, run, args.iters, CUDA))  # fmt: skip
            if sec is None:
                continue
            secs[b] = sec
            floor = (weights + b * context * kv_per_token) / hbm
            log.add(f"decode B={b} ctx {context} {label}", f"{sec * 1e3:.2f} ms",
                    f"floor {floor * 1e3:.2f} ms", f"{sec / floor:.2f}x")  # fmt: skip
        blocks = tuple(range(pages, pages + cdiv(prompt, bs)))
        toks = tuple(int(t) for t in torch.randint(1, cfg.vocab_size, (prompt,)))
        pre = ScheduledBatch((SeqChunk("prefill", toks, 0, blocks, sample=True),))
        sec = log.step(f"{label}: prefill {prompt} tokens", functools.partial(
            seconds_per_call, functools.partial(runner.execute, pre), 5, CUDA))  # fmt: skip
        if sec is not None:
            secs[-1] = sec
            rate = matmul_flops(model, prompt) / sec
            log.add(
                f"prefill {prompt} tokens {label}",
                f"{sec * 1e3:.1f} ms",
                f"{rate / 1e12:.0f} TFLOP/s",
                f"{rate / (bf16_rate or 1):.0%} of bf16 mm",
            )
        print(f"   {label}: weights read per decode step {weights / 2**30:.2f} GiB")
        if dense_logits is not None and label != "bf16":
            err, same = logit_agreement(logits_of(model, ids), dense_logits)
            log.add(f"logits vs bf16, {label}", f"{err:.2e}", f"argmax {same:.1%}")
        runner.graphs = None
        torch.cuda.empty_cache()

    if big:
        bench(f"int4 g{args.group_size}")
    else:
        bench("bf16")
        for scheme in (IntScheme(8), IntScheme(4, args.group_size)):
            label = scheme.name + (f" g{scheme.group_size}" if scheme.group_size else "")
            if (
                log.step(
                    f"quantize to {label}", functools.partial(quantize_in_place, model, scheme)
                )
                is None
            ):
                continue
            bench(label)
            dense_again(model)
        for label, secs in results.items():
            for b in [*batches, -1]:
                if label != "bf16" and b in secs and b in results["bf16"]:
                    what = "prefill" if b < 0 else f"decode B={b}"
                    log.add(f"{what}: {label} / bf16 time", f"{secs[b] / results['bf16'][b]:.2f}x")
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    log.print_table()


def _runner(model: LlamaModel, kv: KVCache, config: EngineConfig) -> ModelRunner:
    runner = ModelRunner(model, kv, config)
    runner.execute(decode_batch(2, 64, config.block_size))
    runner.warmup(256)
    return runner
