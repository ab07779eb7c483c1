"""``resources=`` on ``dt.run`` and ``Trainer``: trainers and ranks only on the Dask workers that
declare the resource, holding it while they run; refused before any work when too few have it.

One module cluster of CPU workers, two started as ``dask worker --resources GPU=1`` starts them
(``Nanny(resources={"GPU": 1})``) beside one without: where each role ran is read from the
workers' own addresses (the ranks' returns, ``result.roles``), not from the placement's plan.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from distributed import Client, Event, LocalCluster, Nanny, get_worker

import dask_train as dt
from dask_train.data._cluster import live_workers
from dask_train.errors import InvalidInput

GPU = {"GPU": 1}


@pytest.fixture(scope="module")
def client() -> Iterator[Client]:
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster:
        spec = cluster.new_worker_spec()
        [(_, plain)] = spec.items()
        for i in range(2):
            cluster.worker_spec[f"gpu-{i}"] = {
                "cls": Nanny, "options": {**plain["options"], "resources": dict(GPU)}}
        cluster.sync(cluster._correct_state)
        with Client(cluster) as client:
            client.wait_for_workers(3, timeout=60)
            yield client


def gpu_workers(client: Client) -> set[str]:
    return {a for a, w in live_workers(client).items() if w.get("resources", {}).get("GPU")}


def data(n: int = 2_000) -> tuple[object, object]:
    X, y = dt.datasets.digits(n_samples=n)
    return X.rechunk(250), y.rechunk(250)


def where_am_i(ctx, hold_s: float = 0.0):
    """A rank's worker, and what its worker has left of GPU while the rank runs."""
    for _ in ctx.epochs(1):
        for _xb, _yb in ctx.batches():
            time.sleep(hold_s)
        ctx.report({"rank": float(ctx.rank)}, checkpoint={"step": torch.zeros(1)})
    worker = get_worker()
    return {"address": worker.address,
            "free": dict(worker.state.available_resources)}


def test_run_puts_every_rank_on_a_worker_with_the_resource_holding_it(client):
    gpus = gpu_workers(client)
    assert len(gpus) == 2 and len(live_workers(client)) == 3
    # workers=None is every worker: without resources= the plain worker would get a rank.
    result = dt.run(where_am_i, workers=None, resources=GPU, client=client,
                    data={"train": data()}, timeout=60)
    assert {r["address"] for r in result.returns} == gpus
    # Each rank's task holds its worker's GPU while it runs: another job's would wait for it.
    assert all(r["free"] == {"GPU": 0.0} for r in result.returns)


def test_trainer_puts_trainers_and_ranks_on_them_and_servers_beside(client):
    X, y = data()
    Xv, yv = dt.datasets.digits(n_samples=200, seed=3)
    gpus = gpu_workers(client)
    plain = set(live_workers(client)) - gpus
    net = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10))
    for strategy in ("async-ps", "sync"):
        trainer = dt.Trainer(net, strategy=strategy, ps=1, workers=2, resources=GPU,
                             batch_size=64, progress=False, client=client, timeout=60)
        result = trainer.fit(X, y, validation=(np.asarray(Xv), np.asarray(yv)))
        assert set(result.roles["trainer"]) == gpus, strategy
        # The scorer (and async-ps's server) hold no GPU: placed on the least-loaded worker,
        # the one without a trainer.
        assert set(result.roles["scorer"]) == plain, strategy
        if strategy == "async-ps":
            assert set(result.roles["ps"]) == plain
        assert result.steps > 0


def _gpus_free(client: Client, timeout: float = 30.0) -> None:
    """Wait until no task holds a GPU slot: an earlier test's role task keeps its worker's slot
    until its thread returns, a moment after its job ended (the refusal counts free room)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        used = client.run_on_scheduler(lambda dask_scheduler: [
            dict(ws.used_resources) for ws in dask_scheduler.workers.values()])
        if all(not any(u.values()) for u in used):
            return
        time.sleep(0.2)
    raise AssertionError(f"GPU slots still held after {timeout:g} s: {used}")


def test_too_few_workers_with_the_resource_is_refused_before_any_work(client):
    _gpus_free(client)
    gpus = gpu_workers(client)
    X, y = data(500)
    net = torch.nn.Linear(64, 10)
    before = client.run_on_scheduler(_keys)
    with pytest.raises(InvalidInput) as sync:
        dt.Trainer(net, strategy="sync", workers=3, resources=GPU, client=client,
                   progress=False).fit(X, y)
    with pytest.raises(InvalidInput) as ranks:
        dt.run(where_am_i, workers=3, resources=GPU, client=client, timeout=1)
    with pytest.raises(InvalidInput) as unknown:
        dt.Trainer(net, workers=1, resources={"TPU": 1}, client=client, progress=False).fit(X, y)
    after = client.run_on_scheduler(_keys)
    for info in (sync, ranks):
        message = str(info.value)
        assert "resources={'GPU': 1}" in message and "room for 2" in message
        assert all(address in message for address in gpus)
        assert "dask worker --resources GPU=1" in message
    assert "room for 0" in str(unknown.value) and "TPU=1" in str(unknown.value)
    assert after <= before  # nothing was submitted, data included


def _keys(dask_scheduler=None) -> set[str]:
    # The keys the scheduler holds (an earlier test's may still be going: compare for new ones).
    return {str(k) for k in dask_scheduler.tasks}


@pytest.mark.parametrize("value, said", [
    ({"GPU": 0}, "GPU=0 is not a finite number > 0"),
    ({"GPU": -1}, "GPU=-1 is not a finite number > 0"),
    ("GPU=1", "resources='GPU=1' is invalid"),
    ({"GPU": "1"}, "GPU='1' is not a finite number > 0"),
])
def test_bad_values_name_the_parameter_and_the_fix(client, value, said):
    with pytest.raises(InvalidInput) as run:
        dt.run(where_am_i, resources=value, client=client)
    with pytest.raises(InvalidInput) as fit:
        dt.Trainer(torch.nn.Linear(64, 10), resources=value, client=client).fit(*data(500))
    for info in (run, fit):
        assert said in str(info.value) and "resources={'GPU': 1}" in str(info.value)


def test_slots_held_by_another_job_are_refused_naming_them(client):
    gpus = gpu_workers(client)
    started = time.monotonic()
    # Tasks that hold each GPU until told: a cancelled task's thread runs on to its end.
    release = Event(f"release-{time.monotonic_ns()}", client=client)
    holders = [client.submit(_hold, release.name, resources=GPU, workers=[a], pure=False)
               for a in sorted(gpus)]
    try:
        while client.run_on_scheduler(_used) < 2 and time.monotonic() - started < 30:
            time.sleep(0.05)
        with pytest.raises(InvalidInput) as info:
            dt.run(where_am_i, workers=1, resources=GPU, client=client, timeout=5)
    finally:
        release.set()
        client.gather(holders)
    message = str(info.value)
    assert "tasks running now hold them" in message and "0 are free" in message
    assert all(address in message for address in gpus)


def _hold(name: str) -> bool:
    return Event(name).wait(30)


def _used(dask_scheduler=None) -> float:
    return sum(ws.used_resources.get("GPU", 0) for ws in dask_scheduler.workers.values())


class AtFirstScore(dt.Callback):
    """Does ``act()`` once, at the job's first score (a rank's first report)."""

    def __init__(self, act) -> None:
        self.act, self.done = act, False

    def on_score(self, record):
        if not self.done:
            self.done = True
            self.act()


def test_a_lost_rank_is_replaced_only_on_a_worker_with_the_resource(client, tmp_path):
    gpus = gpu_workers(client)
    plain = set(live_workers(client)) - gpus
    pids = client.run(os.getpid)
    victim = sorted(gpus)[1]

    # Two epochs' reports, the first one's kill: the next generation is placed on the
    # workers with GPU there are then (the survivor, and the victim's nanny's new worker if it
    # is back), never on the plain worker, which is idle and would be every worker's choice.
    kill = AtFirstScore(lambda: os.kill(pids[victim], signal.SIGKILL))
    result = dt.run(_reports, config={"epochs": 2}, workers=None, resources=GPU, client=client,
                    data={"train": data()}, callbacks=[kill], timeout=60,
                    checkpoint=dt.CheckpointConfig(tmp_path / "ck"))
    assert result.generations == 2 and result.failures[0]["worker"] == victim
    ranks = {r["address"] for r in result.returns}
    assert ranks and not ranks & plain and victim not in ranks
    assert ranks <= gpu_workers(client)
    client.wait_for_workers(3, timeout=60)


def test_search_reserves_each_trial_only_workers_with_the_resource(client):
    X, y = data()
    Xv, yv = dt.datasets.digits(n_samples=200, seed=3)
    gpus = gpu_workers(client)
    net = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10))
    trainer = dt.Trainer(net, workers=1, ps=1, resources=GPU, batch_size=64, timeout=60)
    # Two trials at once need two gangs of one worker: the two GPU workers, never the plain one.
    result = dt.search(trainer, {"lr": [1e-3, 3e-3]}, X, y, validation=(np.asarray(Xv),
                       np.asarray(yv)), n_trials=2, max_concurrent=2, pruner=None, timeout=60,
                       progress=False, client=client)
    assert list(result.trials["state"]) == ["complete", "complete"]
    assert {w for r in result.records for w in r.workers} == gpus
    with pytest.raises(InvalidInput, match="each trial's gang needs 1 trainer"):
        dt.search(dt.Trainer(net, workers=1, resources={"TPU": 1}), {"lr": [1e-3]}, X, y,
                  validation=(np.asarray(Xv), np.asarray(yv)), n_trials=1, progress=False,
                  client=client)


def test_async_ps_with_every_worker_never_takes_in_one_without_the_resource(client):
    # workers=None takes in every worker that is there and joins (the controller offers the job
    # each live worker at every check): the plain worker, there all along, must be left out.
    X, y = dt.datasets.digits(n_samples=6_000)
    gpus = gpu_workers(client)
    net = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10))
    # Stopped by time, not by its data: every second's check offers it the plain worker.
    result = dt.Trainer(net, strategy="async-ps", workers=None, ps=1, resources=GPU, epochs=1000,
                        batch_size=32, stop=[dt.StopAfter(seconds=3)], progress=False,
                        client=client, timeout=60).fit(X.rechunk(500), y.rechunk(500))
    assert result.stopped_by.startswith("StopAfter")
    assert sorted(result.roles["trainer"]) == sorted(gpus)


def test_an_array_model_with_resources_is_refused():
    from dask_train.models._array import ArrayModel

    model = ArrayModel(params=np.zeros(2), loss_grad=lambda p, X, y: (0.0, np.zeros_like(p)))
    with pytest.raises(InvalidInput, match="an ArrayModel's groups run on every worker"):
        dt.Trainer(model, resources=GPU, progress=False).fit(np.zeros((8, 2)), np.zeros(8))


def test_a_retiring_ranks_hand_over_goes_only_to_workers_with_the_resource(client, tmp_path):
    gpus = gpu_workers(client)
    victim = sorted(gpus)[0]

    retire = AtFirstScore(lambda: client.retire_workers([victim]))
    try:
        result = dt.run(_reports, config={"epochs": 6}, workers=None, resources=GPU,
                        client=client, data={"train": data()}, callbacks=[retire], timeout=60)
        [departure] = result.departures
        assert departure["workers"] == [victim] and result.failures == []
        # The generation after the hand-over: the other GPU worker alone, not the plain one.
        assert {r["address"] for r in result.returns} == gpus - {victim}
    finally:  # the module's cluster gets its second GPU worker back
        cluster = client.cluster
        [(_, plain)] = cluster.new_worker_spec().items()
        cluster.worker_spec[f"gpu-{time.monotonic_ns()}"] = {
            "cls": Nanny, "options": {**plain["options"], "resources": dict(GPU)}}
        cluster.sync(cluster._correct_state)
        client.wait_for_workers(3, timeout=60)


def _reports(ctx, epochs: int):
    for epoch in ctx.epochs(epochs):
        for _xb, _yb in ctx.batches():
            time.sleep(0.01)
        ctx.report({"my_epoch": float(epoch)}, checkpoint={"epoch": torch.tensor([epoch])})
    return {"address": get_worker().address}


def test_launch_puts_every_rank_on_a_worker_with_the_resource(client, tmp_path):
    script = tmp_path / "rank.py"
    script.write_text("import os\nprint('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'])\n")
    _gpus_free(client)
    result = dt.launch(script, workers=None, resources=GPU, client=client, echo=False,
                       log_dir=tmp_path / "run", timeout=60)
    assert result.exit_code == 0, result.failure
    # workers=None is every worker: without resources= the plain worker would run a rank.
    assert {r["worker"] for r in result.ranks} == gpu_workers(client)
    with pytest.raises(InvalidInput, match="room for 2") as refused:
        dt.launch(script, workers=3, resources=GPU, client=client, echo=False,
                  log_dir=tmp_path / "refused", timeout=5)
    assert "dask worker --resources GPU=1" in str(refused.value)
