"""``strategy="auto"``'s decision over recorded costs: one process, sync or async-ps."""

from __future__ import annotations

import math

import pytest

from dask_train.errors import InvalidInput
from dask_train.policy import CostModel
from dask_train.policy._strategy import choose_strategy, one_process, sync_ranks

#: The digits MLP (64-100-10, batch 128) as the probe measured it on the 2-worker LocalCluster of
#: a 2-core machine: a 0.25 ms gradient, Adam at 5.9 ns a parameter, a 0.64 ms echo.
DIGITS_ON_TWO_CORES = CostModel(
    n_params=7_510, batch_size=128, compute_s=0.00025, update_s_per_param=5.9e-9,
    link_bytes_per_s=2.15e9, message_s=0.00064, hosts=2, cores_per_host=1.0, shared_cores=2.0)

#: A convolutional net on the same machine: 20 ms a batch of gradient, 100k parameters.
CONV_ON_TWO_CORES = DIGITS_ON_TWO_CORES.replace(n_params=100_000, compute_s=0.02)

#: The large MLP (1.1M parameters) on 8 hosts of 4 cores with 10 Gbit/s links and a 2 ms echo:
#: messages cost more than a gradient's 10 ms can hide only with pushes in flight.
LARGE_ON_EIGHT_HOSTS = CostModel(
    n_params=1_100_000, batch_size=128, compute_s=0.01, update_s_per_param=4e-9,
    link_bytes_per_s=1.25e9, message_s=0.002, prefetch=1, hosts=8, cores_per_host=4.0)


def _rates(plan) -> dict[str, float]:
    return {c.name: c.samples_per_s for c in plan.candidates}


def test_a_small_model_on_one_machine_runs_as_one_process() -> None:
    plan = choose_strategy(DIGITS_ON_TWO_CORES, workers=2, sync_workers=2, max_ps=2)
    rates = _rates(plan)
    assert set(rates) == {"one-process", "sync", "async-ps"}
    assert plan.chosen.name == "one-process"
    assert (plan.chosen.strategy, plan.chosen.workers, plan.chosen.ps) == ("sync", 1, 0)
    # One process: a gradient and a local Adam step, nothing sent.
    step = 0.00025 + 5.9e-9 * 7_510
    assert rates["one-process"] == pytest.approx(128 / step)
    # Distributing on the same two cores costs more in messages than the second core gives.
    assert rates["sync"] < rates["one-process"] and rates["async-ps"] < rates["one-process"]
    line = plan.describe()
    assert line.startswith("one-process (strategy='sync', workers=1); predicted one-process")
    assert "sync (2 ranks): " in line and "async-ps (2 trainers, ps=1): " in line
    record = plan.record()
    assert record["chosen"] == "one-process" and record["workers"] == 1
    assert set(record["predicted_samples_per_s"]) == set(rates)


def test_a_small_model_runs_async_ps_when_its_shards_are_in_host_memory() -> None:
    # Trainers of one machine update the shards themselves: no message, only their gradients,
    # their updates and a lock per shard; two cores then beat one process.
    plan = choose_strategy(DIGITS_ON_TWO_CORES, workers=2, sync_workers=2, max_ps=2,
                           host_memory=True)
    rates = _rates(plan)
    assert plan.chosen.name == "async-ps" and (plan.chosen.workers, plan.chosen.ps) == (2, 1)
    assert rates["async-ps"] > 1.1 * rates["one-process"] > rates["sync"]
    # Between hosts there is no shared memory: the messages count again.
    apart = choose_strategy(LARGE_ON_EIGHT_HOSTS, workers=8, sync_workers=8, max_ps=8,
                            host_memory=True)
    assert apart == choose_strategy(LARGE_ON_EIGHT_HOSTS, workers=8, sync_workers=8, max_ps=8)


def test_a_compute_heavy_model_runs_sync_when_async_ps_is_no_faster() -> None:
    plan = choose_strategy(CONV_ON_TWO_CORES, workers=2, sync_workers=2, max_ps=2)
    rates = _rates(plan)
    # Two processes on two cores beat one by far; async-ps is within 10% of sync, so the
    # exact gradients of sync win the near-tie.
    assert rates["sync"] > 1.2 * rates["one-process"]
    assert rates["sync"] >= 0.9 * max(rates.values())
    assert plan.chosen.name == "sync"
    assert (plan.chosen.strategy, plan.chosen.workers, plan.chosen.ps) == ("sync", 2, 0)


def test_many_hosts_with_costly_messages_run_async_ps() -> None:
    plan = choose_strategy(LARGE_ON_EIGHT_HOSTS, workers=8, sync_workers=8, max_ps=8)
    rates = _rates(plan)
    assert plan.chosen.name == "async-ps" and plan.chosen.strategy == "async-ps"
    assert plan.chosen.workers == 8 and 1 <= plan.chosen.ps <= 8
    # Pushes in flight hide the messages behind the gradients; sync waits for each all-reduce.
    assert rates["async-ps"] > 1.1 * rates["sync"] > rates["one-process"]
    # The servers asked for are used as given.
    given = choose_strategy(LARGE_ON_EIGHT_HOSTS, workers=8, sync_workers=8, max_ps=8, ps=2)
    assert next(c for c in given.candidates if c.name == "async-ps").ps == 2


def test_near_ties_go_to_the_simpler_candidate() -> None:
    tie = choose_strategy(CONV_ON_TWO_CORES, workers=2, sync_workers=2, max_ps=2,
                          tolerance=0.0)
    best = max(tie.candidates, key=lambda c: c.samples_per_s)
    assert tie.chosen == best  # no tolerance: the fastest, whichever it is
    loose = choose_strategy(LARGE_ON_EIGHT_HOSTS, workers=8, sync_workers=8, max_ps=8,
                            tolerance=0.99)
    assert loose.chosen.name == "one-process"  # everything is within 99%: the simplest


def test_sync_needs_two_workers_and_a_global_batch_is_split() -> None:
    alone = choose_strategy(CONV_ON_TWO_CORES, workers=2, sync_workers=1, max_ps=1)
    assert [c.name for c in alone.candidates] == ["one-process", "async-ps"]
    # global_batch_size=256: one process takes all 256 rows a step, each of 2 ranks 128.
    split = choose_strategy(CONV_ON_TWO_CORES.replace(batch_size=128), workers=2,
                            sync_workers=2, max_ps=2, global_batch=256)
    by_name = {c.name: c for c in split.candidates}
    assert by_name["one-process"].batch_size == 256 and by_name["sync"].batch_size == 128
    # A gradient's time is taken as proportional to its rows.
    assert by_name["one-process"].samples_per_s == pytest.approx(
        one_process(CONV_ON_TWO_CORES.replace(batch_size=256, compute_s=0.04)).samples_per_s)


def test_sync_is_bounded_by_its_all_reduce_and_by_shared_cores() -> None:
    costs = CONV_ON_TWO_CORES.replace(cpu_s_per_message=0.0)
    two = sync_ranks(costs, workers=2)
    assert two.bottleneck in ("the all-reduce", "cores")
    # More ranks than cores: the cores bound each step.
    many = sync_ranks(costs.replace(hosts=8), workers=8)
    assert many.bottleneck == "cores" and many.samples_per_s < 2 * two.samples_per_s
    assert math.isfinite(many.samples_per_s)


def test_bad_arguments_are_named() -> None:
    with pytest.raises(InvalidInput) as info:
        choose_strategy(DIGITS_ON_TWO_CORES, workers=0, sync_workers=2, max_ps=2, tolerance=1.5)
    text = str(info.value)
    assert "workers=0 is invalid" in text and "tolerance=1.5 is invalid" in text


def test_measured_rates_replace_the_predictions_they_cover() -> None:
    # The digits job as measured on one 2-core machine: one process and async-ps nearly tied,
    # sync behind. Measured rates win over the model's; near-ties still go to the simpler.
    measured = {"one-process": 490_000.0, "sync": 330_000.0, "async-ps": 480_000.0}
    plan = choose_strategy(DIGITS_ON_TWO_CORES, workers=2, sync_workers=2, max_ps=2,
                           host_memory=True, measured=measured)
    assert _rates(plan) == measured
    assert plan.chosen.name == "one-process"
    assert set(plan.record()["bottlenecks"].values()) == {
        "its whole step, measured on this machine"}
    # A clear winner is taken; a candidate not measured keeps its prediction.
    plan = choose_strategy(DIGITS_ON_TWO_CORES, workers=2, sync_workers=2, max_ps=2,
                           host_memory=True, measured={"async-ps": 2e6})
    assert plan.chosen.name == "async-ps" and _rates(plan)["async-ps"] == 2e6
    assert plan.record()["bottlenecks"]["one-process"] == "compute"
    with pytest.raises(InvalidInput, match=r"measured\['sync'\]=nan is invalid"):
        choose_strategy(DIGITS_ON_TWO_CORES, workers=2, sync_workers=2, max_ps=2,
                        measured={"sync": math.nan})
