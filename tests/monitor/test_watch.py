"""Watching a job as a person would: Prometheus scrapes, the dashboard's Training page in a real
(headless) Chromium, and TensorBoard's own reader on the event files.

One job runs for the whole module on the session's 2-worker LocalCluster (digits, a small MLP,
async-ps with 2 trainers, 1 server, 1 scorer), in a thread, as a notebook user's job would while
they look at it. It trains until the module asks it to stop (a callback; ``StopAfter`` bounds it
in any case), so the live checks see it running whatever the machine's load. Screenshots are kept
under ``test-artifacts/`` (git-ignored).
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.request import urlopen

import pytest
import torch
from _chromium import HEADLINE_JS, POINTS_JS, Chromium
from _tensorboard_read import read_scalars
from distributed import Client
from prometheus_client.parser import text_string_to_metric_families

import dask_train as dt

sys.path.insert(0, str(Path(__file__).parents[1] / "engines"))
from _models import Slow  # noqa: E402

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
WAIT_S = 120.0  # longest wait for anything the job must show (a loaded 2-core machine is slow)


class StopWhenAsked(dt.Callback):
    """Stops the job at its next score once the test asks (callbacks run in this process)."""

    def __init__(self) -> None:
        self.asked = threading.Event()

    def on_score(self, record: Mapping[str, Any]) -> bool | None:
        return self.asked.is_set()


@dataclass
class Job:
    base: str  # the dashboard's address, e.g. http://127.0.0.1:8787
    tensorboard: Path
    stopper: StopWhenAsked
    thread: threading.Thread | None = None
    outcome: dict[str, Any] = field(default_factory=dict)
    job_id: str = ""

    def result(self) -> Any:
        """Ask the job to stop and return its FitResult."""
        self.stopper.asked.set()
        assert self.thread is not None
        self.thread.join(timeout=WAIT_S)
        assert not self.thread.is_alive(), "the job did not stop"
        if "error" in self.outcome:
            raise self.outcome["error"]
        return self.outcome["result"]

    def running_id(self) -> str:
        """The job's id, once /metrics shows it running, both trainers reporting and a score."""
        if self.job_id:
            return self.job_id
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            assert self.thread is not None
            if not self.thread.is_alive():
                self.result()  # raises the job's error
                raise AssertionError("the job ended before the test could watch it")
            values = scrape(self.base)
            for (name, labels), value in values.items():
                if name == "dask_train_running" and value == 1.0:
                    job_id = dict(labels)["job_id"]
                    scored = ("dask_train_score", tuple(sorted((*labels, ("metric", "loss")))))
                    trainers = {dict(lab)["trainer"] for n, lab in values
                                if n == "dask_train_trainer_samples_per_second"
                                and dict(lab)["job_id"] == job_id}
                    # Both trainers reporting and a score in: what a watcher waits to see.
                    if trainers == {"0", "1"} and scored in values:
                        self.job_id = job_id
                        return job_id
            time.sleep(0.5)
        raise AssertionError(f"no running job with samples on {self.base}/metrics in {WAIT_S} s")


def scrape(base: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``/metrics`` as (sample name, sorted labels) -> value."""
    text = urlopen(f"{base}/metrics", timeout=30).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def one(values: Mapping[tuple[str, Any], float], name: str, job_id: str, **labels: str) -> float:
    return values[(name, tuple(sorted({"job_id": job_id, **labels}.items())))]


@pytest.fixture(scope="module")
def job(client: Client, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    X, y = dt.datasets.digits(n_samples=100_000, chunks=25_000, seed=0)
    Xv, yv = dt.datasets.digits_test()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    watched = Job(base=client.dashboard_link.rsplit("/", 1)[0],
                  tensorboard=tmp_path_factory.mktemp("runs") / "exp1", stopper=StopWhenAsked())
    # Epochs it never reaches: the module stops it, StopAfter bounds it. Fifty (5M samples) took
    # under 10 s once training got faster, and the live page then waited 120 s for new scores of
    # a job that had ended. Its batches take 10 ms each (a sleep, not CPU): it runs while the
    # module's tests look at it, and at full speed it took both cores meanwhile.
    trainer = dt.Trainer(
        Slow(net, 0.01), ps=1, workers=2, scorer=1, batch_size=128, epochs=10_000, score_every=0.25,
        stop=[dt.StopAfter(seconds=600)], progress=False, client=client,
        callbacks=[dt.callbacks.TensorBoard(watched.tensorboard), watched.stopper])

    def run() -> None:
        try:
            watched.outcome["result"] = trainer.fit(X, y, validation=(Xv, yv))
        except BaseException as exc:  # handed to the test that asks for the result
            watched.outcome["error"] = exc

    watched.thread = threading.Thread(target=run, name="watched-job", daemon=True)
    watched.thread.start()
    yield watched
    watched.stopper.asked.set()
    watched.thread.join(timeout=WAIT_S)


def test_metrics_count_up_while_the_job_runs(job: Job) -> None:
    job_id = job.running_id()
    first = scrape(job.base)
    time.sleep(2.5)  # the trainers report once a second
    second = scrape(job.base)
    assert one(second, "dask_train_running", job_id) == 1.0
    samples = [one(m, "dask_train_samples_total", job_id) for m in (first, second)]
    assert 0 < samples[0] < samples[1]
    assert one(first, "dask_train_step", job_id) < one(second, "dask_train_step", job_id)
    assert 0.0 < one(second, "dask_train_score", job_id, metric="accuracy") <= 1.0
    assert one(second, "dask_train_score", job_id, metric="loss") > 0.0
    for trainer in ("0", "1"):
        for what in ("data", "servers"):
            assert one(second, "dask_train_trainer_wait_seconds_total", job_id, trainer=trainer,
                       waiting_for=what) >= 0.0
    assert one(second, "dask_train_server_updates_total", job_id, server="0") > 0
    # On the scheduler's own endpoint, beside distributed's metrics.
    assert any(name.startswith("dask_scheduler_") for name, _ in second)


def _counts(value: str) -> dict[str, int]:
    counts: dict[str, int] = json.loads(value)
    return counts


def test_the_training_page_shows_the_live_job(job: Job) -> None:
    job_id = job.running_id()
    status = urlopen(f"{job.base}/status", timeout=30).read().decode()
    assert '<a href="training">Training</a>' in status  # in the dashboard's top menu

    async def look() -> tuple[str, dict[str, int], dict[str, int]]:
        async with Chromium() as browser:
            await browser.goto(f"{job.base}/training")
            await browser.wait_for(HEADLINE_JS, lambda text: job_id in text, timeout=WAIT_S)
            first = _counts(await browser.wait_for(
                POINTS_JS, lambda v: _counts(v).get("src-score-loss", 0) >= 3, timeout=WAIT_S))
            headline = await browser.evaluate(HEADLINE_JS)
            # Live: new scores reach the open page without a reload.
            later = _counts(await browser.wait_for(
                POINTS_JS, lambda v: _counts(v)["src-score-loss"] > first["src-score-loss"],
                timeout=WAIT_S))
            await browser.screenshot(ARTIFACTS / "training-page-live.png")
            return headline, first, later

    headline, first, later = asyncio.run(look())
    assert "running" in headline and "async-ps" in headline
    assert later["src-score-accuracy"] >= 3
    assert (ARTIFACTS / "training-page-live.png").stat().st_size > 20_000


def test_after_the_end_the_page_shows_the_last_job(job: Job) -> None:
    job_id = job.running_id()
    result = job.result()
    n_scores = len(result.history)
    assert n_scores >= 3

    async def look() -> tuple[str, dict[str, int]]:
        async with Chromium() as browser:
            await browser.goto(f"{job.base}/training")
            headline = await browser.wait_for(
                HEADLINE_JS, lambda t: job_id in t and "finished" in t, timeout=WAIT_S)
            # Every score of the history, none lost or doubled on the way to the page.
            points = _counts(await browser.wait_for(
                POINTS_JS, lambda v: _counts(v).get("src-score-loss") == n_scores,
                timeout=WAIT_S))
            await browser.screenshot(ARTIFACTS / "training-page.png")
            return headline, points

    headline, points = asyncio.run(look())
    assert result.stopped_by == "callback"  # the test asked
    assert f"finished: {result.stopped_by}" in headline
    for trainer in (0, 1):
        assert points[f"src-samples-trainer-{trainer}"] >= 1
        assert points[f"src-wait-data-{trainer}"] == points[f"src-wait-servers-{trainer}"] >= 1
    assert points["src-updates-0"] >= 1 and points["src-samples-total"] >= 2
    assert points["src-log"] >= 2  # start and end at least

    values = scrape(job.base)
    assert one(values, "dask_train_running", job_id) == 0.0
    # Every trainer's last report is in: the counter is exactly what the trainers trained.
    assert one(values, "dask_train_samples_total", job_id) == sum(
        t["samples"] for t in result.trainers)


def test_tensorboard_has_the_scores_and_the_trainers_figures(job: Job) -> None:
    result = job.result()
    scalars = read_scalars(job.tensorboard)
    history = result.history
    for metric in ("loss", "accuracy"):
        rows = scalars[f"score/{metric}"]
        assert [step for step, _ in rows] == list(history["step"])
        assert [value for _, value in rows] == pytest.approx(list(history[metric]), rel=1e-6)
    assert scalars["train/epoch"][-1][1] == pytest.approx(history["epoch"].iloc[-1], rel=1e-6)
    for trainer in (0, 1):
        rates = [v for _, v in scalars[f"trainer/{trainer}/samples_per_s"]]
        assert len(rates) >= 2 and max(rates) > 0
        for what in ("wait_data", "wait_servers"):
            fractions = [v for _, v in scalars[f"trainer/{trainer}/{what}"]]
            assert len(fractions) == len(rates) and all(0.0 <= f <= 1.0 for f in fractions)
    assert max(v for _, v in scalars["ps/0/updates_per_s"]) > 0
    steps = [step for step, _ in scalars["trainer/0/samples_per_s"]]
    assert steps == sorted(steps)  # at the job's step as the trainer saw it
