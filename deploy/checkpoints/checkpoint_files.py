"""What every checkpoint writer shares: the bundled text corpus (tokenizer training, the tiny
model's training, FP8 calibration) and writing safetensors shards into a folder atomically."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

CORPUS = Path(__file__).parent / "data" / "corpus.txt"


@contextlib.contextmanager
def staged_dir(out: Path) -> Iterator[Path]:
    """A temporary folder beside `out` to write a checkpoint into, renamed to `out` (replacing
    it) when the block ends and removed if it raises: a reader never sees half a folder."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_shards(tensors: dict[str, torch.Tensor], out: Path, shard_bytes: int) -> None:
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if total <= shard_bytes:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if size and size + n > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
