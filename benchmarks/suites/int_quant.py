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
  `--group-size` columns: PyTorch's tinygemm int4 GEMM or the Triton W4A16 GEMM over bf16
  inputs;
each quantized from the same bf16 weights as a checkpoint writer would
(engine/loading/dummy_weights.py `int_linear`). Measured: decode step at batch 1, 16, 64
with 2048 tokens of context per sequence against each format's HBM floor (its weight bytes +
the KV read, over the copy bandwidth measured here); prefill of one 4096-token prompt in
TFLOP/s; the logits of a 256-token random prompt of bf16, int8 and int4 against a float32
copy of the same weights (relative error, argmax agreement), after the first decoder layer
(the quantization alone: there the argmax agreement means something) and after all of them
(random weights amplify any error layer by layer: int4 g128 round-to-nearest of Gaussian
weights, ~11 % per weight, reaches chaos by 32 layers, argmax agreement near 0 %, while bf16's
stays near its one-layer figure; this says the path is sound, not how a trained model's
quality moves). The full-depth rows need room for the float32 copy (the 8B shape: 32 GB).

`--int4-large-m 16,32,64,off`: INT4 once per threshold (rows from which a projection
dequantizes W to bf16 and runs the bf16 GEMM instead of its small-M kernel; off: tinygemm at
every size, not timed for Triton; engine/quantization/int4_linear.py `INT4_LARGE_M_ROWS`, the
default run's).

`--int4-kernels triton,tinygemm`: INT4 once per small-M kernel (the layers hold the weight
layout each reads, one at a time): the Triton W4A16 GEMM (engine/quantization/int4_gemm.py)
and PyTorch's tinygemm.

`--int8-kernels auto,triton,fused,torch`: INT8 once through the layer's default 'auto' (one of
the next two by rows: int8_linear.py `auto_kernels`), once through the one-kernel Triton GEMM
(engine/quantization/int8_gemm.py: one or two launches a projection), once through the fused
quantize and rescale kernels around `_int_mm` (int8_kernels.py: three) and once through the
torch ops (about sixteen), the same numbers. `--batches 1,4,8,16,32,64 --prefill-tokens
512,1024,2048,4096` finds where the Triton GEMM and the fused kernels cross.

`--tune`: first a few tilings of both Triton GEMMs per M bucket on the 8B projection shapes
(benchmarks/suites/int_tune.py), the fastest installed for the rest of the run.

`--shape llama3-70b`: the Llama-3-70B shape with INT4 dummy weights made layer by layer
(~35 GB; its bf16 weights would not fit one GPU), INT4 only, with an e.g. `--layers 40`
for a card that cannot hold all 80 beside its pool. The KV pool is sized to the memory left
(less `KV_HEADROOM`): batches that do not fit at `--context` are cut to the largest that
does, and the output says so.

    python -m benchmarks int [--batches 1,16,64] [--group-size 128] [--int4-large-m 16,32,64,off]
                             [--int8-kernels triton,fused,torch] [--int4-kernels triton,tinygemm]
                             [--tune]
    python -m benchmarks int --shape llama3-70b
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace

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
from engine.quantization import int4_kernels
from engine.quantization.int4_linear import INT4_LARGE_M_ROWS, Int4Linear
from engine.quantization.int8_linear import Int8Linear, fused_ready, triton_ready
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


KV_HEADROOM = 6 * 2**30
"""Device memory left beside the KV pool: a 4096-token prefill's activations (the 70B shape's
gate/up output alone is 0.5 GB), the CUDA graphs' pool, cuBLAS and flashinfer workspaces."""


@contextlib.contextmanager
def first_layers(model: LlamaModel, depth: int) -> Iterator[None]:
    """`model` runs only its first `depth` decoder layers while open."""
    full = model.layers
    model.layers = nn.ModuleList(list(full)[:depth])
    try:
        yield
    finally:
        model.layers = full


def reference_logits(model: LlamaModel, ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """{depth: logits of a float32 copy of `model` run through its first `depth` layers} for
    depth 1 and, where the device holds a float32 copy of every layer, all of them (the copy
    is filled tensor by tensor from the dense weights, then freed)."""
    cfg = model.cfg
    need = 2 * model.weight_bytes  # bf16 -> float32
    free = torch.cuda.mem_get_info()[0]
    deepest = cfg.num_layers if need + 4 * 2**30 < free else 1
    if deepest == 1 and cfg.num_layers > 1:
        print(f"   a float32 copy of every layer needs {need / 2**30:.1f} GiB, "
              f"{free / 2**30:.1f} free: one layer only")  # fmt: skip
    ref = LlamaModel(replace(cfg, num_layers=deepest), torch.float32, "cuda").eval()
    source = model.state_dict()
    with torch.no_grad():
        for name, tensor in ref.state_dict().items():
            if name in source:
                tensor.copy_(source[name])
    out = {}
    for depth in sorted({1, deepest}):
        with first_layers(ref, depth):
            out[depth] = logits_of(ref, ids)
    del ref, source
    torch.cuda.empty_cache()
    return out


def set_int4_large_m(model: LlamaModel, rows: int | None) -> int:
    """Every INT4 projection with a large-M path dequantizes from `rows` rows on (None: its
    small-M kernel, tinygemm or Triton, at every size); returns how many took it."""
    took = 0
    for module in model.modules():
        if isinstance(module, Int4Linear) and (
            module.kernels == "triton"
            or (
                module.kernels == "tinygemm"
                and int4_kernels.layout_verified(module.weight_scale.device)
            )
        ):
            module.large_m_rows = rows
            took += 1
    return took


def set_int4_kernels(model: LlamaModel, name: str) -> int:
    """Every INT4 projection holds the weight copy `name` reads; returns how many run it."""
    took = 0
    for module in model.modules():
        if isinstance(module, Int4Linear):
            took += module.use_kernels(name) == name
    torch.cuda.empty_cache()
    return took


def set_int8_kernels(model: LlamaModel, name: str) -> None:
    """Every INT8 projection runs `name` (int8_linear.KERNELS) where its check passes (else
    the torch ops)."""
    for module in model.modules():
        if isinstance(module, Int8Linear):
            module.kernels = name


def fitting_batches(
    cfg: ModelConfig, batches: list[int], context: int, prompt: int, bs: int, reserve: int
) -> tuple[list[int], int]:
    """(the batches whose KV at `context` tokens a sequence fits the free device memory less
    `reserve` beside one `prompt`-token prefill, pages for them): a batch that does not fit is
    replaced by the largest that does."""
    page_bytes = kv_cache_spec(cfg, bs, torch.bfloat16, 1).block_nbytes
    room = (torch.cuda.mem_get_info()[0] - reserve) // page_bytes - cdiv(prompt, bs) - 8
    fit = max(0, int(room) // cdiv(context, bs))
    kept = sorted({min(b, fit) for b in batches if min(b, fit) > 0})
    return kept, max(kept, default=0) * cdiv(context, bs)


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
    parser.add_argument(
        "--prefill-tokens", default="4096", help="prompt lengths timed, comma separated"
    )
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--shape", default="llama3-8b", choices=("llama3-8b", "llama3-70b"))
    parser.add_argument("--layers", type=int, default=0, help="llama3-70b: this many layers")
    parser.add_argument(
        "--int4-large-m", default=str(INT4_LARGE_M_ROWS),
        help="INT4 once per threshold, comma separated: rows from which a projection "
        "dequantizes to bf16 for the bf16 GEMM ('off': the small-M kernel at every size)",
    )  # fmt: skip
    parser.add_argument(
        "--int8-kernels", default="auto,triton,fused",
        help="INT8 once per kernel choice, comma separated: 'triton' (engine/quantization/"
        "int8_gemm.py), 'fused' (int8_kernels.py), each where its check passes, 'auto' (the "
        "default: one of the two by rows), or 'torch' (the torch ops)",
    )  # fmt: skip
    parser.add_argument(
        "--int4-kernels", default="triton,tinygemm",
        help="INT4 once per kernel choice, comma separated: 'triton' (engine/quantization/"
        "int4_gemm.py, where its check passes) or 'tinygemm' (PyTorch's int4 GEMM); 'none': "
        "no INT4",
    )  # fmt: skip
    parser.add_argument(
        "--tune", action="store_true",
        help="first time a few tilings of the Triton GEMMs per M bucket on the 8B projection "
        "shapes, print them and run the rest with the fastest (benchmarks/suites/int_tune.py)",
    )  # fmt: skip
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
    if args.tune:
        from benchmarks.suites.int_tune import tune

        tuned = log.step("tune the Triton GEMMs' tilings", functools.partial(tune, args.group_size))
        for row in tuned or []:
            log.add(*row)
    model = log.step(f"build the {args.shape} shape", build)
    if model is None:
        log.print_table()
        return
    prompts = sorted(int(p) for p in args.prefill_tokens.split(","))
    cfg, bs, context, prompt = model.cfg, args.block_size, args.context, prompts[-1]
    thresholds = [None if t == "off" else int(t) for t in args.int4_large_m.split(",")]
    ids = torch.randint(1, cfg.vocab_size, (256,), device="cuda")
    refs: dict[int, torch.Tensor] = {}
    if not big:  # before the pool: the float32 copy needs the room
        refs = log.step("float32 reference logits", lambda: reference_logits(model, ids)) or {}

    def logit_rows(label: str) -> None:
        for depth, ref in refs.items():
            with first_layers(model, depth):
                err, same = logit_agreement(logits_of(model, ids), ref)
            log.add(f"logits vs float32, {depth} layer(s), {label}", f"{err:.2e}",
                    f"argmax {same:.1%}")  # fmt: skip

    if refs:
        logit_rows("bf16")
    asked = [int(b) for b in args.batches.split(",")]
    # the 8B run later adds int8 and int4 copies beside the dense weights
    reserve = KV_HEADROOM + (0 if big else dense_projection_bytes(model) * 4 // 5)
    batches, pages = fitting_batches(cfg, asked, context, prompt, bs, reserve)
    if batches != asked:
        print(f"   KV sized to the free memory: batches {asked} -> {batches} at {context} tokens")
        log.add("batches cut to the KV that fits", ",".join(map(str, batches)),
                f"asked {args.batches}")  # fmt: skip
    if not batches:
        log.print_table()
        return
    kv = KVCache(kv_cache_spec(cfg, bs, torch.bfloat16, pages + cdiv(prompt, bs) + 8), "cuda")
    kv.tensor.normal_()
    kv_per_token = kv.spec.block_nbytes // bs
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
        for p in prompts:
            blocks = tuple(range(pages, pages + cdiv(p, bs)))
            toks = tuple(int(t) for t in torch.randint(1, cfg.vocab_size, (p,)))
            pre = ScheduledBatch((SeqChunk("prefill", toks, 0, blocks, sample=True),))
            sec = log.step(f"{label}: prefill {p} tokens", functools.partial(
                seconds_per_call, functools.partial(runner.execute, pre), 5, CUDA))  # fmt: skip
            if sec is not None:
                secs[-p] = sec  # (prefills by minus their length, beside the batch sizes)
                rate = matmul_flops(model, p) / sec
                log.add(
                    f"prefill {p} tokens {label}",
                    f"{sec * 1e3:.1f} ms",
                    f"{rate / 1e12:.0f} TFLOP/s",
                    f"{rate / (bf16_rate or 1):.0%} of bf16 mm",
                )
        print(f"   {label}: weights read per decode step {weights / 2**30:.2f} GiB")
        runner.graphs = None
        torch.cuda.empty_cache()

    def bench_int4() -> None:
        """INT4 once per kernel choice and threshold (the logits once: every path computes
        the same weight)."""
        for kernels in args.int4_kernels.split(","):
            if not set_int4_kernels(model, kernels):
                print(f"   int4: no projection runs {kernels} here (see the log)")
                continue
            for rows in thresholds:
                if rows is None and kernels == "triton":
                    continue  # its small-M kernel for a 4096-token prefill: not a path
                took = set_int4_large_m(model, rows)
                if rows is not None and not took:
                    print("   int4: no large-M path here (the layout check failed: see the log)")
                m = kernels if rows is None else f"{kernels} m>={rows}"
                bench(f"int4 g{args.group_size} {m}")
        if refs:
            logit_rows(f"int4 g{args.group_size}")

    if big:
        bench_int4()
    else:
        bench("bf16")
        schemes = [IntScheme(8), IntScheme(4, args.group_size)]
        if args.int4_kernels in ("", "none"):  # INT8 alone
            schemes.pop()
        for scheme in schemes:
            label = scheme.name + (f" g{scheme.group_size}" if scheme.group_size else "")
            if (
                log.step(
                    f"quantize to {label}", functools.partial(quantize_in_place, model, scheme)
                )
                is None
            ):
                continue
            if scheme.bits == 4:
                bench_int4()
            else:
                for kernels in args.int8_kernels.split(","):
                    set_int8_kernels(model, kernels)
                    ready = {"fused": fused_ready, "triton": triton_ready}.get(kernels)
                    if ready is not None and not ready(torch.device("cuda")):
                        print(f"   int8: the {kernels} kernels are not ready here (see the log)")
                    bench(f"{label} {kernels}")
                logit_rows(label)
            dense_again(model)
        for label, secs in results.items():
            for b in [*batches, *(-p for p in prompts)]:
                if label != "bf16" and b in secs and b in results["bf16"]:
                    what = f"prefill {-b}" if b < 0 else f"decode B={b}"
                    log.add(f"{what}: {label} / bf16 time", f"{secs[b] / results['bf16'][b]:.2f}x")
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    log.print_table()


def _runner(model: LlamaModel, kv: KVCache, config: EngineConfig) -> ModelRunner:
    runner = ModelRunner(model, kv, config)
    runner.execute(decode_batch(2, 64, config.block_size))
    runner.warmup(256)
    return runner
