"""A split engine (prefill and decode loops on one GPU, each in its own SM partition) against a
colocated engine with chunked prefill, at the engine level: goodput under Poisson arrivals,
and the TPOT of running streams while a burst of long prompts arrives.

    python -m benchmarks split_goodput --model DIR --load-format dummy \\
        --workload prefill_heavy --rates 1,2,3,4,6 --modes colocated:2048,split:66
    python -m benchmarks split_goodput --cpu      # the tiny model, a smoke of every path
    python -m benchmarks split_goodput --plot OUT.png --from A.json B.json   # no run: a plot
    python -m benchmarks split_goodput --model DIR --load-format dummy --modes split:0 \\
        --ramp 1:12:60 --json ramp.json     # the split over time while the load ramps
    python -m benchmarks split_goodput --plot-split OUT.png --from ramp.json


Each mode is one engine in this process (no router, no Ray: what the worker's engine thread
runs), fed by a driver that adds each request at its Poisson arrival time and steps the
engine; a request's TTFT runs from its planned arrival to its first token, its TPOT is the
mean gap after that. Prompts are random token ids (no prefix-cache hits), greedy, eos ignored
so output lengths are pinned. Goodput is the highest swept rate at which >= 90 % of requests
meet both SLOs (loadtests/goodput.py); it is printed for each TPOT SLO given.
A mode is `colocated:CHUNK` (max_num_batched_tokens CHUNK) or `split:DECODE_SMS[@TPOT_MS]`
(split_decode_sms; 0: adaptive, vocabulary/split_policy.py, sizing the decode partition for
split_tpot_target_ms, 20 unless @TPOT_MS says: `split:0@40` for the looser SLO).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.table import Table
from engine.config import EngineConfig, EngineMode
from engine.core.engine import LLMEngine
from engine.loading.loaders import load_model
from engine.modeling.llama import LlamaModel
from loadtests.goodput import SLO, max_rate_meeting, summarize
from loadtests.records import RequestRecord
from vocabulary.numeric import percentile
from vocabulary.sampling import SamplingParams
from vocabulary.tokenizer import Tokenizer


@dataclass(frozen=True)
class Workload:
    name: str
    prompt_tokens: int
    output_tokens: int
    ttft_ms: float


WORKLOADS = {
    w.name: w
    for w in (
        Workload("prefill_heavy", 3000, 150, 2000.0),
        Workload("balanced", 1000, 300, 1000.0),
        Workload("decode_heavy", 200, 1000, 1000.0),
        Workload("cpu_smoke", 40, 8, 60_000.0),
    )
}


@dataclass(frozen=True)
class Mode:
    name: str
    """`colocated:CHUNK` or `split:DECODE_SMS`."""

    def engine_config(self, base: EngineConfig) -> EngineConfig:
        kind, _, value = self.name.partition(":")
        if kind == "colocated":
            return replace(base, mode=EngineMode.COLOCATED, max_num_batched_tokens=int(value))
        if kind == "split":
            sms, _, target = value.partition("@")
            config = replace(base, mode=EngineMode.SPLIT, split_decode_sms=int(sms or 0))
            return replace(config, split_tpot_target_ms=float(target)) if target else config
        raise ValueError(f"mode: colocated:CHUNK or split:DECODE_SMS[@TPOT_MS], got {self.name!r}")


def arrivals(rate: float, count: int, seed: int) -> list[float]:
    """Poisson arrival times (s) of `count` requests at `rate` per second."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def ramp_arrivals(start: float, end: float, seconds: float, seed: int) -> list[float]:
    """Arrival times (s) of a Poisson process whose rate goes linearly from `start` to `end`
    per second over `seconds` (thinning a process at the larger rate)."""
    rng, top, t = random.Random(seed), max(start, end), 0.0
    out: list[float] = []
    while True:
        t += rng.expovariate(top)
        if t >= seconds:
            return out
        if rng.random() * top <= start + (end - start) * t / seconds:
            out.append(t)


def ramp(
    engine: LLMEngine, w: Workload, spec: tuple[float, float, float], seed: int, vocab: int
) -> tuple[list[RequestRecord], list[tuple[float, int, int]]]:
    """One run whose arrival rate ramps as `spec` (start, end, seconds): every request's
    record, and the split over time (s from the start, decode SMs, prefill SMs)."""
    rng = random.Random(seed)
    plan = [(at, random_prompt(rng, vocab, w.prompt_tokens), w.output_tokens)
            for at in ramp_arrivals(*spec, seed)]  # fmt: skip
    lane = engine.prefill_lane
    t0 = time.monotonic()
    records = drive(engine, plan, None)
    history = list(lane.streams.history) if lane is not None else []
    before = [h for h in history if h[0] < t0][-1:]  # the split in effect at the start
    split = [(max(0.0, t - t0), d, p) for t, d, p in before + [h for h in history if h[0] >= t0]]
    engine.reset_prefix_cache()
    return records, split


def plot_ramps(paths: list[Path], out: Path) -> None:
    """The SM split over time against the offered rate, and each request's TPOT at its
    arrival, one row per mode that ran a ramp (`--ramp` runs' `--json` files)."""
    from matplotlib.figure import Figure

    runs = []
    for path in paths:
        for mode, data in json.loads(path.read_text())["modes"].items():
            if data.get("ramp"):
                runs.append((mode, data["ramp"]))
    if not runs:
        raise SystemExit("--plot-split: no --ramp run in the --from files")
    fig = Figure(figsize=(10, 3.2 * len(runs)), layout="constrained")
    axes = fig.subplots(len(runs), 2, squeeze=False)
    for (mode, run), (ax_split, ax_tpot) in zip(runs, axes, strict=True):
        start, end, seconds = run["ramp"]
        history = run["history"] + [[seconds, *run["history"][-1][1:]]] if run["history"] else []
        ax_split.step([h[0] for h in history], [h[1] for h in history], where="post",
                      label="decode SMs")  # fmt: skip
        ax_split.step([h[0] for h in history], [h[2] for h in history], where="post",
                      label="prefill SMs")  # fmt: skip
        rate = ax_split.twinx()
        rate.plot([0, seconds], [start, end], color="grey", linestyle=":", label="offered rate")
        rate.set_ylabel("offered req/s")
        ax_split.set_title(f"{mode}: the split during a ramp")
        ax_split.set_xlabel("s since the ramp started")
        ax_split.set_ylabel("SMs")
        ax_split.legend(fontsize="small", loc="upper left")
        recs = [r for r in run["records"] if r["tpot_ms"] is not None]
        ax_tpot.scatter([r["sent_s"] for r in recs], [r["tpot_ms"] for r in recs], s=6)
        ax_tpot.set_title(f"{mode}: TPOT of each request")
        ax_tpot.set_xlabel("arrival (s since the ramp started)")
        ax_tpot.set_ylabel("TPOT (ms)")
        for ax in (ax_split, ax_tpot):
            ax.grid(True, alpha=0.3)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def random_prompt(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def drive(
    engine: LLMEngine, plan: list[tuple[float, list[int], int]], rate: float | None
) -> list[RequestRecord]:
    """Add each planned (arrival s, prompt, max tokens) at its time, step until all finish;
    one record per request."""
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, _, m in plan]
    times: dict[str, list[float]] = {}
    start = time.perf_counter()
    i = 0
    while i < len(plan) or engine.has_unfinished():
        now = time.perf_counter() - start
        while i < len(plan) and plan[i][0] <= now:
            engine.add_request(f"r{i}", plan[i][1], params[i])
            times[f"r{i}"] = []
            i += 1
        if not engine.has_unfinished():
            time.sleep(min(0.001, max(0.0, plan[i][0] - now)) if i < len(plan) else 0.0)
            continue
        for out in engine.step():
            at = time.perf_counter() - start
            times[out.request_id] += [at] * len(out.new_token_ids)
    records = []
    for k, (at, prompt, max_tokens) in enumerate(plan):
        t = times[f"r{k}"]
        records.append(
            RequestRecord(
                request_id=f"r{k}", index=k, sent_s=at, scheduled_s=at,
                prompt_tokens=len(prompt), max_tokens=max_tokens, output_tokens=len(t),
                e2e_ms=(t[-1] - at) * 1e3, ttft_ms=(t[0] - at) * 1e3,
                tpot_ms=(t[-1] - t[0]) / (len(t) - 1) * 1e3 if len(t) > 1 else None,
                offered_rate=rate,
            )
        )  # fmt: skip
    return records


def sweep(
    engine: LLMEngine, w: Workload, rates: list[float], count: int, seed: int, vocab: int
) -> dict[float, list[RequestRecord]]:
    out = {}
    for rate in rates:
        rng = random.Random(seed)
        plan = [
            (at, random_prompt(rng, vocab, w.prompt_tokens), w.output_tokens)
            for at in arrivals(rate, count, seed)
        ]
        out[rate] = drive(engine, plan, rate)
        engine.reset_prefix_cache()
    return out


def burst(
    engine: LLMEngine, w: Workload, streams: int, burst_prompts: int, seed: int, vocab: int
) -> dict[str, float]:
    """TPOT p50/p99 of `streams` running streams (decode-heavy, all started at once), alone
    and while `burst_prompts` prompts of w.prompt_tokens arrive together mid-way."""
    rng = random.Random(seed)
    steady = [(0.0, random_prompt(rng, vocab, 200), 400) for _ in range(streams)]
    big = [(0.5, random_prompt(rng, vocab, w.prompt_tokens), 4) for _ in range(burst_prompts)]
    result = {}
    for label, plan in (("alone", steady), ("burst", steady + big)):
        records = drive(engine, sorted(plan, key=lambda p: p[0]), None)
        tpots = [r.tpot_ms for r in records if r.max_tokens == 400 and r.tpot_ms is not None]
        result[f"tpot_p50_{label}"] = percentile(tpots, 50)
        result[f"tpot_p99_{label}"] = percentile(tpots, 99)
        engine.reset_prefix_cache()
    result["p99_ratio"] = result["tpot_p99_burst"] / result["tpot_p99_alone"]
    return result


def merged_runs(paths: list[Path]) -> tuple[Workload, dict[str, dict[float, list[RequestRecord]]]]:
    """The records of several `--json` files of one workload, by mode and rate (a rate run in
    more than one file: the run with more requests)."""
    workload: Workload | None = None
    modes: dict[str, dict[float, list[RequestRecord]]] = {}
    for path in paths:
        report = json.loads(path.read_text())
        w = Workload(**report["workload"])
        if workload is not None and w != workload:
            raise SystemExit(f"{path}: workload {w.name}, the others {workload.name}")
        workload = w
        for mode, data in report["modes"].items():
            split = data.get("split")
            if split and split.get("partitioned"):
                mode = f"{mode} ({split['decode_sms']} decode / {split['prefill_sms']} prefill SMs)"
            runs = modes.setdefault(mode, {})
            for rate, records in data["records"].items():
                recs = [RequestRecord.from_dict(r) for r in records]
                if len(recs) > len(runs.get(float(rate), [])):
                    runs[float(rate)] = recs
    if workload is None:
        raise SystemExit("--plot needs --from with at least one --json file")
    return workload, modes


def parse_ramp(text: str) -> tuple[float, float, float]:
    try:
        start, end, seconds = (float(x) for x in text.split(":"))
    except ValueError:
        raise SystemExit(f"--ramp: START:END:SECONDS, got {text!r}") from None
    if min(start, end) < 0 or max(start, end) <= 0 or seconds <= 0:
        raise SystemExit(f"--ramp: rates >= 0 (one > 0) and SECONDS > 0, got {text!r}")
    return start, end, seconds


def plot(paths: list[Path], out: Path, tpot_slos: list[float], only: str | None) -> None:
    """Goodput against the TPOT SLO from `--json` files (`only`: these modes, comma-separated)."""
    from loadtests.plots import plot_goodput_against_tpot_slo

    w, modes = merged_runs(paths)
    keep = only.split(",") if only else None
    series = [
        (mode, sorted(runs.items()))
        for mode, runs in modes.items()
        if keep is None or mode.split(" ")[0] in keep
    ]
    title = f"{w.name} ({w.prompt_tokens} in / {w.output_tokens} out)"
    plot_goodput_against_tpot_slo(series, w.ttft_ms, tpot_slos, out, title)
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument(
        "--model", help="checkpoint folder (config.json alone with --load-format dummy)"
    )
    ap.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    ap.add_argument("--workload", default="prefill_heavy", choices=sorted(WORKLOADS))
    ap.add_argument("--modes", default=None, help="default colocated:2048,split:0")
    ap.add_argument("--rates", default="1,2,3,4")
    ap.add_argument("--requests", type=int, default=40, help="requests per rate")
    ap.add_argument("--tpot-slo", default="20,40", help="TPOT SLOs (ms), comma-separated")
    ap.add_argument("--burst", type=int, default=8, help="long prompts in the burst (0: none)")
    ap.add_argument("--burst-streams", type=int, default=32)
    ap.add_argument("--kv-blocks", type=int, default=0, help="0: sized from memory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu", action="store_true", help="the tiny model on CPU (a smoke)")
    ap.add_argument("--json", help="write every record and summary here")
    ap.add_argument("--ramp", default=None, metavar="START:END:SECONDS",
                    help="instead of the sweep: one run whose rate ramps from START to END "
                    "req/s over SECONDS, recording the split over time")  # fmt: skip
    ap.add_argument("--plot", type=Path, help="no run: plot goodput against the TPOT SLO")
    ap.add_argument("--plot-split", type=Path, help="no run: plot --ramp runs' split over time")
    ap.add_argument("--from", dest="sources", nargs="*", type=Path, default=[],
                    help="--json files of one workload to plot")  # fmt: skip
    args = ap.parse_args(argv)
    if args.plot:
        plot(args.sources, args.plot, [float(t) for t in range(8, 42, 2)], args.modes)
        return 0
    if args.plot_split:
        plot_ramps(args.sources, args.plot_split)
        return 0
    ramp_spec = parse_ramp(args.ramp) if args.ramp else None
    args.modes = args.modes or "colocated:2048,split:0"
    if args.cpu:
        from deploy.checkpoints.make_model import cached_tiny_model

        args.model, args.workload = str(cached_tiny_model()), "cpu_smoke"
        args.rates, args.requests, args.burst_streams, args.burst = "4,8", 6, 4, 2
        args.modes = args.modes.replace("2048", "32")
    elif not torch.cuda.is_available():
        print("split_goodput needs a CUDA GPU (or --cpu)", file=sys.stderr)
        return 2
    if not args.model:
        ap.error("--model is required without --cpu")
    device = "cpu" if args.cpu else "cuda"
    base = EngineConfig(
        model_dir=args.model, device=device, dtype="float32" if args.cpu else "bfloat16",
        load_format=args.load_format, num_kv_blocks=args.kv_blocks, enable_prefix_caching=True,
        cuda_graph_max_batch=64, host_kv_gb=0, seed=args.seed,
        attention_backend="torch" if args.cpu else "auto", cuda_graphs=not args.cpu,
    )  # fmt: skip
    w = WORKLOADS[args.workload]
    rates = [float(r) for r in args.rates.split(",")]
    slos = [SLO(ttft_ms=w.ttft_ms, tpot_ms=float(t)) for t in args.tpot_slo.split(",")]
    dtype = torch.float32 if args.cpu else torch.bfloat16
    model: LlamaModel = load_model(args.model, dtype, device, load_format=args.load_format)
    tokenizer = Tokenizer.from_model_dir(args.model)
    report: dict[str, Any] = {"workload": asdict(w), "rates": rates, "modes": {}}
    header = [
        "mode", *[f"goodput @ tpot {s.tpot_ms:g} ms" for s in slos],
        "TPOT p99 alone/burst ms", "ratio", "split (SMs)", "hand-off µs mean/max",
    ]  # fmt: skip
    rows: list[list[str]] = []
    for mode in [Mode(m) for m in args.modes.split(",")]:
        engine = LLMEngine(mode.engine_config(base), model=model, tokenizer=tokenizer)
        vocab = engine.model_config.vocab_size
        if ramp_spec is not None:
            recs, history = ramp(engine, w, ramp_spec, args.seed, vocab)
            report["modes"][mode.name] = {"ramp": {
                "ramp": list(ramp_spec), "records": [asdict(r) for r in recs], "history": history,
            }}  # fmt: skip
            tpots = [r.tpot_ms for r in recs if r.tpot_ms is not None]
            print(f"{mode.name}: ramp {args.ramp}, {len(recs)} requests, "
                  f"{len(history) - 1} resizes, TPOT p50/p90 "
                  f"{percentile(tpots, 50):.1f}/{percentile(tpots, 90):.1f} ms, TTFT p90 "
                  f"{percentile([r.ttft_ms for r in recs if r.ttft_ms is not None], 90):.0f} ms",
                  flush=True)  # fmt: skip
            engine.close()
            continue
        runs = sweep(engine, w, rates, args.requests, args.seed, vocab)
        goodputs = [
            max_rate_meeting([summarize(recs, slo, offered_rate=r) for r, recs in runs.items()])
            for slo in slos
        ]
        bursts = (
            burst(engine, w, args.burst_streams, args.burst, args.seed, vocab) if args.burst else {}
        )
        split = engine.load().split
        report["modes"][mode.name] = {
            "goodput": {s.describe(): g for s, g in zip(slos, goodputs, strict=True)},
            "burst": bursts,
            "split": asdict(split) if split is not None else None,
            "records": {str(r): [asdict(x) for x in recs] for r, recs in runs.items()},
        }
        rows.append([
            mode.name, *[f"{g:g} req/s" if g is not None else "< lowest" for g in goodputs],
            f"{bursts.get('tpot_p99_alone', 0):.1f} / {bursts.get('tpot_p99_burst', 0):.1f}",
            f"{bursts.get('p99_ratio', 0):.2f}",
            f"{split.decode_sms}/{split.prefill_sms}" if split and split.partitioned else "-",
            f"{split.handoff_us_mean:.0f}/{split.handoff_us_max:.0f}" if split else "-",
        ])  # fmt: skip
        print(" | ".join(rows[-1]), flush=True)  # (a run cut short keeps what it measured)
        engine.close()
        del engine
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    if rows:
        print(Table.of(header, rows).render())
    if args.json:
        Path(args.json).write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
