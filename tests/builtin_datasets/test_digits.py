"""Tests of the digits data set: shapes, reproducibility, the fixed split, and usefulness."""

from __future__ import annotations

import time

import dask
import numpy as np
import pytest
from distributed import Client
from sklearn.base import ClassifierMixin
from sklearn.datasets import load_digits
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import train_test_split
from sklearn.neighbors import KNeighborsClassifier

from dask_train.datasets import digits, digits_test, digits_train
from dask_train.datasets._digits import BLOCK_TASK_PREFIX
from dask_train.errors import InvalidInput


def _sklearn_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    bunch = load_digits()
    X_train, X_test, y_train, y_test = train_test_split(
        bunch.data, bunch.target, test_size=0.2, stratify=bunch.target, random_state=0
    )
    return X_train / 16.0, y_train, X_test / 16.0, y_test


def test_shapes_dtypes_and_chunks() -> None:
    X, y = digits(1_050, chunks=500)

    assert X.shape == (1_050, 64)
    assert y.shape == (1_050,)
    assert X.dtype == np.float32
    assert y.dtype == np.int64
    assert X.chunks == ((500, 500, 50), (64,))
    assert y.chunks == ((500, 500, 50),)


def test_values_in_unit_interval_and_labels_are_digits(client: Client) -> None:
    X, y = digits(3_000, chunks=1_000, seed=3, noise=0.3, max_shift=2)

    X_np, y_np = client.compute([X, y], sync=True)

    assert X_np.shape == (3_000, 64)
    assert X_np.dtype == np.float32
    assert X_np.min() >= 0.0
    assert X_np.max() <= 1.0
    assert set(np.unique(y_np)) == set(range(10))


def test_same_seed_same_data_other_seed_other_data(client: Client) -> None:
    first = client.compute(list(digits(2_000, chunks=700, seed=1)), sync=True)
    again = client.compute(list(digits(2_000, chunks=700, seed=1)), sync=True)
    other = client.compute(list(digits(2_000, chunks=700, seed=2)), sync=True)

    np.testing.assert_array_equal(first[0], again[0])
    np.testing.assert_array_equal(first[1], again[1])
    assert not np.array_equal(first[0], other[0])
    assert not np.array_equal(first[1], other[1])


def test_blocks_do_not_depend_on_where_they_run(client: Client) -> None:
    X, y = digits(1_500, chunks=500, seed=4)

    on_cluster = client.compute([X, y], sync=True)
    in_process = dask.compute(X, y, scheduler="sync")

    np.testing.assert_array_equal(on_cluster[0], in_process[0])
    np.testing.assert_array_equal(on_cluster[1], in_process[1])


def test_test_and_train_parts_are_the_untouched_sklearn_split() -> None:
    X_train_ref, y_train_ref, X_test_ref, y_test_ref = _sklearn_split()

    X_test, y_test = digits_test()
    X_train, y_train = digits_train()

    assert X_test.shape == (360, 64)
    assert X_test.dtype == np.float32
    assert y_test.dtype == np.int64
    np.testing.assert_array_equal(X_test, X_test_ref.astype(np.float32))
    np.testing.assert_array_equal(y_test, y_test_ref)
    np.testing.assert_array_equal(X_train, X_train_ref.astype(np.float32))
    np.testing.assert_array_equal(y_train, y_train_ref)


def test_the_bundled_file_is_read_as_load_digits_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Read from scikit-learn's file without importing scikit-learn, or through load_digits
    where the file is not found: the same pixels and labels either way."""
    import importlib.util

    from dask_train.datasets import _digits

    bunch = load_digits()
    pixels, labels = _digits._load_digits()
    np.testing.assert_array_equal(pixels, bunch.data)
    np.testing.assert_array_equal(labels, bunch.target)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    pixels, labels = _digits._load_digits()
    np.testing.assert_array_equal(pixels, bunch.data)
    np.testing.assert_array_equal(labels, bunch.target)


def test_the_held_out_split_imports_neither_scikit_learn_nor_dask_array() -> None:
    """A plain torch script that only scores on the held-out split pays for neither (0.7 s and
    0.3-0.9 s to import); a worker generating rows does not import scikit-learn either."""
    import json
    import subprocess
    import sys

    code = ("import sys, json, dask_train as dt; dt.datasets.digits_test(); "
            "print(json.dumps(['sklearn' in sys.modules, 'dask.array' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [False, False]
    code = ("import sys, json; from dask_train.datasets._digits import _generate_block; "
            "_generate_block(seed=0, block_index=0, size=10, max_shift=1, noise=0.1); "
            "print(json.dumps('sklearn' in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert json.loads(out.stdout.strip().splitlines()[-1]) is False


def test_returned_parts_are_copies_the_cache_cannot_be_corrupted() -> None:
    X_test, _ = digits_test()
    X_test[:] = -1.0

    assert digits_test()[0].min() >= 0.0


def test_without_augmentation_rows_are_training_images_with_their_labels() -> None:
    X, y = digits(500, chunks=200, max_shift=0, noise=0.0)
    X_np, y_np = dask.compute(X, y, scheduler="sync")
    X_train, y_train = digits_train()

    # Each generated row equals some training image, and carries that image's label.
    matches = (X_np[:, None, :] == X_train[None, :, :]).all(axis=2)
    assert matches.any(axis=1).all()
    row, image = np.nonzero(matches)
    np.testing.assert_array_equal(y_np[row], y_train[image])


def test_augmented_rows_are_not_copies_of_training_images() -> None:
    X, _ = digits(500, chunks=500, seed=5)
    X_np = X.compute(scheduler="sync")
    X_train, _ = digits_train()

    distance = np.abs(X_np[:, None, :] - X_train[None, :, :]).sum(axis=2).min(axis=1)
    assert (distance > 0).all()


def _shifted(images: np.ndarray, *, dy: int, dx: int) -> np.ndarray:
    """Shift by slicing, an implementation independent of the library's gather."""
    out = np.zeros_like(images)
    rows_to, rows_from = slice(max(dy, 0), 8 + min(dy, 0)), slice(max(-dy, 0), 8 + min(-dy, 0))
    cols_to, cols_from = slice(max(dx, 0), 8 + min(dx, 0)), slice(max(-dx, 0), 8 + min(-dx, 0))
    out[:, rows_to, cols_to] = images[:, rows_from, cols_from]
    return out


def test_each_row_is_a_zero_filled_shift_of_a_training_image_with_its_label() -> None:
    X, y = digits(600, chunks=300, max_shift=2, noise=0.0, seed=6)
    X_np, y_np = dask.compute(X, y, scheduler="sync")
    X_train, y_train = digits_train()
    images = X_train.reshape(-1, 8, 8)

    known: dict[bytes, set[int]] = {}
    for dy in range(-2, 3):
        for dx in range(-2, 3):
            for row, label in zip(_shifted(images, dy=dy, dx=dx).reshape(-1, 64), y_train):
                known.setdefault(row.tobytes(), set()).add(int(label))

    assert all(int(label) in known.get(row.tobytes(), set()) for row, label in zip(X_np, y_np))
    # Shifted, not merely copied: most rows differ from every unshifted training image.
    unshifted = {row.tobytes() for row in X_train}
    assert sum(row.tobytes() not in unshifted for row in X_np) > len(X_np) // 2


@pytest.mark.parametrize(
    ("model", "augmentation"),
    [
        # A linear model cannot undo translations (it scores about 0.81 with the default 1-pixel
        # shifts), so it checks labels and noise on unshifted rows; nearest neighbours check the
        # default augmentation.
        (LogisticRegression(max_iter=500), {"max_shift": 0}),
        (KNeighborsClassifier(n_neighbors=5), {}),
    ],
    ids=["logistic-regression-no-shift", "nearest-neighbours-default"],
)
def test_generated_rows_teach_a_classifier(
    client: Client, model: ClassifierMixin, augmentation: dict
) -> None:
    # 10,000 rows: logistic regression 0.96-0.97 and nearest neighbours 0.97 on them (0.96-0.99
    # on 20,000), with half the fitting.
    X, y = digits(10_000, chunks=5_000, seed=7, **augmentation)
    X_np, y_np = client.compute([X, y], sync=True)
    X_test, y_test = digits_test()

    model.fit(X_np, y_np)

    assert model.score(X_test, y_test) >= 0.9


def test_huge_request_builds_one_small_task_per_block_without_computing() -> None:
    start = time.perf_counter()
    X, y = digits(10**8, chunks=50_000)
    elapsed = time.perf_counter() - start

    # 2,000 blocks: graph construction only, nothing of size n_samples (Dask's per-block cost is
    # about 1 ms here, so allow for a slow CI machine).
    assert elapsed < 20
    assert X.numblocks == (2_000, 1)
    generating = [k for k in dict(X.__dask_graph__()) if str(k).startswith(BLOCK_TASK_PREFIX)]
    assert len(generating) == 2_000
    y_generating = {k for k in dict(y.__dask_graph__()) if str(k).startswith(BLOCK_TASK_PREFIX)}
    assert y_generating == set(generating)


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"n_samples": 0}, ["n_samples=0"]),
        ({"n_samples": 10.5}, ["n_samples=10.5"]),
        ({"chunks": 0, "max_shift": 4}, ["chunks=0", "max_shift=4"]),
        ({"noise": -0.1, "seed": -1}, ["seed=-1", "noise=-0.1"]),
        ({"noise": float("nan")}, ["noise=nan"]),
    ],
)
def test_invalid_arguments_are_all_reported(kwargs: dict, names: list[str]) -> None:
    with pytest.raises(InvalidInput) as info:
        digits(**kwargs)

    assert len(info.value.problems) == len(names)
    for problem, name in zip(info.value.problems, names):
        assert problem.startswith(name)
