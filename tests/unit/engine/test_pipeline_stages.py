"""Pipeline-parallel pieces without a process group: what a stage holds (its config, its
checkpoint tensors, dummy weights equal to the whole model's layers), a stage model computing
the whole model's numbers when its stages are chained, the micro-batch cut (exact chunks),
and EngineConfig refusing what PP does not support yet, naming the field."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine.batch import ScheduledBatch, SeqChunk
from engine.config import EngineConfig, EngineMode
from engine.kv.kv_sizing import decide_num_host_blocks, kv_cache_spec
from engine.loading.dummy_weights import dummy_model
from engine.loading.loaders import load_model
from engine.modeling.llama import causal_attend
from engine.pp.micro_batches import logit_row_count, micro_batches
from engine.pp.pp_stage import PPStage, stage_config, stage_tensors
from vocabulary.model_config import ModelConfig


def chunk(rid: str, n: int, start: int = 0, sample: bool = True, **kw: object) -> SeqChunk:
    return SeqChunk(rid, tuple(range(1, n + 1)), start, (0, 1, 2, 3, 4, 5, 6, 7), sample, **kw)  # type: ignore[arg-type]


def test_stage_bounds_and_local_layers() -> None:
    stage = PPStage.of(10, 3, 1, (4, 3, 3))
    assert stage.bounds == (0, 4, 7, 10)
    assert (stage.layer_start, stage.layer_end, stage.num_layers) == (4, 7, 3)
    assert not stage.is_first and not stage.is_last and stage.holds(6) and not stage.holds(7)
    with pytest.raises(ValueError, match="3 pipeline stages do not divide the model's 10 layers"):
        PPStage.of(10, 3, 0)
    with pytest.raises(ValueError, match="pipeline stage 2 of 2"):
        PPStage(2, 2, (0, 2, 4))


def test_stage_tensors_keep_the_stage_layers_under_local_names() -> None:
    names = ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight",
             "model.layers.2.mlp.up_proj.weight", "model.layers.3.input_layernorm.weight",
             "model.norm.weight", "lm_head.weight"]  # fmt: skip
    kept = [n for n, _ in stage_tensors(iter((n, None) for n in names), PPStage.of(4, 2, 1))]
    assert kept == [
        "model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight",
        "model.layers.1.input_layernorm.weight", "model.norm.weight", "lm_head.weight",
    ]  # fmt: skip


def test_stage_config_has_the_stage_layer_count(tiny_model_dir: Path) -> None:
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    assert stage_config(cfg, PPStage.of(cfg.num_layers, 4, 3)).num_layers == 1
    with pytest.raises(ValueError, match="cut 8 layers; the model has 4"):
        stage_config(cfg, PPStage.of(8, 2, 0))


@pytest.mark.parametrize("stages", [2, 4])
def test_chained_stage_models_compute_the_whole_model(tiny_model_dir: Path, stages: int) -> None:
    """Each stage loaded alone holds the whole model's layers; running them one after the
    other over the pair (h, residual) gives the whole model's logits bit for bit. Only stage 0
    keeps the embedding (and the last stage, for a tied head) and only the last the head."""
    tiny_model = load_model(tiny_model_dir, torch.float32)
    ids = torch.tensor([5, 9, 2, 7, 7, 1])
    positions = torch.arange(6)
    cfg = tiny_model.cfg
    attend = causal_attend(1, 6, cfg.num_heads, cfg.num_kv_heads)
    want = tiny_model.compute_logits(tiny_model(ids, positions, attend))
    parts = [
        load_model(tiny_model_dir, torch.float32, stage=PPStage.of(cfg.num_layers, stages, s))
        for s in range(stages)
    ]
    h, residual = parts[0].embed(ids), None
    for part in parts:
        assert part.cfg.num_layers == cfg.num_layers // stages
        h, residual = part.run_layers(h, residual, positions, attend)
    assert residual is not None
    assert torch.equal(parts[-1].compute_logits(residual + h), want)
    tied = tiny_model.lm_head is None
    for s, part in enumerate(parts):
        keeps_embedding = s == 0 or (s == stages - 1 and tied)
        assert (part.embed_tokens.numel() > 0) == keeps_embedding, s
        if not tied:
            assert part.lm_head is not None and (part.lm_head.numel() > 0) == (s == stages - 1)


def test_dummy_stage_layers_are_the_whole_dummy_models(tiny_model_dir: Path) -> None:
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    whole = dummy_model(cfg, torch.float32, seed=3)
    stage = PPStage.of(cfg.num_layers, 2, 1)
    part = dummy_model(cfg, torch.float32, seed=3, stage=stage)
    for i in range(stage.num_layers):
        a, b = whole.layers[stage.layer_start + i], part.layers[i]
        assert torch.equal(a.qkv_proj, b.qkv_proj) and torch.equal(a.down_proj, b.down_proj)
    if whole.lm_head is not None:
        assert part.lm_head is not None and torch.equal(whole.lm_head, part.lm_head)


def test_micro_batches_cut_a_long_prompt_chunk_into_pieces() -> None:
    batch = ScheduledBatch((chunk("a", 10, start=16), chunk("b", 1), chunk("c", 1)))
    got = micro_batches(batch, 3)
    cut = [[(c.request_id, c.start_pos, c.num_tokens, c.sample) for c in b.chunks] for b in got]
    assert cut == [
        [("a", 16, 4, False)],
        [("a", 20, 4, False)],
        [("a", 24, 2, True), ("b", 0, 1, True), ("c", 0, 1, True)],
    ]  # fmt: skip
    pieces = [c for b in got for c in b.chunks if c.request_id == "a"]
    assert sum((c.token_ids for c in pieces), ()) == batch.chunks[0].token_ids
    assert sum(logit_row_count(b) for b in got) == logit_row_count(batch) == 3


def test_micro_batches_never_cut_decodes_placeholders_or_all_logits_chunks() -> None:
    decodes = ScheduledBatch(tuple(chunk(f"d{i}", 1, placeholder=True) for i in range(5)))
    assert [len(b.chunks) for b in micro_batches(decodes, 2)] == [3, 2]
    assert [len(b.chunks) for b in micro_batches(decodes, 8)] == [1, 1, 1, 1, 1]
    whole = ScheduledBatch((chunk("p", 12, all_logits=True), chunk("d", 1)))
    got = micro_batches(whole, 4)
    assert [[c.num_tokens for c in b.chunks] for b in got] == [[12], [1]]
    assert sum(logit_row_count(b) for b in got) == 13
    assert micro_batches(ScheduledBatch(()), 4) == ()
    assert micro_batches(decodes, 1) == (decodes,)


def test_engine_config_takes_fp8_lora_and_the_host_tier_with_pp_and_refuses_the_rest() -> None:
    EngineConfig("m", pipeline_parallel_size=2, tensor_parallel_size=2)
    pp = EngineConfig(
        "m", pipeline_parallel_size=2, quantization="fp8", kv_cache_dtype="fp8",
        enable_lora=True, host_kv_gb=1.0,
    )  # fmt: skip
    assert pp.lora_enabled
    with pytest.raises(ValueError, match=r"^mode: a split engine runs on one device"):
        EngineConfig("m", pipeline_parallel_size=2, mode=EngineMode.SPLIT)
    # (tensor parallelism still refuses LoRA and the host tier, a pipeline of TP ranks too)
    with pytest.raises(ValueError, match=r"^tensor_parallel_size: LoRA"):
        EngineConfig("m", pipeline_parallel_size=2, tensor_parallel_size=2, enable_lora=True)
    with pytest.raises(ValueError, match=r"^host_kv_gb: the host KV tier with tensor"):
        EngineConfig("m", pipeline_parallel_size=2, tensor_parallel_size=2, host_kv_gb=1.0)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be >= 1"):
        EngineConfig("m", pipeline_parallel_size=0)
    with pytest.raises(ValueError, match="pipeline_layer_partition: 2 positive layer counts"):
        EngineConfig("m", pipeline_parallel_size=2, pipeline_layer_partition=(4,))
    # the cross-step schedule (the default) keeps S groups in flight; within a step, 2S
    three = EngineConfig("m", pipeline_parallel_size=3)
    assert three.pipeline_schedule == "cross_step" and three.cross_step_pipeline
    assert three.micro_batches == 3
    assert replace(three, pipeline_schedule="within_step").micro_batches == 6
    assert not replace(three, overlap_scheduling=False).cross_step_pipeline  # within_step
    assert replace(three, overlap_scheduling=False).micro_batches == 6
    assert replace(three, pipeline_micro_batches=2).micro_batches == 2
    assert not EngineConfig("m").cross_step_pipeline  # (one stage)
    with pytest.raises(ValueError, match=r"^pipeline_schedule: one of cross_step, within_step"):
        EngineConfig("m", pipeline_parallel_size=2, pipeline_schedule="gpipe")
    # a pipeline worker's stages hold the tier together, sized by the whole model's blocks
    two = EngineConfig("m", pipeline_parallel_size=2, host_kv_gb=1.0)
    assert decide_num_host_blocks(two, 2**20, 100) == 1024
    tp = replace(two, tensor_parallel_size=2, host_kv_gb=-1.0)
    assert decide_num_host_blocks(tp, 2**20, 100) == 0  # auto: no tier with TP


def test_a_stage_pool_spec_names_its_layers(tiny_model_dir: Path) -> None:
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    part = stage_config(cfg, PPStage.of(cfg.num_layers, 2, 1))
    spec = kv_cache_spec(part, 16, torch.float32, 8, stage=(2, 1, 2, 4))
    assert (spec.num_layers, spec.layer_start, spec.total_layers, spec.pp_rank) == (2, 2, 4, 1)


def test_only_the_last_stage_has_a_head(tiny_model_dir: Path) -> None:
    """Memory profiling (engine/kv/kv_sizing.py) runs logits only where there is a head."""
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    first, last = (
        load_model(tiny_model_dir, torch.float32, stage=PPStage.of(cfg.num_layers, 2, s))
        for s in (0, 1)
    )
    assert (first.has_head, last.has_head) == (False, True)
    assert load_model(tiny_model_dir, torch.float32).has_head
    hidden = first(
        torch.tensor([1, 2, 3]),
        torch.arange(3),
        causal_attend(1, 3, cfg.num_heads, cfg.num_kv_heads),
    )
    assert hidden.shape == (3, cfg.hidden_size)
