"""Llama-family decoder written with torch: Llama 2/3, Mistral, Qwen2, Qwen3.

The model computes over a flat list of tokens (`[num_tokens]` ids and positions) from any mix
of sequences; how those tokens attend to each other and to cached KV is delegated to an
`Attend` callable per layer (an attention backend, or plain causal attention for training),
so the same weights serve prefill, decode, chunked prefill and training. q/k/v and gate/up are
fused into one matmul each; the loader (engine/loading/hf_checkpoint.py) fills the fused parameters
from Hugging Face tensor names.

Numerics follow transformers (RMSNorm in float32, rotate-half RoPE with cos/sin in float32
cast to the activation dtype), so float32 greedy decoding is token-identical to it.

The norms, residual adds, RoPE and SiLU-and-mul go through a `LayerOps`
(engine/modeling/layer_ops.py) passed to `forward`: `TorchOps` (the reference above, the default) or
flashinfer's fused kernels on the GPU. The residual stream r is carried between layers next to the
hidden state h (as vLLM does), so every residual add is fused into the norm that follows it:

    h, r = embed(ids), None
    each layer:  h, r = add_rms_norm(h, r)        (layer 0: r = h; h = rms_norm(h))
                 h = o_proj(attend(rope(qkv_proj(h))))
                 h, r = add_rms_norm(h, r)
                 h = down_proj(silu_and_mul(gate_up_proj(h)))
    forward returns r + h; compute_logits applies the final norm.

With TorchOps this is the same arithmetic in the same order as a plain residual stream
(x + f(norm(x)) per sublayer), so results are bit-for-bit those of the unfused form.

LoRA adapters (engine/lora/lora_apply.py) ride on the same projections: `forward` takes a
`LoraStep` (None: the base model, and nothing below changes) that adds each token's adapter
delta to the projection outputs it targets. An adapted FP8 projection takes its input in the
activation dtype (the op before it does not write e4m3 then; `Fp8Linear` quantizes with the
same static scale), so the delta is computed from the unquantized input and added to the FP8
GEMM's output in the activation dtype.

Tensor parallelism (engine/tp/tp_shard.py): a rank's model is built from its part's config (its
heads and intermediate rows) and given the group's all-reduce (`use_all_reduce`), which sums
the partial outputs of the two row-parallel projections, o_proj and down_proj, in place; a
whole model (no all-reduce) runs exactly the code above.

Pipeline parallelism (engine/pp/pp_stage.py): a stage's model holds only its layers (numbered
from 0) and passes the pair (h, r) on rather than r + h: `embed` (stage 0), `run_layers` (every
stage) and `compute_logits` over r + h (the last stage) are the pieces of `forward`, so a model
cut into stages computes the same numbers as a whole one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.modeling.layer_ops import TORCH_OPS, LayerOps, rms_norm
from engine.quantization.fp8_linear import FP8_DTYPE, Fp8Linear
from vocabulary.model_config import ModelConfig, RopeConfig

if TYPE_CHECKING:
    from engine.lora.lora_apply import LoraStep
    from engine.pp.pp_stage import PPStage
    from engine.tp.tp_shard import TPShard


class Attend(Protocol):
    """(layer index, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> attention output [T, Hq, D].

    `out_scale`: o_proj's static FP8 input scale when its input may be e4m3 (else None). An
    implementation MAY then return the output already divided by it in e4m3 (a kernel that
    writes it so saves the separate cast); the model casts any other output itself."""

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out_scale: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


class QuantizedLinear(Protocol):
    """What the model asks of a quantized projection (`Fp8Linear`, `Int8Linear`,
    `Int4Linear`): `input_scale`, a static activation scale the op before may quantize with
    (None: the projection takes its input in the activation dtype), and a call
    `(x, out_dtype) -> x @ W.T + b`."""

    input_scale: torch.Tensor | None


AllReduce = Callable[[torch.Tensor], None]
"""Sums a tensor in place over the tensor-parallel ranks (engine/tp/tensor_parallel.py)."""


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = _param((dim,), dtype, device)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies, with linear or llama3 scaling applied (float32)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class Rotary(nn.Module):
    """Rotate-half RoPE tables (float32) for every position up to the context length, in the
    layouts `engine.modeling.layer_ops.RopeTables` describes (torch's cos/sin, flashinfer's
    cache)."""

    cos: torch.Tensor
    sin: torch.Tensor
    cos_sin_cache: torch.Tensor

    def __init__(self, cfg: ModelConfig, device: torch.device) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)
        positions = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        half = cfg.head_dim // 2
        cos_sin = torch.cat((cos[:, :half], sin[:, :half]), dim=-1).contiguous()
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)
        self.register_buffer("cos_sin_cache", cos_sin.to(device), persistent=False)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        h, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype, device)
        self.qkv_proj = _param((q + 2 * kv, h), dtype, device)
        self.qkv_bias = _param((q + 2 * kv,), dtype, device) if cfg.attention_bias else None
        self.o_proj = _param((h, q), dtype, device)
        self.o_bias = _param((h,), dtype, device) if cfg.o_proj_bias else None
        if cfg.qk_norm:
            self.q_norm: RMSNorm | None = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
            self.k_norm: RMSNorm | None = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
        else:
            self.q_norm = self.k_norm = None
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype, device)
        self.gate_up_proj = _param((2 * cfg.intermediate_size, h), dtype, device)
        self.down_proj = _param((h, cfg.intermediate_size), dtype, device)
        self.quantized: nn.ModuleDict | None = None
        """The four projections in a quantized format (`Fp8Linear` by `quantize_fp8` or an
        FP8 loader, `Int8Linear` or `Int4Linear` by the INT loader); the dense ones are then
        empty."""
        self.all_reduce: AllReduce | None = None
        """A tensor-parallel shard's sum of the row-parallel outputs (None: a whole model)."""

    def quantize_fp8(self) -> None:
        """Replace qkv, o, gate/up and down by FP8 copies (engine/quantization/fp8_linear.py),
        freeing the dense weights; norms stay in the model dtype."""
        self.quantized = nn.ModuleDict(
            {
                "qkv_proj": Fp8Linear.from_weight(self.qkv_proj, self.qkv_bias),
                "o_proj": Fp8Linear.from_weight(self.o_proj, self.o_bias),
                "gate_up_proj": Fp8Linear.from_weight(self.gate_up_proj),
                "down_proj": Fp8Linear.from_weight(self.down_proj),
            }
        )
        empty = torch.empty(0, dtype=self.qkv_proj.dtype, device=self.qkv_proj.device)
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            setattr(self, name, nn.Parameter(empty, requires_grad=False))

    def projection_bias(self, name: str) -> torch.Tensor | None:
        """The bias of fused projection `name` (qkv_proj, o_proj; the MLP's have none)."""
        return {"qkv_proj": self.qkv_bias, "o_proj": self.o_bias}.get(name)

    def _static_scale(self, name: str, lora: LoraStep | None = None) -> torch.Tensor | None:
        """The static input scale of FP8 projection `name` (the op before it then writes
        e4m3 itself), or None (dense, FP8 with dynamic input scales, INT, or adapted by
        `lora`: the adapter reads the input in the activation dtype)."""
        if self.quantized is None or (lora is not None and name in lora.projections):
            return None
        return cast(QuantizedLinear, self.quantized[name]).input_scale

    def _linear(
        self, name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """Projection `name` of x (model dtype, or e4m3 made with its static input scale)."""
        if self.quantized is not None:
            out: torch.Tensor = self.quantized[name](x, out_dtype=weight.dtype)
            return out
        return F.linear(x, weight, bias)

    def _project(
        self,
        layer: int,
        name: str,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        lora: LoraStep | None,
    ) -> torch.Tensor:
        """`_linear`, plus the adapters' deltas of `lora` (None: none)."""
        begun = lora.begin(layer, name, x) if lora is not None else None
        out = self._linear(name, x, weight, bias)
        if lora is not None:
            lora.add(layer, name, x, out, begun)
        return out

    def _norm_into(
        self,
        name: str,
        ops: LayerOps,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        lora: LoraStep | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the input of projection `name`: rmsnorm of x (+ residual), residual stream);
        e4m3 when that projection's input scale is static."""
        eps = self.cfg.rms_norm_eps
        scale = self._static_scale(name, lora)
        if residual is None:
            if scale is not None:
                return ops.rms_norm_quant(x, weight, eps, scale), x
            return ops.rms_norm(x, weight, eps), x
        if scale is not None:
            return ops.add_rms_norm_quant(x, residual, weight, eps, scale)
        return ops.add_rms_norm(x, residual, weight, eps)

    def forward(
        self,
        layer: int,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rotary: Rotary,
        attend: Attend,
        ops: LayerOps,
        lora: LoraStep | None = None,
        rope_in_attention: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual stream before it) for the previous layer's pair (x, residual);
        layer 0 gets (embeddings, None). x and residual may be overwritten (see LayerOps).
        `rope_in_attention`: q and k go to `attend` unrotated (its backend rotates them)."""
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        h, residual = self._norm_into(
            "qkv_proj", ops, x, residual, self.input_layernorm.weight, lora
        )
        qkv = self._project(layer, "qkv_proj", h, self.qkv_proj, self.qkv_bias, lora)
        t = qkv.shape[0]
        # views into qkv (no copies); RoPE may rotate q and k in place there
        q = qkv[:, : cfg.q_size].view(t, cfg.num_heads, cfg.head_dim)
        k = qkv[:, cfg.q_size : cfg.q_size + cfg.kv_size].view(t, cfg.num_kv_heads, cfg.head_dim)
        v = qkv[:, cfg.q_size + cfg.kv_size :].view(t, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = ops.rms_norm(q, self.q_norm.weight, eps)
            k = ops.rms_norm(k, self.k_norm.weight, eps)
        if not rope_in_attention:
            q, k = ops.rope(positions, q, k, rotary)
        o_scale = self._static_scale("o_proj", lora)
        attn = attend(layer, q, k, v, o_scale).reshape(t, cfg.q_size)
        if o_scale is not None and attn.dtype != FP8_DTYPE:
            attn = ops.quantize(attn, o_scale)
        h = self._project(layer, "o_proj", attn, self.o_proj, self.o_bias, lora)
        if self.all_reduce is not None:
            self.all_reduce(h)
        h, residual = self._norm_into(
            "gate_up_proj", ops, h, residual, self.post_attention_layernorm.weight, lora
        )
        gate_up = self._project(layer, "gate_up_proj", h, self.gate_up_proj, None, lora)
        down_scale = self._static_scale("down_proj", lora)
        if down_scale is not None:
            h = ops.silu_and_mul_quant(gate_up, down_scale)
        else:
            h = ops.silu_and_mul(gate_up)
        out = self._project(layer, "down_proj", h, self.down_proj, None, lora)
        if self.all_reduce is not None:
            self.all_reduce(out)
        return out, residual


class LlamaModel(nn.Module):
    """A Llama-family decoder over a flat batch of tokens; weights via
    engine.loading.hf_checkpoint."""

    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__()
        device = torch.device(device)
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.embed_tokens = _param((cfg.vocab_size, cfg.hidden_size), dtype, device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, device) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else _param((cfg.vocab_size, cfg.hidden_size), dtype, device)
        )
        self.rotary = Rotary(cfg, device)
        self.quantization = "none"
        """How the projections are stored (the weight format; part of the hand-off's
        compatibility hash): none (the model dtype), fp8, int8 or int4."""
        self.tp_shard: TPShard | None = None
        """The tensor-parallel part this model holds (`cfg` is then that part's config,
        engine/tp/tp_shard.py); None: the whole model."""
        self.pp_stage: PPStage | None = None
        """The pipeline stage whose layers this model holds (`cfg.num_layers` is then that
        stage's count, engine/pp/pp_stage.py); None: every layer."""

    def use_all_reduce(self, all_reduce: AllReduce) -> None:
        """Sum o_proj's and down_proj's partial outputs over the TP ranks with `all_reduce`
        (a shard's model, `tp_shard`), from the next forward on."""
        for layer in self.layers:
            cast(DecoderLayer, layer).all_reduce = all_reduce

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attend: Attend,
        ops: LayerOps = TORCH_OPS,
        lora: LoraStep | None = None,
        rope_in_attention: bool = False,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] (before the final norm) for flat `input_ids` [T];
        `lora`: the step's adapters (None: the base model); `rope_in_attention`: `attend`
        rotates q and k itself (a backend that took `graph_rope`), so no RoPE op runs here."""
        h, residual = self.run_layers(
            self.embed(input_ids), None, positions, attend, ops, lora, rope_in_attention
        )
        return h if residual is None else residual + h

    def forward_stage(
        self,
        input_ids: torch.Tensor,
        carried: torch.Tensor | None,
        positions: torch.Tensor,
        attend: Attend,
        ops: LayerOps = TORCH_OPS,
        lora: LoraStep | None = None,
        rope_in_attention: bool = False,
    ) -> torch.Tensor:
        """A pipeline stage's part of `forward` (eager, or inside a stage's CUDA graph):
        from `carried`, the stage before's pair (h, residual) stacked [2, T, hidden] (None:
        embed `input_ids`, stage 0), through this model's layers; the pair stacked for the
        next stage, or on the last stage the hidden states `forward` returns."""
        if carried is None:
            h, residual = self.embed(input_ids), None
        else:
            h, residual = carried[0], carried[1]
        h, residual = self.run_layers(h, residual, positions, attend, ops, lora, rope_in_attention)
        assert residual is not None  # a stage holds at least one layer
        if self.pp_stage is not None and not self.pp_stage.is_last:
            return torch.stack((h, residual))
        return residual + h

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings [T, hidden] (zeros on a pipeline stage without the embedding:
        its real input comes from the stage before; only memory profiling runs it so)."""
        if self.embed_tokens.numel() == 0:
            return torch.zeros(
                (input_ids.shape[0], self.cfg.hidden_size), dtype=self.dtype, device=self.device
            )
        return F.embedding(input_ids, self.embed_tokens)

    def run_layers(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        attend: Attend,
        ops: LayerOps = TORCH_OPS,
        lora: LoraStep | None = None,
        rope_in_attention: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every layer this model holds over the pair (h, residual) (the embeddings and None
        before the first layer); the pair after the last (module docstring)."""
        for i, layer in enumerate(self.layers):
            h, residual = layer(
                i, h, residual, positions, self.rotary, attend, ops, lora, rope_in_attention
            )
        return h, residual

    @property
    def has_head(self) -> bool:
        """The model computes logits (a whole model, or a pipeline's last stage)."""
        return self.pp_stage is None or self.pp_stage.is_last

    def drop_unused_ends(self) -> None:
        """A pipeline stage's model: free the embedding off stage 0 (unless the last stage's
        tied head reads it) and the head off the last stage (engine/pp/pp_stage.py)."""
        stage = self.pp_stage
        if stage is None:
            return
        empty = nn.Parameter(
            torch.empty(0, dtype=self.dtype, device=self.device), requires_grad=False
        )
        if not stage.is_first and not (stage.is_last and self.lm_head is None):
            self.embed_tokens = empty
        if not stage.is_last and self.lm_head is not None:
            self.lm_head = empty

    def quantize_fp8(self) -> None:
        """FP8 weights for every decoder layer's projections; embeddings, norms and the head
        stay in the model dtype."""
        for layer in self.layers:
            cast(DecoderLayer, layer).quantize_fp8()
        self.quantization = "fp8"

    @property
    def weight_bytes(self) -> int:
        """Bytes of every weight the model holds (FP8 buffers included)."""
        return sum(t.numel() * t.element_size() for t in (*self.parameters(), *self.buffers()))

    def compute_logits(self, hidden: torch.Tensor, ops: LayerOps = TORCH_OPS) -> torch.Tensor:
        """Float32 logits [N, vocab] for hidden states [N, hidden] (final norm applied here)."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        normed = ops.rms_norm(hidden, self.norm.weight, self.norm.eps)
        return F.linear(normed, head).float()


def causal_attend(batch: int, seq_len: int, num_heads: int, num_kv_heads: int) -> Attend:
    """Attention for dense [batch, seq_len] inputs with no KV cache (training, references)."""
    group = num_heads // num_kv_heads

    def attend(
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        del layer, out_scale  # the output stays in q's dtype
        d = q.shape[-1]
        qb = q.reshape(batch, seq_len, num_heads, d).transpose(1, 2)
        kb = k.reshape(batch, seq_len, num_kv_heads, d).transpose(1, 2)
        vb = v.reshape(batch, seq_len, num_kv_heads, d).transpose(1, 2)
        if group > 1:
            kb = kb.repeat_interleave(group, dim=1)
            vb = vb.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True)
        return out.transpose(1, 2).reshape(batch * seq_len, num_heads, d)

    return attend
