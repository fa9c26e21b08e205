"""Engine execution benchmark: decode and prefill step times of the ModelRunner vs their floors.

GPU mode (default when CUDA is present): a Llama-3-8B-shaped model with random bf16 weights
made directly on the GPU (nothing on disk), a KV pool with random contents, and:
- decode step time at batch 1, 16, 64 with 2048 tokens of context per sequence, with and
  without CUDA graphs, vs the HBM floor (weights + KV read) / (HBM copy bandwidth measured
  in this run, read+write counted); goal: within 1.3x of the floor at batch 64;
- prefill of one 4096-token prompt vs the bf16 matmul rate measured in this run (8192^3);
  prefill FLOPs = 2 * matmul params * tokens + causal attention FLOPs; goal: >= 50%;
- each of the above with flashinfer's fused layer ops ("fused") and with the torch ops
  ("torch-ops") side by side (`--layer-ops`), and the GPU kernels one eager decode step
  launches with each (torch profiler).
Every step prints what it does and catches its own failure, so one failure loses nothing else.

CPU mode (`--cpu`): tokens/s of the runner in a greedy loop on the tiny model vs
transformers.generate on the same prompts, same run (and whether their tokens agree).

Engine-step mode (`--engine-step`: the engine_step suite, benchmarks/suites/engine_step.py):
the whole `LLMEngine.step()` over a steady decode batch, overlap scheduling on and off, vs the
pure CUDA-graph decode replay at B=1/8/16/64 (ratios; goal: step <= 1.05x decode with
overlap), and a host-side profile of the step (schedule, launch, sample, wait, postprocess).

    python -m benchmarks engine                    # GPU
    python -m benchmarks engine --cpu              # CPU, tiny model
    python -m benchmarks engine --engine-step      # GPU (one H200), Llama-3-8B shape
    python -m benchmarks engine --engine-step --cpu  # CPU, tiny model
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Sequence

import torch

from benchmarks.harness.cuda_timing import copy_bytes_per_s, matmul_flops_per_s, seconds_per_call
from benchmarks.harness.decode_model import decode_batch, random_llama3_8b, weight_read_bytes
from benchmarks.harness.steps import StepLog, run_steps
from engine.batch import ScheduledBatch, SeqChunk
from engine.config import EngineConfig
from engine.core.runner import ModelRunner
from engine.kv.kv_cache import KVCache
from engine.kv.kv_sizing import kv_cache_spec
from engine.modeling.llama import LlamaModel
from vocabulary.numeric import cdiv

CUDA = torch.device("cuda")


# ---------------------------------------------------------------------------------- GPU


def measure_hbm(log: StepLog) -> float:
    """Device-to-device copy bandwidth, bytes/s, read + write counted (2 GiB copied)."""
    bw = copy_bytes_per_s(CUDA, 2 << 30)
    print(f"   HBM copy: {bw / 1e9:.0f} GB/s (read+write)")
    log.add("HBM copy bandwidth (read+write)", f"{bw / 1e9:.0f} GB/s", "decode floors")
    return bw


def measure_matmul(log: StepLog) -> float:
    """bf16 8192^3 matmul rate, FLOP/s."""
    rate = matmul_flops_per_s(8192)
    print(f"   bf16 matmul 8192^3: {rate / 1e12:.0f} TFLOP/s")
    log.add("bf16 matmul 8192^3", f"{rate / 1e12:.0f} TFLOP/s", "prefill floor")
    return rate


def decode_read_bytes(model: LlamaModel, batch_size: int, context: int) -> int:
    """Bytes a decode step must read: every weight but the embedding table, plus the KV."""
    cfg = model.cfg
    kv_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    return weight_read_bytes(model) + batch_size * context * kv_per_token


def prefill_flops(model: LlamaModel, tokens: int) -> float:
    cfg = model.cfg
    per_layer = sum(
        p.numel() for n, p in model.layers[0].named_parameters() if not n.endswith("norm.weight")
    )
    matmul = 2 * per_layer * cfg.num_layers * tokens + 2 * cfg.vocab_size * cfg.hidden_size
    attention = 2 * tokens * tokens * cfg.head_dim * cfg.num_heads * cfg.num_layers  # causal
    return float(matmul + attention)


def gpu_main(args: argparse.Namespace, log: StepLog) -> None:
    import flashinfer

    print(
        f"torch {torch.__version__}, {torch.cuda.get_device_name()}, flashinfer "
        f"{getattr(flashinfer, '__version__', '?')}"
    )
    hbm = log.step("measure HBM bandwidth", functools.partial(measure_hbm, log))
    mm = log.step("measure bf16 matmul rate", functools.partial(measure_matmul, log))
    model = log.step(
        "build Llama-3-8B-shaped model with random bf16 weights on the GPU", random_llama3_8b
    )
    if model is None:
        return
    bs, context, prompt = 16, args.context, args.prefill_tokens
    batches = [int(b) for b in args.batches.split(",")]
    pages_decode = max(batches) * cdiv(context, bs)
    num_blocks = pages_decode + cdiv(prompt, bs) + 8

    def make_pool() -> KVCache:
        kv = KVCache(kv_cache_spec(model.cfg, bs, torch.bfloat16, num_blocks), "cuda")
        kv.tensor.normal_()
        print(f"   KV pool: {num_blocks} blocks, {kv.spec.nbytes / 2**30:.1f} GiB, random")
        return kv

    kv = log.step("allocate the KV pool", make_pool)
    if kv is None:
        return

    ops_kinds = [k for k in args.layer_ops.split(",") if k]
    label_of = {"flashinfer": "fused", "torch": "torch-ops", "auto": "auto-ops"}

    def make_runner(graphs: bool, layer_ops: str) -> ModelRunner:
        config = EngineConfig(
            model_dir="random:llama3-8b",
            block_size=bs,
            attention_backend="flashinfer",
            layer_ops=layer_ops,
            cuda_graphs=graphs,
            cuda_graph_max_batch=max(batches),
            max_num_seqs=max(batches),
        )
        t0 = time.perf_counter()
        runner = ModelRunner(model, kv, config)
        print(
            f"   backend {runner.attention_backend}, layer ops {runner.layer_ops.name}, graphs "
            f"{runner.graphs.sizes if runner.graphs else None}, {time.perf_counter() - t0:.1f} s"
        )
        return runner

    def warm_up(runner: ModelRunner) -> None:
        runner.execute(decode_batch(2, 64, bs, pages_decode))
        runner.warmup(256)

    eager: dict[str, ModelRunner] = {}
    graphed: dict[str, ModelRunner] = {}
    for ops in ops_kinds:
        runner = log.step(
            f"eager runner, {label_of[ops]} (first use JITs flashinfer on a fresh machine: "
            "attention ~25 s, fused layer ops more)",
            functools.partial(make_runner, False, ops),
        )
        if runner is not None:
            eager[ops] = runner
            log.step(
                f"warm up eager prefill + decode, {label_of[ops]}",
                functools.partial(warm_up, runner),
            )
    for ops in ops_kinds:
        runner = log.step(
            f"CUDA-graph runner, {label_of[ops]} (captures 1..max batch)",
            functools.partial(make_runner, True, ops),
        )
        if runner is not None:
            graphed[ops] = runner

    def bench_decode(runner: ModelRunner, label: str, b: int) -> float:
        batch = decode_batch(b, context, bs)
        sec = seconds_per_call(lambda: runner.execute(batch), args.iters, CUDA)
        floor = decode_read_bytes(model, b, context) / hbm if hbm else float("nan")
        print(
            f"   {label} B={b}: {sec * 1e3:.2f} ms/step, floor {floor * 1e3:.2f} ms, "
            f"{sec / floor:.2f}x, {b / sec:.0f} tok/s"
        )
        log.add(
            f"decode B={b} ctx {context} {label}",
            f"{sec * 1e3:.2f} ms",
            f"floor {floor * 1e3:.2f} ms",
            f"{sec / floor:.2f}x",
        )
        return sec

    for b in batches:
        graph_secs: dict[str, float | None] = {}
        for ops, runner in graphed.items():
            label = f"graphs {label_of[ops]}"
            graph_secs[ops] = log.step(
                f"decode B={b}, CUDA graphs, {label_of[ops]}",
                functools.partial(bench_decode, runner, label, b),
            )
        for ops, runner in eager.items():
            label = f"eager {label_of[ops]}"
            log.step(
                f"decode B={b}, eager, {label_of[ops]}",
                functools.partial(bench_decode, runner, label, b),
            )
        fused, plain = graph_secs.get("flashinfer"), graph_secs.get("torch")
        if fused and plain:
            log.add(f"decode B={b} graphs: torch-ops / fused", f"{plain / fused:.2f}x")

    def bench_prefill(runner: ModelRunner, label: str) -> None:
        first = pages_decode
        blocks = tuple(range(first, first + cdiv(prompt, bs)))
        ids = tuple(int(t) for t in torch.randint(1, 128000, (prompt,)))
        batch = ScheduledBatch((SeqChunk("prefill", ids, 0, blocks, sample=True),))
        sec = seconds_per_call(lambda: runner.execute(batch), max(3, args.iters // 5), CUDA)
        flops = prefill_flops(model, prompt)
        rate = flops / sec
        share = f"{rate / mm:.0%} of matmul" if mm else "matmul rate unknown"
        print(
            f"   prefill {prompt} tokens, {label}: {sec * 1e3:.1f} ms, {flops / 1e12:.1f} TFLOP, "
            f"{rate / 1e12:.0f} TFLOP/s, {share}"
        )
        log.add(
            f"prefill {prompt} tokens {label}",
            f"{sec * 1e3:.1f} ms",
            f"{rate / 1e12:.0f} TFLOP/s",
            share,
        )

    for ops, runner in (eager or graphed).items():
        log.step(
            f"prefill one {prompt}-token prompt, {label_of[ops]}",
            functools.partial(bench_prefill, runner, label_of[ops]),
        )

    def count_kernels(runner: ModelRunner, label: str, b: int) -> None:
        """GPU kernels one eager decode step launches (torch profiler; copies not counted)."""
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        batch = decode_batch(b, context, bs)
        runner.execute(batch)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.execute(batch)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
        n = sum(1 for name in names if not name.startswith(("Memcpy", "Memset")))
        per_layer = n / model.cfg.num_layers
        print(f"   {label}: {n} kernels per decode step (~{per_layer:.1f} per layer)")
        log.add(f"kernels per eager decode step B={b} {label}", str(n))

    for ops, runner in eager.items():
        log.step(
            f"count kernels of one eager decode step, {label_of[ops]}",
            functools.partial(count_kernels, runner, label_of[ops], 16),
        )

    def bench_decode_kernels() -> None:
        """flashinfer decode alone on one layer (B=max batch, ctx tokens each), per kernel and
        page size: our strided pool view at page 16, then contiguous per-layer tensors."""
        b = max(batches)
        assert kv is not None and hbm
        cfg = model.cfg
        q = torch.randn(b, cfg.num_heads, cfg.head_dim, dtype=torch.bfloat16, device="cuda")
        floor = b * context * cfg.num_kv_heads * cfg.head_dim * 2 * 2 / hbm
        ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
        # (label, kernel backend, tensor cores, page size, strided pool view?)
        variants = [
            ("fa2 TC p16 pool view (ours)", "fa2", True, bs, True),
            ("fa2 CUDA cores p16 pool view", "fa2", False, bs, True),
            ("fa2 TC p16 contiguous", "fa2", True, 16, False),
            ("fa2 TC p32 contiguous", "fa2", True, 32, False),
            ("fa2 TC p64 contiguous", "fa2", True, 64, False),
        ]
        if args.fa3:
            variants.append(("fa3 TC p16 pool view", "fa3", True, bs, True))
        for label, backend, tc, page, strided in variants:
            try:
                pages = cdiv(context, page)
                if strided:
                    cache = kv.layer(0)
                else:
                    shape = (b * pages, 2, page, cfg.num_kv_heads, cfg.head_dim)
                    cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
                w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    ws, "NHD", use_tensor_cores=tc, backend=backend
                )
                t0 = time.perf_counter()
                w.plan(
                    torch.arange(0, (b + 1) * pages, pages, dtype=torch.int32),
                    torch.arange(b * pages, dtype=torch.int32, device="cuda"),
                    torch.full((b,), context - (pages - 1) * page, dtype=torch.int32),
                    cfg.num_heads,
                    cfg.num_kv_heads,
                    cfg.head_dim,
                    page,
                    q_data_type=torch.bfloat16,
                    kv_data_type=torch.bfloat16,
                )
                w.run(q, cache)
                torch.cuda.synchronize()
                jit = time.perf_counter() - t0
                sec = seconds_per_call(functools.partial(w.run, q, cache), 50, CUDA)
                del cache
            except Exception as e:  # one variant failing must not hide the others
                print(f"   {label}: FAILED {type(e).__name__}: {e}")
                log.add(f"decode attn B={b} {label}", "FAILED")
                continue
            print(
                f"   {label}: {sec * 1e6:.0f} us/layer (first call {jit:.1f} s), "
                f"floor {floor * 1e6:.0f} us, {sec / floor:.2f}x"
            )
            log.add(
                f"decode attn B={b} {label}",
                f"{sec * 1e6:.0f} us",
                f"floor {floor * 1e6:.0f} us",
                f"{sec / floor:.2f}x",
            )

    log.step(
        "decode attention kernels alone (which kernel bounds the decode step)", bench_decode_kernels
    )


# ---------------------------------------------------------------------------------- CPU


def cpu_main(args: argparse.Namespace, log: StepLog) -> None:
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    from deploy.checkpoints.checkpoint_files import CORPUS
    from deploy.checkpoints.make_model import cached_tiny_model
    from engine.loading.loaders import load_model

    torch.manual_seed(0)
    model_dir = cached_tiny_model()
    model = load_model(model_dir, torch.float32)
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # both sides generate exactly n_new tokens
    corpus = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(CORPUS.read_text()).ids
    n_prompt, n_new = args.cpu_prompt, args.cpu_new
    print(f"tiny model {model_dir}, torch threads {torch.get_num_threads()}")

    def ours(prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
        bs = 16
        per_seq = cdiv(n_prompt + n_new, bs)
        kv = KVCache(kv_cache_spec(model.cfg, bs, torch.float32, per_seq * len(prompts)))
        config = EngineConfig(model_dir=str(model_dir), block_size=bs, cuda_graphs=False)
        runner = ModelRunner(model, kv, config)
        tables = [tuple(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
        seqs = [list(p) for p in prompts]
        t0 = time.perf_counter()
        chunks = [SeqChunk(str(i), tuple(s), 0, tables[i], True) for i, s in enumerate(seqs)]
        logits = runner.execute(ScheduledBatch(tuple(chunks)))
        for _ in range(n_new):
            for s, row in zip(seqs, logits.argmax(-1).tolist(), strict=True):
                s.append(row)
            if len(seqs[0]) == n_prompt + n_new:
                break
            chunks = [
                SeqChunk(str(i), (s[-1],), len(s) - 1, tables[i], True) for i, s in enumerate(seqs)
            ]
            logits = runner.execute(ScheduledBatch(tuple(chunks)))
        return time.perf_counter() - t0, [s[n_prompt:] for s in seqs]

    def theirs(prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
        ids = torch.tensor(prompts)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(ids, max_new_tokens=n_new, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t0, out[:, n_prompt:].tolist()

    for batch_size in (1, 4):
        starts = torch.randint(0, len(corpus) - n_prompt, (batch_size,)).tolist()
        prompts = [corpus[s : s + n_prompt] for s in starts]
        ours(prompts)  # warm-up
        theirs(prompts)
        t_ours, tok_ours = ours(prompts)
        t_hf, tok_hf = theirs(prompts)
        gen = batch_size * n_new
        same = tok_ours == tok_hf
        print(
            f"   batch {batch_size}: runner {gen / t_ours:.0f} tok/s, transformers "
            f"{gen / t_hf:.0f} tok/s, tokens equal: {same}"
        )
        log.add(
            f"CPU tiny greedy, batch {batch_size}, {n_prompt}+{n_new}",
            f"{gen / t_ours:.0f} tok/s",
            f"HF {gen / t_hf:.0f} tok/s",
            f"{t_hf / t_ours:.2f}x {'same' if same else 'DIFF'}",
        )


def main(argv: Sequence[str] | None = None) -> None:
    from benchmarks.suites import engine_step

    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="CPU mode (tiny model)")
    parser.add_argument("--batches", default="1,16,64", help="decode batch sizes")
    parser.add_argument("--context", type=int, default=2048, help="decode context per sequence")
    parser.add_argument("--prefill-tokens", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=30, help="timed decode steps")
    parser.add_argument(
        "--fa3", action="store_true", help="also time fa3 decode attention (JIT ~100 s)"
    )
    parser.add_argument(
        "--layer-ops",
        default="flashinfer,torch",
        help="layer ops to time side by side (EngineConfig.layer_ops values, comma-separated)",
    )
    parser.add_argument("--cpu-prompt", type=int, default=32)
    parser.add_argument("--cpu-new", type=int, default=64)
    parser.add_argument(
        "--engine-step",
        action="store_true",
        help="time LLMEngine.step() (overlap on/off) vs the pure decode, with a host profile "
        "(the engine_step suite)",
    )
    engine_step.add_step_arguments(parser)
    args = parser.parse_args(argv)
    if args.engine_step:
        engine_step.run(args)
        return
    run_steps(
        args.cpu or not torch.cuda.is_available(),
        "CPU: runner greedy loop vs transformers.generate",
        lambda log: cpu_main(args, log),
        lambda log: gpu_main(args, log),
    )
