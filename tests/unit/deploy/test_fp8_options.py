"""The FP8 options of a cluster: --quantization, --kv-cache-dtype and --load-format set
workers.engine.* (shown by `pdserve config show`, read back through --config), a value
outside their choices is refused naming the flag or the file's key; `up` takes a config-only
folder with --load-format dummy and refuses it without; make-model writes config-only presets
and FP8 checkpoints whose config the compressed-tensors package itself reads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from typer.testing import CliRunner

from deploy.checkpoints.make_model import make_model
from deploy.cli.app import app
from deploy.cli.options import check_model_dir

FP8_FLAGS = ["--quantization", "fp8", "--kv-cache-dtype", "fp8", "--load-format", "dummy",
             "--fp8-activation-scales", "calibrated"]  # fmt: skip


def run(tmp_path: Path, *args: str) -> Any:
    env = {"PDSERVE_STATE_FILE": str(tmp_path / "run" / "cluster.json")}
    return CliRunner().invoke(app, list(args), env=env)


def test_fp8_flags_set_the_engine_fields_and_round_trip_through_config_show(
    tmp_path: Path,
) -> None:
    shown = run(tmp_path, "config", "show", *FP8_FLAGS)
    assert shown.exit_code == 0, shown.output
    engine = yaml.safe_load(shown.output)["workers"]["engine"]
    keys = ("quantization", "kv_cache_dtype", "load_format", "fp8_activation_scales")
    assert tuple(engine[k] for k in keys) == ("fp8", "fp8", "dummy", "calibrated")
    defaults = yaml.safe_load(run(tmp_path, "config", "show").output)["workers"]["engine"]
    assert tuple(defaults[k] for k in keys) == ("none", "auto", "auto", "checkpoint")
    path = tmp_path / "tree.yaml"
    path.write_text(shown.output)
    again = run(tmp_path, "config", "show", "--config", str(path))
    assert again.exit_code == 0 and again.output == shown.output


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--quantization", "int4"], "error: --quantization: one of none, fp8, got 'int4'"),
        (["--kv-cache-dtype", "fp16"], "error: --kv-cache-dtype: one of auto, fp8, got 'fp16'"),
        (["--load-format", "gguf"], "error: --load-format: one of auto, dummy, got 'gguf'"),
        (
            ["--fp8-activation-scales", "static"],
            "error: --fp8-activation-scales: one of checkpoint, calibrated, got 'static'",
        ),
    ],
)
def test_a_value_outside_the_choices_is_refused_naming_the_flag(
    tmp_path: Path, args: list[str], line: str
) -> None:
    result = run(tmp_path, "config", "show", *args)
    assert (result.exit_code, result.output.strip()) == (2, line)


def test_a_file_value_outside_the_choices_is_refused_naming_its_key(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("engine:\n  quantization: fp4\n")  # the flat key, as the file spells it
    result = run(tmp_path, "config", "show", "--config", str(path))
    assert result.exit_code == 2
    assert result.output.strip() == "error: config engine.quantization: one of none, fp8, got 'fp4'"


def test_up_takes_a_config_only_folder_with_dummy_weights_and_refuses_it_without(
    tmp_path: Path,
) -> None:
    folder = make_model(tmp_path / "l70", preset="llama3-70b", config_only=True)
    config = json.loads((folder / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        80, 8192, 128256,
    )  # fmt: skip
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json", "generation_config.json", "pdserve_recipe.json",
        "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json",
    ]  # fmt: skip
    check_model_dir(str(folder), weights=False)
    with pytest.raises(typer.BadParameter, match=r"has no \*\.safetensors weights"):
        check_model_dir(str(folder))
    refused = run(tmp_path, "up", "--model", str(folder))  # refused before anything starts
    assert refused.exit_code == 2 and "has no *.safetensors weights" in refused.output
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(typer.BadParameter, match="quant_method 'fp8' is not supported"):
        check_model_dir(str(folder), weights=False)


def test_make_model_refuses_fp8_options_that_do_not_fit(tmp_path: Path) -> None:
    out = str(tmp_path / "x")
    cases = [
        (["--quantization", "int2"], "--quantization: none, fp8, int8, int4 or gptq, got 'int2'"),
        (["--quantization", "int4", "--group-size", "0"], "--group-size: a positive number"),
        (["--quantization", "int8", "--from", out, "--config-only"], "--from: only with a"),
        (["--quantization", "fp8", "--weight-scales", "block"], "--weight-scales: channel or"),
        (
            ["--quantization", "fp8", "--activations", "token"],
            "--activations: dynamic, static or none",
        ),
        (["--from", out], "--from: only with a --quantization (and weights)"),
    ]
    for args, message in cases:
        result = run(tmp_path, "make-model", out, *args)
        assert result.exit_code == 2 and message in result.output, (args, result.output)


@pytest.mark.parametrize(
    ("scales", "activations"), [("channel", "dynamic"), ("tensor", "static"), ("channel", "none")]
)
def test_make_model_fp8_config_is_compressed_tensors_own_format(
    tmp_path: Path, scales: str, activations: str
) -> None:
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStrategy

    out = tmp_path / "fp8"
    result = run(
        tmp_path, "make-model", str(out), "--train-steps", "0", "--layers", "2",
        "--quantization", "fp8", "--weight-scales", scales, "--activations", activations,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    raw = json.loads((out / "config.json").read_text())["quantization_config"]
    config = QuantizationConfig.model_validate(raw)
    assert config.format == CompressionFormat.float_quantized.value
    assert config.quant_method == "compressed-tensors" and config.ignore == ["lm_head"]
    (scheme,) = config.config_groups.values()
    assert scheme.weights is not None
    assert scheme.weights.strategy == QuantizationStrategy(scales)
    assert scheme.weights.pytorch_dtype().is_floating_point  # float8_e4m3fn
    if activations == "none":  # weights only
        assert scheme.input_activations is None
    else:
        assert scheme.input_activations is not None
        assert scheme.input_activations.dynamic is (activations == "dynamic")
        dynamic = activations == "dynamic"
        want = QuantizationStrategy.TOKEN if dynamic else QuantizationStrategy.TENSOR
        assert scheme.input_activations.strategy == want
    assert QuantizationConfig.model_validate(config.model_dump()) == config
