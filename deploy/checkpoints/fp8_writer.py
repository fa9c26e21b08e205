"""Write FP8 checkpoints in the compressed-tensors `float-quantized` format (the format
engine/loading/fp8_checkpoint.py reads; its docstring shows the config keys and tensor names), as
llm-compressor's FP8 schemes write them:

    per-channel weights + dynamic activations   (llm-compressor's FP8_DYNAMIC; the default)
        <module>.weight        e4m3 [out, in]      weight / weight_scale, saturated at ±448
        <module>.weight_scale  float32 [out, 1]    amax of each row / 448
    per-tensor weights + static activations     (llm-compressor's FP8)
        <module>.weight_scale  float32 [1]         amax / 448
        <module>.input_scale   float32 [1]         amax of the module's input / 448, observed
                                                   on the bundled corpus (one forward pass)

Only the decoder's Linear modules are quantized (q/k/v/o, gate/up/down, each on its own as
Hugging Face names them); the head, embeddings and norms stay dense (`ignore: [lm_head]`).
`pdserve make-model --quantization fp8` writes one (of a preset, or `--from` an existing
checkpoint folder).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from deploy.checkpoints.checkpoint_files import CORPUS, save_shards, staged_dir
from engine.loading.fp8_checkpoint import Fp8Scheme
from engine.quantization.fp8_linear import FP8_DTYPE, FP8_MAX
from engine.tp.tp_shard import FUSED_MODULES
from vocabulary.model_config import ModelConfig

_MIN_SCALE = 1e-12
LINEAR_WEIGHT = re.compile(
    r"^(model\.layers\.\d+\.(?:self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj))\.weight$"
)
"""A decoder Linear's weight by its Hugging Face name (group 1: the module)."""
CALIBRATION_TOKENS = 256
"""Tokens of the bundled corpus the static input scales are observed on."""


def popped(
    tensors: dict[str, torch.Tensor],
) -> Iterator[tuple[str, torch.Tensor, str | None]]:
    """(name, tensor, its decoder projection's module name or None) of every tensor, each
    taken out of `tensors` as it is yielded (one copy of the weights at a time)."""
    for name in list(tensors):
        t = tensors.pop(name)
        m = LINEAR_WEIGHT.match(name)
        yield name, t, (m[1] if m is not None else None)


def quantize_tensors(
    tensors: dict[str, torch.Tensor],
    scheme: Fp8Scheme,
    input_amax: Mapping[str, float] | None = None,
) -> dict[str, torch.Tensor]:
    """The checkpoint `tensors` (HF names, dense) in `scheme`; `input_amax` (checkpoint
    module -> amax of its input) is required for static activations. Empties `tensors` as
    it goes (one copy of the weights at a time)."""
    static = not scheme.dynamic_activations
    if static and input_amax is None:
        raise ValueError("static activations need the input amax of every module")
    out: dict[str, torch.Tensor] = {}
    for name, t, module in popped(tensors):
        if module is None:
            out[name] = t
            continue
        w = t.float()
        if scheme.weight_strategy == "channel":
            amax = w.abs().amax(dim=1, keepdim=True)
        else:
            amax = w.abs().amax().reshape(1)
        scale = (amax / FP8_MAX).clamp(min=_MIN_SCALE)
        out[name] = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        out[f"{module}.weight_scale"] = scale
        if static:
            assert input_amax is not None
            if module not in input_amax:
                raise ValueError(f"no observed input amax for {module}")
            act = max(input_amax[module] / FP8_MAX, _MIN_SCALE)
            out[f"{module}.input_scale"] = torch.tensor([act], dtype=torch.float32)
    return out


def observe_input_amax(
    tensors: Mapping[str, torch.Tensor], cfg: ModelConfig, token_ids: list[int]
) -> dict[str, float]:
    """Amax of every decoder Linear's input (checkpoint module names) over one causal
    forward of `token_ids`, with the weights in FP8 as they will serve (so each layer sees
    the inputs the quantized layers before it produce)."""
    from engine.loading.fp8_calibration import observe
    from engine.loading.hf_checkpoint import load_weights
    from engine.modeling.llama import LlamaModel

    dtype = next(iter(tensors.values())).dtype
    model = LlamaModel(cfg, dtype=dtype if dtype.is_floating_point else torch.float32)
    load_weights(model, iter(tensors.items()))
    model.quantize_fp8()
    observed = observe(model, token_ids[: cfg.max_model_len])
    amax: dict[str, float] = {}
    for i in range(cfg.num_layers):
        for projection, modules in FUSED_MODULES.items():
            for module in modules:  # fused parts read the same input
                amax[f"model.layers.{i}.{module}"] = observed.activations[
                    f"layers.{i}.quantized.{projection}"
                ]
    return amax


def corpus_ids(model_dir: Path | None, tokenizer: object | None = None) -> list[int]:
    """The first CALIBRATION_TOKENS tokens of the bundled corpus, tokenized by the
    checkpoint's tokenizer (`model_dir`) or by `tokenizer` (a tokenizers.Tokenizer)."""

    text = CORPUS.read_text()
    if tokenizer is None:
        from vocabulary.tokenizer import Tokenizer

        assert model_dir is not None
        return Tokenizer.from_model_dir(model_dir).encode(text)[:CALIBRATION_TOKENS]
    return list(tokenizer.encode(text).ids[:CALIBRATION_TOKENS])  # type: ignore[attr-defined]


def quantize_checkpoint(src: str | Path, out: str | Path, scheme: Fp8Scheme) -> Path:
    """Write the dense checkpoint folder `src` to `out` in `scheme` (config.json gains its
    `quantization_config`; tokenizer and other files are copied). Written under a temporary
    name and renamed into place, as make-model does."""
    from engine.loading.fp8_checkpoint import read_fp8_scheme
    from engine.loading.hf_checkpoint import iter_checkpoint

    src, out = Path(src), Path(out)
    raw = json.loads((src / "config.json").read_text())
    if read_fp8_scheme(raw) is not None:
        raise ValueError(f"{src} is already an FP8 checkpoint")
    cfg = ModelConfig.from_dict(raw)
    tensors = dict(iter_checkpoint(src))
    amax = None
    if not scheme.dynamic_activations:
        amax = observe_input_amax(tensors, cfg, corpus_ids(src))
    quantized = quantize_tensors(tensors, scheme, amax)
    raw["quantization_config"] = scheme.quantization_config()
    return write_quantized_copy(src, out, quantized, raw)


def write_quantized_copy(
    src: Path, out: Path, tensors: dict[str, torch.Tensor], raw_config: dict[str, Any]
) -> Path:
    """`out`: checkpoint folder `src` with `tensors` for its weights and `raw_config` for its
    config.json (tokenizer and other files copied), written under a temporary name and
    renamed into place."""
    with staged_dir(out) as tmp:
        save_shards(tensors, tmp, 5 << 30)
        (tmp / "config.json").write_text(json.dumps(raw_config, indent=2))
        for f in src.iterdir():
            weights = f.suffix == ".safetensors" or f.name == "model.safetensors.index.json"
            if f.is_file() and not weights and f.name != "config.json":
                shutil.copy2(f, tmp / f.name)
    return out
