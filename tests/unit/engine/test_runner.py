"""ModelRunner logits equal transformers' LlamaForCausalLM (float32) on the same prefix.

Prompts are corpus text tokenized with the tiny model's tokenizer (4 query heads, 2 KV heads:
grouped-query attention). Block ids are allocated by hand: sequential and scattered.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from runner_factories import (
    BLOCK_SIZE,
    batch,
    chunk,
    corpus_tokens,
    make_pool,
    make_runner,
    prompt_tokens,
    scattered_blocks,
    sequential_blocks,
)

from engine.batch import SeqChunk
from engine.config import EngineConfig
from engine.core.runner import ModelRunner
from engine.kv.kv_sizing import CPU_DEFAULT_KV_BLOCKS, decide_num_kv_blocks
from engine.loading.loaders import load_model
from engine.modeling.llama import LlamaModel

TOL = {"rtol": 1e-5, "atol": 1e-4}


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> LlamaModel:
    return load_model(tiny_model_dir, torch.float32)


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def corpus(tiny_model_dir: Path) -> list[int]:
    return corpus_tokens(tiny_model_dir)


@torch.inference_mode()
def reference(hf, tokens: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """transformers' float32 logits [len(tokens), vocab] of every prefix of `tokens`."""
    return hf(torch.tensor([tokens])).logits[0].float()


def assert_same_logits(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, **TOL)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("layout", ["sequential", "scattered"])
def test_full_prompt_in_one_chunk_matches_transformers(
    model: LlamaModel, hf, corpus: list[int], tiny_model_dir: Path, layout: str
) -> None:
    runner = make_runner(model, tiny_model_dir)
    tokens = prompt_tokens(corpus, 0, 77)
    blocks = sequential_blocks(3, 77) if layout == "sequential" else scattered_blocks(3, 77, 64)
    logits = runner.execute(batch(chunk("a", tokens, 0, blocks)))
    assert logits.shape == (1, model.cfg.vocab_size) and logits.dtype == torch.float32
    assert_same_logits(logits, reference(hf, tokens)[-1:])


def test_prompt_in_chunks_across_block_boundaries_matches_transformers(
    model: LlamaModel, hf, corpus: list[int], tiny_model_dir: Path
) -> None:
    runner = make_runner(model, tiny_model_dir)
    tokens = prompt_tokens(corpus, 1, 90)
    blocks = scattered_blocks(5, 90, 64)
    ref = reference(hf, tokens)
    cuts = [0, 5, 16, 17, 40, 64, 89, 90]  # ends mid-block, on a boundary, one past, ...
    for start, end in itertools.pairwise(cuts):
        logits = runner.execute(batch(chunk("a", tokens[start:end], start, blocks)))
        assert_same_logits(logits, ref[end - 1 : end])


def test_non_final_chunks_without_sample_return_no_logits(
    model: LlamaModel, hf, corpus: list[int], tiny_model_dir: Path
) -> None:
    runner = make_runner(model, tiny_model_dir)
    tokens = prompt_tokens(corpus, 2, 40)
    blocks = sequential_blocks(0, 40)
    first = runner.execute(batch(chunk("a", tokens[:25], 0, blocks, sample=False)))
    assert first.shape == (0, model.cfg.vocab_size)
    last = runner.execute(batch(chunk("a", tokens[25:], 25, blocks)))
    assert_same_logits(last, reference(hf, tokens)[-1:])
    assert runner.execute(batch()).shape == (0, model.cfg.vocab_size)


def test_greedy_decode_after_prefill_matches_transformers_every_step(
    model: LlamaModel, hf, corpus: list[int], tiny_model_dir: Path
) -> None:
    runner = make_runner(model, tiny_model_dir)
    tokens = prompt_tokens(corpus, 3, 30)
    steps = 20
    blocks = scattered_blocks(7, 30 + steps, 64)
    got = [runner.execute(batch(chunk("a", tokens, 0, blocks)))]
    for _ in range(steps):
        tokens.append(int(got[-1][0].argmax()))
        pos = len(tokens) - 1
        got.append(runner.execute(batch(chunk("a", tokens[-1:], pos, blocks))))
    assert_same_logits(torch.cat(got), reference(hf, tokens)[29:])
    with torch.inference_mode():
        want = hf.generate(
            torch.tensor([tokens[:30]]), max_new_tokens=steps, do_sample=False, pad_token_id=0
        )[0].tolist()
    assert tokens == want


def test_mixed_batch_of_prefill_chunks_and_decodes_matches_transformers(
    model: LlamaModel, hf, corpus: list[int], tiny_model_dir: Path
) -> None:
    """Four sequences in one step: a first prompt chunk, a later prompt chunk, two decodes."""
    runner = make_runner(model, tiny_model_dir)
    prompts = {
        s: prompt_tokens(corpus, 10 + i, n)
        for i, (s, n) in enumerate([("p1", 33), ("p2", 50), ("d1", 21), ("d2", 48)])
    }
    blocks = {"p1": (0, 1, 2), "p2": (40, 12, 7, 30), "d1": (9, 63), "d2": (20, 21, 22, 23)}
    # earlier steps: p2's first chunk, and the decodes' prompts minus their last token
    runner.execute(batch(chunk("p2", prompts["p2"][:20], 0, blocks["p2"], sample=False)))
    for s in ("d1", "d2"):
        runner.execute(batch(chunk(s, prompts[s][:-1], 0, blocks[s])))
    logits = runner.execute(
        batch(
            chunk("p1", prompts["p1"][:18], 0, blocks["p1"]),
            chunk("p2", prompts["p2"][20:], 20, blocks["p2"]),
            chunk("d1", prompts["d1"][-1:], 20, blocks["d1"]),
            chunk("d2", prompts["d2"][-1:], 47, blocks["d2"]),
        )
    )
    want = torch.stack(
        [
            reference(hf, prompts["p1"][:18])[-1],
            reference(hf, prompts["p2"])[-1],
            reference(hf, prompts["d1"])[-1],
            reference(hf, prompts["d2"])[-1],
        ]
    )
    assert_same_logits(logits, want)


def test_prompt_kv_is_the_same_in_one_chunk_or_several_so_blocks_can_be_handed_off(
    model: LlamaModel, hf, corpus: list[int], tiny_model_dir: Path
) -> None:
    """Prefill in pool A (one chunk) and pool B (four chunks): equal KV; then decode in pool C
    from blocks copied out of A (a hand-off) and match transformers."""
    tokens = prompt_tokens(corpus, 4, 70)
    one, several = make_runner(model, tiny_model_dir), make_runner(model, tiny_model_dir)
    blocks_a, blocks_b = sequential_blocks(10, 70), scattered_blocks(11, 70, 64)
    one.execute(batch(chunk("a", tokens, 0, blocks_a)))
    for start, end in [(0, 9), (9, 33), (33, 48), (48, 70)]:
        several.execute(batch(chunk("a", tokens[start:end], start, blocks_b)))
    kv_a = one.kv_cache.tensor[list(blocks_a)].flatten(0, 3)  # [blocks, L, 2, bs] -> rows
    kv_b = several.kv_cache.tensor[list(blocks_b)].flatten(0, 3)
    torch.testing.assert_close(kv_a, kv_b, rtol=1e-5, atol=1e-5)

    decode = make_runner(model, tiny_model_dir)
    blocks_c = (50, 3, 17, 60, 8)  # room for the prompt + 5 new tokens
    decode.kv_cache.copy_blocks_from(one.kv_cache, list(blocks_a), list(blocks_c[:5]))
    first = int(reference(hf, tokens)[-1].argmax())
    seq = [*tokens, first]
    for _ in range(5):
        logits = decode.execute(batch(chunk("a", seq[-1:], len(seq) - 1, blocks_c)))
        assert_same_logits(logits, reference(hf, seq)[-1:])
        seq.append(int(logits[0].argmax()))


def test_runner_checks_pool_against_config_and_model(
    model: LlamaModel, tiny_model_dir: Path
) -> None:
    config = EngineConfig(model_dir=str(tiny_model_dir), block_size=8)
    with pytest.raises(ValueError, match="block size 16 != config 8"):
        ModelRunner(model, make_pool(model), config)
    runner = make_runner(model, tiny_model_dir)
    assert runner.attention_backend == "torch" and runner.graphs is None
    assert runner.block_size == BLOCK_SIZE


def test_out_of_range_block_token_or_position_is_a_value_error_not_a_crash(
    model: LlamaModel, tiny_model_dir: Path
) -> None:
    runner = make_runner(model, tiny_model_dir, num_blocks=8)
    with pytest.raises(ValueError, match=r"block id out of range: \[2, 8\] vs limit 8"):
        runner.execute(batch(chunk("a", [1] * 20, 0, (8, 2))))
    with pytest.raises(ValueError, match="token id out of range"):
        runner.execute(batch(chunk("a", [1, 512], 0, (0,))))
    with pytest.raises(ValueError, match="position out of range"):
        runner.execute(batch(chunk("a", [1], 4096, tuple(range(8)) * 33)))


def test_kv_pool_size_on_cpu_is_the_config_value_or_the_default(
    model: LlamaModel, tiny_model_dir: Path
) -> None:
    cpu = torch.device("cpu")
    default = EngineConfig(model_dir=str(tiny_model_dir))
    assert decide_num_kv_blocks(default, model.cfg, cpu, torch.float32) == CPU_DEFAULT_KV_BLOCKS
    sized = EngineConfig(model_dir=str(tiny_model_dir), num_kv_blocks=123)
    assert decide_num_kv_blocks(sized, model.cfg, cpu, torch.float32) == 123


def test_placeholder_chunks_take_their_tokens_from_the_kept_sample(
    model: LlamaModel, tiny_model_dir: Path, corpus: list[int]
) -> None:
    prompts = {s: prompt_tokens(corpus, seed, 20 + 7 * seed) for seed, s in enumerate("abc")}
    blocks = {s: sequential_blocks(8 * i, 40) for i, s in enumerate("abc")}
    known, fed = make_runner(model, tiny_model_dir), make_runner(model, tiny_model_dir)
    for runner in (known, fed):
        runner.execute(batch(*(chunk(s, prompts[s], 0, blocks[s]) for s in "abc")))
    nxt = {"a": 11, "b": 22, "c": 33}
    want = known.execute(batch(*(chunk(s, [nxt[s]], len(prompts[s]), blocks[s]) for s in "abc")))

    def placeholders(*order: str):  # type: ignore[no-untyped-def]
        return batch(
            *(
                SeqChunk(s, (0,), len(prompts[s]), blocks[s], sample=True, placeholder=True)
                for s in order
            )
        )

    # the steady case (same requests, same order: a slice copy) ...
    fed.keep_sampled(torch.tensor([nxt[s] for s in "abc"]), list("abc"))
    got = fed.execute(placeholders("a", "b", "c"))
    assert torch.equal(got, want)
    # ... and rows gathered out of order, beside a prompt chunk (an index copy)
    pool_known, pool_fed = make_runner(model, tiny_model_dir), make_runner(model, tiny_model_dir)
    for runner in (pool_known, pool_fed):
        runner.execute(batch(*(chunk(s, prompts[s], 0, blocks[s]) for s in "bc")))
    prompt = chunk("a", prompts["a"], 0, blocks["a"])
    want = pool_known.execute(
        batch(prompt, *(chunk(s, [nxt[s]], len(prompts[s]), blocks[s]) for s in "cb"))
    )
    pool_fed.keep_sampled(torch.tensor([5, nxt["b"], 7, nxt["c"]]), ["x", "b", "y", "c"])
    got = pool_fed.execute(
        batch(
            prompt,
            *(SeqChunk(s, (0,), len(prompts[s]), blocks[s], True, placeholder=True) for s in "cb"),
        )
    )
    assert torch.equal(got, want)


def test_a_placeholder_without_a_kept_sample_is_a_value_error(
    model: LlamaModel, tiny_model_dir: Path
) -> None:
    runner = make_runner(model, tiny_model_dir)
    orphan = SeqChunk("a", (0,), 4, (0,), sample=True, placeholder=True)
    with pytest.raises(ValueError, match="request a: a placeholder chunk"):
        runner.execute(batch(orphan))
    runner.keep_sampled(torch.tensor([3]), ["other"])
    with pytest.raises(ValueError, match="request a: a placeholder chunk"):
        runner.execute(batch(orphan))
