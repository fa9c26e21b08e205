"""The model and batches the GPU engine suites time (engine, engine_step, fp8, lora, tp,
tp_gpu): a Llama-3-8B-shaped model with random bf16 weights made on the GPU (nothing on
disk), B one-token decodes over blocks of their own, and the weight bytes a decode step
reads (the numerator of its HBM floor)."""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from engine.batch import ScheduledBatch, SeqChunk
from engine.modeling.llama import LlamaModel
from vocabulary.model_config import ModelConfig
from vocabulary.numeric import cdiv
from vocabulary.tokenizer import Tokenizer


@contextlib.contextmanager
def llama3_8b_folder() -> Iterator[tuple[Path, Tokenizer]]:
    """(a folder holding just the Llama-3-8B preset's config.json, the benchmarks' 512-token
    tokenizer, eos 1): what an engine over `random_llama3_8b` reads its shape from."""
    from deploy.checkpoints.make_model import PRESETS, build_tokenizer, hf_config

    tok, _ = build_tokenizer(512, 8192)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(hf_config(PRESETS["llama3-8b"], 0, 1)))
        yield Path(tmp), Tokenizer(tok, (1,))  # type: ignore[arg-type]


def random_llama3_8b() -> LlamaModel:
    """The Llama-3-8B shape on the current CUDA device, weights N(0, 0.02), norms 1."""
    from deploy.checkpoints.make_model import PRESETS, hf_config

    cfg = ModelConfig.from_dict(hf_config(PRESETS["llama3-8b"], 0, 1))
    model = LlamaModel(cfg, dtype=torch.bfloat16, device="cuda").eval()
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    n = sum(p.numel() for p in model.parameters())
    print(f"   {n / 1e9:.2f} B parameters, {torch.cuda.memory_allocated() / 2**30:.1f} GiB used")
    return model


def decode_batch(
    batch: int,
    context: int,
    block_size: int,
    first_block: int = 0,
    lora_slots: Sequence[int] = (),
) -> ScheduledBatch:
    """`batch` one-token decodes, each at position context - 1 over blocks of its own (from
    `first_block` on, in order); row i reads LoRA slot `lora_slots[i]` (none: the base)."""
    pages = cdiv(context, block_size)
    return ScheduledBatch(
        tuple(
            SeqChunk(
                f"seq{i}",
                (i % 1000 + 1,),
                context - 1,
                tuple(range(first_block + i * pages, first_block + (i + 1) * pages)),
                sample=True,
                lora_slot=lora_slots[i] if lora_slots else -1,
            )
            for i in range(batch)
        )
    )


def weight_read_bytes(model: LlamaModel) -> int:
    """Weight bytes a decode step of `model` reads: its parameters and quantized buffers, less the
    embedding table where the head is separate (the table is only gathered); not the RoPE
    tables."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:
        params -= model.embed_tokens.numel() * model.embed_tokens.element_size()
    quantized = sum(
        b.numel() * b.element_size() for n, b in model.named_buffers() if ".quantized." in f".{n}"
    )
    return params + quantized
