"""ClusterView: one listing of the scheduler, read by the controller's pass and the engines."""

from __future__ import annotations

from distributed import Client

from dask_train.policy._scope import use_workers
from dask_train.runtime._calls import alive_workers
from dask_train.runtime._cluster_view import ClusterView, look

LISTING = {
    "tcp://10.0.0.1:4000": {"nthreads": 2, "status": "running"},
    "tcp://10.0.0.1:4001": {"nthreads": 1, "status": "closing_gracefully"},
    "tcp://10.0.0.2:4000": {"nthreads": 4, "status": "running"},
    "tcp://10.0.0.3:4000": {"status": "closed"},  # no nthreads: taken for 1
}


def test_a_view_tells_the_workers_that_may_take_a_role_from_those_on_their_way_out() -> None:
    view = ClusterView.of(LISTING)
    assert view.alive() == {"tcp://10.0.0.1:4000": 2, "tcp://10.0.0.1:4001": 1,
                            "tcp://10.0.0.2:4000": 4, "tcp://10.0.0.3:4000": 1}
    assert view.placeable() == {"tcp://10.0.0.1:4000": 2, "tcp://10.0.0.2:4000": 4}
    assert view.workers["tcp://10.0.0.1:4001"].leaving
    assert not view.workers["tcp://10.0.0.2:4000"].leaving


def test_a_view_says_who_joined_who_is_lost_and_the_hosts() -> None:
    view = ClusterView.of(LISTING)
    assert view.joined(since={"tcp://10.0.0.1:4000", "tcp://10.0.0.2:4000"}) == {
        "tcp://10.0.0.1:4001", "tcp://10.0.0.3:4000"}
    assert view.lost(["tcp://10.0.0.2:4000", "tcp://10.0.0.9:4000"]) == {"tcp://10.0.0.9:4000"}
    assert view.hosts() == {"10.0.0.1": ["tcp://10.0.0.1:4000", "tcp://10.0.0.1:4001"],
                            "10.0.0.2": ["tcp://10.0.0.2:4000"],
                            "10.0.0.3": ["tcp://10.0.0.3:4000"]}


def test_a_view_cannot_be_changed_by_its_reader() -> None:
    view = ClusterView.of(LISTING)
    try:
        view.workers["tcp://10.0.0.9:1"] = view.workers["tcp://10.0.0.2:4000"]  # type: ignore[index]
    except TypeError:
        pass
    else:
        raise AssertionError("a view's workers were changed")
    assert "tcp://10.0.0.9:1" not in view.alive()


def test_look_lists_the_real_cluster_in_the_jobs_scope(client: Client) -> None:
    listed = client.scheduler_info(n_workers=-1)["workers"]
    view = client.sync(look, client)
    assert view.alive() == {a: w["nthreads"] for a, w in listed.items()}
    assert view.placeable() == view.alive()  # nobody is leaving
    assert client.sync(alive_workers, client) == view.alive()
    first = sorted(listed)[0]
    with use_workers([first]):
        scoped = client.sync(look, client)
    assert list(scoped.alive()) == [first]
