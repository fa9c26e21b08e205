"""FP8 weights and FP8 KV vs bf16 on one GPU: decode step, prefill and logit error, side by side
in one run.

A Llama-3-8B-shaped model with random bf16 weights made on the GPU
(benchmarks/harness/decode_model.py), the engine's ModelRunner with CUDA graphs and flashinfer
attention, then the same model quantized to FP8 in place (engine/quantization/fp8_linear.py: e4m3
weights with one scale per tensor, cuBLASLt `_scaled_mm`), measured four ways:
- bf16;
- fp8-dynamic: activations quantized per tensor at run time (an amax reduction and a cast
  kernel before every GEMM);
- fp8-token: activations quantized per token at run time (one amax per row), weights still one
  scale per tensor: the GEMM runs row-wise (cuBLASLt's row-wise `_scaled_mm`);
- fp8-token-channel: per-token activations and one weight scale per output channel, the scheme
  most FP8 Llama checkpoints declare (compressed-tensors' FP8_DYNAMIC), also row-wise
  (timed only: its weights are requantized from the per-tensor e4m3, so rounded twice);
- fp8: static activation scales calibrated at load (engine/loading/fp8_calibration.py), so RMSNorm,
  SiLU·mul and attention's output write e4m3 themselves (engine/modeling/layer_ops.py,
  fp8_kernels.py);
- fp8+kv8: the same with an e4m3 KV pool (calibrated per-layer scales);
- decode step at batch 1, 16, 64 with 2048 tokens of context per sequence, each against its
  own HBM floor (its weight bytes + the KV read, over the copy bandwidth measured here);
- prefill of one 4096-token prompt in TFLOP/s against the bf16 and FP8 matmul rates measured
  here (8192^3);
- relative logit error (||logits - ref|| / ||ref||) of bf16 and FP8 against a float32 copy of
  the same weights, over one 256-token random prompt.

    python -m benchmarks fp8 [--batches 1,16,64] [--layer-ops flashinfer]
    python -m benchmarks fp8 --shape llama3-70b   # FP8 weights + FP8 KV, dummy weights
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Sequence
from typing import cast

import torch

from benchmarks.harness.cuda_timing import fill_random, kernel_profile, seconds_per_call
from benchmarks.harness.decode_model import decode_batch, random_llama3_8b, weight_read_bytes
from benchmarks.harness.steps import StepLog
from benchmarks.suites.engine import CUDA, measure_hbm, measure_matmul
from engine.batch import ScheduledBatch, SeqChunk
from engine.config import EngineConfig
from engine.core.runner import ModelRunner
from engine.kv.kv_cache import KV_LAYOUT, LAYOUT_NAMES, KVCache
from engine.kv.kv_sizing import kv_cache_spec
from engine.loading.fp8_calibration import calibrate_activations, kv_scales, observe
from engine.modeling.layer_ops import TORCH_OPS
from engine.modeling.llama import DecoderLayer, LlamaModel, causal_attend
from engine.quantization.fp8_linear import Fp8Linear, quantize_per_tensor, quantize_per_token
from vocabulary.model_config import ModelConfig
from vocabulary.numeric import cdiv


def measure_fp8_matmul(log: StepLog) -> float:
    """FP8 8192^3 `_scaled_mm` rate with per-tensor scales, FLOP/s."""
    n = 8192
    a, sa = quantize_per_tensor(torch.randn(n, n, device="cuda"))
    b, sb = quantize_per_tensor(torch.randn(n, n, device="cuda"))
    bt = b.t()  # column-major, as cuBLASLt wants the second operand

    def mm() -> torch.Tensor:
        return torch._scaled_mm(a, bt, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

    sec = seconds_per_call(mm, 20, CUDA)
    rate = 2 * n**3 / sec
    print(f"   FP8 matmul 8192^3 (per-tensor scales): {rate / 1e12:.0f} TFLOP/s")
    log.add("FP8 matmul 8192^3 per-tensor", f"{rate / 1e12:.0f} TFLOP/s")
    return rate


def dummy_llama3_70b_fp8(layers: int = 0) -> LlamaModel:
    """The Llama-3-70B shape with FP8 dummy weights; `layers` > 0: only that many decoder
    layers (the same layer shape, for a GPU that does not hold all 80)."""
    from deploy.checkpoints.make_model import PRESETS, hf_config
    from engine.loading.dummy_weights import dummy_model

    shape = PRESETS["llama3-70b"]
    if layers:
        shape = shape.with_options(num_layers=layers)
    cfg = ModelConfig.from_dict(hf_config(shape, 0, 1))
    model = dummy_model(cfg, torch.bfloat16, "cuda", fp8=True)
    print(f"   {model.weight_bytes / 2**30:.1f} GiB of weights")
    return model


def fp8_linears(model: LlamaModel) -> list[Fp8Linear]:
    return [m for m in model.modules() if isinstance(m, Fp8Linear)]


def set_dynamic(model: LlamaModel, dynamic: str | None) -> None:
    """Every FP8 projection quantizes its input at run time as `dynamic` says."""
    for linear in fp8_linears(model):
        linear.dynamic = dynamic


def per_channel(model: LlamaModel) -> None:
    """Requantize every (per-tensor) FP8 weight with one scale per output row, in place, 4096
    rows at a time through float32 so the largest weight of the 70B shape fits."""
    for linear in fp8_linears(model):
        parts = [quantize_per_token(rows.float() * linear.weight_scale)
                 for rows in linear.weight.split(4096)]  # fmt: skip
        linear.weight = torch.cat([q for q, _ in parts])
        linear.weight_scale = torch.cat([s.reshape(-1) for _, s in parts])


def matmul_flops(model: LlamaModel, tokens: int) -> float:
    cfg = model.cfg
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    per_layer = h * (q + 2 * kv) + q * h + 2 * inter * h + inter * h
    attention = 2 * tokens * tokens * cfg.head_dim * cfg.num_heads * cfg.num_layers  # causal
    return float(2 * per_layer * cfg.num_layers * tokens + 2 * cfg.vocab_size * h + attention)


@torch.inference_mode()
def logits_of(model: LlamaModel, ids: torch.Tensor) -> torch.Tensor:
    cfg = model.cfg
    attend = causal_attend(1, ids.numel(), cfg.num_heads, cfg.num_kv_heads)
    hidden = model(ids, torch.arange(ids.numel(), device=ids.device), attend)
    return model.compute_logits(hidden).float()


def logit_agreement(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(relative error ||got - ref|| / ||ref||, share of rows whose argmax agrees)."""
    err = float((got - ref).norm() / ref.norm())
    return err, float((got.argmax(-1) == ref.argmax(-1)).float().mean())


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--prefill-tokens", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--layer-ops", default="flashinfer")
    parser.add_argument("--block-size", type=int, default=16, help="KV block (page) size")
    parser.add_argument(
        "--profile-batch", type=int, default=0,
        help="also profile the decode step at this batch: CUDA time per kernel (torch.profiler)",
    )  # fmt: skip
    parser.add_argument(
        "--xqa", action="store_true", help="also time fp8+kv8 with decode_attention xqa"
    )
    parser.add_argument(
        "--e4m3-scores", action="store_true",
        help="also time fp8+kv8 with decode_attention triton-e4m3-scores (q rounded to e4m3)",
    )  # fmt: skip
    parser.add_argument(
        "--bf16-attention",
        default="",
        help="also time bf16 (weights and KV) with these decode_attention kernels, comma "
        "separated (e.g. triton); every FP8 run is then also compared with each",
    )
    parser.add_argument(
        "--kv-layouts", default="block_major",
        help="the e4m3 pool's layouts to time, one after another (engine/kv/kv_cache.py): "
        "block_major, layer_major",
    )  # fmt: skip
    parser.add_argument(
        "--shape",
        default="llama3-8b",
        choices=("llama3-8b", "llama3-70b"),
        help="llama3-70b: FP8 dummy weights made layer by layer (engine/loading/dummy_weights.py), "
        "FP8 weights + FP8 KV only (its bf16 weights do not fit one GPU)",
    )
    parser.add_argument(
        "--layers", type=int, default=0,
        help="llama3-70b only: this many decoder layers instead of 80 (an 80 GB card holds ~40 "
        "with a B=64 x 2048 e4m3 pool); the floor and ratios are of that model",
    )  # fmt: skip
    args = parser.parse_args(argv)
    log = StepLog()
    big = args.shape == "llama3-70b"
    t_start = time.perf_counter()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    hbm = log.step("measure HBM bandwidth", functools.partial(measure_hbm, log)) or float("nan")
    bf16_rate = log.step("measure bf16 matmul rate", functools.partial(measure_matmul, log))
    fp8_rate = log.step("measure FP8 matmul rate", functools.partial(measure_fp8_matmul, log))
    bf16_rate, fp8_rate = bf16_rate or float("nan"), fp8_rate or float("nan")
    if big:
        model = log.step(
            "build the Llama-3-70B shape (FP8 dummy weights)",
            functools.partial(dummy_llama3_70b_fp8, args.layers),
        )
    else:
        model = log.step(
            "build the Llama-3-8B-shaped model (random bf16 weights)", random_llama3_8b
        )
    if model is None:
        log.print_table()
        return
    bs, context, prompt = args.block_size, args.context, args.prefill_tokens
    batches = [int(b) for b in args.batches.split(",")]
    pages_decode = max(batches) * cdiv(context, bs)
    num_blocks = pages_decode + cdiv(prompt, bs) + 8
    kv_holder: dict[str, object] = {"kv": None, "bytes": 2}  # the pool the next runner uses
    if not big:
        kv = KVCache(kv_cache_spec(model.cfg, bs, torch.bfloat16, num_blocks), "cuda")
        kv.tensor.normal_()
        kv_holder["kv"] = kv
    cfg = model.cfg
    kv_elems_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim

    ids = torch.randint(1, cfg.vocab_size, (256,), device="cuda")
    errors: dict[str, float] = {}

    ref_layer: DecoderLayer | None = None
    ref_rotary = None
    gen32 = torch.Generator(device="cuda").manual_seed(1)

    def reference_logits() -> torch.Tensor | None:
        """The float32 copy's logits, or None (said why) where the card cannot hold the copy
        beside the bf16 model and its pool (an 80 GB card holds the 8B shape's 32 GB copy once:
        it is filled tensor by tensor, never through a second float32 state dict)."""
        nonlocal ref_layer, ref_rotary
        need = 2 * sum(p.numel() * p.element_size() for p in model.parameters())  # bf16 → fp32
        free = torch.cuda.mem_get_info()[0]
        if need + 2 * 2**30 > free:
            need_gib, free_gib = need / 2**30, free / 2**30
            print(f"   skipped: a float32 copy needs {need_gib:.1f} GiB, {free_gib:.1f} free")
            return None
        ref_model = LlamaModel(cfg, dtype=torch.float32, device="cuda").eval()
        source = model.state_dict()
        with torch.no_grad():
            for name, tensor in ref_model.state_dict().items():
                if name in source:
                    tensor.copy_(source[name])
        out = logits_of(ref_model, ids)
        ref_layer = cast(DecoderLayer, ref_model.layers[0])
        ref_rotary = ref_model.rotary
        del ref_model
        torch.cuda.empty_cache()
        return out

    ref = None
    if not big:
        ref = log.step("float32 reference logits (a float32 copy of the weights)", reference_logits)

    def layer_error(label: str) -> None:
        """One decoder layer's output against float32 (random weights amplify any error
        layer by layer, so the logits of a 32-layer random model show chaos more than
        quantization; one layer shows the quantization alone)."""
        assert ref_layer is not None
        x = torch.randn(256, cfg.hidden_size, device="cuda", generator=gen32).bfloat16()
        attend = causal_attend(1, 256, cfg.num_heads, cfg.num_kv_heads)
        pos = torch.arange(256, device="cuda")
        with torch.inference_mode():
            got = model.layers[0](0, x.clone(), None, pos, model.rotary, attend, TORCH_OPS)[0]
            want = ref_layer(0, x.float(), None, pos, ref_rotary, attend, TORCH_OPS)[0]
        err = float((got.float() - want).norm() / want.norm())
        print(f"   {label}: one layer's relative error {err:.2e}")
        log.add(f"layer 0 error vs float32, {label}", f"{err:.2e}")

    def logit_error(label: str) -> None:
        assert ref is not None
        err, same = logit_agreement(logits_of(model, ids), ref)
        errors[label] = err
        print(f"   {label}: relative logit error {err:.2e}, argmax agreement {same:.1%}")
        log.add(f"logit error vs float32, {label}", f"{err:.2e}", f"argmax {same:.1%}")

    def make_runner(decode_attention: str = "auto") -> ModelRunner:
        config = EngineConfig(
            decode_attention=decode_attention,
            model_dir="random:llama3-8b",
            block_size=bs,
            attention_backend="flashinfer",
            layer_ops=args.layer_ops,
            cuda_graphs=True,
            cuda_graph_max_batch=max(batches),
            max_num_seqs=max(batches),
        )
        runner = ModelRunner(model, cast(KVCache, kv_holder["kv"]), config)
        runner.execute(decode_batch(2, 64, bs, pages_decode))
        runner.warmup(256)
        return runner

    def bench(label: str, decode_attention: str = "auto") -> dict[int, float]:
        runner = log.step(
            f"{label}: CUDA-graph runner (capture + warm-up)",
            functools.partial(make_runner, decode_attention),
        )
        if runner is None:
            return {}
        weights = weight_read_bytes(model)
        secs: dict[int, float] = {}
        for b in batches:
            batch = decode_batch(b, context, bs)
            run = functools.partial(runner.execute, batch)
            sec = log.step(
                f"{label}: decode B={b}", functools.partial(seconds_per_call, run, args.iters, CUDA)
            )
            if sec is None:
                continue
            secs[b] = sec
            if b == args.profile_batch:
                log.step(f"{label}: profile decode B={b}", functools.partial(kernel_profile, run))
            kv_per_token = kv_elems_per_token * cast(int, kv_holder["bytes"])
            floor = (weights + b * context * kv_per_token) / hbm
            print(f"   {label} B={b}: {sec * 1e3:.2f} ms, floor {floor * 1e3:.2f} ms")
            log.add(
                f"decode B={b} ctx {context} {label}",
                f"{sec * 1e3:.2f} ms",
                f"floor {floor * 1e3:.2f} ms",
                f"{sec / floor:.2f}x",
            )
        blocks = tuple(range(pages_decode, pages_decode + cdiv(prompt, bs)))
        toks = tuple(int(t) for t in torch.randint(1, cfg.vocab_size, (prompt,)))
        pre = ScheduledBatch((SeqChunk("prefill", toks, 0, blocks, sample=True),))
        sec = log.step(
            f"{label}: prefill {prompt} tokens",
            functools.partial(seconds_per_call, functools.partial(runner.execute, pre), 5, CUDA),
        )
        if sec is not None:
            rate = matmul_flops(model, prompt) / sec
            secs[-1] = sec
            print(f"   {label} prefill: {sec * 1e3:.1f} ms, {rate / 1e12:.0f} TFLOP/s")
            log.add(
                f"prefill {prompt} tokens {label}",
                f"{sec * 1e3:.1f} ms",
                f"{rate / 1e12:.0f} TFLOP/s",
                f"{rate / bf16_rate:.0%} of bf16 mm, {rate / fp8_rate:.0%} of FP8 mm",
            )
        print(f"   weights read per decode step: {weights / 2**30:.2f} GiB")
        runner.graphs = None  # free the captured graphs before the next runner captures
        torch.cuda.empty_cache()
        return secs

    if ref is not None:
        log.step("bf16 logit error", functools.partial(logit_error, "bf16"))
        log.step("bf16 one-layer error", functools.partial(layer_error, "bf16"))
    results: dict[str, dict[int, float]] = {}
    if not big:
        results["bf16"] = bench("bf16")
        for kernel in filter(None, args.bf16_attention.split(",")):
            results[f"bf16 {kernel}"] = bench(f"bf16 {kernel}", kernel)
        log.step("quantize the projections to FP8 in place", model.quantize_fp8)
        torch.cuda.empty_cache()
        if ref is not None:
            log.step("FP8 (dynamic) logit error", functools.partial(logit_error, "fp8-dynamic"))
        results["fp8-dynamic"] = bench("fp8-dynamic")
        set_dynamic(model, "token")
        if ref is not None:
            log.step("FP8 (per token) logit error", functools.partial(logit_error, "fp8-token"))
        results["fp8-token"] = bench("fp8-token")
        # timing only: the per-channel weights are rounded twice (from the per-tensor e4m3)
        kept = [(linear.weight, linear.weight_scale) for linear in fp8_linears(model)]
        log.step("requantize the FP8 weights per output channel", lambda: per_channel(model))
        results["fp8-token-channel"] = bench("fp8-token-channel")
        for linear, (weight, scale) in zip(fp8_linears(model), kept, strict=True):
            linear.weight, linear.weight_scale = weight, scale  # the rest runs per tensor
        del kept
        set_dynamic(model, None)
    calib = [int(t) for t in torch.randint(1, cfg.vocab_size, (512,))]
    observed = log.step("calibrate static FP8 scales (512 tokens)", lambda: observe(model, calib))
    if observed is not None:
        calibrate_activations(model, observed)
        if ref is not None:
            log.step("FP8 (static) logit error", functools.partial(logit_error, "fp8"))
            log.step("FP8 (static) one-layer error", functools.partial(layer_error, "fp8"))
        if not big:
            results["fp8"] = bench("fp8")
            kv_holder["kv"] = None
            del kv
            torch.cuda.empty_cache()
        scales8 = kv_scales(observed)
        for name in args.kv_layouts.split(","):
            layout = LAYOUT_NAMES[name]
            tag = "" if layout == KV_LAYOUT else f" {name}"
            spec8 = kv_cache_spec(model.cfg, bs, torch.float8_e4m3fn, num_blocks, scales8,
                                  layout=layout)  # fmt: skip
            kv_holder["kv"] = None
            torch.cuda.empty_cache()
            kv8 = KVCache(spec8, "cuda")
            fill_random(kv8.tensor, 8)  # the random context the decodes attend to
            kv_holder["kv"], kv_holder["bytes"] = kv8, 1
            del kv8
            results[f"fp8+kv8{tag}"] = bench(f"fp8+kv8{tag}")
            if args.e4m3_scores:  # the same with the decode attention's scores in e4m3
                label = f"fp8+kv8{tag} e4m3 scores"
                results[label] = bench(label, "triton-e4m3-scores")
            if args.xqa:  # flashinfer's XQA decode (TensorRT-LLM's) instead of the Triton one
                results[f"fp8+kv8{tag} xqa"] = bench(f"fp8+kv8{tag} xqa", "xqa")
    bases = [label for label in results if label.split()[0] == "bf16"]
    for base in bases:
        for label, secs in results.items():
            if label in bases:
                continue
            for b in [*batches, -1]:
                if b in results[base] and b in secs:
                    what = "prefill" if b < 0 else f"decode B={b}"
                    ratio = secs[b] / results[base][b]
                    log.add(f"{what}: {label} / {base} time", f"{ratio:.2f}x")
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    log.print_table()
