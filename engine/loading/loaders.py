"""One loader per weight format, behind `load_model`: the way a checkpoint folder becomes an
engine `LlamaModel`.

`load_model` reads config.json, decides the checkpoint's weight format (what it declares,
else what `EngineConfig.quantization` and `load_format` ask for) and calls that format's
loader from `LOADERS`:

    dense    dense safetensors, quantization none: LlamaModel in the dtype
             (engine/loading/hf_checkpoint.py)
    fp8      an FP8 checkpoint (compressed-tensors `float-quantized`), read as FP8 whatever
             quantization says (logged); or a dense checkpoint with quantization fp8, each
             fused projection quantized as soon as its parts are read, so the dense
             projections never exist on the device (engine/loading/fp8_checkpoint.py)
    int      an INT8 W8A8 or INT4 W4A16 checkpoint (compressed-tensors `int-quantized` /
             `pack-quantized`), read as declared whatever quantization says (logged)
             (engine/loading/int_checkpoint.py); INT is never made at load from a dense one
    dummy    load_format dummy: random weights from config.json, made layer by layer
             straight into FP8 when fp8, or into the INT scheme config.json declares
             (engine/loading/dummy_weights.py)

What a config.json declares is read by engine/loading/checkpoint_scheme.py, which refuses any
scheme not computed. The FP8 and INT loaders build the model with `empty_model` (its
projections allocated by nobody but the loader) and set `model.quantization` to the format.
With a `TPShard` of size > 1 every loader builds that rank's part (engine/tp/tp_shard.py): a
model of the part's config, dummy weights drawn whole and cut, so each rank's part is the same
whatever the size. With a `PPStage` every loader builds that pipeline stage's model
(engine/pp/pp_stage.py): the checkpoint read through `stage_tensors`, dummy weights drawn for
every layer and only the stage's kept, so a stage's layers are those of the whole model.

A new format registers a loader here and, when a checkpoint declares it, its detection in
`weight_format`; the format joins the hand-off compatibility hash through the pool spec.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import LOAD_FORMATS, QUANTIZATIONS
from engine.loading.checkpoint_scheme import read_checkpoint_scheme
from engine.loading.dummy_weights import dummy_model
from engine.loading.fp8_checkpoint import Fp8Scheme, load_fp8_weights
from engine.loading.gptq_checkpoint import pack_quantized_tensors
from engine.loading.hf_checkpoint import (
    empty_model,
    iter_checkpoint,
    load_weights,
    shard_tensors,
)
from engine.loading.int_checkpoint import IntScheme, load_int_weights
from engine.modeling.llama import LlamaModel
from engine.pp.pp_stage import PPStage, stage_config, stage_tensors
from engine.tp.tp_shard import TPShard, check_tp_size, local_config
from vocabulary.model_config import ModelConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadSpec:
    """What one loader builds: the checkpoint, the whole model's config and this rank's part
    of it, where the model goes, and the FP8 scheme the checkpoint declares (if any)."""

    model_dir: Path
    cfg: ModelConfig
    local_cfg: ModelConfig
    dtype: torch.dtype
    device: torch.device | str
    shard: TPShard | None
    fp8: bool
    """The model computes in FP8 (declared by the checkpoint, or asked for)."""
    fp8_scheme: Fp8Scheme | None
    int_scheme: IntScheme | None
    """The INT scheme the checkpoint declares (then `fp8` is False)."""
    seed: int
    stage: PPStage | None = None
    """The pipeline stage whose layers the model holds (None: every layer)."""

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors this rank reads (its TP part, its stage's layers); a GPTQ
        checkpoint's as the pack-quantized tensors they equal, cut for the rank after."""
        gptq = self.int_scheme if self.int_scheme is not None and self.int_scheme.source else None
        tensors = iter_checkpoint(self.model_dir, self.cfg, None if gptq else self.shard)
        if self.stage is not None:
            tensors = stage_tensors(tensors, self.stage)
        if gptq is not None:
            tensors = pack_quantized_tensors(tensors, gptq)
            if self.shard is not None:
                tensors = shard_tensors(tensors, self.cfg, self.shard)
        return tensors


Loader = Callable[[LoadSpec], LlamaModel]


def _load_dense(spec: LoadSpec) -> LlamaModel:
    model = LlamaModel(spec.local_cfg, dtype=spec.dtype, device=spec.device)
    load_weights(model, spec.tensors())
    return model


def _load_fp8(spec: LoadSpec) -> LlamaModel:
    model = empty_model(spec.local_cfg, spec.dtype, spec.device)
    load_fp8_weights(model, spec.tensors(), spec.fp8_scheme)
    return model


def _load_int(spec: LoadSpec) -> LlamaModel:
    assert spec.int_scheme is not None
    model = empty_model(spec.local_cfg, spec.dtype, spec.device)
    load_int_weights(model, spec.tensors(), spec.int_scheme, spec.cfg)
    return model


def _load_dummy(spec: LoadSpec) -> LlamaModel:
    return dummy_model(
        spec.cfg, spec.dtype, spec.device, fp8=spec.fp8, seed=spec.seed, shard=spec.shard,
        int_scheme=spec.int_scheme, stage=spec.stage,
    )  # fmt: skip


LOADERS: dict[str, Loader] = {
    "dense": _load_dense, "fp8": _load_fp8, "int": _load_int, "dummy": _load_dummy,
}  # fmt: skip
"""Weight format → its loader."""


def weight_format(load_format: str, fp8: bool, int_scheme: IntScheme | None = None) -> str:
    """The `LOADERS` key for a checkpoint: dummy when asked for, else what its weights are."""
    if load_format == "dummy":
        return "dummy"
    if int_scheme is not None:
        return "int"
    return "fp8" if fp8 else "dense"


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    *,
    quantization: str = "none",
    load_format: str = "auto",
    seed: int = 0,
    shard: TPShard | None = None,
    stage: PPStage | None = None,
) -> LlamaModel:
    """Build a LlamaModel from a Hugging Face checkpoint folder on local disk (the ways in:
    see the module docstring). `seed` seeds dummy weights; `shard`: the tensor-parallel
    rank's part only (`model.tp_shard`; ValueError for a TP size that does not split it);
    `stage`: the pipeline stage's layers only (`model.pp_stage`)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization: one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format: one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: not a Hugging Face checkpoint folder")
    raw = json.loads(path.read_text())
    cfg = ModelConfig.from_dict(raw)
    if shard is not None and shard.size == 1:
        shard = None
    if shard is not None:
        check_tp_size(cfg, shard.size)
    if stage is not None and stage.size == 1:
        stage = None
    local_cfg = cfg if shard is None else local_config(cfg, shard)
    if stage is not None:
        local_cfg = stage_config(local_cfg, stage)
    scheme = read_checkpoint_scheme(raw)
    int_scheme = scheme if isinstance(scheme, IntScheme) else None
    fp8_scheme = scheme if isinstance(scheme, Fp8Scheme) else None
    if fp8_scheme is not None and quantization != "fp8":
        log.info("%s is an FP8 checkpoint (%s): loading FP8 weights", model_dir, scheme)
    if int_scheme is not None:
        log.info("%s is an INT checkpoint (%s): loading it as declared", model_dir, scheme)
    fp8 = int_scheme is None and (quantization == "fp8" or fp8_scheme is not None)
    spec = LoadSpec(
        model_dir=Path(model_dir),
        cfg=cfg,
        local_cfg=local_cfg,
        dtype=dtype,
        device=device,
        shard=shard,
        fp8=fp8,
        fp8_scheme=fp8_scheme,
        int_scheme=int_scheme,
        seed=seed,
        stage=stage,
    )
    model = LOADERS[weight_format(load_format, fp8, int_scheme)](spec)
    model.tp_shard = shard
    model.pp_stage = stage
    model.drop_unused_ends()
    return model.eval()
