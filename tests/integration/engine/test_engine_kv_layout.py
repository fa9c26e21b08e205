"""Head- and layer-major KV pools serve the same tokens as the block-major one: chunked
prefill, prefix hits, and the host tier's whole-block copies (a prompt evicted from a small
device pool is onboarded again; a layer-major block is copied layer by layer) through the
real engine, against transformers."""

from __future__ import annotations

from pathlib import Path

from engine_factories import greedy, make_engine, run_to_completion, tokens_of
from references import Reference

from engine.kv.kv_cache import LAYOUT_NAMES
from engine.modeling.llama import LlamaModel
from vocabulary.tokenizer import Tokenizer

TINY_BLOCK_NBYTES = 4 * 2 * 16 * 2 * 32 * 4
"""The tiny model's block: 4 layers, K and V, 16 tokens, 2 KV heads of 32, float32."""


def test_head_and_layer_major_pools_give_block_major_tokens_with_chunks_prefix_hits_host_tier(
    tiny_model_dir: Path,
    tiny_model: LlamaModel,
    tokenizer: Tokenizer,
    prompts: list[list[int]],
    hf_greedy: Reference,
) -> None:
    results = {}
    for layout in ("block_major", "head_major", "layer_major"):
        # 8 device blocks: every few prompts cycle the pool, so later rounds onboard from
        # the host tier; 32-token steps chunk the long prompts.
        engine = make_engine(
            tiny_model_dir, tiny_model, tokenizer, kv_layout=layout, num_kv_blocks=8,
            max_num_batched_tokens=32, host_kv_gb=64 * TINY_BLOCK_NBYTES / 2**30,
        )  # fmt: skip
        assert engine.kv_cache.spec.layout == LAYOUT_NAMES[layout]
        tier = engine.host_tier
        assert tier is not None and tier.tensor.shape[engine.kv_cache.spec.block_dim] == 64
        got: list[tuple[list[int], int]] = []
        for round_ in range(2):
            for i, prompt in enumerate(prompts):
                rid = f"{round_}-{i}"
                engine.add_request(rid, prompt, greedy(10))
                out = run_to_completion(engine)[rid]
                got.append((tokens_of(out), out[-1].num_cached_prompt_tokens))
        assert tier.num_onboarded > 0
        assert engine.block_pool.num_free == engine.block_pool.num_blocks
        results[layout] = got
    assert results["head_major"] == results["block_major"] == results["layer_major"]
    for i, prompt in enumerate(prompts):
        assert results["head_major"][i][0] == hf_greedy(prompt, 10)
    assert sum(cached for _, cached in results["layer_major"][len(prompts) :]) > 0
