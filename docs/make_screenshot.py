"""Regenerate ``docs/training-page.png``: the dashboard's Training page after a digits job.

Runs a job on an embedded cluster (async-ps: 2 trainers, 1 server, 1 scorer; an MLP 64-100-10 on
the augmented digits), with a TensorBoard callback as a user would add it, kills the worker
process of a trainer that holds no parameter server midway (so the page shows a failure and the
job going on), then opens ``<dashboard>/training`` in headless Chromium (Debian's ``chromium``
package) and saves the page.

    python docs/make_screenshot.py [--seconds 30] [--kill-after 12] [--out docs/training-page.png]
"""

from __future__ import annotations

import argparse
import asyncio
import html
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "monitor"))  # the DevTools driver the tests use

from _chromium import HEADLINE_JS, POINTS_JS, Chromium  # noqa: E402

import dask_train as dt  # noqa: E402


class Timed(dt.Callback):
    """Training time, counted from the first score (start-up time varies a lot with the load)."""

    first: float | None = None

    def trained_s(self, record: Any) -> float:
        if self.first is None:
            self.first = float(record["time_s"])
        return float(record["time_s"]) - self.first


class TrainFor(Timed):
    """Stops the job after ``seconds`` of training."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_score(self, record: Any) -> bool | None:
        return self.trained_s(record) >= self.seconds


class KillOnce(Timed):
    """SIGKILLs the worker process of a trainer without a parameter server, once, after
    ``after_s`` seconds of training."""

    def __init__(self, client: Any, after_s: float) -> None:
        self.client, self.after_s, self.pid = client, after_s, 0

    def on_fit_start(self, info: Any) -> None:
        roles = info["roles"]
        victim = next(w for w in roles["trainer"] if w not in roles["ps"])
        self.pid = self.client.run(os.getpid, workers=[victim])[victim]
        print(f"will kill {victim} (pid {self.pid}) after {self.after_s:g} s")

    def on_score(self, record: Any) -> bool | None:
        if self.trained_s(record) >= self.after_s and self.pid:
            os.kill(self.pid, signal.SIGKILL)
            self.pid = 0
        return None


async def shoot(url: str, out: Path) -> str:
    """Open the page, wait for the finished job's curves, save the PNG; the page's headline."""
    async with Chromium(width=1500, height=1010) as browser:
        await browser.goto(url)
        headline = await browser.wait_for(HEADLINE_JS, lambda t: "finished" in t, timeout=120)
        await browser.wait_for(POINTS_JS, lambda v: '"src-score-loss"' in v, timeout=120)
        await asyncio.sleep(2.0)  # let the plots draw every point
        await browser.screenshot(out)
        return html.unescape(re.sub(r"<[^>]+>", "", str(headline)))  # the text a reader sees


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0,
                        help="how long the job trains (from its first score)")
    parser.add_argument("--kill-after", type=float, default=12.0,
                        help="seconds of training before a trainer's worker is killed (0: never)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "training-page.png")
    args = parser.parse_args()

    import torch

    client = dt.connect(n_workers=2, threads_per_worker=1)
    try:
        X, y = dt.datasets.digits(n_samples=200_000, chunks=25_000, seed=0)
        Xv, yv = dt.datasets.digits_test()
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 100), torch.nn.ReLU(),
                                  torch.nn.Linear(100, 10))
        runs = Path(tempfile.mkdtemp(prefix="dt-runs-"))
        callbacks: list[dt.Callback] = [dt.callbacks.TensorBoard(runs / "digits"),
                                        TrainFor(args.seconds)]
        if args.kill_after > 0:
            callbacks.append(KillOnce(client, args.kill_after))
        trainer = dt.Trainer(net, ps=1, workers=2, scorer=1, batch_size=128, epochs=20,
                             score_every=0.5, stop=[dt.StopAfter(seconds=300)],
                             failure=dt.FailureConfig(max_failures=3), callbacks=callbacks,
                             progress=False, client=client)
        t0 = time.time()
        result = trainer.fit(X, y, validation=(Xv, yv))
        print(f"job: {result.stopped_by}, {len(result.history)} scores, "
              f"accuracy {result.history['accuracy'].iloc[-1]:.3f}, {time.time() - t0:.0f} s")
        url = client.dashboard_link.replace("/status", "/training")
        headline = asyncio.run(shoot(url, args.out))
        print(f"saved {args.out} ({args.out.stat().st_size:,} bytes) from {url}")
        print(f"TensorBoard files: tensorboard --logdir {runs}")
        print("headline:", headline)
    finally:
        cluster = client.cluster
        client.close()
        if cluster is not None:
            cluster.close()


if __name__ == "__main__":
    main()
