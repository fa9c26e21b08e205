"""EngineConfig's LoRA fields: on with `enable_lora` or any adapter, sizes and the kernel
checked, adapter names checked (the router's id characters) and never given twice."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from vocabulary.lora_names import check_lora_name


def config(**fields: object) -> EngineConfig:
    return EngineConfig(model_dir="m", **fields)  # type: ignore[arg-type]


def test_lora_is_on_with_the_flag_or_any_adapter() -> None:
    assert not config().lora_enabled
    assert config(enable_lora=True).lora_enabled
    assert config(loras=(("sql", "/a/sql"),)).lora_enabled


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_loras": 0}, "max_loras: must be >= 1, got 0"),
        ({"max_loras": 9}, "max_cpu_loras: must be >= max_loras (9), got 8"),
        ({"max_lora_rank": 0}, "max_lora_rank: must be >= 1, got 0"),
        ({"lora_kernel": "cutlass"}, "lora_kernel: one of auto, torch, flashinfer, triton"),
        ({"loras": (("a", "/x"), ("a", "/y"))}, "loras: adapter 'a' is given twice"),
        ({"loras": (("a", ""),)}, "loras: adapter 'a' has no path"),
        ({"loras": (("a b", "/x"),)}, "lora name 'a b': character ' ' is not allowed"),
        ({"loras": (("a",),)}, "loras: each entry is (name, path), got ('a',)"),
    ],
)
def test_bad_lora_settings_are_refused_naming_the_field(
    fields: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError) as info:
        config(**fields)
    assert str(info.value).startswith(message)


def test_an_adapter_name_is_one_to_128_id_characters() -> None:
    for name in ("sql", "org/adapter-v2", "a.b_c:d+e=f@g~h", "x" * 128):
        check_lora_name(name)
    for bad, why in [("", "must not be empty"), ("x" * 129, "longer than 128"),
                     ("tab\there", "character '\\t'"), ("é", "character 'é'")]:  # fmt: skip
        with pytest.raises(ValueError) as info:
            check_lora_name(bad)
        assert why in str(info.value)
