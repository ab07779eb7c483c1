"""A script that makes many estimators, copies them as scikit-learn's tools do and fits them ends
quietly: no "Exception ignored" and no traceback on stderr (issue 55).

The noise it printed was ``BaseEventLoop.__del__``'s AttributeError ('_UnixSelectorEventLoop' object
has no attribute '_closed'): deep-copying a Client (check_set_params' ``deepcopy(get_params())``)
made half-built copies of its event loop, through ``__new__`` without ``__init__``, and the copy
failed on an ``asyncio.Task``; the half-built loops were collected at exit. The estimators' client
parameter now deep-copies to itself (see dask_train.classical._glm).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

SCRIPT = """
import copy
import warnings

import numpy as np
from sklearn.base import clone
from sklearn.exceptions import ConvergenceWarning
from sklearn.model_selection import GridSearchCV
from sklearn.utils.estimator_checks import check_estimators_overwrite_params, check_set_params

import dask_train as dt


def main() -> None:
    client = dt.connect(n_workers=2, quiet=True)
    rng = np.random.default_rng(0)
    X = rng.normal(size=(200, 3))
    y = (X[:, 0] > 0).astype(int)
    kinds = [dt.LogisticRegression, dt.LinearRegression, dt.PoissonRegression]
    for i in range(20):
        est = kinds[i % 3](solver="newton", tol=1e-3, client=client)
        est = clone(copy.deepcopy(est))
        copy.deepcopy(est.get_params())
        est.fit(X, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        for kind in kinds:
            est = kind(solver="newton", client=client)
            check_set_params(kind.__name__, est)
            check_estimators_overwrite_params(kind.__name__, est)
    GridSearchCV(dt.LogisticRegression(solver="newton", client=client), {"C": [0.1, 1.0]},
                 cv=2).fit(X, y)
    print("fitted")


if __name__ == "__main__":
    main()
"""


@pytest.mark.timeout(240)
def test_a_script_of_many_estimators_ends_quietly(tmp_path: Path) -> None:
    script = tmp_path / "many_estimators.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    env.pop("DASK_SCHEDULER_ADDRESS", None)  # the script's own embedded cluster
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=200, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "fitted"
    assert "Exception ignored" not in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
