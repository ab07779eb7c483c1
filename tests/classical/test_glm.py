"""GLM estimators on a real 2-worker cluster: coefficients against scikit-learn, input errors, API checks."""

from __future__ import annotations

import copy
import pickle
import warnings
from typing import Any

import dask.array as da
import dask.dataframe as dd
import joblib
import numpy as np
import pandas as pd
import pytest
import sklearn.linear_model as sk
from distributed import Client
from sklearn.base import clone
from sklearn.exceptions import ConvergenceWarning
from sklearn.model_selection import GridSearchCV
from sklearn.utils.estimator_checks import check_estimator

import dask_train as dt

TOL = 1e-4  # coefficients must agree with scikit-learn's to this (absolute)
CHUNKS = 150  # 4 blocks of the 600 rows, spread over both workers


@pytest.fixture(scope="module")
def binary() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    X = rng.normal(size=(600, 4)) * [1.0, 2.0, 0.5, 1.0] + [0.0, 1.0, 0.0, -1.0]
    z = X @ np.array([1.0, -0.5, 2.0, 0.0]) + 0.3
    y = (rng.random(600) < 1 / (1 + np.exp(-z))).astype(int)
    return X, y


def _dask(X: np.ndarray, y: np.ndarray) -> tuple[da.Array, da.Array]:
    return da.from_array(X, chunks=(CHUNKS, -1)), da.from_array(y, chunks=CHUNKS)


def _assert_coef(ours: Any, ref: Any) -> None:
    np.testing.assert_allclose(ours.coef_, ref.coef_, atol=TOL, rtol=0)
    np.testing.assert_allclose(ours.intercept_, ref.intercept_, atol=TOL, rtol=0)


@pytest.mark.parametrize("solver", ["lbfgs", "newton", "gradient_descent", "proximal_grad"])
@pytest.mark.parametrize("penalty", ["l2", "none"])
def test_logistic_matches_sklearn(client: Client, binary: Any, penalty: str, solver: str) -> None:
    X, y = binary
    C = 0.05 if penalty == "l2" else np.inf  # a penalty strong enough to move the coefficients
    ref = sk.LogisticRegression(C=C, l1_ratio=0.0, tol=1e-10, max_iter=10_000).fit(X, y)
    # First-order solvers converge linearly: a looser tol still puts the coefficients within 1e-5.
    tol = 1e-9 if solver in ("lbfgs", "newton") else 1e-6
    ours = dt.LogisticRegression(penalty, C=0.05, solver=solver, tol=tol, max_iter=2000,
                                 client=client).fit(*_dask(X, y))
    _assert_coef(ours, ref)
    assert ours.coef_.shape == (1, 4) and ours.intercept_.shape == (1,)
    assert list(ours.classes_) == [0, 1]
    assert ours.n_iter_ == len(ours.loss_history_) >= 1
    if solver != "proximal_grad":  # FISTA's momentum may go uphill for a step; the others may not
        assert np.all(np.diff(ours.loss_history_) <= 1e-10)


@pytest.mark.parametrize("solver", ["newton", "proximal_grad"])
def test_logistic_l1_matches_liblinear_and_saga(client: Client, binary: Any, solver: str) -> None:
    X, y = binary
    # liblinear penalises the intercept, so it is compared without one; saga with one.
    lib = sk.LogisticRegression(C=0.02, l1_ratio=1.0, solver="liblinear", fit_intercept=False,
                                tol=1e-12, max_iter=10_000).fit(X, y)
    tol = 1e-10 if solver == "newton" else 1e-6
    ours = dt.LogisticRegression("l1", C=0.02, solver=solver, fit_intercept=False, tol=tol,
                                 max_iter=5000, client=client).fit(*_dask(X, y))
    np.testing.assert_allclose(ours.coef_, lib.coef_, atol=TOL, rtol=0)
    assert np.sum(ours.coef_ == 0) >= 1  # the L1 term set a coefficient exactly to zero

    saga = sk.LogisticRegression(C=0.02, l1_ratio=1.0, solver="saga", tol=1e-12,
                                 max_iter=100_000).fit(X, y)
    ours = dt.LogisticRegression("l1", C=0.02, solver=solver, tol=tol, max_iter=5000,
                                 client=client).fit(*_dask(X, y))
    _assert_coef(ours, saga)


def test_logistic_elasticnet_matches_saga(client: Client, binary: Any) -> None:
    X, y = binary
    saga = sk.LogisticRegression(C=0.05, l1_ratio=0.5, solver="saga", tol=1e-12,
                                 max_iter=100_000).fit(X, y)
    ours = dt.LogisticRegression("elasticnet", C=0.05, l1_ratio=0.5, solver="newton", tol=1e-10,
                                 client=client).fit(*_dask(X, y))
    _assert_coef(ours, saga)


def test_multinomial_matches_sklearn(client: Client) -> None:
    rng = np.random.default_rng(3)
    X = rng.normal(size=(600, 3))
    y = np.array(["a", "b", "c"])[(X @ rng.normal(size=(3, 3)) + rng.gumbel(size=(600, 3))).argmax(1)]
    ref = sk.LogisticRegression(C=0.5, tol=1e-10, max_iter=10_000).fit(X, y)
    for solver in ("lbfgs", "newton"):
        ours = dt.LogisticRegression(C=0.5, solver=solver, tol=1e-9, client=client).fit(X, y)
        _assert_coef(ours, ref)
        assert list(ours.classes_) == ["a", "b", "c"]
        np.testing.assert_allclose(ours.predict_proba(X), ref.predict_proba(X), atol=TOL)
        assert (ours.predict(X) == ref.predict(X)).mean() == 1.0


def test_predictions_are_dask_arrays_aligned_with_x(client: Client, binary: Any) -> None:
    X, y = binary
    Xd = da.from_array(X, chunks=((100, 250, 250), (4,)))
    clf = dt.LogisticRegression(C=1.0, client=client).fit(Xd, da.from_array(y, chunks=100))
    proba, pred, dec = clf.predict_proba(Xd), clf.predict(Xd), clf.decision_function(Xd)
    assert isinstance(proba, da.Array) and isinstance(pred, da.Array) and isinstance(dec, da.Array)
    assert proba.chunks == (Xd.chunks[0], (2,)) and pred.chunks == (Xd.chunks[0],)
    np.testing.assert_allclose(proba.compute(), clf.predict_proba(X))
    np.testing.assert_array_equal(pred.compute(), clf.predict(X))
    ref = sk.LogisticRegression(C=1.0, tol=1e-10).fit(X, y)
    assert clf.score(Xd, da.from_array(y, chunks=100)) == pytest.approx(ref.score(X, y), abs=1e-9)


def test_linear_regression_matches_sklearn(client: Client) -> None:
    rng = np.random.default_rng(4)
    X = rng.normal(size=(500, 5)) * [1, 3, 0.2, 1, 1]
    y = X @ rng.normal(size=5) + 2.0 + rng.normal(size=500)
    Xd, yd = da.from_array(X, chunks=(125, -1)), da.from_array(y, chunks=125)
    ols = dt.LinearRegression(client=client).fit(Xd, yd)
    _assert_coef(ols, sk.LinearRegression().fit(X, y))
    assert ols.coef_.shape == (5,) and isinstance(ols.intercept_, float)
    assert ols.score(Xd, yd) == pytest.approx(sk.LinearRegression().fit(X, y).score(X, y), abs=1e-9)
    # penalty="l2" is scikit-learn's ElasticNet(l1_ratio=0) objective: Ridge with alpha * n_samples.
    ridge = dt.LinearRegression("l2", alpha=0.1, solver="lbfgs", tol=1e-10, client=client).fit(Xd, yd)
    _assert_coef(ridge, sk.Ridge(alpha=0.1 * len(X)).fit(X, y))
    for solver in ("newton", "proximal_grad"):
        lasso = dt.LinearRegression("l1", alpha=0.3, solver=solver, max_iter=5000,
                                    tol=1e-10 if solver == "newton" else 1e-6, client=client).fit(Xd, yd)
        _assert_coef(lasso, sk.Lasso(alpha=0.3, tol=1e-12, max_iter=100_000).fit(X, y))


def test_poisson_matches_sklearn(client: Client) -> None:
    rng = np.random.default_rng(5)
    X = rng.normal(size=(500, 4))
    y = rng.poisson(np.exp(X @ np.array([0.3, -0.2, 0.1, 0.0]) + 0.5))
    ref = sk.PoissonRegressor(alpha=0.05, tol=1e-12, max_iter=10_000).fit(X, y)
    for solver in ("lbfgs", "newton"):
        ours = dt.PoissonRegression(alpha=0.05, solver=solver, tol=1e-10, client=client)
        ours.fit(*_dask(X, y))
        _assert_coef(ours, ref)
        np.testing.assert_allclose(ours.predict(X), ref.predict(X), rtol=1e-4)


def test_dataframe_input(client: Client, binary: Any) -> None:
    X, y = binary
    frame = pd.DataFrame(X, columns=["a", "b", "c", "d"])
    df = dd.from_pandas(frame, npartitions=3)
    ys = dd.from_pandas(pd.Series(y, name="y"), npartitions=3)
    clf = dt.LogisticRegression(C=0.05, tol=1e-9, client=client).fit(df, ys)
    _assert_coef(clf, sk.LogisticRegression(C=0.05, tol=1e-10).fit(X, y))
    assert list(clf.feature_names_in_) == ["a", "b", "c", "d"]
    assert clf.predict(df).numblocks == (3,)
    np.testing.assert_array_equal(clf.predict(df).compute(), clf.predict(frame))

    with_text = dd.from_pandas(frame.assign(city="x"), npartitions=3)
    with pytest.raises(dt.InvalidInput) as err:
        clf.fit(with_text, ys)
    assert "non-numeric columns ['city']" in str(err.value)


def _transitions(client: Client) -> int:
    return int(client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.transition_counter))


def test_every_problem_is_reported_at_once_before_any_work(client: Client, binary: Any) -> None:
    X, y = binary
    before = _transitions(client)
    bad = dt.LogisticRegression(C=-1.0, solver="lbfgs", penalty="l1", max_iter=0, client=client)
    with pytest.raises(dt.InvalidInput) as err:
        bad.fit(X, y[:-5])
    assert _transitions(client) == before  # nothing was submitted to the cluster
    text = str(err.value)
    for needle in ("C=-1.0", "solver='lbfgs' does not support penalty='l1'", "max_iter=0",
                   "y has 595 rows but X has 600"):
        assert needle in text
    assert len(err.value.problems) == 4


def test_value_problems_of_dask_input_stop_the_fit_before_the_solver(client: Client, binary: Any) -> None:
    X, y = binary
    X_nan = X.copy()
    X_nan[7, 1] = np.nan
    with pytest.raises(dt.InvalidInput) as err:
        dt.LogisticRegression(client=client).fit(*_dask(X_nan, y + 0.5))
    assert "X contains NaN (1 values)" in str(err.value)
    assert "Unknown label type: continuous" in str(err.value)
    with pytest.raises(dt.InvalidInput, match="y has negative values"):
        dt.PoissonRegression(client=client).fit(*_dask(X, y - 1))
    with pytest.raises(dt.InvalidInput, match="only one class"):
        dt.LogisticRegression(client=client).fit(*_dask(X, np.zeros_like(y)))
    with pytest.raises(dt.InvalidInput, match="y has 300 rows but X has 600"):
        dt.LinearRegression(client=client).fit(da.from_array(X, chunks=CHUNKS),
                                               da.from_array(y[:300], chunks=CHUNKS))
    with pytest.raises(dt.InvalidInput, match="X has shape .* expecting 4 features"):
        dt.LinearRegression(client=client).fit(X, y).predict(da.ones((3, 2)))


def test_newton_refuses_a_huge_hessian(client: Client) -> None:
    X = np.zeros((3, 5000))
    with pytest.raises(dt.InvalidInput, match="solver='newton' with 5001 parameters"):
        dt.LinearRegression(solver="newton", client=client).fit(X, np.zeros(3))


def test_a_solver_that_runs_out_of_iterations_warns(client: Client, binary: Any) -> None:
    X, y = binary
    with pytest.warns(ConvergenceWarning, match="max_iter"):
        clf = dt.LogisticRegression(solver="gradient_descent", max_iter=2, tol=1e-12, client=client)
        clf.fit(X, y)
    assert clf.n_iter_ == 2


def test_clone_and_pickle_keep_the_estimator_usable(client: Client, binary: Any) -> None:
    X, y = binary
    clf = dt.LogisticRegression(C=0.3, client=client)
    copied = clone(clf)
    assert copied.client is client and copied.C == 0.3
    fitted = pickle.loads(pickle.dumps(copied.fit(X, y)))
    assert fitted.client is None
    np.testing.assert_allclose(fitted.predict_proba(X), copied.predict_proba(X))


@pytest.mark.parametrize("cls", [dt.LogisticRegression, dt.LinearRegression, dt.PoissonRegression])
def test_the_client_survives_deepcopy_clone_and_set_params_as_itself(client: Client, cls: Any) -> None:
    est = cls(tol=1e-3, client=client)
    assert copy.deepcopy(est).client is client
    assert clone(est).client is client
    assert clone(clone(est)).client is client
    params = est.get_params()
    copied = copy.deepcopy(params)  # what check_estimator and GridSearchCV's cloning do
    assert copied["client"] is params["client"] and copied["client"] == est.get_params()["client"]
    assert joblib.hash(copied) == joblib.hash(est.get_params())
    assert pickle.loads(pickle.dumps(params))["client"] is None  # the connection does not travel
    other = cls().set_params(**copied)
    assert other.client is client
    assert other.get_params(deep=False)["client"] is copied["client"]  # stored as given
    assert cls(client=params["client"]).client is client
    assert copy.deepcopy(cls()).client is None and clone(cls()).client is None


def test_grid_search_over_estimators_with_a_client(client: Client, binary: Any) -> None:
    X, y = binary
    search = GridSearchCV(dt.LogisticRegression(solver="newton", client=client),
                          {"C": [0.01, 1.0]}, cv=2).fit(X, y)
    assert search.best_estimator_.client is client
    assert search.best_params_["C"] in (0.01, 1.0) and 0.5 < search.best_score_ <= 1.0
    reg = GridSearchCV(dt.LinearRegression(client=client), {"alpha": [0.0, 1.0]}, cv=2)
    reg.fit(X, X @ np.array([1.0, 2.0, 0.0, -1.0]))
    assert reg.best_params_ == {"alpha": 0.0} and reg.best_estimator_.client is client


# scikit-learn's estimator checks. check_array_api_input is the one check sklearn skips here: it
# needs SCIPY_ARRAY_API=1 and estimators that compute with the array API; these compute with numpy
# on the workers (array_api_support stays False), so it does not apply.
NOT_APPLICABLE = {"check_array_api_input"}


# The checks test the estimator contract (input handling, fitted attributes, clone, pickle), which
# is the same code for every solver; they run with solver="newton" because its ~8 iterations per fit
# keep the ~150 fits of the suite at a few seconds (lbfgs needs up to 100 task round trips per fit:
# 4x longer). The lbfgs path is checked against scikit-learn's coefficients above.
# They run with client= given (the checks deep-copy, hash and pickle the parameters: the client must
# survive each as itself), and once without (client=None: the current client).
@pytest.mark.parametrize(
    ("estimator", "given"),
    [(dt.LogisticRegression(solver="newton"), True), (dt.LinearRegression(), True),
     (dt.PoissonRegression(solver="newton"), True), (dt.LogisticRegression(solver="newton"), False)],
    ids=lambda v: type(v).__name__ if not isinstance(v, bool) else ("client" if v else "no-client"),
)
def test_sklearn_estimator_checks(client: Client, estimator: Any, given: bool) -> None:
    if given:
        estimator = clone(estimator).set_params(client=client)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        results = check_estimator(estimator, on_fail=None, on_skip=None)
    failed = [f"{r['check_name']}: {r['exception']!r}" for r in results
              if r["status"] != "passed" and r["check_name"] not in NOT_APPLICABLE]
    assert not failed, "\n".join(failed)
    assert len([r for r in results if r["status"] == "passed"]) >= 45
