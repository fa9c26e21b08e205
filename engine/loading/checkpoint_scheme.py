"""What a checkpoint's config.json declares about its weights: dense (no
`quantization_config`), FP8 (compressed-tensors `float-quantized`,
engine/loading/fp8_checkpoint.py) or INT8 / INT4 (compressed-tensors `int-quantized` /
`pack-quantized`, engine/loading/int_checkpoint.py; GPTQ INT4,
engine/loading/gptq_checkpoint.py). The checkpoint decides how it loads;
anything else is refused here, before a worker starts, naming the config key and value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.loading.fp8_checkpoint import (
    FLOAT_QUANTIZED,
    QUANT_METHOD,
    WHERE,
    Fp8Scheme,
    quantization_config,
    read_fp8_scheme,
)
from engine.loading.gptq_checkpoint import is_gptq, read_gptq_scheme
from engine.loading.int_checkpoint import INT_FORMATS, IntScheme, read_int_scheme

CheckpointScheme = Fp8Scheme | IntScheme


def read_checkpoint_scheme(raw_config: Mapping[str, Any]) -> CheckpointScheme | None:
    """The quantization scheme config.json declares; None for a dense checkpoint. Raises
    ValueError naming the key of any quantization the engine does not compute."""
    if is_gptq(raw_config):
        return read_gptq_scheme(raw_config)
    qc = quantization_config(raw_config, (
        f"quantized checkpoints load in the {QUANT_METHOD} formats {FLOAT_QUANTIZED!r}, "
        f"{', '.join(map(repr, INT_FORMATS))} and as GPTQ INT4; AWQ checkpoints convert to "
        "them with llm-compressor"
    ))  # fmt: skip
    if qc is None:
        return None
    where = WHERE
    groups = qc["config_groups"]
    formats = {
        (g.get("format") if isinstance(g, Mapping) else None) or qc.get("format")
        for g in groups.values()
    }
    if formats <= set(INT_FORMATS):
        return read_int_scheme(qc, where)
    if formats == {FLOAT_QUANTIZED} or not formats & set(INT_FORMATS):
        return read_fp8_scheme(raw_config)  # it names an unsupported format
    raise ValueError(f"{where}: groups in formats {sorted(map(str, formats))} do not load together")
