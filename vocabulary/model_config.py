"""The model's shape and features, read from a Hugging Face `config.json`.

Covers the Llama family: Llama 2/3 (incl. llama3 RoPE scaling), Mistral, Qwen2 (qkv bias) and
Qwen3 (q/k RMSNorm per head), with grouped-query attention and tied or untied embeddings.
Both the old (`rope_theta` + `rope_scaling`) and the transformers-5 (`rope_parameters`)
spellings of RoPE settings are understood.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings. `kind` is "default", "linear" or "llama3"."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (what the engine needs of config.json)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v (and for Llama, o) projections carry a bias
    o_proj_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    # Mistral v0.1-style sliding-window attention: the engine serves contexts only up to this
    # length (full attention is exact there) instead of silently attending past the window.
    sliding_window: int | None = None

    @property
    def max_model_len(self) -> int:
        """Longest context (prompt + output) the engine serves for this model."""
        if self.sliding_window:
            return min(self.max_position_embeddings, int(self.sliding_window))
        return self.max_position_embeddings

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = str(raw.get("model_type", "llama"))
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"config.json: model_type {model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json: hidden_act {act!r} is not supported (only silu)")
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        head_dim = int(raw.get("head_dim") or hidden // num_heads)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        if model_type == "qwen2":  # Qwen2: bias on q/k/v only
            bias, o_bias = True, False
        else:
            bias = o_bias = bool(raw.get("attention_bias", False))
        window = raw.get("sliding_window")
        if raw.get("use_sliding_window") is False:
            window = None
        dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        return cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=_rope_from_dict(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bias,
            o_proj_bias=o_bias,
            qk_norm=model_type == "qwen3",
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            torch_dtype=str(dtype),
            sliding_window=int(window) if window else None,
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: not a Hugging Face checkpoint folder")
        return cls.from_dict(json.loads(path.read_text()))


def _rope_from_dict(raw: dict[str, Any]) -> RopeConfig:
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = str(merged.get("rope_type", merged.get("type", "default")) or "default")
    if kind not in ("default", "linear", "llama3"):
        raise ValueError(f"config.json: rope type {kind!r} is not supported")
    return RopeConfig(
        theta=theta,
        kind=kind,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            merged.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))
        ),
    )
