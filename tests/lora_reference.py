"""Random PEFT adapters on the tiny model, made by `peft` itself, and `peft`'s own greedy
continuation in transformers (float32): the reference LoRA serving is checked against."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def hf_base(model_dir: Path) -> Any:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def make_adapter(model_dir: Path, out: Path, seed: int, **lora: object) -> Path:
    """A random PEFT adapter (B nonzero) on the tiny model, saved to `out`."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(init_lora_weights=False, lora_dropout=0.0, **lora)  # type: ignore[arg-type]
    get_peft_model(hf_base(model_dir), config).save_pretrained(str(out))
    return out


def peft_model(model_dir: Path, adapter: Path) -> Any:
    """peft's PeftModel of `adapter` over the tiny model."""
    from peft import PeftModel

    return PeftModel.from_pretrained(hf_base(model_dir), str(adapter)).eval()


@torch.inference_mode()
def greedy(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation by full recompute (eos ignored)."""
    ids = list(prompt)
    for _ in range(max_tokens):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]
