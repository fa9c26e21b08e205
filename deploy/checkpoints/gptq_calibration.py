"""GPTQ rounding for make-model's INT4 checkpoints (`--calibrate`): each projection's int4
values chosen against the inputs it sees on the bundled corpus, not rounded to nearest.

GPTQ (Frantar et al., 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers"), as AutoGPTQ runs it with `desc_act: false`, `static_groups: false`:

    H = 2 X^T X / n over the projection's inputs X [n, in] (one causal forward of the
        calibration tokens through the dense model), plus `damp` x mean(diag H) on its
        diagonal; inputs never seen (diag 0) get 1 there and their weights 0
    U = the upper Cholesky factor of H^-1
    for each column k in order (blocks of `BLOCK` columns, the updates of a block applied to
    the columns after it at its end):
        at a group's first column: the group's scale = amax of its (updated) weights / 7
        q_k = clamp(round(w_k / scale), -8, 7)           (make-model's writer clamps to +-7
                                                          with the amax: the same range)
        e_k = (w_k - q_k * scale) / U[k, k]
        w_j -= e_k * U[k, j] for every later column j    (the error spread where H says the
                                                          inputs correlate)

The scales and integers are stored as the round-to-nearest writer stores them (int_writer.py:
pack-quantized or GPTQ layout), so a reader sees no difference but the values; the test
compares the projections' output error on the corpus against round-to-nearest.
Non-sequential: every layer's H comes from the dense model's activations.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from engine.modeling.llama import DecoderLayer, LlamaModel, causal_attend
from engine.quantization.int4_linear import INT4_MAX
from engine.tp.tp_shard import FUSED_MODULES
from vocabulary.model_config import ModelConfig

DAMP = 0.01
"""Share of the mean diagonal added to H (AutoGPTQ's `damp_percent`)."""
BLOCK = 128
"""Columns quantized before their updates reach the rest (the algorithm's lazy batch)."""
_MIN_SCALE = 1e-12


class _Recorder(nn.Module):
    """A dense projection that sums X^T X of its inputs (float64) as the model runs it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        self.xtx = torch.zeros(weight.shape[1], weight.shape[1], dtype=torch.float64)
        self.rows = 0
        self.input_scale = None  # (read by the model: no static FP8 scale)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).double()
        self.xtx += flat.T @ flat
        self.rows += flat.shape[0]
        return F.linear(x, self.weight, self.bias).to(out_dtype or x.dtype)


@torch.no_grad()
def input_hessians(
    tensors: Mapping[str, torch.Tensor], cfg: ModelConfig, token_ids: list[int]
) -> dict[str, torch.Tensor]:
    """H = 2 X^T X / n (float64 [in, in]) of every decoder Linear's inputs, by checkpoint
    module name (fused parts share their input), over one causal forward of `token_ids`
    through the dense model in `tensors`."""
    from engine.loading.hf_checkpoint import load_weights

    model = LlamaModel(cfg, dtype=torch.float32)
    load_weights(model, ((k, v.float()) for k, v in tensors.items()))
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        layer.quantized = nn.ModuleDict({
            "qkv_proj": _Recorder(layer.qkv_proj, layer.qkv_bias),
            "o_proj": _Recorder(layer.o_proj, layer.o_bias),
            "gate_up_proj": _Recorder(layer.gate_up_proj, None),
            "down_proj": _Recorder(layer.down_proj, None),
        })  # fmt: skip
    ids = torch.tensor(token_ids[: cfg.max_model_len], dtype=torch.long)
    attend = causal_attend(1, len(ids), cfg.num_heads, cfg.num_kv_heads)
    model(ids, torch.arange(len(ids)), attend)
    out: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer) and layer.quantized is not None
        for projection, modules in FUSED_MODULES.items():
            recorder = layer.quantized[projection]
            assert isinstance(recorder, _Recorder)
            h = 2 * recorder.xtx / max(recorder.rows, 1)
            for name in modules:
                out[f"model.layers.{i}.{name}"] = h
    return out


def gptq_round(
    weight: torch.Tensor, hessian: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(int values [out, in] in [-7, 7], scales [out, in / group_size] in weight's dtype, the
    values the integers were rounded with) of `weight` [out, in] by GPTQ against `hessian`
    [in, in] (module docstring)."""
    w = weight.double().clone()
    rows, cols = w.shape
    if cols % group_size:
        raise ValueError(f"{cols} columns are not a multiple of group_size {group_size}")
    h = hessian.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += DAMP * torch.mean(torch.diag(h)) * torch.eye(cols, dtype=torch.float64)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.zeros_like(w)
    scales = torch.zeros(rows, cols // group_size, dtype=torch.float64)
    for start in range(0, cols, BLOCK):
        stop = min(start + BLOCK, cols)
        block, errors = w[:, start:stop].clone(), torch.zeros(rows, stop - start, dtype=w.dtype)
        inverse = u[start:stop, start:stop]
        for j in range(stop - start):
            k = start + j
            if k % group_size == 0:
                group = torch.cat([block[:, j:], w[:, stop:]], dim=1)[:, :group_size]
                scale = (group.abs().amax(dim=1) / INT4_MAX).clamp(min=_MIN_SCALE)
                scales[:, k // group_size] = scale.to(weight.dtype).double()  # as stored
            s = scales[:, k // group_size]
            col = block[:, j]
            q[:, k] = (col / s).round().clamp(-INT4_MAX, INT4_MAX)
            err = (col - q[:, k] * s) / inverse[j, j]
            block[:, j:] -= err[:, None] * inverse[j, j:][None, :]
            errors[:, j] = err
        w[:, stop:] -= errors @ u[start:stop, stop:]
    return q.to(torch.int64), scales.to(weight.dtype)
