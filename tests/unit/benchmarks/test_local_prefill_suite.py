"""The local-prefill suite's runs: each run's token ids are moved by one shift within the
workload's vocabulary, so lengths, arrivals and the prefixes requests share stay as generated,
and no run's prompts hit the prefix cache another run filled."""

from __future__ import annotations

from benchmarks.suites.local_prefill import shifted
from loadtests.workload import generate, load_profile


def test_a_shifted_run_keeps_its_shape_and_shares_no_prompt_with_the_original() -> None:
    profile = load_profile("mixed")
    planned = generate(profile, rate=4.0, duration_s=20.0, seed=0)
    moved = shifted(planned, 97, profile.vocab_low, profile.vocab_high)
    assert [(p.send_at_s, p.max_tokens, p.after, p.prompt_tokens) for p in moved] == [
        (p.send_at_s, p.max_tokens, p.after, p.prompt_tokens) for p in planned
    ]
    assert all(profile.vocab_low <= t < profile.vocab_high for p in moved for t in p.token_ids)
    assert all(a.token_ids[:16] != b.token_ids[:16] for a, b in zip(planned, moved, strict=True))
    # a later turn still extends the turn it follows
    turns = [(moved[p.after], p) for p in moved if p.after is not None]
    assert turns and all(p.token_ids[: q.prompt_tokens] == q.token_ids for q, p in turns)
