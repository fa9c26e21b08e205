"""Workload profiles and the seeded request generator both load drivers replay.

A profile (YAML under `loadtests/profiles/`, or any path) says what requests look like; the
generator turns (profile, rate, duration, seed) into the exact list of `PlannedRequest`s: send
times and token ids of exact lengths, with `max_tokens` and `ignore_eos` so output lengths are
exact too. Same arguments, same list, on any machine: every random draw comes from
`random.Random` streams seeded by strings (arrivals, lengths and tokens apart, so a longer run
only appends requests).

Kinds: `synthetic` (independent prompts), `shared_prefix` (a few system prompts shared by many
requests), `multi_turn` (each turn's prompt is the previous prompt + a reply + a new user
message; a turn is sent `think_s` after the previous one completes). Conversations are open
(new sessions keep starting over the whole window) or closed (`conversation.sessions`: a fixed
set of sessions that start in the first seconds and keep coming back, so every one of them is
alive at once: the working set the host KV tier is measured on). Arrivals: `poisson`,
`gamma` (burstiness < 1 is burstier, as in vLLM's benchmark), `on_off` bursts, or a
`schedule` (Poisson at a rate that follows a piecewise-linear curve: ramps and bursts).
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
import random
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from loadtests.token_stream import TokenStream


class ProfileError(ValueError):
    """A profile file is missing or malformed (the message names the field)."""


class ProfileKind(enum.Enum):
    SYNTHETIC = "synthetic"
    SHARED_PREFIX = "shared_prefix"
    MULTI_TURN = "multi_turn"


class ArrivalProcess(enum.Enum):
    POISSON = "poisson"
    GAMMA = "gamma"
    ON_OFF = "on_off"
    SCHEDULE = "schedule"


@dataclass(frozen=True)
class LengthDist:
    """Lognormal token counts, clamped to [min, max]."""

    median: float
    sigma: float = 0.0
    min: int = 1
    max: int = 1 << 20

    def __post_init__(self) -> None:
        if not (self.median > 0 and self.sigma >= 0 and 1 <= self.min <= self.max):
            raise ProfileError(f"length: need median > 0, sigma >= 0, 1 <= min <= max: {self}")

    def draw(self, rng: random.Random) -> int:
        value = round(rng.lognormvariate(math.log(self.median), self.sigma))
        return min(self.max, max(self.min, value))


@dataclass(frozen=True)
class Arrival:
    process: ArrivalProcess = ArrivalProcess.POISSON
    burstiness: float = 1.0
    """gamma: shape of the inter-arrival gamma distribution (1 is Poisson)."""
    period_s: float = 10.0
    """on_off: length of one burst + quiet cycle."""
    burst_fraction: float = 0.2
    """on_off: share of each period spent in the burst."""
    burst_multiplier: float = 4.0
    """on_off: burst rate / mean rate; burst_fraction * burst_multiplier must be <= 1."""
    schedule: tuple[tuple[float, float], ...] = ()
    """schedule: (seconds, multiplier of the rate) points, times ascending; the rate at a time
    between two points is interpolated, before the first and after the last it is held."""

    def __post_init__(self) -> None:
        if self.burstiness <= 0 or self.period_s <= 0:
            raise ProfileError("arrival: burstiness and period_s must be > 0")
        if not 0 < self.burst_fraction < 1 or self.burst_multiplier < 1:
            raise ProfileError("arrival: need 0 < burst_fraction < 1 and burst_multiplier >= 1")
        if self.burst_fraction * self.burst_multiplier > 1 + 1e-9:
            raise ProfileError("arrival: burst_fraction * burst_multiplier must be <= 1")
        if self.process is ArrivalProcess.SCHEDULE:
            times = [t for t, _ in self.schedule]
            if not self.schedule or times != sorted(times) or min(m for _, m in self.schedule) < 0:
                raise ProfileError(
                    "arrival.schedule: needs (seconds, multiplier >= 0) points, times ascending"
                )
            if max(m for _, m in self.schedule) <= 0:
                raise ProfileError("arrival.schedule: some multiplier must be > 0")

    def multiplier(self, t: float) -> float:
        """schedule: the rate's multiplier at `t` seconds."""
        points = self.schedule
        if t <= points[0][0]:
            return points[0][1]
        for (t0, m0), (t1, m1) in itertools.pairwise(points):
            if t <= t1:
                return m0 if t1 == t0 else m0 + (m1 - m0) * (t - t0) / (t1 - t0)
        return points[-1][1]


@dataclass(frozen=True)
class SharedPrefix:
    prefix_tokens: int
    """Length of each shared system prompt."""
    num_prefixes: int = 1
    """How many distinct system prompts requests pick from (uniformly)."""


@dataclass(frozen=True)
class Conversation:
    turns_min: int = 2
    turns_max: int = 6
    user_tokens: LengthDist = LengthDist(median=64, sigma=0.5, min=4, max=512)
    """New user message appended at each turn after the first."""
    think_time_s: float = 2.0
    """Mean pause between a reply and the next turn (open sessions; closed ones pause
    `sessions / rate` on average, so that `rate` stays the offered requests/s)."""
    think_time_min_s: float = 0.0
    """Shortest pause: each pause is this plus an exponential draw (whose mean makes up the
    rest of the mean). A floor keeps a session from coming back before the others ran."""
    max_prompt_tokens: int = 3072
    """A conversation ends before a turn whose prompt would exceed this."""
    sessions: int = 0
    """0: open sessions, started by the arrival process at rate / mean turns over the whole
    window. N: closed, exactly N sessions, started evenly over the first `start_window_s`
    (the arrival process is not used), each coming back until its turns or the window end."""
    start_window_s: float = 10.0
    """Closed sessions: the seconds over which their first turns are spread."""

    def __post_init__(self) -> None:
        if not 1 <= self.turns_min <= self.turns_max:
            raise ProfileError("conversation: need 1 <= turns_min <= turns_max")
        if self.think_time_s <= 0 or not 0 <= self.think_time_min_s < self.think_time_s:
            raise ProfileError("conversation: need 0 <= think_time_min_s < think_time_s")
        if self.sessions < 0 or self.start_window_s < 0:
            raise ProfileError("conversation: sessions and start_window_s must be >= 0")


@dataclass(frozen=True)
class Profile:
    name: str
    kind: ProfileKind
    prompt_tokens: LengthDist
    """Synthetic: the prompt; shared_prefix: the part after the prefix; multi_turn: turn 1."""
    output_tokens: LengthDist
    description: str = ""
    arrival: Arrival = Arrival()
    vocab_low: int = 10
    vocab_high: int = 500
    """Token ids are drawn uniformly from [vocab_low, vocab_high)."""
    temperature: float = 0.0
    tenant: str = ""
    shared_prefix: SharedPrefix | None = None
    conversation: Conversation | None = None
    rate: float = 1.0
    """Default requests/s when the command line gives none."""
    duration_s: float = 60.0
    """Default length of the arrival window."""
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.vocab_low < self.vocab_high:
            raise ProfileError("vocab: need 0 <= low < high")
        if self.kind is ProfileKind.SHARED_PREFIX and self.shared_prefix is None:
            raise ProfileError("shared_prefix: required for kind shared_prefix")
        if self.kind is ProfileKind.MULTI_TURN and self.conversation is None:
            raise ProfileError("conversation: required for kind multi_turn")


@dataclass(frozen=True)
class PlannedRequest:
    """One request of a workload, known before the run starts."""

    index: int
    request_id: str
    send_at_s: float
    """Offset from the start of the run (a lower bound when `after` is set)."""
    token_ids: tuple[int, ...]
    max_tokens: int
    ignore_eos: bool = True
    temperature: float = 0.0
    tenant: str = ""
    conversation: int | None = None
    turn: int = 0
    after: int | None = None
    """Index of the previous turn: send only once it completed, plus `think_s`."""
    think_s: float = 0.0

    @property
    def prompt_tokens(self) -> int:
        return len(self.token_ids)


# -- profiles ----------------------------------------------------------------------------------


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ProfileError(f"{where}: expected a mapping, got {data!r}")
    try:
        return cls(**data)
    except TypeError as e:
        raise ProfileError(f"{where}: {e}") from e


def profile_from_dict(data: dict[str, Any]) -> Profile:
    values = dict(data)
    try:
        values["kind"] = ProfileKind(values.get("kind", "synthetic"))
    except ValueError as e:
        raise ProfileError(f"kind: {e}") from e
    vocab = values.pop("vocab", None)
    if vocab is not None:
        values["vocab_low"], values["vocab_high"] = int(vocab["low"]), int(vocab["high"])
    for key in ("prompt_tokens", "output_tokens"):
        if key not in values:
            raise ProfileError(f"{key}: required")
        values[key] = _build(LengthDist, values[key], key)
    if "arrival" in values:
        arrival = dict(values["arrival"])
        try:
            arrival["process"] = ArrivalProcess(arrival.get("process", "poisson"))
        except ValueError as e:
            raise ProfileError(f"arrival.process: {e}") from e
        if "schedule" in arrival:
            try:
                arrival["schedule"] = tuple((float(t), float(m)) for t, m in arrival["schedule"])
            except (TypeError, ValueError) as e:
                raise ProfileError(f"arrival.schedule: pairs of numbers ({e})") from e
        values["arrival"] = _build(Arrival, arrival, "arrival")
    if "shared_prefix" in values:
        values["shared_prefix"] = _build(SharedPrefix, values["shared_prefix"], "shared_prefix")
    if "conversation" in values:
        conversation = dict(values["conversation"])
        if "user_tokens" in conversation:
            conversation["user_tokens"] = _build(
                LengthDist, conversation["user_tokens"], "conversation.user_tokens"
            )
        values["conversation"] = _build(Conversation, conversation, "conversation")
    return _build(Profile, values, "profile")


def profile_names() -> list[str]:
    """Profiles shipped with the package."""
    folder = resources.files("loadtests") / "profiles"
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def load_profile(name_or_path: str | Path) -> Profile:
    """A shipped profile by name (`synthetic`), or a YAML file by path."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.exists():
            raise ProfileError(f"profile: no such file {path}")
        text = path.read_text()
    else:
        resource = resources.files("loadtests") / "profiles" / f"{name_or_path}.yaml"
        if not resource.is_file():
            known = ", ".join(profile_names())
            raise ProfileError(f"profile: unknown {name_or_path!r} (shipped: {known})")
        text = resource.read_text()
    data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ProfileError(f"profile: {name_or_path} is not a YAML mapping")
    return profile_from_dict(data)


# -- generation --------------------------------------------------------------------------------


def arrival_times(
    arrival: Arrival, rate: float, duration_s: float, rng: random.Random
) -> list[float]:
    """Send offsets in [0, duration_s) of a process with mean `rate` requests/s."""
    return list(iter_arrivals(arrival, rate, duration_s, rng))


def iter_arrivals(
    arrival: Arrival, rate: float, duration_s: float, rng: random.Random
) -> Iterator[float]:
    """`arrival_times`, one at a time (the draws made as they are pulled)."""
    if rate <= 0:
        raise ValueError(f"rate: must be > 0, got {rate}")
    return _arrivals(arrival, rate, duration_s, rng)


def _arrivals(
    arrival: Arrival, rate: float, duration_s: float, rng: random.Random
) -> Iterator[float]:
    t = 0.0
    if arrival.process is ArrivalProcess.SCHEDULE:  # thinning at the schedule's peak
        peak = rate * max(m for _, m in arrival.schedule)
        while True:
            t += rng.expovariate(peak)
            if t >= duration_s:
                return
            if rng.random() * peak < rate * arrival.multiplier(t):
                yield t
    if arrival.process is ArrivalProcess.ON_OFF:
        high = rate * arrival.burst_multiplier
        burst_s = arrival.period_s * arrival.burst_fraction
        low = rate * (1 - arrival.burst_fraction * arrival.burst_multiplier)
        low /= 1 - arrival.burst_fraction
        while True:
            phase = t % arrival.period_s
            in_burst = phase < burst_s
            current = high if in_burst else low
            boundary = t - phase + (burst_s if in_burst else arrival.period_s)
            step = rng.expovariate(current) if current > 0 else math.inf
            if t + step >= boundary:  # memoryless: restart the draw at the phase boundary
                t = boundary
            else:
                t += step
                if t < duration_s:
                    yield t
            if t >= duration_s:
                return
    while True:
        if arrival.process is ArrivalProcess.GAMMA:
            t += rng.gammavariate(arrival.burstiness, 1.0 / (rate * arrival.burstiness))
        else:
            t += rng.expovariate(rate)
        if t >= duration_s:
            return
        yield t


@dataclass(frozen=True)
class Shard:
    """The part of a workload one shard of a sharded simulation serves (simulator/shards.py):
    of the requests in send order every `count`-th from the `index`-th; of a conversational
    workload every `count`-th conversation, whole (its turns share their prefixes)."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"shard: need 0 <= index < count, got {self.index} of {self.count}")


def generate(
    profile: Profile,
    *,
    rate: float | None = None,
    duration_s: float | None = None,
    seed: int | None = None,
    num_requests: int | None = None,
) -> list[PlannedRequest]:
    """The workload's requests in send order. Pure: same arguments, same list (`stream` yields
    the same requests one by one)."""
    rate, duration_s, seed = _defaults(profile, rate, duration_s, seed)
    made = _Draws(profile, seed)
    if profile.kind is ProfileKind.MULTI_TURN:
        turns = _conversations(profile, rate, duration_s, made, None)
        planned = [p for _, conversation in turns for _, p in conversation if p is not None]
    else:
        planned = [p for p in _independent(profile, rate, duration_s, made, None) if p]
    # Final ids and indices in send order; `after` is remapped from generation order (a turn
    # always sorts after the one it follows, so truncating keeps every `after` target).
    order = sorted(range(len(planned)), key=lambda i: (planned[i].send_at_s, i))
    if num_requests is not None:
        order = order[:num_requests]
    new_index = {old: new for new, old in enumerate(order)}
    result = []
    for new, old in enumerate(order):
        p = planned[old]
        after = None if p.after is None else new_index.get(p.after)
        result.append(replace(p, index=new, request_id=f"{profile.name}-{seed}-{new}", after=after))
    return result


def stream(
    profile: Profile,
    *,
    rate: float | None = None,
    duration_s: float | None = None,
    seed: int | None = None,
    num_requests: int | None = None,
    shard: Shard | None = None,
) -> Iterator[PlannedRequest]:
    """`generate`'s requests, in its order, made as they are pulled: memory holds the
    requests not yet pulled of the conversations under way, not the workload. With `shard`,
    only that shard's requests (their indices and ids the whole workload's; the others'
    token ids never made)."""
    rate, duration_s, seed = _defaults(profile, rate, duration_s, seed)
    made = _Draws(profile, seed)
    indexed: Iterator[PlannedRequest | None]
    if profile.kind is ProfileKind.MULTI_TURN:
        conversations = _conversations(profile, rate, duration_s, made, shard)
        indexed = _merge_turns(conversations, f"{profile.name}-{seed}")
    else:
        indexed = _independent(profile, rate, duration_s, made, shard)
    if num_requests is not None:
        indexed = itertools.islice(indexed, num_requests)
    return (p for p in indexed if p is not None)


def _defaults(
    profile: Profile, rate: float | None, duration_s: float | None, seed: int | None
) -> tuple[float, float, int]:
    return (
        profile.rate if rate is None else rate,
        profile.duration_s if duration_s is None else duration_s,
        profile.seed if seed is None else seed,
    )


class _Draws:
    """The workload's three random streams (arrivals, lengths and tokens apart, so a longer
    run only appends requests), seeded by strings."""

    def __init__(self, profile: Profile, seed: int) -> None:
        key = f"{profile.name}:{seed}"
        self.name = f"{profile.name}-{seed}"
        self.arrivals = random.Random(f"{key}:arrivals")
        self.lengths = random.Random(f"{key}:lengths")
        self.tokens = TokenStream(f"{key}:tokens", profile.vocab_low, profile.vocab_high)


def _independent(
    profile: Profile, rate: float, duration_s: float, made: _Draws, keep: Shard | None
) -> Iterator[PlannedRequest | None]:
    """Synthetic and shared-prefix requests in send order (arrivals are increasing), final
    indices and ids; None for a request `keep` leaves to another shard."""
    tokens, lengths = made.tokens, made.lengths
    prefixes: list[tuple[int, ...]] = []
    if profile.shared_prefix is not None:
        sp = profile.shared_prefix
        prefixes = [tokens.take(sp.prefix_tokens) for _ in range(sp.num_prefixes)]
    arrivals = iter_arrivals(profile.arrival, rate, duration_s, made.arrivals)
    for index, at in enumerate(arrivals):
        n = profile.prompt_tokens.draw(lengths)
        kept = keep is None or index % keep.count == keep.index
        if kept:
            prompt = tokens.take(n)
        else:
            tokens.skip(n)
            prompt = ()
        if prefixes:
            prompt = prefixes[int(lengths.random() * len(prefixes))] + prompt
        out = profile.output_tokens.draw(lengths)
        if not kept:
            yield None
            continue
        yield PlannedRequest(
            index=index,
            request_id=f"{made.name}-{index}",
            send_at_s=at,
            token_ids=prompt,
            max_tokens=out,
            temperature=profile.temperature,
            tenant=profile.tenant,
        )


Turn = tuple[float, "PlannedRequest | None"]
"""A turn's send time and the turn (None: another shard's)."""


def _conversations(
    profile: Profile, rate: float, duration_s: float, made: _Draws, keep: Shard | None
) -> Iterator[tuple[float, list[Turn]]]:
    """Each conversation's start and turns, in start order. A turn's `index` and `after` are
    its and its previous turn's places in generation order (`generate` and `_merge_turns`
    make them send order); a conversation `keep` leaves to another shard has its turns'
    lengths and times drawn, as the streams need, but not their token ids."""
    conv = profile.conversation
    assert conv is not None
    tokens, lengths = made.tokens, made.lengths
    mean_turns = (conv.turns_min + conv.turns_max) / 2
    if conv.sessions:  # closed: N sessions, all alive at once
        starts = array("d", (i * conv.start_window_s / conv.sessions
                             for i in range(conv.sessions)))  # fmt: skip
        mean_think = conv.sessions / rate
    else:  # every start is drawn before the first think time, as the streams were always drawn
        starts = array("d", iter_arrivals(profile.arrival, rate / mean_turns, duration_s,
                                          made.arrivals))  # fmt: skip
        mean_think = conv.think_time_s
    floor = conv.think_time_min_s
    rest = mean_think - floor  # the exponential part's mean (none when the floor is longer)
    made_turns = 0
    for number, start in enumerate(starts):
        kept = keep is None or number % keep.count == keep.index

        def draw(n: int, kept: bool = kept) -> tuple[int, ...]:
            if kept:
                return tokens.take(n)
            tokens.skip(n)
            return ()

        turns = conv.turns_min + int(lengths.random() * (conv.turns_max - conv.turns_min + 1))
        length = profile.prompt_tokens.draw(lengths)
        prompt = draw(length)
        at, previous, think = start, None, 0.0
        mine: list[Turn] = []
        for turn in range(turns):
            if length > conv.max_prompt_tokens or at >= duration_s:
                break
            out = profile.output_tokens.draw(lengths)
            planned = None
            if kept:
                planned = PlannedRequest(
                    index=made_turns,
                    request_id="",
                    send_at_s=at,
                    token_ids=prompt,
                    max_tokens=out,
                    temperature=profile.temperature,
                    tenant=profile.tenant,
                    conversation=number,
                    turn=turn,
                    after=previous,
                    think_s=think,
                )
            mine.append((at, planned))
            previous = made_turns
            made_turns += 1
            # The next turn extends this one: prompt + a reply of the output length + a new
            # user message. The reply is synthetic so the whole sequence is known up front;
            # the server caches the real one, so the cache hit is this turn's prompt.
            reply = draw(out)
            user = conv.user_tokens.draw(lengths)
            prompt = prompt + reply + draw(user)
            length += out + user
            think = floor + (made.arrivals.expovariate(1.0 / rest) if rest > 0 else 0.0)
            at = at + think
        yield start, mine


def _merge_turns(
    conversations: Iterator[tuple[float, list[Turn]]], name: str
) -> Iterator[PlannedRequest | None]:
    """The turns of conversations (in start order) in send order, as `generate` sorts them
    (by time, then generation order), with final indices, ids and `after`. A turn is out
    once the next conversation starts at or after it: every later turn sorts after it."""
    heap: list[tuple[float, int, bool, PlannedRequest | None]] = []
    new_index: dict[int, int] = {}
    """A turn's generation index → its final one, until its next turn is out."""
    out = 0
    made = 0

    def emit() -> PlannedRequest | None:
        nonlocal out
        _, gen, last, p = heapq.heappop(heap)
        index, out = out, out + 1
        if p is None:
            return None
        if not last:
            new_index[gen] = index
        after = None if p.after is None else new_index.pop(p.after)
        return replace(p, index=index, request_id=f"{name}-{index}", after=after)

    for start, turns in conversations:
        while heap and heap[0][0] <= start:
            yield emit()
        for k, (at, p) in enumerate(turns):
            heapq.heappush(heap, (at, made, k == len(turns) - 1, p))
            made += 1
    while heap:
        yield emit()
