"""LoRA adapter names: the characters and length a name may have, checked alike by the router
(request validation) and the engine (adapter registry)."""

from __future__ import annotations

import re

LORA_NAME_CHARS = "A-Z a-z 0-9 and . _ - : / + = @ ~"


MAX_LORA_NAME_CHARS = 128


_LORA_NAME_RE = re.compile(r"[A-Za-z0-9._\-:/+=@~]+")


def check_lora_name(name: str) -> None:
    """A LoRA adapter's name: 1 to MAX_LORA_NAME_CHARS characters of LORA_NAME_CHARS (the
    router's rule for ids; no whitespace or control characters, so the name can never
    collide with the separators of `engine.block_hash.hash_extra`). ValueError if not."""
    if not name:
        raise ValueError("lora name: must not be empty")
    if len(name) > MAX_LORA_NAME_CHARS:
        raise ValueError(f"lora name {name!r}: longer than {MAX_LORA_NAME_CHARS} characters")
    if not _LORA_NAME_RE.fullmatch(name):
        bad = next(c for c in name if not _LORA_NAME_RE.fullmatch(c))
        raise ValueError(
            f"lora name {name!r}: character {bad!r} is not allowed ({LORA_NAME_CHARS})"
        )
