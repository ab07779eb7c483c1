"""``dt.launch`` / ``dask-train launch``: a torchrun script of our own (DDP, gloo, a
DistributedSampler, a snapshot saved each epoch and loaded at the start) run by real torchrun
and by dask-train on a real cluster; kills, retirements, Ctrl-C, a failing rank and a cluster
of ``dask scheduler``/``dask worker`` programs started in another directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import dask_train as dt
from dask_train.launcher._rank import running_children

SCRIPT = Path(__file__).parent / "programs" / "ddp_snapshot.py"
EPOCHS = 4


@pytest.fixture(scope="module")
def cluster():
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as c, Client(c) as client:
        yield c, client


@pytest.fixture(scope="module")
def torchrun_weights(tmp_path_factory) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The script's final weights and rank 1's environment under real torchrun."""
    where = tmp_path_factory.mktemp("torchrun")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                    str(SCRIPT), str(EPOCHS), "--env-out", "env"], cwd=where, check=True,
                   capture_output=True, timeout=120)
    return torch.load(where / "final.pt"), json.loads((where / "env.1.json").read_text())


def _cli(*args: str, cwd: Path) -> subprocess.Popen[str]:
    """``dask-train launch`` as a user runs it, with SIGINT's default action (a background job
    of a non-interactive shell starts with SIGINT ignored)."""
    command = [str(Path(sys.executable).parent / "dask-train"), "launch", *args]
    return subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT,
                                                                        signal.SIG_DFL))


def _no_children_left(client) -> None:
    import psutil

    def children() -> list[int]:
        return [p.pid for p in psutil.Process().children(recursive=True)]

    deadline = time.monotonic() + 10
    while any(client.run(children).values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert client.run(children) == {w: [] for w in client.scheduler_info()["workers"]}
    assert set(map(tuple, client.run(running_children).values())) == {()}


def _wait_for(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_the_same_final_weights_and_torchruns_environment(cluster, torchrun_weights, tmp_path,
                                                          monkeypatch):
    _, client = cluster
    monkeypatch.chdir(tmp_path)
    result = dt.launch(SCRIPT, [str(EPOCHS), "--env-out", "env"], workers=2, client=client,
                       log_dir=tmp_path / "logs", echo=False)
    assert result.exit_code == 0 and result.restarts == 0 and result.attempts == 1
    weights, torchrun_env = torchrun_weights
    mine = torch.load(tmp_path / "final.pt")
    assert mine.keys() == weights.keys()
    assert all(torch.equal(mine[k], weights[k]) for k in weights)
    env = json.loads((tmp_path / "env.1.json").read_text())
    assert [k for k, v in env.items() if v is None] == [] == \
        [k for k, v in torchrun_env.items() if v is None]
    same = {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME",
                                "ROLE_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT",
                                "TORCHELASTIC_MAX_RESTARTS")}
    assert same == {k: torchrun_env[k] for k in same}
    # Each rank's lines kept in the run's directory, torchrun's layout.
    out = (tmp_path / "logs" / "attempt_0" / "1" / "stdout.log").read_text().splitlines()
    assert out[-1].startswith(f"epoch {EPOCHS - 1} loss")
    _no_children_left(client)


def test_a_killed_worker_restarts_the_gang_which_resumes_from_its_snapshot(
        cluster, torchrun_weights, tmp_path, monkeypatch):
    _, client = cluster
    monkeypatch.chdir(tmp_path)
    got: dict[str, dt.LaunchResult] = {}
    run = threading.Thread(target=lambda: got.setdefault("result", dt.launch(
        SCRIPT, [str(EPOCHS), "--epoch-sleep", "0.6"], workers=2, max_restarts=1, client=client,
        log_dir=tmp_path / "logs", echo=False)))
    run.start()
    _wait_for(tmp_path / "snapshot.pt")
    victim = sorted(client.scheduler_info()["workers"])[-1]
    os.kill(client.run(os.getpid, workers=[victim])[victim], signal.SIGKILL)
    run.join(120)
    result = got["result"]
    assert result.exit_code == 0 and result.restarts == 1 and result.attempts == 2, result
    assert "left the cluster" in result.history[0]["why"]
    resumed = (tmp_path / "logs" / "attempt_1" / "0" / "stdout.log").read_text()
    assert "resumed from epoch" in resumed and "at restart 1" in resumed
    weights, _ = torchrun_weights
    mine = torch.load(tmp_path / "final.pt")
    assert all(torch.equal(mine[k], weights[k]) for k in weights)
    client.wait_for_workers(2, timeout=60)
    _no_children_left(client)


def test_a_retired_worker_sends_sigterm_and_the_restart_does_not_count(cluster, tmp_path,
                                                                       monkeypatch):
    local, client = cluster
    monkeypatch.chdir(tmp_path)
    got: dict[str, dt.LaunchResult] = {}
    run = threading.Thread(target=lambda: got.setdefault("result", dt.launch(
        SCRIPT, [str(EPOCHS), "--epoch-sleep", "0.6"], workers=(1, 2), max_restarts=0,
        client=client, grace=5, log_dir=tmp_path / "logs", echo=False)))
    run.start()
    try:
        _wait_for(tmp_path / "snapshot.pt")
        before = set(client.scheduler_info()["workers"])
        local.scale(1)  # a scale-down: the scheduler retires one of the two workers
        run.join(120)
        (leaving,) = before - set(client.scheduler_info()["workers"])
    finally:
        local.scale(2)
    result = got["result"]
    assert result.exit_code == 0 and result.restarts == 0 and result.attempts == 2, result
    assert "with notice" in result.history[0]["why"]
    first = "".join(p.read_text() for p in (tmp_path / "logs" / "attempt_0").glob("*/stdout.log"))
    assert "got SIGTERM" in first
    assert [r["worker"] for r in result.ranks] != [leaving] and len(result.ranks) == 1
    assert "resumed from epoch" in (tmp_path / "logs" / "attempt_1" / "0" / "stdout.log").read_text()
    client.wait_for_workers(2, timeout=60)


def test_a_module_runs_as_python_m_does(cluster, tmp_path, monkeypatch):
    _, client = cluster
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "helper.py").write_text("WORD = 'sibling'\n")
    (package / "train.py").write_text(
        "import os, sys\nfrom mypkg.helper import WORD\n"
        "print(__name__, WORD, sys.argv[1:], os.environ['RANK'], os.getcwd())\n")
    monkeypatch.chdir(tmp_path)
    result = dt.launch("mypkg.train", ["--lr", "0.1"], module=True, workers=2, client=client,
                       log_dir=tmp_path / "logs", echo=False)
    assert result.exit_code == 0
    for rank in (0, 1):
        line = (tmp_path / "logs" / "attempt_0" / str(rank) / "stdout.log").read_text().strip()
        assert line == f"__main__ sibling ['--lr', '0.1'] {rank} {tmp_path}"


def test_a_failing_rank_gives_its_exit_status_and_one_traceback(cluster, tmp_path):
    local, _ = cluster
    cli = _cli("--scheduler", local.scheduler_address, "--in-place", "--workers", "2",
               "--log-dir", str(tmp_path / "logs"), str(SCRIPT), str(EPOCHS), "--fail-rank", "1",
               cwd=tmp_path)
    out, err = cli.communicate(timeout=120)
    assert cli.returncode == 7, err
    assert err.count("[rank1]: Traceback (most recent call last):") == 1
    assert err.count("[rank1]: ValueError: a bad batch on rank 1") == 1
    summary = [line for line in err.splitlines() if line.startswith("dask-train launch: rank 1")]
    assert len(summary) == 1 and "tcp://" in summary[0] and "exit code 7" in summary[0]
    assert "[rank0]: epoch 0 loss" in out
    assert json.loads((tmp_path / "logs" / "summary.json").read_text())["exit_code"] == 7


def test_ctrl_c_ends_every_rank_and_leaves_the_workers_usable(cluster, tmp_path):
    local, client = cluster
    (tmp_path / "forever.py").write_text(
        "import os, time\nprint('started', os.environ['RANK'], flush=True)\n"
        "import subprocess, sys\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "time.sleep(600)\n")
    cli = _cli("--scheduler", local.scheduler_address, "--in-place", "--workers", "2",
               "--log-dir", str(tmp_path / "logs"), "forever.py", cwd=tmp_path)
    seen: list[str] = []
    assert cli.stdout is not None
    while sum(line.startswith("[rank") for line in seen) < 2:
        line = cli.stdout.readline()
        assert line, "the launcher ended early"
        seen.append(line)
    sent = time.monotonic()
    cli.send_signal(signal.SIGINT)
    _, err = cli.communicate(timeout=30)
    assert cli.returncode == 130, err
    assert time.monotonic() - sent < 10
    assert "Traceback" not in err
    _no_children_left(client)  # the program's own child too: the program's session was ended
    (tmp_path / "quick.py").write_text("import os\nprint('again', os.environ['RANK'])\n")
    again = dt.launch(tmp_path / "quick.py", workers=2, client=client, echo=False,
                      log_dir=tmp_path / "again")
    assert again.exit_code == 0
    assert (tmp_path / "again" / "attempt_0" / "1" / "stdout.log").read_text() == "again 1\n"


def test_a_remote_cluster_gets_the_scripts_directory(tmp_path):
    sys.path.insert(0, str(Path(__file__).parents[1] / "controller"))
    from _dask_cli import dask_cli_cluster

    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    (project / "data").mkdir(parents=True)
    elsewhere.mkdir()
    (project / "helper.py").write_text("def word():\n    return open('data/word.txt').read()\n")
    (project / "data" / "word.txt").write_text("shipped")
    (project / "main.py").write_text(
        "import os\nfrom helper import word\n"
        "open('written.txt', 'w').write(word())\n"
        "print(word(), os.environ['RANK'], os.getcwd(), flush=True)\n")
    with dask_cli_cluster(elsewhere) as (address, _):
        cli = _cli("--scheduler", address, "--workers", "2", "--include", "data",
                   "--log-dir", str(tmp_path / "logs"), "main.py", cwd=project)
        out, err = cli.communicate(timeout=120)
    assert cli.returncode == 0, err
    lines = sorted(line for line in out.splitlines() if line.startswith("[rank"))
    assert [line.split()[:3] for line in lines] == [["[rank0]:", "shipped", "0"],
                                                    ["[rank1]:", "shipped", "1"]]
    cwd = lines[0].split()[3]
    assert str(project) not in cwd and "dask-train-launch" in cwd
    assert not (project / "written.txt").exists()  # relative paths are the worker's disk


def test_bad_arguments_are_all_named_before_anything_runs(tmp_path, monkeypatch):
    from dask_train.errors import InvalidInput

    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidInput) as info:
        dt.launch("missing.py", workers=(3, 1), max_restarts=-1, grace="soon",
                  include=["nowhere"], scheduler="tcp://127.0.0.1:1")
    text = str(info.value)
    for part in ("script='missing.py' is not a file", "workers=(3, 1)", "max_restarts=-1",
                 "grace='soon'", "include='nowhere'"):
        assert part in text, part
    with pytest.raises(InvalidInput, match="module='not a module'"):
        dt.launch("not a module", module=True, scheduler="tcp://127.0.0.1:1")


def test_the_command_line_takes_torchruns_option_names():
    from dask_train.cli.main import _parser

    args = _parser().parse_args(["launch", "--nnodes", "1:4", "--max_restarts", "2",
                                 "--rdzv-id", "r1", "-m", "pkg.train", "--lr", "0.1", "-m", "x"])
    assert (args.workers, args.max_restarts, args.run_id, args.module) == ((1, 4), 2, "r1", True)
    assert (args.target, args.args) == ("pkg.train", ["--lr", "0.1", "-m", "x"])
    args = _parser().parse_args(["launch", "--resources", "GPU=1,MEM=2e9", "train.py"])
    assert args.resources == {"GPU": 1.0, "MEM": 2e9}
    with pytest.raises(SystemExit):
        _parser().parse_args(["launch", "--resources", "GPU", "train.py"])


def test_workers_that_joined_are_taken_at_the_next_restart(cluster, tmp_path, monkeypatch):
    local, client = cluster
    (tmp_path / "grow.py").write_text(
        "import os, sys, time\n"
        "restart = os.environ['TORCHELASTIC_RESTART_COUNT']\n"
        "open(f\"up.{restart}.{os.environ['RANK']}\", 'w').close()\n"
        "print('world', os.environ['WORLD_SIZE'], 'restart', restart, flush=True)\n"
        "if restart == '0' and os.environ['RANK'] == '0':\n"
        "    while not os.path.exists('go'):\n"
        "        time.sleep(0.02)\n"
        "    sys.exit(3)\n")
    monkeypatch.chdir(tmp_path)
    got: dict[str, dt.LaunchResult] = {}
    run = threading.Thread(target=lambda: got.setdefault("result", dt.launch(
        "grow.py", workers=(1, 3), max_restarts=1, client=client, echo=False,
        log_dir=tmp_path / "logs")))
    run.start()
    try:
        _wait_for(tmp_path / "up.0.1")
        local.scale(3)
        client.wait_for_workers(3, timeout=60)
        (tmp_path / "go").touch()
        run.join(60)
    finally:
        local.scale(2)
    result = got["result"]
    assert result.exit_code == 0 and result.restarts == 1 and len(result.ranks) == 3, result
    assert len(result.history[0]["workers"]) == 2
    assert (tmp_path / "logs" / "attempt_1" / "2" / "stdout.log").read_text() == \
        "world 3 restart 1\n"
    deadline = time.monotonic() + 60
    while len(client.scheduler_info()["workers"]) != 2 and time.monotonic() < deadline:
        time.sleep(0.1)


def test_the_rank_blamed_is_the_one_that_failed_for_its_own_reason():
    from dask_train.launcher._launcher import _first_failure
    from dask_train.runtime._torch_rank import PEER_GONE

    # A suite run's case: rank 1 raised and exited 7; rank 0's gloo saw the connection close
    # and aborted (SIGABRT), and its answer came first. Its stderr, as gloo words it:
    gloo = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
            "closed by peer [127.0.0.1]:31129. This is typically caused by a remote worker "
            "crashing. Check the logs of the remote worker be")
    assert any(words in gloo for words in PEER_GONE)
    exits = {0: {"exit": -6, "order": 0, "ended": 10.2, "peer_gone": True},
             1: {"exit": 7, "order": 1, "ended": 10.1, "peer_gone": False}}
    assert _first_failure(exits, [0, 1]) == 1
    # Neither said a peer went: the program that ended first, whatever answered first.
    exits[0]["peer_gone"] = False
    exits[0]["ended"] = 10.3
    assert _first_failure(exits, [0, 1]) == 1
    # A rank whose task raised has no end time: after those that have one, then by answer.
    assert _first_failure({0: {"exit": 1, "order": 0}, 1: {"exit": 7, "order": 1, "ended": 5.0}},
                          [0, 1]) == 1
    assert _first_failure({0: {"exit": 1, "order": 1}, 1: {"exit": 1, "order": 0}}, [0, 1]) == 1
