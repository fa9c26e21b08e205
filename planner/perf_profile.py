"""A worker's measured performance, as a data file: what `pdserve profile` writes and
`pdserve simulate` reads (simulator/), and what the router's `cost` local-prefill policy
predicts with (`PerfProfile.prefill_cost_model`, router/prefill_cost.py).

A profile holds engine step times, never a model: prefill step time against the tokens in the
batch (and against a cached prefix, where measured), decode step time against batch size x
context, and the KV hand-off cost. Between grid points the times are interpolated piecewise
linearly; beyond the grid they are extended along the last segment (never below the smallest
measured time). The header says what was measured (model id and shape, dtype, TP, device, the
pdserve and torch versions), so a profile of another model or dtype is refused by name.

Pure and torch-free: JSON in, frozen values out.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from functools import cached_property
from pathlib import Path
from typing import Any

from router.prefill_cost import PrefillCostModel
from vocabulary.numeric import interpolate

FORMAT_VERSION = 1


class PerfProfileError(ValueError):
    """A profile file that does not parse, or one made for another model / dtype / TP."""


def _positive(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise PerfProfileError(f"{name}: must be a number > 0, got {value!r}")


@dataclass(frozen=True)
class ProfileHeader:
    """What was measured, and on what."""

    model_id: str
    """The model's folder name (the engine's model id)."""
    num_layers: int
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype: str
    tensor_parallel_size: int
    device: str
    """`cpu`, or the card's name (torch.cuda.get_device_name)."""
    block_size: int
    """Tokens per KV block."""
    num_kv_blocks: int
    """KV blocks of one worker's pool (the decode pool's capacity in the simulator)."""
    max_num_batched_tokens: int
    """Token budget of one step (prefill chunks at this size)."""
    max_num_seqs: int
    pdserve_version: str
    torch_version: str
    torch_threads: int = 1
    """CPU: intra-op threads the measuring process used (a worker's `torch_threads`)."""


@dataclass(frozen=True)
class PrefillPoint:
    batch_tokens: int
    """Prompt tokens computed in the step."""
    step_s: float
    cached_tokens: int = 0
    """Prompt tokens already in the prefix cache (attended to, not computed)."""

    def __post_init__(self) -> None:
        _positive(self.batch_tokens, "batch_tokens")
        _positive(self.step_s, "step_s")


@dataclass(frozen=True)
class DecodePoint:
    batch_size: int
    context_tokens: int
    """Tokens of context per sequence."""
    step_s: float

    def __post_init__(self) -> None:
        _positive(self.batch_size, "batch_size")
        _positive(self.context_tokens, "context_tokens")
        _positive(self.step_s, "step_s")


@dataclass(frozen=True)
class HandoffCost:
    """Time from a prefill's first token to its request running on the decode worker."""

    fixed_s: float
    per_block_s: float = 0.0
    source: str = ""
    """Measured, or where the constant comes from."""

    def seconds(self, blocks: int) -> float:
        return self.fixed_s + self.per_block_s * blocks


@dataclass(frozen=True)
class ServingOverhead:
    """What serving adds around the engine's steps (the engine alone: the defaults). Given to
    `pdserve profile`, or measured from a real run's records against the profile
    (benchmarks/suites/simulator.py:measure_serving)."""

    request_s: float = 0.0
    """Send → the prompt in a worker's queue, and the first token's way back: client, router
    (validation, Redis lookup, admission, placement), the call to the worker."""
    prefill_factor: float = 1.0
    """A prefill on a serving worker over the profiled step (the worker shares the cores with
    the rest of the cluster; the profile is taken with a core to itself)."""
    decode_step_s: float = 0.0
    """Added to every decode step: the actor's own work per step (outputs onto the token
    channel, KV events), the relay to the client, and its share of the cores."""
    source: str = "engine only"

    def __post_init__(self) -> None:
        if not (self.request_s >= 0 and self.decode_step_s >= 0 and self.prefill_factor > 0):
            raise PerfProfileError(
                "serving: request_s and decode_step_s must be >= 0 and prefill_factor > 0, got "
                f"{self.request_s!r}, {self.decode_step_s!r}, {self.prefill_factor!r}"
            )


@dataclass(frozen=True)
class PerfProfile:
    header: ProfileHeader
    prefill: tuple[PrefillPoint, ...]
    decode: tuple[DecodePoint, ...]
    handoff: HandoffCost
    serving: ServingOverhead = ServingOverhead()

    def __post_init__(self) -> None:
        if not any(p.cached_tokens == 0 for p in self.prefill):
            raise PerfProfileError("prefill: needs points with cached_tokens 0")
        if not self.decode:
            raise PerfProfileError("decode: needs at least one point")

    # ---- lookups -----------------------------------------------------------------------------

    def prefill_step_s(self, batch_tokens: int, cached_tokens: int = 0) -> float:
        """One prefill step computing `batch_tokens` tokens (behind `cached_tokens` cached)."""
        xs, ys, per_cached = self._prefill_table
        base = interpolate(xs, ys, batch_tokens)
        if cached_tokens <= 0 or per_cached is None:
            return base
        return base + per_cached * cached_tokens

    def largest_prefill_tokens(self) -> int:
        """The largest prefill step measured (tokens)."""
        return max(p.batch_tokens for p in self.prefill)

    def decode_step_s(self, batch_size: int, context_tokens: float) -> float:
        """One decode step of `batch_size` sequences of `context_tokens` tokens each."""
        contexts, steps = self.decode_step_curve(batch_size)
        return interpolate(contexts, steps, context_tokens)

    def decode_step_curve(self, batch_size: int) -> tuple[list[int], list[float]]:
        """A decode step's time against context at `batch_size` (context tokens ascending):
        `decode_step_s` interpolates along it (a simulator keeps it per batch size)."""
        contexts, rows = self._decode_table
        return contexts, [interpolate(xs, ys, batch_size) for xs, ys in rows]

    # The lookups' tables, made once per profile (the simulator asks for a step time per
    # simulated step).

    @cached_property
    def _prefill_table(self) -> tuple[list[int], list[float], float | None]:
        """Cold points' (batch tokens, step s), and the extra cost of attending to a cached
        prefix per cached token, averaged over the warm points (None: no warm point)."""
        cold = sorted((p.batch_tokens, p.step_s) for p in self.prefill if p.cached_tokens == 0)
        xs, ys = [x for x, _ in cold], [y for _, y in cold]
        warm = [p for p in self.prefill if p.cached_tokens > 0]
        if not warm:
            return xs, ys, None
        extra = [max(0.0, p.step_s - interpolate(xs, ys, p.batch_tokens)) / p.cached_tokens
                 for p in warm]  # fmt: skip
        return xs, ys, sum(extra) / len(extra)

    @cached_property
    def _decode_table(self) -> tuple[list[int], list[tuple[list[int], list[float]]]]:
        """Context lengths ascending, and for each its (batch sizes, step s) ascending."""
        contexts = sorted({p.context_tokens for p in self.decode})
        rows = []
        for c in contexts:
            row = sorted((p.batch_size, p.step_s) for p in self.decode if p.context_tokens == c)
            rows.append(([b for b, _ in row], [t for _, t in row]))
        return contexts, rows

    def prefill_cost_model(self, source: str = "") -> PrefillCostModel:
        """The step times the router's `cost` local-prefill policy predicts with
        (router/prefill_cost.py), serving overheads applied: the simulator and a router
        given this profile decide alike."""
        xs, ys, per_cached = self._prefill_table
        contexts, rows = self._decode_table
        factor, step_s = self.serving.prefill_factor, self.serving.decode_step_s
        h = self.header
        return PrefillCostModel(
            source=source or f"{h.model_id} {h.dtype} TP{h.tensor_parallel_size} on {h.device}",
            token_budget=h.max_num_batched_tokens,
            prefill_tokens=tuple(xs),
            prefill_s=tuple(y * factor for y in ys),
            prefill_s_per_cached_token=(per_cached or 0.0) * factor,
            decode_contexts=tuple(contexts),
            decode_batches=tuple(tuple(sizes) for sizes, _ in rows),
            decode_s=tuple(tuple(t + step_s for t in steps) for _, steps in rows),
            handoff_fixed_s=self.handoff.fixed_s,
            handoff_per_block_s=self.handoff.per_block_s,
        )

    def prefill_tokens_per_s(self) -> float:
        """Prefill throughput at a full step (admission's throughput prior)."""
        n = self.header.max_num_batched_tokens
        return n / self.prefill_step_s(n)

    # ---- checks and files --------------------------------------------------------------------

    def check_matches(self, **expected: object) -> None:
        """Refuse a profile made for another model, dtype, TP or device: `expected` maps
        header fields to the values wanted (None: any)."""
        for name, want in expected.items():
            if want is None:
                continue
            have = getattr(self.header, name)
            if have != want:
                raise PerfProfileError(
                    f"profile {name}: made for {have!r}, but {want!r} was asked for"
                )

    def to_dict(self) -> dict[str, Any]:
        return {"format_version": FORMAT_VERSION, **asdict(self)}

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")


def _build(cls: type, data: object, where: str) -> Any:
    if not isinstance(data, dict):
        raise PerfProfileError(f"{where}: expected an object, got {data!r}")
    names = {f.name for f in fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise PerfProfileError(f"{where}: unknown fields {sorted(unknown)}")
    try:
        return cls(**data)
    except TypeError as e:
        raise PerfProfileError(f"{where}: {e}") from None


def profile_from_dict(data: object) -> PerfProfile:
    if not isinstance(data, dict):
        raise PerfProfileError("profile: expected a JSON object")
    version = data.get("format_version")
    if version != FORMAT_VERSION:
        raise PerfProfileError(f"format_version: {version!r}, this pdserve reads {FORMAT_VERSION}")
    for key in ("header", "prefill", "decode", "handoff"):
        if key not in data:
            raise PerfProfileError(f"{key}: required")
    for key in ("prefill", "decode"):
        if not isinstance(data[key], list) or not data[key]:
            raise PerfProfileError(f"{key}: expected a non-empty list of points")
    return PerfProfile(
        header=_build(ProfileHeader, data["header"], "header"),
        prefill=tuple(
            _build(PrefillPoint, p, f"prefill[{i}]") for i, p in enumerate(data["prefill"])
        ),
        decode=tuple(_build(DecodePoint, p, f"decode[{i}]") for i, p in enumerate(data["decode"])),
        handoff=_build(HandoffCost, data["handoff"], "handoff"),
        serving=_build(ServingOverhead, data.get("serving", {}), "serving"),
    )


SAME_WORKER_FIELDS = (
    "model_id", "num_layers", "hidden_size", "num_kv_heads", "head_dim", "vocab_size", "dtype",
    "device", "block_size",
)  # fmt: skip
"""Header fields the profiles of one cluster share: one model, dtype, card and KV block size
(their TP sizes, pools and budgets may differ)."""


def check_same_worker(first: PerfProfile, *others: PerfProfile) -> None:
    """Refuse profiles of different models, dtypes, cards or block sizes in one cluster (a
    simulation stepping prefill workers on one and decode workers on another, a plan over
    TP sizes): PerfProfileError naming the first field that differs."""
    for other in others:
        for name in SAME_WORKER_FIELDS:
            mine, theirs = getattr(first.header, name), getattr(other.header, name)
            if mine != theirs:
                raise PerfProfileError(
                    f"profile {name}: one cluster's profiles must agree, got {mine!r} (TP "
                    f"{first.header.tensor_parallel_size}) and {theirs!r} (TP "
                    f"{other.header.tensor_parallel_size})"
                )


def load_perf_profile(path: Path, **expected: object) -> PerfProfile:
    """The profile in `path`, checked against `expected` header fields (see
    `PerfProfile.check_matches`). Raises PerfProfileError with one line naming what is wrong."""
    try:
        text = path.read_text()
    except OSError as e:
        raise PerfProfileError(f"profile: cannot read {path}: {e.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise PerfProfileError(f"profile: {path} is not JSON ({e})") from None
    profile = profile_from_dict(data)
    profile.check_matches(**expected)
    return profile
