"""make-model writes a Hugging Face checkpoint that transformers and the engine both load."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from deploy.checkpoints.make_model import PRESETS, ModelShape, hf_config, make_model
from vocabulary.model_config import ModelConfig

PINNED = Path(__file__).with_name("preset_configs")
"""The config.json every preset writes, and two with make-model options, byte for byte."""
TOY = {"num_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4,
       "num_kv_heads": 2, "vocab_size": 1000}  # fmt: skip


def _digest(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.is_file()
    }


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def test_tiny_model_loads_in_transformers_and_generates_text(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = tok("The river runs", return_tensors="pt").input_ids
    assert ids[0, 0].item() == tok.bos_token_id
    out = model.generate(ids, max_new_tokens=20, do_sample=False)
    text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    # trained on English prose: mostly letters and spaces, not random bytes
    assert sum(c.isalpha() or c in " .," for c in text) >= 0.8 * len(text) > 0


def test_engine_model_logits_equal_transformers(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.loading.loaders import load_model
    from engine.modeling.llama import causal_attend

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ours = load_model(tiny_model_dir, torch.float32)
    ids = tok("Once upon a time there was a fox", return_tensors="pt").input_ids
    n = ids.shape[1]
    with torch.no_grad():
        hidden = ours(ids[0], torch.arange(n), causal_attend(1, n, 4, 2))
        torch.testing.assert_close(ours.compute_logits(hidden), ref(ids).logits[0])


@pytest.mark.parametrize(
    ("pinned", "preset", "options"),
    [
        *((name, name, {}) for name in PRESETS),
        ("tiny-2-layers-hidden-256-bf16", "tiny",
         {"num_layers": 2, "hidden_size": 256, "torch_dtype": "bfloat16"}),
        ("llama3-8b-toy", "llama3-8b", TOY),
    ],
)  # fmt: skip
def test_config_json_is_pinned(
    tmp_path: Path, pinned: str, preset: str, options: dict[str, object]
) -> None:
    out = make_model(tmp_path / pinned, preset=preset, config_only=True, **options)
    assert (out / "config.json").read_bytes() == (PINNED / f"{pinned}.json").read_bytes()


def test_the_presets_are_tiny_and_llama3() -> None:
    assert sorted(PRESETS) == ["llama3-70b", "llama3-8b", "tiny"]  # each pinned above


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_the_engine_reads_each_presets_config_back(name: str) -> None:
    shape = PRESETS[name]
    read = ModelConfig.from_dict(hf_config(shape, 0, 1))
    expected = replace(shape.config, bos_token_id=0, eos_token_ids=(1,))
    if shape.config.rope.kind == "default":  # not written: read as max_position_embeddings
        original = shape.config.max_position_embeddings  # (and unused by default RoPE)
        expected = replace(
            expected, rope=replace(expected.rope, original_max_position_embeddings=original)
        )
    assert read == expected


def test_options_name_fields_of_the_config_or_of_the_recipe() -> None:
    tiny = PRESETS["tiny"]
    shape = tiny.with_options(hidden_size=256, num_layers=2, torch_dtype="bfloat16", train_steps=3)
    config = replace(
        tiny.config, hidden_size=256, head_dim=64, num_layers=2, torch_dtype="bfloat16"
    )
    assert shape == ModelShape(config, train_steps=3, sharpen=4.0)
    assert tiny.with_options(hidden_size=256, head_dim=32).config.head_dim == 32
    with pytest.raises(TypeError, match="dtype"):
        tiny.with_options(dtype="bfloat16")


@pytest.mark.parametrize(
    "options",
    [{"model_type": "qwen3", "qk_norm": True}, {"o_proj_bias": True}, {"sliding_window": 64}],
)
def test_hf_config_refuses_what_a_llama_config_cannot_declare(options: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="make-model writes Llama checkpoints"):
        hf_config(PRESETS["tiny"].with_options(**options), 0, 1)


def test_same_seed_same_bytes_different_seed_different(tmp_path: Path) -> None:
    a = make_model(tmp_path / "a", seed=7, train_steps=3)
    b = make_model(tmp_path / "b", seed=7, train_steps=3)
    c = make_model(tmp_path / "c", seed=8, train_steps=3)
    assert _digest(a) == _digest(b)
    assert _digest(a)["model.safetensors"] != _digest(c)["model.safetensors"]
    assert _digest(a)["tokenizer.json"] == _digest(c)["tokenizer.json"]


def test_llama3_preset_sharded_bf16_loads(tmp_path: Path) -> None:
    """The GPU preset's recipe (llama3 RoPE, bf16, shards) at a toy size."""
    from transformers import AutoModelForCausalLM

    from engine.loading.hf_checkpoint import checkpoint_files
    from engine.loading.loaders import load_model
    from vocabulary.model_config import ModelConfig

    out = make_model(tmp_path / "l3", preset="llama3-8b", shard_bytes=100_000, **TOY)
    assert len(checkpoint_files(out)) > 1
    cfg = ModelConfig.from_pretrained(out)
    assert (cfg.rope.kind, cfg.rope.factor, cfg.torch_dtype) == ("llama3", 8.0, "bfloat16")
    ours = load_model(out, torch.bfloat16)
    ref = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    torch.testing.assert_close(ours.embed_tokens, ref.model.embed_tokens.weight)
    torch.testing.assert_close(
        ours.layers[1].gate_up_proj[:128], ref.model.layers[1].mlp.gate_proj.weight
    )


def test_cli_make_model_rejects_unknown_preset(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from deploy.cli.app import app

    result = CliRunner().invoke(app, ["make-model", str(tmp_path / "x"), "--preset", "nope"])
    assert result.exit_code == 2
    assert "unknown preset 'nope'" in result.output


def test_loader_names_missing_tensor(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from engine.loading.loaders import load_model

    out = make_model(tmp_path / "m", seed=1, train_steps=0)
    tensors = load_file(out / "model.safetensors")
    del tensors["model.layers.2.mlp.up_proj.weight"]
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing model\.layers\.2\.mlp\.up_proj\.weight"):
        load_model(out, torch.float32)
