"""The INT8 W8A8 and INT4 W4A16 checkpoints `pdserve make-model --quantization int8|int4`
writes (compressed-tensors int-quantized / pack-quantized) computed as they declare: greedy
tokens equal transformers + compressed-tensors (which emulates the scheme) on the same
checkpoint under the margin rule of tests/fp8_reference.py; a request's INT8 tokens do not
depend on its batch neighbours' activations; a prefill-only → decode-only hand-off on an INT
checkpoint gives the colocated tokens, and pools of different weight formats refuse each
other; schemes not computed are refused at load naming the config key. The GPTQ-format INT4
checkpoint (`--quantization gptq`) loads into its pack-quantized twin's weights, by the format's
own dequantization formula too, and its refusals name the key or tensor.

INT4 dequantizes in float32 as compressed-tensors does, so its logits equal the reference's
(measured: 0.0). INT8 accumulates in int32 and rescales once (what the GPU computes), where
the reference multiplies dequantized floats: float noise of ~1e-6 flips an activation's int8
rounding now and then, and those flips move the tiny model's logits by ~0.2 (of a range of
~40) after four layers; the margin rule lets a token part only where that error is more
than half the reference's top-2 gap."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_factories import greedy, make_engine, run_to_completion, tokens_of
from fp8_reference import hf_on, margin_check_against_transformers
from test_engine_handoff import hand_off, prefill
from typer.testing import CliRunner

from deploy.cli.app import app
from engine.config import EngineMode
from engine.loading.loaders import load_model
from engine.modeling.llama import LlamaModel, causal_attend
from engine.quantization.int4_linear import Int4Linear
from engine.quantization.int8_linear import Int8Linear
from kv_transfer.types import compat_fields
from vocabulary.engine_io import KVHandoff
from vocabulary.tokenizer import Tokenizer

MAX_TOKENS = 24


def make_int(out: Path, quantization: str, says: str) -> Path:
    result = CliRunner().invoke(app, ["make-model", str(out), "--quantization", quantization])
    assert result.exit_code == 0, result.output
    assert says in " ".join(result.output.split())
    return out


@pytest.fixture(scope="module")
def trained_once(tiny_model_dir: Path) -> Iterator[None]:
    """make-model trains the tiny preset (seed 0) before it quantizes; that training is the
    one the session's tiny model already ran (same code, seed and steps: same bytes, as
    test_make_model checks for a seed), so here it returns that model's tensors instead of
    spending ~12 CPU-s per checkpoint on it again."""
    from safetensors.torch import load_file

    import deploy.checkpoints.make_model as make_model

    recipe = json.loads((tiny_model_dir / "pdserve_recipe.json").read_text())
    assert (recipe["preset"], recipe["seed"]) == ("tiny", 0)
    trained = {k: v for f in tiny_model_dir.glob("*.safetensors") for k, v in load_file(f).items()}

    def train_tiny(tensors: Any, cfg_dict: Any, stream: Any, shape: Any, seed: int) -> Any:
        assert (shape, seed) == (make_model.PRESETS["tiny"], 0)
        return dict(trained)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(make_model, "train_tiny", train_tiny)
        yield


@pytest.fixture(scope="module")
def int8_dir(trained_once: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_int(tmp_path_factory.mktemp("int8") / "int8", "int8", "INT8 W8A8")


@pytest.fixture(scope="module")
def int4_dir(trained_once: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_int(tmp_path_factory.mktemp("int4") / "int4", "int4", "group of 128")


@pytest.fixture(scope="module")
def gptq_dir(trained_once: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_int(tmp_path_factory.mktemp("gptq") / "gptq", "gptq", "GPTQ INT4")


@pytest.fixture(scope="module")
def gptq_calibrated_dir(trained_once: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gptq-calibrated") / "gptq"
    args = ["make-model", str(out), "--quantization", "gptq", "--calibrate"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "GPTQ-rounded on the corpus" in " ".join(result.output.split())
    return out


@pytest.fixture(scope="module")
def int8_model(int8_dir: Path) -> LlamaModel:
    return load_model(int8_dir, torch.float32, quantization="fp8")  # the checkpoint decides


@pytest.mark.parametrize("which", ["int8", "int4"])
def test_greedy_matches_transformers_compressed_tensors(
    which: str, request: pytest.FixtureRequest, tokenizer: Tokenizer,
    corpus_prompts: list[list[int]],
) -> None:  # fmt: skip
    checkpoint: Path = request.getfixturevalue(f"{which}_dir")
    model = load_model(checkpoint, torch.float32)
    kind = Int8Linear if which == "int8" else Int4Linear
    assert model.quantization == which
    assert all(isinstance(m, kind) for layer in model.layers for m in layer.quantized.values())  # type: ignore[union-attr]
    engine = make_engine(checkpoint, model, tokenizer)
    prompts = corpus_prompts[::4]  # 8 prompts, 3 to ~90 tokens
    got = engine.generate(prompts, greedy(MAX_TOKENS, ignore_eos=True))
    report = margin_check_against_transformers(hf_on(checkpoint), model, prompts, got)
    assert report.exact >= len(prompts) - 2, report
    assert all(err < 1.0 for err in report.errors), report  # the scheme, not another one


def test_an_int8_requests_tokens_do_not_depend_on_its_neighbours_activations(
    int8_dir: Path, tokenizer: Tokenizer, corpus_prompts: list[list[int]]
) -> None:
    """A neighbour whose every token embeds 64x larger than any other: each token's own
    activation scale keeps the request's tokens (integer sums: bit-for-bit)."""
    loud = 7
    model = load_model(int8_dir, torch.float32)
    model.embed_tokens.data[loud] *= 64.0
    prompt, neighbour = corpus_prompts[9], [loud] * 40
    params = greedy(MAX_TOKENS, ignore_eos=True)
    engine = make_engine(int8_dir, model, tokenizer)
    alone = engine.generate([prompt], params)[0]
    assert engine.generate([neighbour, prompt, neighbour], params)[1] == alone


def test_a_prefill_only_to_decode_only_handoff_on_int8_gives_the_colocated_tokens(
    int8_dir: Path, int8_model: LlamaModel, tokenizer: Tokenizer, prompts: list[list[int]]
) -> None:
    args = (int8_dir, int8_model, tokenizer)
    p = make_engine(*args, mode=EngineMode.PREFILL_ONLY, num_kv_blocks=64)
    d = make_engine(*args, mode=EngineMode.DECODE_ONLY, num_kv_blocks=48)
    colocated = make_engine(*args).generate([prompts[2]], greedy(10))[0]
    out = prefill(p, "r", prompts[2], greedy(10))
    assert isinstance(out.kv_handoff, KVHandoff)
    hand_off(p, d, out, prompts[2], greedy(10))
    assert [out.kv_handoff.first_token_id, *tokens_of(run_to_completion(d)["r"])] == colocated
    assert "weights=int8" in compat_fields(p.kv_cache.spec, "m")


def test_pools_of_different_weight_formats_refuse_each_other(
    int8_dir: Path, int4_dir: Path, int8_model: LlamaModel, tokenizer: Tokenizer,
    tiny_model_dir: Path, tiny_model: LlamaModel, prompts: list[list[int]],
) -> None:  # fmt: skip
    p = make_engine(int8_dir, int8_model, tokenizer, mode=EngineMode.PREFILL_ONLY)
    int4 = load_model(int4_dir, torch.float32)
    others = [
        make_engine(int4_dir, int4, tokenizer, mode=EngineMode.DECODE_ONLY),
        make_engine(tiny_model_dir, tiny_model, tokenizer, mode=EngineMode.DECODE_ONLY),
    ]
    fields = {compat_fields(e.kv_cache.spec, "m") for e in (p, *others)}
    assert len(fields) == 3  # int8, int4 and the dense model hash apart
    out = prefill(p, "r", prompts[2], greedy(10))
    assert out.kv_handoff is not None
    for d in others:
        with pytest.raises(ValueError, match="incompatible KV caches"):
            hand_off(p, d, out, prompts[2], greedy(10))


def _edited(src: Path, out: Path, edit_config=None, edit_tensors=None) -> Path:  # type: ignore[no-untyped-def]
    """A copy of checkpoint `src` with its config and/or tensors changed."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    if edit_config is not None:
        raw = json.loads((out / "config.json").read_text())
        edit_config(raw["quantization_config"])
        (out / "config.json").write_text(json.dumps(raw))
    if edit_tensors is not None:
        tensors = load_file(str(out / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(out / "model.safetensors"))
    return out


def _weights(qc: dict) -> dict:
    return qc["config_groups"]["group_0"]["weights"]


@pytest.mark.parametrize(
    ("which", "edit_config", "edit_tensors", "message"),
    [
        ("int8", lambda qc: _weights(qc).update(num_bits=6), None,
         "group_0.weights: 6-bit int is not supported"),
        ("int4", lambda qc: _weights(qc).update(symmetric=False), None,
         r"weights.symmetric: false \(zero points\) is not supported"),
        ("int4", lambda qc: _weights(qc).update(actorder="group"), None,
         "weights.actorder: 'group' is not supported"),
        ("int4", lambda qc: _weights(qc).update(group_size=256), None,
         "not a whole number of groups of 256"),
        ("int8", lambda qc: qc["config_groups"]["group_0"]["input_activations"].update(
            dynamic=False, strategy="tensor"), None,
         "input_activations: dynamic=False strategy 'tensor' is not supported"),
        ("int8", lambda qc: qc.update(quant_method="awq"), None,
         "quant_method 'awq' is not supported"),
        ("int8", None, lambda t: t.pop("model.layers.1.mlp.up_proj.weight_scale"),
         "missing model.layers.1.mlp.up_proj.weight_scale"),
        ("int4", None, lambda t: t.update({"model.layers.0.mlp.up_proj.weight_g_idx":
                                           torch.zeros(128, dtype=torch.int32)}),
         "weight_g_idx: activation ordering"),
        ("int4", None, lambda t: t.update({"model.layers.0.mlp.up_proj.weight_zero_point":
                                           torch.zeros(384, 1, dtype=torch.int32)}),
         "a zero point"),
    ],
)  # fmt: skip
def test_schemes_not_computed_are_refused_at_load_naming_the_key(
    which: str, edit_config, edit_tensors, message: str,  # type: ignore[no-untyped-def]
    request: pytest.FixtureRequest, tmp_path: Path,
) -> None:  # fmt: skip
    src: Path = request.getfixturevalue(f"{which}_dir")
    bad = _edited(src, tmp_path / "bad", edit_config, edit_tensors)
    with pytest.raises(ValueError, match=message):
        load_model(bad, torch.float32)


@pytest.mark.parametrize("which", ["int8", "int4"])
def test_dummy_weights_of_an_int_config_are_the_dense_dummy_weights_quantized(
    which: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """load_format dummy over a config.json declaring an INT scheme: the projections come in
    that scheme, and they are the dense dummy model's (same seed) quantized as the checkpoint
    writer would; the rest of the model is the dense dummy model's."""
    src: Path = request.getfixturevalue(f"{which}_dir")
    model = load_model(src, torch.float32, load_format="dummy", seed=3)
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    dense = load_model(tmp_path, torch.float32, load_format="dummy", seed=3)
    assert model.quantization == which
    kind = Int8Linear if which == "int8" else Int4Linear
    for i, layer in enumerate(model.layers):
        for name, linear in layer.quantized.items():  # type: ignore[union-attr]
            assert isinstance(linear, kind), (i, name)
            want = getattr(dense.layers[i], name)
            got = linear.dequantized(torch.float32)
            scales = linear.weight_scale.reshape(want.shape[0], -1)
            step = scales.repeat_interleave(want.shape[1] // scales.shape[1], dim=1)
            assert bool(((got - want).abs() <= step / 2 + 1e-7).all()), (i, name)
    assert torch.equal(model.embed_tokens, dense.embed_tokens)
    ids = torch.tensor([5, 9, 2, 7])
    attend = causal_attend(1, 4, model.cfg.num_heads, model.cfg.num_kv_heads)
    out = model.compute_logits(model(ids, torch.arange(4), attend))
    assert bool(out.isfinite().all())


def test_int8_stages_of_a_pipeline_chain_to_the_whole_int8_model(int8_dir: Path) -> None:
    """Each pipeline stage loads its layers of an INT8 checkpoint (engine/pp/pp_stage.py);
    chained over the pair (h, residual) they give the whole model's logits bit for bit."""
    from engine.pp.pp_stage import PPStage

    whole = load_model(int8_dir, torch.float32)
    ids, positions = torch.tensor([5, 9, 2, 7]), torch.arange(4)
    cfg = whole.cfg
    attend = causal_attend(1, 4, cfg.num_heads, cfg.num_kv_heads)
    stages = [
        load_model(int8_dir, torch.float32, stage=PPStage.of(cfg.num_layers, 2, s))
        for s in range(2)
    ]
    assert {s.quantization for s in stages} == {whole.quantization}
    h, residual = stages[0].embed(ids), None
    for stage in stages:
        h, residual = stage.run_layers(h, residual, positions, attend)
    assert residual is not None
    want = whole.compute_logits(whole(ids, positions, attend))
    assert torch.equal(stages[1].compute_logits(residual + h), want)


# ---- GPTQ ----------------------------------------------------------------------------------


def _gptq_dequantized(checkpoint: Path, module: str, group_size: int) -> torch.Tensor:
    """W [out, in] of a GPTQ module by the format's own formula (AutoGPTQ's v1 layout:
    qweight packs 8 input rows a word, the lowest nibble first; zero points stored as z - 1),
    independent of engine/loading/gptq_checkpoint.py."""
    from safetensors.torch import load_file

    t = load_file(str(checkpoint / "model.safetensors"))
    qweight, qzeros, scales = (t[f"{module}.{k}"] for k in ("qweight", "qzeros", "scales"))
    shifts = torch.arange(8) * 4
    u = ((qweight.long()[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(-1, qweight.shape[1])
    z = ((qzeros.long()[:, :, None] >> shifts) & 0xF).reshape(qzeros.shape[0], -1) + 1
    group = torch.arange(u.shape[0]) // group_size
    return (scales.float()[group] * (u - z[group]).float()).t()


def test_a_gptq_checkpoint_computes_what_its_pack_quantized_twin_does(
    gptq_dir: Path, int4_dir: Path, tokenizer: Tokenizer, corpus_prompts: list[list[int]]
) -> None:
    """make-model writes the same integers and scales in both formats: the GPTQ one loads
    into the same Int4Linear weights (the format's own dequantization formula agrees), gives
    the same greedy tokens, and those hold against transformers + compressed-tensors on the
    twin under the margin rule."""
    gptq, twin = load_model(gptq_dir, torch.float32), load_model(int4_dir, torch.float32)
    assert gptq.quantization == "int4"
    for a, b in zip(gptq.layers, twin.layers, strict=True):
        for name, linear in a.quantized.items():  # type: ignore[union-attr]
            other = b.quantized[name]  # type: ignore[index]
            assert torch.equal(linear.weight_packed, other.weight_packed), name
            assert torch.equal(linear.weight_scale, other.weight_scale), name
    q_proj = gptq.layers[1].quantized["qkv_proj"].dequantized(torch.float32)  # type: ignore[index]
    want = _gptq_dequantized(gptq_dir, "model.layers.1.self_attn.q_proj", 128)
    assert torch.equal(q_proj[: want.shape[0]], want)
    prompts, params = corpus_prompts[::4], greedy(MAX_TOKENS, ignore_eos=True)
    got = make_engine(gptq_dir, gptq, tokenizer).generate(prompts, params)
    assert got == make_engine(int4_dir, twin, tokenizer).generate(prompts, params)
    report = margin_check_against_transformers(hf_on(int4_dir), gptq, prompts, got)
    assert report.exact >= len(prompts) - 2, report


def _gptq_tensor(module: str, kind: str) -> str:
    return f"model.layers.0.{module}.{kind}"


@pytest.mark.parametrize(
    ("edit_config", "edit_tensors", "message"),
    [
        (lambda qc: qc.update(bits=8), None, r"quantization_config.bits: 8 is not supported"),
        (lambda qc: qc.update(desc_act=True), None, "desc_act: true"),
        (lambda qc: qc.update(sym=False), None, r"sym: false \(zero points\)"),
        (lambda qc: qc.update(group_size=-1), None, "group_size: -1 is not supported"),
        (lambda qc: qc.update(checkpoint_format="marlin"), None,
         "checkpoint_format: 'marlin' is not supported"),
        (lambda qc: qc.update(checkpoint_format="gptq_v2"), None,
         "a zero point of 7: asymmetric"),  # v1's stored 7 read as z = 7
        (None, lambda t: t.update({_gptq_tensor("mlp.up_proj", "qzeros"):
                                   t[_gptq_tensor("mlp.up_proj", "qzeros")] + 1}),
         "mlp.up_proj.qzeros: a zero point of 9"),
        (None, lambda t: t.update({_gptq_tensor("mlp.down_proj", "g_idx"):
                                   t[_gptq_tensor("mlp.down_proj", "g_idx")].flip(0)}),
         "down_proj.g_idx: not each row's k // 128"),
        (None, lambda t: t.pop(_gptq_tensor("self_attn.k_proj", "qzeros")),
         "missing model.layers.0.self_attn.k_proj.qzeros"),
        (None, lambda t: t.update({_gptq_tensor("self_attn.o_proj", "scales"):
                                   t[_gptq_tensor("self_attn.o_proj", "scales")][:, :7]}),
         r"o_proj.scales is torch.float32 \[1, 7\]"),
    ],
)  # fmt: skip
def test_gptq_schemes_not_computed_are_refused_at_load_naming_the_key(
    edit_config,
    edit_tensors,
    message: str,
    gptq_dir: Path,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    bad = _edited(gptq_dir, tmp_path / "bad", edit_config, edit_tensors)
    with pytest.raises(ValueError, match=message):
        load_model(bad, torch.float32)


def test_a_gptq_checkpoint_shards_for_tensor_parallelism_as_its_twin_does(
    trained_once: None, tmp_path: Path
) -> None:
    """TP ranks cut the converted tensors (whole groups: G = 32 lets the tiny model split in
    two): each rank holds what it holds of the pack-quantized twin."""
    from engine.tp.tp_shard import TPShard

    pairs = []
    for fmt in ("gptq", "int4"):
        args = ["make-model", str(tmp_path / fmt), "--quantization", fmt, "--group-size", "32"]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        pairs.append(
            [load_model(tmp_path / fmt, torch.float32, shard=TPShard(2, r)) for r in (0, 1)]
        )
    for gptq, twin in zip(*pairs, strict=True):
        assert gptq.quantization == "int4" and gptq.tp_shard == twin.tp_shard
        for a, b in zip(gptq.layers, twin.layers, strict=True):
            for name, linear in a.quantized.items():  # type: ignore[union-attr]
                other = b.quantized[name]  # type: ignore[index]
                assert torch.equal(linear.weight_packed, other.weight_packed), name
                assert torch.equal(linear.weight_scale, other.weight_scale), name


def test_gptq_rounding_on_the_corpus_cuts_the_output_error_of_round_to_nearest(
    tiny_model_dir: Path, gptq_dir: Path, gptq_calibrated_dir: Path, tokenizer: Tokenizer
) -> None:
    """make-model --calibrate (deploy/checkpoints/gptq_calibration.py): the model's output
    (final hidden states) over the calibration tokens (the corpus' first 256) and over the
    256 after them is closer to the dense model's than round-to-nearest's of the same scheme
    (measured: 0.049 vs 0.096 relative on the calibration tokens, 0.088 vs 0.093 after)."""
    from deploy.checkpoints.checkpoint_files import CORPUS

    ids = tokenizer.encode(CORPUS.read_text())
    dense = load_model(tiny_model_dir, torch.float32)
    rtn, gptq = (load_model(d, torch.float32) for d in (gptq_dir, gptq_calibrated_dir))
    assert gptq.quantization == "int4"

    def error(model: LlamaModel, tokens: list[int]) -> float:
        def out(m: LlamaModel) -> torch.Tensor:
            attend = causal_attend(1, len(tokens), m.cfg.num_heads, m.cfg.num_kv_heads)
            with torch.no_grad():
                return m(torch.tensor(tokens), torch.arange(len(tokens)), attend)

        ref = out(dense)
        return float((out(model) - ref).norm() / ref.norm())

    calibration, after = ids[:256], ids[256:512]
    assert error(gptq, calibration) < 0.75 * error(rtn, calibration)
    assert error(gptq, after) < error(rtn, after)


@pytest.mark.parametrize("calibrate", [False, True], ids=["round-to-nearest", "gptq-rounded"])
def test_make_model_from_a_dense_checkpoint_writes_what_make_model_writes(
    calibrate: bool, tiny_model_dir: Path, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """`make-model --quantization gptq --from DIR` (the tiny model's own trained checkpoint)
    writes the tensors and config make-model writes for that model: the same integers and
    scales, calibrated or not; a quantized source is refused."""
    from safetensors.torch import load_file

    args = ["make-model", str(tmp_path / "q"), "--quantization", "gptq", "--from",
            str(tiny_model_dir), *(["--calibrate"] if calibrate else [])]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    made: Path = request.getfixturevalue("gptq_calibrated_dir" if calibrate else "gptq_dir")
    got, want = (load_file(str(d / "model.safetensors")) for d in (tmp_path / "q", made))
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert (
        config["quantization_config"]
        == json.loads((made / "config.json").read_text())["quantization_config"]
    )
    again = CliRunner().invoke(app, ["make-model", str(tmp_path / "r"), "--quantization", "int4",
                                     "--from", str(tmp_path / "q")])  # fmt: skip
    assert again.exit_code == 2 and "is already quantized" in " ".join(again.output.split())
