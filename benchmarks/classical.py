"""Classical models: reducing partial results, sending parameters, and logistic regression vs dask-glm.

Usage::

    python benchmarks/classical.py [--rows N] [--quick]

What is measured, in one run:

a) **Reducing partial gradients.** 16, 32 and 64 partial results of 4 MB each (random float64, so
   nothing compresses) live on a 2-worker embedded cluster. The client sums them three ways:
   ``client.gather`` then ``sum``; ``as_completed`` and a running sum; ``dt.tree_reduce`` (pairwise
   on the workers, one result to the client; also with a fan-in of 4: half the tree levels). Time
   (median of the repeats) and bytes into the client, measured at the socket (TCP_INFO
   ``bytes_received`` of every TCP socket of the client process). The client runs in its own
   process, once next to the cluster (loopback) and once in a network namespace whose veth link to
   the cluster is rate-limited to 1 Gbit/s with ``tc`` (tbf, both directions), when this machine
   allows it (root, ``ip netns``, ``tc``); otherwise the table says so and nothing is emulated.
b) **Logistic regression** on generated data (5M x 50 by default; ``--quick``: 200k x 50), all
   solvers on the same persisted dask arrays of a 2-worker ``dt.connect`` cluster: dask-glm's
   ``lbfgs`` (no penalty, its defaults otherwise), dask-ml's ``LogisticRegression`` (C=1) with
   ``solver="lbfgs"`` and with its default ADMM capped at 10 iterations (uncapped it needs 51 s for
   200k rows here, so many minutes at 5M), and ``dt.LogisticRegression`` (no penalty, tol 1e-10,
   L-BFGS and Newton). dask-glm and dask-ml are optional (``pip install .[bench]``). For each reference,
   the time dask-train's fit needed to reach the same mean log-loss (from ``time_history_``, which
   counts from the start of ``fit``, checks and persisting included) and the iterations that took.
c) **Sending the parameters each iteration** (the choice in ``dask_train.runtime.send_params``): one
   ``evaluate_sum`` over 8 small blocks in 2 groups, with parameters of 400 B, 800 kB and 40 MB
   passed in the task arguments, by ``scatter`` (via the scheduler / direct to a worker), by
   ``scatter(broadcast=True)``, by ``scatter`` + ``replicate``; median time and bytes the client
   sent. Measured from the same client processes as a).

The machine is shared by other programs: every timed section records the CPU used by other
processes ("other load", cores). Results go to ``benchmarks/results/classical.md`` and ``.json``
(``classical-quick.*`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import dask.array as da
import numpy as np
from _common import cpu_load, environment, markdown_table, wait_for_quiet, write_results
from distributed import Client, as_completed, wait

import dask_train as dt
from dask_train.classical import GLMBlockLoss, full_batch
from dask_train.data import persist_data
from dask_train.runtime import send_params

NETNS, HOST_IP, NS_IP, RATE = "dtbench", "10.231.0.1", "10.231.0.2", "1gbit"
PART_FLOATS = 500_000  # 4 MB
COUNTS = (16, 32, 64)
PARAM_FLOATS = (50, 100_000, 5_000_000)  # 400 B, 800 kB, 40 MB


# -- measuring the client's traffic ----------------------------------------------------------------


def tcp_bytes() -> tuple[int, int]:
    """(received, sent and acknowledged) bytes over all open TCP sockets of this process (Linux)."""
    received = sent = 0
    seen: set[str] = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
            if not link.startswith("socket:") or link in seen:
                continue
            seen.add(link)
            sock = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        try:
            if sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6):
                info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
                if len(info) >= 136:  # struct tcp_info: bytes_acked at 120, bytes_received at 128
                    sent += struct.unpack_from("Q", info, 120)[0]
                    received += struct.unpack_from("Q", info, 128)[0]
        except OSError:
            pass
        finally:
            sock.close()
    return received, sent


def measure(fn: Callable[[], Any], repeats: int) -> dict[str, Any]:
    """Median seconds, bytes in and bytes out of ``repeats`` calls of ``fn``."""
    times, received, sent = [], [], []
    for _ in range(repeats):
        r0, s0 = tcp_bytes()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        r1, s1 = tcp_bytes()
        received.append(r1 - r0)
        sent.append(s1 - s0)
    return {"seconds": statistics.median(times), "bytes_in": statistics.median(received),
            "bytes_out": statistics.median(sent)}


# -- a) and c): run in a client process ------------------------------------------------------------


def _partial(i: int, size: int) -> np.ndarray:
    return np.random.default_rng(i).standard_normal(size)


def reduce_rows(client: Client, repeats: int) -> list[dict[str, Any]]:
    rows = []
    for n in COUNTS:
        parts = client.map(_partial, range(n), size=PART_FLOATS, pure=False)
        wait(parts)
        expected = sum(client.gather(parts))

        def by_gather(parts: list[Any] = parts) -> np.ndarray:
            return np.asarray(sum(client.gather(parts)))

        def by_as_completed(parts: list[Any] = parts) -> np.ndarray:
            total = np.zeros(PART_FLOATS)
            for fut in as_completed(parts):
                total += fut.result()
            return total

        def by_tree(parts: list[Any] = parts) -> np.ndarray:
            return np.asarray(dt.tree_reduce(parts, operator.add).result())

        def by_tree4(parts: list[Any] = parts) -> np.ndarray:
            return np.asarray(dt.tree_reduce(parts, operator.add, split_every=4).result())

        for name, fn in (("client.gather + sum", by_gather), ("as_completed sum", by_as_completed),
                         ("dt.tree_reduce", by_tree), ("dt.tree_reduce, split_every=4", by_tree4)):
            np.testing.assert_allclose(fn(), expected, atol=1e-9)  # also warms the connections
            rows.append({"partials": n, "method": name, **measure(fn, repeats)})
            print(f"  {n} x 4 MB, {name}: {rows[-1]['seconds'] * 1e3:.0f} ms", file=sys.stderr, flush=True)
        del parts
    return rows


def _block_fn(params: np.ndarray, X: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    return float(X.sum()), np.full(3, float(params[0]))


def broadcast_rows(client: Client, repeats: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    X = da.from_array(rng.normal(size=(8000, 10)), chunks=(1000, 10))
    data = persist_data(X, da.zeros(8000, chunks=1000), client=client)
    ways: dict[str, Callable[[np.ndarray], Any]] = {
        "in the task arguments": lambda p: p,
        "scatter (via the scheduler)": lambda p: client.scatter(p, hash=False),
        "scatter(direct=True)": lambda p: client.scatter(p, hash=False, direct=True),
        "scatter(broadcast=True)": lambda p: client.scatter(p, hash=False, broadcast=True),
        "scatter + replicate": lambda p: _replicated(client, p),
        "send_params (the library's choice)": lambda p: send_params(client, p, copies=2),
    }
    rows = []
    for floats in PARAM_FLOATS:
        params = np.ones(floats)
        for name, send in ways.items():
            def call(send: Callable[[np.ndarray], Any] = send, params: np.ndarray = params) -> None:
                full_batch.evaluate_sum(_block_fn, params, data, param_future=send(params))

            call()
            rows.append({"param_bytes": params.nbytes, "way": name, "groups": len(data.groups()),
                         **measure(call, repeats)})
    data.release()
    return rows


def _replicated(client: Client, params: np.ndarray) -> Any:
    fut = client.scatter(params, hash=False)
    client.replicate([fut])
    return fut


def client_main(address: str, out: str, repeats: int) -> int:
    """Entry point of the client process (``--client ADDRESS --out FILE``)."""
    with Client(address, timeout=60) as client:
        result = {"reduce": reduce_rows(client, repeats), "broadcast": broadcast_rows(client, repeats)}
    Path(out).write_text(json.dumps(result))
    return 0


# -- the slow link ----------------------------------------------------------------------------------


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


def slow_link_up() -> str | None:
    """Create the namespace and the rate-limited veth; return why not, or None when it is up."""
    if os.geteuid() != 0:
        return "not root"
    if not (shutil.which("ip") and shutil.which("tc")):
        return "ip or tc not installed"
    slow_link_down()
    try:
        _sh("ip", "netns", "add", NETNS)
        _sh("ip", "link", "add", "dtbh", "type", "veth", "peer", "name", "dtbn")
        _sh("ip", "link", "set", "dtbn", "netns", NETNS)
        _sh("ip", "addr", "add", f"{HOST_IP}/24", "dev", "dtbh")
        _sh("ip", "link", "set", "dtbh", "up")
        _sh("ip", "netns", "exec", NETNS, "ip", "addr", "add", f"{NS_IP}/24", "dev", "dtbn")
        _sh("ip", "netns", "exec", NETNS, "ip", "link", "set", "dtbn", "up")
        _sh("ip", "netns", "exec", NETNS, "ip", "link", "set", "lo", "up")
        # Token bucket at 1 Gbit/s on both ends: the client's uploads and downloads are limited.
        _sh("tc", "qdisc", "add", "dev", "dtbh", "root", "tbf", "rate", RATE, "burst", "256kb",
            "latency", "50ms")
        _sh("ip", "netns", "exec", NETNS, "tc", "qdisc", "add", "dev", "dtbn", "root", "tbf", "rate",
            RATE, "burst", "256kb", "latency", "50ms")
    except subprocess.CalledProcessError as exc:
        slow_link_down()
        return f"{' '.join(exc.cmd[:4])} failed: {exc.stderr.strip()}"
    return None


def slow_link_down() -> None:
    subprocess.run(["ip", "netns", "del", NETNS], capture_output=True)  # removes the veth pair too
    subprocess.run(["ip", "link", "del", "dtbh"], capture_output=True)


def run_client(address: str, *, netns: str | None, repeats: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "client.json")
        cmd = [sys.executable, __file__, "--client", address, "--out", out, "--repeats", str(repeats)]
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        subprocess.run(cmd, check=True)
        return dict(json.loads(Path(out).read_text()))


def transport_sections(repeats: int) -> tuple[dict[str, Any], str | None]:
    """Parts a) and c) from a loopback client and (when possible) a client behind the slow link."""
    why_not = slow_link_up()
    host = HOST_IP if why_not is None else "127.0.0.1"
    results: dict[str, Any] = {}
    try:
        client = dt.connect(n_workers=2, host=host, dashboard=False, quiet=True)
        try:
            address = client.scheduler.address
            for link, netns in (("loopback", None), ("1 Gbit/s link", NETNS)):
                if link != "loopback" and why_not is not None:
                    continue
                wait_for_quiet(max_wait_s=30)
                # This process and its children are the cluster and the client: the rest is
                # other programs on the shared machine.
                with cpu_load() as load:
                    results[link] = run_client(address, netns=netns, repeats=repeats)
                results[link]["other_load"] = load.foreign
        finally:
            client.close()
    finally:
        if why_not is None:
            slow_link_down()
    return results, why_not


# -- b) logistic regression ------------------------------------------------------------------------


def make_data(client: Client, rows: int, features: int) -> tuple[da.Array, da.Array]:
    """Gaussian features, labels from a logistic model with an intercept; persisted on the workers."""
    chunk = min(rows, 100_000)
    X = da.random.RandomState(0).normal(size=(rows, features), chunks=(chunk, features))
    w = np.random.default_rng(1).normal(size=features) / np.sqrt(features)
    z = X @ w + 0.5
    y = (da.random.RandomState(2).random_sample(rows, chunks=chunk) < 1 / (1 + da.exp(-z))).astype(float)
    X, y = client.persist([X, y])
    wait([X, y])
    return X, y


def mean_log_loss(coef: np.ndarray, intercept: float, X: da.Array, y: da.Array) -> float:
    """The mean log-loss of a linear model on (X, y), evaluated on the cluster (not timed)."""
    fn = GLMBlockLoss("logistic", X.shape[1], 1, True, 1)
    params = np.append(np.ravel(coef), intercept)
    loss, _ = dt.distributed_loss_grad(fn, params, X, y)
    return float(loss) / X.shape[0]


def timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    wait_for_quiet(max_wait_s=30)
    with cpu_load() as load:
        t0 = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - t0
    return out, seconds, load.foreign


@contextmanager
def counting_lbfgs() -> Iterator[list[int]]:
    """Record scipy's L-BFGS iteration count, which dask-glm (and so dask-ml) computes and drops."""
    import dask_glm.algorithms as glm

    iterations: list[int] = []
    original = glm.fmin_l_bfgs_b

    def counting(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        iterations.append(int(out[2]["nit"]))
        return out

    glm.fmin_l_bfgs_b = counting
    try:
        yield iterations
    finally:
        glm.fmin_l_bfgs_b = original


def dask_glm_row(X: da.Array, y: da.Array) -> dict[str, Any]:
    name = "dask-glm lbfgs (no penalty)"
    try:
        import dask_glm.algorithms as glm
        from dask_glm.families import Logistic
    except Exception as exc:  # an import failure is a result to report, not a crash
        return {"runner": name, "error": f"{type(exc).__name__}: {exc}"}
    X1 = da.hstack([X, da.ones((X.shape[0], 1), chunks=(X.chunks[0], 1))]).persist()
    wait(X1)  # its intercept column, built before the clock starts
    try:
        with counting_lbfgs() as iterations:
            beta, seconds, other = timed(lambda: glm.lbfgs(X1, y, regularizer=None, family=Logistic))
    except Exception as exc:
        return {"runner": name, "error": f"{type(exc).__name__}: {exc}"}
    beta = np.asarray(beta)
    return {"runner": name, "seconds": seconds, "iterations": iterations[-1],
            "loss": mean_log_loss(beta[:-1], float(beta[-1]), X, y), "other_load": other}


def dask_ml_row(X: da.Array, y: da.Array, solver: str, max_iter: int) -> dict[str, Any]:
    name = f"dask-ml LogisticRegression(solver={solver!r}, max_iter={max_iter}), C=1"
    try:
        from dask_ml.linear_model import LogisticRegression
    except Exception as exc:
        return {"runner": name, "error": f"{type(exc).__name__}: {exc}"}
    try:
        with counting_lbfgs() as iterations:
            model, seconds, other = timed(
                lambda: LogisticRegression(solver=solver, max_iter=max_iter).fit(X, y))
    except Exception as exc:
        return {"runner": name, "error": f"{type(exc).__name__}: {exc}"}
    # ADMM's outer iterations are not exposed; at most max_iter of them ran.
    its = iterations[-1] if solver == "lbfgs" else f"<= {max_iter} (not exposed)"
    return {"runner": name, "seconds": seconds, "iterations": its,
            "loss": mean_log_loss(np.asarray(model.coef_), float(model.intercept_), X, y),
            "other_load": other}


def dask_train_row(X: da.Array, y: da.Array, solver: str) -> dict[str, Any]:
    clf = dt.LogisticRegression(None, solver=solver, tol=1e-10, max_iter=200)
    _, seconds, other = timed(lambda: clf.fit(X, y))
    return {"runner": f"dt.LogisticRegression {solver}", "seconds": seconds,
            "iterations": clf.n_iter_, "loss": clf.loss_history_[-1], "other_load": other,
            "loss_history": clf.loss_history_, "time_history": clf.time_history_}


def time_to_loss(row: dict[str, Any], target: float) -> tuple[float, int] | None:
    """First (seconds since fit started, iterations) at which the history reached ``target``."""
    for i, (loss, t) in enumerate(zip(row["loss_history"], row["time_history"])):
        if loss <= target + 1e-12 * abs(target):
            return t, i + 1
    return None


def logistic_section(rows: int, features: int) -> dict[str, Any]:
    client = dt.connect(n_workers=2, dashboard=False, quiet=True)
    try:
        X, y = make_data(client, rows, features)
        # ADMM runs a local L-BFGS on every block in every iteration: 51 s for 100 iterations on
        # 200k rows here, far too long at 5M on 2 cores, so it is capped at 10 iterations; dask-ml's
        # lbfgs solver runs with its defaults.
        references = [dask_glm_row(X, y), dask_ml_row(X, y, "lbfgs", 100), dask_ml_row(X, y, "admm", 10)]
        ours = [dask_train_row(X, y, "lbfgs"), dask_train_row(X, y, "newton")]
    finally:
        client.close()
    comparisons = []
    for ref in references:
        if "loss" not in ref:
            continue
        for row in ours:
            hit = time_to_loss(row, ref["loss"])
            comparisons.append({
                "reference": ref["runner"], "ours": row["runner"], "target_loss": ref["loss"],
                "ref_seconds": ref["seconds"], "seconds": hit[0] if hit else None,
                "iterations": hit[1] if hit else None,
                "speedup": ref["seconds"] / hit[0] if hit else None,
            })
    return {"rows": rows, "features": features, "references": references, "ours": ours,
            "comparisons": comparisons}


# -- report -----------------------------------------------------------------------------------------


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f}"


def reduce_table(transport: dict[str, Any], why_not: str | None) -> tuple[str, list[str]]:
    rows, aims = [], []
    for link, result in transport.items():
        base = {r["partials"]: r["seconds"] for r in result["reduce"]
                if r["method"].startswith("client.gather")}
        for r in result["reduce"]:
            speedup = base[r["partials"]] / r["seconds"]
            rows.append({"client link": link, "partials (4 MB each)": r["partials"], "method": r["method"],
                         "time (ms)": f"{r['seconds'] * 1e3:,.0f}", "MB into client": _mb(r["bytes_in"]),
                         "vs gather": f"{speedup:.1f}x"})
            if link != "loopback" and r["method"].startswith("dt.tree_reduce"):
                aims.append(f"- {r['partials']} partials over the {link}: {r['method']} {speedup:.1f}x "
                            f"faster than gather (aim >= 5x: {'met' if speedup >= 5 else 'NOT met'})")
    if why_not is not None:
        rows.append({"client link": "1 Gbit/s link", "method": f"not measured: {why_not}"})
        aims.append(f"- slow link: not measured ({why_not})")
    cols = ["client link", "partials (4 MB each)", "method", "time (ms)", "MB into client", "vs gather"]
    return markdown_table(rows, cols), aims


def broadcast_table(transport: dict[str, Any]) -> str:
    rows = []
    for link, result in transport.items():
        for r in result["broadcast"]:
            rows.append({"client link": link, "params": _size(r["param_bytes"]), "way": r["way"],
                         "time per call (ms)": f"{r['seconds'] * 1e3:,.1f}",
                         "MB sent by client": f"{r['bytes_out'] / 1e6:,.2f}"})
    return markdown_table(rows, ["client link", "params", "way", "time per call (ms)", "MB sent by client"])


def _size(n: int) -> str:
    return f"{n / 1e6:g} MB" if n >= 1e6 else f"{n / 1e3:g} kB" if n >= 1e3 else f"{n} B"


def logistic_tables(section: dict[str, Any]) -> tuple[str, str, list[str]]:
    runs = []
    for r in section["references"] + section["ours"]:
        if "error" in r:
            runs.append({"runner": r["runner"], "time (s)": f"failed: {r['error']}"})
            continue
        runs.append({"runner": r["runner"], "time (s)": f"{r['seconds']:.1f}",
                     "iterations": r["iterations"], "final mean log-loss": f"{r['loss']:.12f}",
                     "other load (cores)": f"{r['other_load']:.2f}"})
    comps, aims = [], []
    for c in section["comparisons"]:
        reached = c["seconds"] is not None
        comps.append({"reference": c["reference"], "dask-train": c["ours"],
                      "target loss": f"{c['target_loss']:.12f}", "reference (s)": f"{c['ref_seconds']:.1f}",
                      "dask-train to the same loss (s)": f"{c['seconds']:.1f}" if reached else "not reached",
                      "iterations": c["iterations"] if reached else "",
                      "speedup": f"{c['speedup']:.1f}x" if reached else ""})
        if c["reference"].startswith("dask-glm"):
            ok = reached and c["speedup"] >= 2
            got = f"{c['speedup']:.1f}x" if reached else "target not reached"
            aims.append(f"- {c['ours']} vs dask-glm lbfgs: {got} "
                        f"(aim: at most half its time, >= 2x: {'met' if ok else 'NOT met'})")
    t1 = markdown_table(runs, ["runner", "time (s)", "iterations", "final mean log-loss",
                               "other load (cores)"])
    t2 = markdown_table(comps, ["reference", "dask-train", "target loss", "reference (s)",
                                "dask-train to the same loss (s)", "iterations", "speedup"])
    return t1, t2, aims


def render(env: dict[str, Any], transport: dict[str, Any], why_not: str | None, section: dict[str, Any],
           quick: bool) -> str:
    reduce_md, aims = reduce_table(transport, why_not)
    runs_md, comps_md, more_aims = logistic_tables(section)
    loads = ", ".join(f"{k}: {v['other_load']:.2f}" for k, v in transport.items())
    return "\n".join([
        f"# Classical models{' (quick smoke test)' if quick else ''}", "",
        f"Machine: {env['cores']} cores ({env['cpu']}), dask {env['dask']}, distributed "
        f"{env['distributed']}, Python {env['python']}; {env['date']}. Shared with other programs: "
        f"CPU used by them during a) and c), in cores: {loads or 'n/a'}.", "",
        "## a) Summing partial gradients (2 workers; the client in its own process)", "",
        reduce_md, "",
        f"## b) Logistic regression, {section['rows']:,} x {section['features']} (2 workers)", "",
        runs_md, "", comps_md, "",
        "## c) Sending the parameters for one evaluation (8 blocks in 2 groups)", "",
        broadcast_table(transport), "",
        "## Aims", "", *aims, *more_aims,
    ])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=None, help="rows of b) (default 5M, 200k with --quick)")
    parser.add_argument("--features", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats in a) and c) (default 5)")
    parser.add_argument("--quick", action="store_true", help="a short smoke test")
    parser.add_argument("--client", help=argparse.SUPPRESS)  # internal: run as the client process
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    repeats = args.repeats or (2 if args.quick else 5)
    if args.client:
        return client_main(args.client, args.out, repeats)
    env = environment()
    transport, why_not = transport_sections(repeats)
    section = logistic_section(args.rows or (200_000 if args.quick else 5_000_000), args.features)
    markdown = render(env, transport, why_not, section, args.quick)
    print(markdown)
    raw = {"environment": env, "transport": transport, "slow_link_unavailable": why_not,
           "logistic": section}
    paths = write_results("classical-quick" if args.quick else "classical", markdown, raw)
    print("wrote " + ", ".join(os.path.relpath(p) for p in paths), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
