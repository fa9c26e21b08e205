"""What constrained decoding costs the batch it runs in: the engine step with half the batch
under a nested JSON schema vs the same batch all free, and a schema's compile, cold and cached.

    python -m benchmarks structured           # GPU, Llama-3-8B shape (random bf16 weights)
    python -m benchmarks structured --cpu     # CPU, tiny model (figures as ratios)

For each batch size B, B requests enter decoding at once over `context` tokens of reserved
(not computed) prompt KV, as a hand-off would leave them, all sampled at temperature 1:
- free: every request unconstrained;
- mixed: ceil(B/2) under SCHEMA (nested objects and arrays; engine/structured fills their masks
  on the host while the device runs the step, and the sampler applies them), the rest free.
`rounds` rounds interleave timed runs of `iters` steps of each (medians). A constrained
request whose JSON completes is replaced by a new one between two timed steps (the count is
printed), so the batch stays at B. mixed / free is both the step's cost (goal <= 1.05) and
the TPOT of the free requests beside the constrained ones (the step is what each of them
waits for; goal <= 1.02).

Compile: SCHEMA compiled by a fresh `Grammars` (cold) and looked up again (cached), with
this run's tokenizer. The GPU run's tokenizer is the benchmark's 512-token one over the
128,256-entry vocabulary unless `--tokenizer` names a tokenizer.json: no Llama-3 tokenizer is on
the machines, so gpu_validate.sh passes a byte-level BPE of 128,000 tokens trained on Python
sources (scripts/make-bench-tokenizer.py), whose token strings are as varied as a real
one's: xgrammar's mask and compile work grow with the vocabulary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace

import torch

from benchmarks.harness.cuda_timing import sync
from benchmarks.harness.decode_model import llama3_8b_folder, random_llama3_8b
from benchmarks.harness.steps import StepLog, run_steps
from engine.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.modeling.llama import LlamaModel
from engine.structured.grammars import Grammars
from vocabulary.block_hash import hash_chain, hash_extra
from vocabulary.sampling import SamplingParams, StructuredOutput
from vocabulary.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "order": {"type": "integer"},
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "vip": {"type": "boolean"}},
            "required": ["name", "vip"],
        },
        "lines": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "qty": {"type": "integer"},
                    "tags": {"type": "array", "items": {"enum": ["new", "sale", "gift"]}},
                },
                "required": ["sku", "qty"],
            },
        },
    },
    "required": ["order", "customer", "lines"],
}
CONSTRAINT = StructuredOutput("json_schema", json.dumps(SCHEMA))
FREE = SamplingParams(temperature=1.0, max_tokens=1 << 20, ignore_eos=True)
CONSTRAINED = replace(FREE, structured=CONSTRAINT)


def extra(engine: LLMEngine) -> bytes:
    return hash_extra(engine.model_id)


class Batch:
    """B requests decoding in one engine; constrained ones are replaced when they end."""

    def __init__(self, engine: LLMEngine, size: int, constrained: int, context: int) -> None:
        self.engine, self.context = engine, context
        self.gen = torch.Generator().manual_seed(size)
        self.count = 0
        self.replaced = 0
        self.brace = engine.tokenizer.encode("{", add_special_tokens=False)[0]
        for i in range(size):
            self.start(CONSTRAINED if i < constrained else FREE)

    def start(self, params: SamplingParams) -> None:
        engine = self.engine
        vocab = min(engine.model_config.vocab_size, engine.tokenizer.vocab_size)
        prompt = torch.randint(1, vocab, (self.context,), generator=self.gen).tolist()
        rid = f"r{self.count}"
        self.count += 1
        bs = engine.config.block_size
        engine.allocate_for_transfer(rid, prompt, hash_chain(prompt, bs, extra(engine)))
        # the first token (a prefill worker's): "{" opens the constrained ones' JSON
        first = self.brace if params.structured is not None else prompt[-1]
        engine.add_transferred_request(rid, first, params)

    def timed_steps(self, iters: int) -> float:
        """Seconds per step() over `iters` steps (replacements between steps not counted)."""
        engine = self.engine
        sync(engine.runner.device)
        total = 0.0
        for _ in range(iters):
            t0 = time.perf_counter()
            outputs = engine.step()
            total += time.perf_counter() - t0
            for out in outputs:
                if out.finish_reason is not None:
                    self.replaced += 1
                    self.start(CONSTRAINED)
        sync(engine.runner.device)
        return total / iters

    def stop(self) -> None:
        engine = self.engine
        for rid in list(engine.scheduler.requests):
            engine.abort_request(rid)
        engine.step()
        sync(engine.runner.device)
        assert engine.block_pool.num_free == engine.block_pool.num_blocks


def measure(
    log: StepLog, engine: LLMEngine, batches: list[int], context: int, iters: int, rounds: int
) -> None:
    results = {}
    for b in batches:
        times: dict[str, list[float]] = {"free": [], "mixed": []}
        replaced = 0
        for _ in range(rounds):
            for label in times:
                batch = Batch(engine, b, 0 if label == "free" else -(-b // 2), context)
                for _ in range(4):  # first plans, the first masks
                    batch.timed_steps(1)
                times[label].append(batch.timed_steps(iters))
                replaced += batch.replaced
                batch.stop()
        free, mixed = (statistics.median(times[k]) * 1e3 for k in ("free", "mixed"))
        results[b] = {"free_ms": free, "mixed_ms": mixed, "replaced": replaced}
        print(f"   B={b}: all free {free:.3f} ms/step, half constrained {mixed:.3f} ms/step "
              f"= {mixed / free:.3f}x ({replaced} finished JSONs replaced)")  # fmt: skip
        log.add(f"step B={b}, half constrained / all free", f"{mixed:.3f} / {free:.3f} ms",
                f"{mixed / free:.3f}x")  # fmt: skip
    print("   json: " + json.dumps(results))


def compile_times(log: StepLog, engine: LLMEngine) -> None:
    grammars = Grammars(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids)
    t0 = time.perf_counter()
    grammars.compile(CONSTRAINT)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(100):
        grammars.compile(CONSTRAINT)
    cached = (time.perf_counter() - t0) / 100
    grammars.close()
    print(f"   compile: cold {cold * 1e3:.2f} ms, cached {cached * 1e6:.1f} us "
          f"({engine.tokenizer.vocab_size} tokens)")  # fmt: skip
    log.add("schema compile, cold / cached", f"{cold * 1e3:.2f} ms", f"{cached * 1e6:.1f} us")


def make_engine(model: LlamaModel, tokenizer: Tokenizer, config: EngineConfig) -> LLMEngine:
    engine = LLMEngine(config, model, tokenizer)
    if engine.runner.device.type == "cuda":
        engine.kv_cache.tensor.normal_()  # random KV (the graphs are captured already)
    return engine


def pool(batches: list[int], context: int, steps: int) -> dict[str, int]:
    return dict(
        num_kv_blocks=2 * max(batches) * -(-(context + steps) // 16) + 16,
        max_num_seqs=max(batches),
        max_model_len=context + steps + 64,
        enable_prefix_caching=False,
    )


def gpu(args: argparse.Namespace, log: StepLog) -> None:
    batches = [int(b) for b in args.batches.split(",")]
    model = log.step("build Llama-3-8B-shaped model with random bf16 weights", random_llama3_8b)
    if model is None:
        return
    with llama3_8b_folder() as (folder, tokenizer):
        config = EngineConfig(
            model_dir=str(folder), model_id="llama3-8b-random", device="cuda",
            dtype="bfloat16", attention_backend="flashinfer", cuda_graph_max_batch=max(batches),
            **pool(batches, args.context, (args.iters + 8) * args.rounds),  # type: ignore[arg-type]
        )  # fmt: skip
        if args.tokenizer:  # a real-size vocabulary for the masks and the compile
            tokenizer = bench_tokenizer(args.tokenizer)
        engine = log.step(
            "engine (captures its CUDA graphs)", lambda: make_engine(model, tokenizer, config)
        )
    if engine is not None:
        log.step("schema compile", lambda: compile_times(log, engine))
        sizes, context, iters, rounds = batches, args.context, args.iters, args.rounds
        log.step(f"step, half constrained vs all free, B={batches}",
                 lambda: measure(log, engine, sizes, context, iters, rounds))  # fmt: skip


def bench_tokenizer(path: str) -> Tokenizer:
    """A tokenizer.json (byte-level BPE, e.g. one of ~128k tokens as Llama-3's) as the engine's
    tokenizer; its end token: `</s>`, else id 1."""
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer.from_file(path)
    eos = tok.token_to_id("</s>")
    print(f"   tokenizer {path}: {tok.get_vocab_size()} tokens")
    return Tokenizer(tok, (1 if eos is None else eos,))


def cpu(args: argparse.Namespace, log: StepLog) -> None:
    from deploy.checkpoints.make_model import cached_tiny_model
    from engine.loading.loaders import load_model

    torch.set_num_threads(1)
    model_dir = cached_tiny_model()
    batches = [int(b) for b in args.cpu_batches.split(",")]
    config = EngineConfig(
        model_dir=str(model_dir), device="cpu", dtype="float32", attention_backend="torch",
        cuda_graphs=False, **pool(batches, args.cpu_context, (args.iters + 8) * args.rounds),  # type: ignore[arg-type]
    )  # fmt: skip
    model = load_model(model_dir, torch.float32)
    engine = make_engine(model, Tokenizer.from_model_dir(model_dir), config)
    compile_times(log, engine)
    measure(log, engine, batches, args.cpu_context, args.iters, args.rounds)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="CPU mode (tiny model)")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--cpu-batches", default="1,16,64")
    parser.add_argument("--context", type=int, default=1024, help="KV context per request")
    parser.add_argument("--cpu-context", type=int, default=128)
    parser.add_argument("--iters", type=int, default=40, help="timed steps per run")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved runs (median)")
    parser.add_argument(
        "--tokenizer", default="",
        help="GPU: a tokenizer.json to use instead of the 512-token one (its vocabulary at most "
        "the model's 128,256): the masks and the compile over a real-size vocabulary",
    )  # fmt: skip
    args = parser.parse_args(argv)
    run_steps(
        args.cpu or not torch.cuda.is_available(),
        "CPU: structured output's cost per step, tiny model",
        lambda log: cpu(args, log),
        lambda log: gpu(args, log),
    )
