"""The async-ps cost model: its placement, its bounds, calibration and the ps recommendation (pure)."""

from __future__ import annotations

import math

import pytest

from dask_train.errors import InvalidInput
from dask_train.policy import CostModel, Measured, calibrate, plan_roles
from dask_train.policy._cost import place, relative_errors

MB = 1e6


def _model(**kw: object) -> CostModel:
    # A 1 M-parameter model (4 MB a message) on 100 Mbit/s links: the network dominates.
    base = dict(n_params=1_000_000, batch_size=128, compute_s=0.01, update_s_per_param=3e-9,
                link_bytes_per_s=12.5 * MB, sharpness=math.inf)
    base.update(kw)
    return CostModel(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("hosts", [1, 2, 3, 5, 8, 13])
@pytest.mark.parametrize("workers", [1, 2, 4, 7])
@pytest.mark.parametrize("ps", [1, 2, 3, 6])
def test_place_agrees_with_plan_roles(hosts: int, workers: int, ps: int) -> None:
    names = [f"h{i:03d}" for i in range(hosts)]  # plan_roles breaks ties by address order
    plan = plan_roles({n: 1 for n in names}, ps=ps, worker=workers, scorer=0)
    trainers, servers = place(workers=workers, ps=ps, hosts=hosts)
    assert trainers == [plan["trainer"].count(n) for n in names]
    assert servers == [plan["ps"].count(n) for n in names]


def test_one_trainer_waits_for_a_round_trip_over_its_link() -> None:
    model = _model()
    one = model.predict(workers=1, ps=1)
    # 4 MB out and 4 MB back over 12.5 MB/s, the server's 3 ms update: the cycle with prefetch=1.
    trip = 2 * 4 * MB / (12.5 * MB) + 0.003
    assert one.steps_per_s == pytest.approx(1 / trip)
    assert one.samples_per_s == pytest.approx(128 / trip)
    assert one.bottleneck == "trainers"
    # Without prefetch the gradient is computed after the reply, not during the exchange.
    assert model.replace(prefetch=0).predict(workers=1, ps=1).steps_per_s == \
        pytest.approx(1 / (trip + 0.01))
    # Two exchanges in flight keep both directions of the link busy: twice the rate.
    assert model.replace(prefetch=2).predict(workers=1, ps=1).steps_per_s == \
        pytest.approx(2 / trip)


def test_one_server_saturates_its_link_and_more_servers_lift_the_limit() -> None:
    model = _model()
    # Many trainers, one server on its own host: its link carries 4 MB a step each way.
    assert model.predict(workers=16, ps=1).steps_per_s == pytest.approx(12.5 / 4)
    assert model.predict(workers=16, ps=1).bottleneck == "links"
    rates = [model.predict(workers=16, ps=p).steps_per_s for p in (1, 2, 4)]
    assert rates == pytest.approx([12.5 / 4 * p for p in (1, 2, 4)])
    # Each trainer's own link then limits: 16 trainers can do at most 16 round trips at once.
    assert model.predict(workers=16, ps=64).bottleneck == "trainers"


def test_a_costly_optimizer_makes_the_servers_the_bottleneck() -> None:
    # A fast link and a slow optimizer step (100 ns a parameter: 0.1 s per update of 1 M).
    model = _model(link_bytes_per_s=10_000 * MB, update_s_per_param=1e-7)
    assert model.predict(workers=8, ps=1).bottleneck == "servers"
    assert model.predict(workers=8, ps=1).steps_per_s == pytest.approx(10.0)
    assert model.predict(workers=8, ps=4).steps_per_s == pytest.approx(40.0, rel=0.01)


def test_shared_cores_cap_emulated_hosts() -> None:
    # Eight hosts sharing two cores: 20 trainers' gradients at 0.1 s each need 2 cores for
    # 20 steps a second at most.
    model = _model(compute_s=0.1, link_bytes_per_s=1e6 * MB, update_s_per_param=0.0,
                   hosts=None, shared_cores=2.0)
    assert model.predict(workers=20, ps=10).bottleneck == "cores"
    assert model.predict(workers=20, ps=10).steps_per_s == pytest.approx(20.0)


def test_the_soft_minimum_is_below_the_smallest_bound_and_close_to_it_when_one_dominates() -> None:
    sharp = _model()
    soft = _model(sharpness=3.0)
    for w, p in [(1, 1), (4, 1), (4, 4), (64, 8)]:
        hard = sharp.predict(workers=w, ps=p).steps_per_s
        assert soft.predict(workers=w, ps=p).steps_per_s < hard
        assert soft.predict(workers=w, ps=p).steps_per_s > 0.7 * hard
    # One bound far below the others: the soft minimum is within 1% of it.
    far = _model(sharpness=3.0, update_s_per_param=1e-6, link_bytes_per_s=1e6 * MB)
    assert far.predict(workers=8, ps=1).steps_per_s == pytest.approx(1.0, rel=0.01)


def test_overlap_shortens_a_trainers_round_trip_with_several_servers() -> None:
    fair, serial = _model(overlap=0.0), _model(overlap=1.0)
    assert fair.predict(workers=1, ps=4).steps_per_s == pytest.approx(
        fair.predict(workers=1, ps=1).steps_per_s, rel=0.01)
    # Pushes one after another, each reply right behind its push: 4 MB out, then 1 MB back.
    trip = (4 + 1) * MB / (12.5 * MB) + 3e-9 * 250_000
    assert serial.predict(workers=1, ps=4).steps_per_s == pytest.approx(1 / trip)


def test_predictions_reach_a_thousand_workers_and_never_fall_with_more_workers() -> None:
    model = _model(sharpness=3.0)
    for ps in (1, 8, 64):
        rates = [p.steps_per_s for p in model.curve([1, 2, 4, 16, 64, 256, 1000], ps=ps)]
        assert all(b >= a * 0.999 for a, b in zip(rates, rates[1:]))
    top = model.predict(workers=1000, ps=64)
    assert top.bottleneck == "links" and math.isfinite(top.steps_per_s)


def test_recommendation_grows_with_workers_and_shrinks_with_faster_links() -> None:
    model = _model(sharpness=3.0)
    picks = [model.recommend_ps(workers=w).ps for w in (1, 4, 16, 64)]
    assert picks[0] == 1
    assert picks == sorted(picks) and picks[-1] > picks[1] > 1
    # A 10,000x faster link and a 10x slower gradient: compute dominates, one server is enough.
    fast = model.replace(link_bytes_per_s=125_000 * MB, compute_s=0.1)
    assert fast.recommend_ps(workers=4).ps == 1
    choice = model.recommend_ps(workers=16)
    assert choice.predicted.ps == choice.ps and len(choice.candidates) == 16
    assert f"ps={choice.ps} for 16 trainers" in choice.describe()
    assert "ps=1:" in choice.describe()


def test_calibration_recovers_hidden_factors_and_predicts_other_points() -> None:
    truth = _model(sharpness=3.0, link_efficiency=0.7, overlap=0.4)
    measured = {(w, p): truth.predict(workers=w, ps=p).steps_per_s
                for w in (1, 2, 4) for p in (1, 2, 4)}
    on = [(1, 1), (4, 1), (4, 4)]
    guess = truth.replace(link_efficiency=1.0, overlap=0.0)
    fitted = calibrate(guess, [Measured(w, p, measured[(w, p)]) for w, p in on],
                       fit=("link_efficiency", "overlap"))
    assert fitted.link_efficiency == pytest.approx(0.7, rel=0.02)
    assert fitted.overlap == pytest.approx(0.4, abs=0.03)
    others = [Measured(w, p, r) for (w, p), r in measured.items() if (w, p) not in on]
    assert max(abs(e) for e in relative_errors(fitted, others)) < 0.01
    # The uncalibrated guess was off on the same points: calibration did the work.
    assert max(abs(e) for e in relative_errors(guess, others)) > 0.2


def test_calibration_refuses_bad_input() -> None:
    with pytest.raises(InvalidInput) as info:
        calibrate(_model(), [Measured(1, 1, 0.0)], fit=("link_efficiency", "speed"))
    text = str(info.value)
    assert "fit='speed' is unknown" in text
    assert "1 measured points cannot fit 2 factors" in text
    assert "steps_per_s=0.0" in text


def test_invalid_settings_are_named() -> None:
    with pytest.raises(InvalidInput) as info:
        _model(n_params=0, link_bytes_per_s=-1.0, overlap=2.0, prefetch=-1, hosts=0)
    text = str(info.value)
    for name in ("n_params=0", "link_bytes_per_s=-1.0", "overlap=2.0", "prefetch=-1", "hosts=0"):
        assert name in text
    with pytest.raises(InvalidInput, match="workers=0"):
        _model().predict(workers=0, ps=1)
