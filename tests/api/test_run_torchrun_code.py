"""``dt.run`` keeps its promise to torchrun code: a function that calls
``torch.distributed.init_process_group`` itself (``env://`` or an explicit method) gets the
job's group, and one that calls ``destroy_process_group`` at its end leaves the job's last
report and teardown working (real 2-rank jobs on a real cluster)."""

from __future__ import annotations

import os

import pytest
import torch

import dask_train as dt
from dask_train.errors import RoleFailed


@pytest.fixture(scope="module")
def client():
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as c:
        yield c


def torchrun_main(ctx, init_method="env://", world_size=-1, rank=-1):
    """What a torchrun script does: its own init, DDP by hand, a destroy at the end."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init_method, world_size=world_size, rank=rank)
    rank_, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.full((8, 4), float(rank_ + 1))
    for _ in range(3):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    total = torch.tensor([float(rank_)])
    dist.all_reduce(total)
    ctx.report({"sum": float(total)})
    dist.destroy_process_group()
    return {"rank": rank_, "world": world, "sum": float(total),
            "weight": model.module.weight.detach().numpy().tolist()}


def test_own_init_env_gets_the_jobs_group_and_destroy_leaves_the_end_working(client):
    result = dt.run(torchrun_main, workers=2, client=client, timeout=60)
    ranks = sorted(result.returns, key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["world"] == 2 and r["sum"] == 1.0 for r in ranks)
    assert ranks[0]["weight"] == ranks[1]["weight"]  # DDP averaged the two ranks' gradients
    assert result.history["sum"].tolist() == [1.0]

    def state() -> tuple:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        return (dist.is_initialized(), dist.init_process_group.__module__,
                c10d.destroy_process_group.__module__, os.environ.get("RANK"))

    # Torch's own functions back, no group left, the job's environment gone.
    assert set(client.run(state).values()) == {
        (False, "torch.distributed.distributed_c10d", "torch.distributed.distributed_c10d", None)}
    again = dt.run(torchrun_main, workers=2, client=client, timeout=60)  # the workers usable
    assert sorted(r["sum"] for r in again.returns) == [1.0, 1.0]


def test_an_explicit_init_method_with_world_and_rank_gets_the_jobs_group(client):
    def main(ctx):
        import torch.distributed as dist

        address = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        return torchrun_main(ctx, init_method=address, world_size=int(os.environ["WORLD_SIZE"]),
                             rank=int(os.environ["RANK"])) | {"backend": dist.get_backend()
                                                              if dist.is_initialized() else ""}

    result = dt.run(main, workers=2, client=client, timeout=60)
    assert sorted(r["rank"] for r in result.returns) == [0, 1]
    assert {r["backend"] for r in result.returns} == {"gloo"}  # still the job's after destroy


def test_an_init_asking_for_another_world_names_the_values_and_the_fix(client):
    with pytest.raises(RoleFailed) as info:
        dt.run(torchrun_main, config={"world_size": 3}, workers=2, client=client, timeout=60)
    text = str(info.value) + str(info.value.__cause__)
    assert "world_size=3" in text and "world size 2" in text and "without world_size=" in text


def test_one_rank_without_a_group_of_the_job_makes_its_own_and_it_is_destroyed(client):
    def main(ctx):
        import torch.distributed as dist

        dist.init_process_group("gloo")  # env:// on the port the rank was given
        return dist.get_world_size()  # no destroy: the job's end does it

    result = dt.run(main, workers=1, client=client, timeout=60)
    assert result.returns == [1]
    import torch.distributed as dist

    assert set(client.run(dist.is_initialized).values()) == {False}
