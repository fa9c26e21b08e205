"""`rebalance_shortfall`: a rebalance on a Ray of fixed size is refused at once when the workers
it would start can never be placed next to those that stay (it waited for the 900 s start
timeout). Workers it stops free their share before new ones start; drained workers that were
not stopped keep theirs."""

from __future__ import annotations

from deploy.control.worker_actors import capacity_shortfall, rebalance_shortfall
from vocabulary.worker_api import ActorPlacement

GPU = ActorPlacement(num_gpus=1.0, num_cpus=1.0)
CPU_SLOT = ActorPlacement()  # half a CPU
FREE = ActorPlacement(num_cpus=0.0)


def test_new_workers_that_fit_next_to_the_staying_ones_are_accepted() -> None:
    staying = [("prefill", GPU), ("decode", GPU)]
    assert rebalance_shortfall(staying, [("decode", GPU)], {"GPU": 3, "CPU": 8}) is None
    # 1P1D -> 0P2D: the prefill worker is stopped first, so its GPU takes the new decode
    assert rebalance_shortfall([("decode", GPU)], [("decode", GPU)], {"GPU": 2, "CPU": 8}) is None
    assert rebalance_shortfall([("decode", FREE)] * 3, [("prefill", FREE)] * 9, {}) is None


def test_a_rebalance_that_starts_nothing_is_never_refused() -> None:
    # even where the staying workers ask more than there is (a node left): nothing to place
    assert rebalance_shortfall([("decode", GPU)] * 3, [], {"GPU": 1, "CPU": 8}) is None


def test_too_many_new_gpu_workers_are_refused_with_what_each_role_asks() -> None:
    why = rebalance_shortfall(
        [("prefill", GPU), ("decode", GPU)], [("prefill", GPU)] * 2, {"GPU": 2, "CPU": 16}
    )
    assert why == (
        "the rebalance would start 2 prefill worker(s); with the 2 staying they need 4 GPU "
        "(decode 1, prefill 3) but this Ray has 2 (a local Ray keeps the resources it started "
        "with): ask for fewer workers (a drained worker that was not stopped keeps its share)"
    )


def test_drained_workers_that_stay_hold_their_share() -> None:
    drained_and_ready = [("decode", GPU), ("decode", GPU)]
    why = rebalance_shortfall(drained_and_ready, [("prefill", GPU)], {"GPU": 2, "CPU": 8})
    assert why is not None
    assert why.startswith(
        "the rebalance would start 1 prefill worker(s); with the 2 staying they need 3 GPU "
        "(decode 2, prefill 1) but this Ray has 2"
    )


def test_cpus_and_custom_resources_count_and_new_roles_are_listed() -> None:
    why = rebalance_shortfall(
        [("decode", CPU_SLOT)] * 2, [("prefill", CPU_SLOT), ("decode", CPU_SLOT)] * 2, {"CPU": 2}
    )
    assert str(why).startswith(
        "the rebalance would start 2 decode, 2 prefill worker(s); with the 2 staying they need "
        "3 CPU (decode 2, prefill 1) but this Ray has 2"
    )
    tagged = ActorPlacement(num_cpus=0.0, resources=(("prefill", 1.0),))
    assert "need 2 prefill (prefill 2) but this Ray has 1" in str(
        rebalance_shortfall([("prefill", tagged)], [("prefill", tagged)], {"CPU": 8, "prefill": 1})
    )


def test_up_check_reads_as_before() -> None:
    # capacity_shortfall now shares the arithmetic; its message is unchanged
    assert capacity_shortfall([("decode", GPU)] * 2, {"GPU": 1, "CPU": 4}) == (
        "the workers need 2 GPU (decode 2) but this Ray has 1: on 1 GPU(s) run colocated "
        "workers (--colocated --decode 1)"
    )
