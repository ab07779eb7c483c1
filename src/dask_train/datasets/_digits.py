"""Handwritten digits, inflated to any size by augmentation generated block by block on the workers."""

from __future__ import annotations

import functools
import gzip
import importlib.util
import math
import numbers
import os
from typing import TYPE_CHECKING

import dask
import numpy as np
from dask.base import tokenize

from dask_train.errors import InvalidInput

if TYPE_CHECKING:
    import dask.array as da

_SIDE = 8
_N_FEATURES = _SIDE * _SIDE
_MAX_SHIFT_LIMIT = 3
# The split is fixed (independent of ``seed``, see _SPLIT_FILE) so every call, every seed and every
# worker agree on which images are held out: augmented training data never leaks test images.
# Prefix of the one task per block that generates rows; named so a graph or the dashboard shows it.
BLOCK_TASK_PREFIX = "digits-block"
# Empty arrays of the right type, so from_delayed need not infer them once per block.
_X_META = np.empty((0, _N_FEATURES), dtype=np.float32)
_Y_META = np.empty((0,), dtype=np.int64)


#: The split, as rows of the bundled file: the training rows then the held-out ones, in the
#: order scikit-learn's ``train_test_split(test_size=0.2, stratify=y, random_state=0)`` gives
#: them (``tests/builtin_datasets`` checks it against scikit-learn). Kept in the package so the split
#: needs no scikit-learn import (0.7 s, in the client and in every worker that generates rows)
#: and stays the same whatever its release.
_SPLIT_FILE = os.path.join(os.path.dirname(__file__), "digits_split.npy")
_N_TRAIN = 1437


def _load_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits as ``(pixels 0..16, labels)``, read from its file without
    importing scikit-learn; through ``load_digits`` where the file is not where it was."""
    spec = importlib.util.find_spec("sklearn")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    path = os.path.join(roots[0], "datasets", "data", "digits.csv.gz") if roots else ""
    if path and os.path.exists(path):
        with gzip.open(path, "rt") as f:  # what load_digits reads, as it reads it
            data = np.loadtxt(f, delimiter=",")
        return data[:, :-1], data[:, -1].astype(int)
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return bunch.data, bunch.target


@functools.lru_cache(maxsize=1)
def _split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Load scikit-learn's bundled digits (no download) and split them once, scaled to [0, 1]."""
    pixels, labels = _load_digits()
    X = (pixels / 16.0).astype(np.float32)
    y = labels.astype(np.int64)
    order = np.load(_SPLIT_FILE).astype(np.intp)
    train, test = order[:_N_TRAIN], order[_N_TRAIN:]
    parts = (X[train], y[train], X[test], y[test])
    # Cached and shared by every block on a worker: read-only so no block can corrupt another.
    for part in parts:
        part.setflags(write=False)
    return parts


def digits_train() -> tuple[np.ndarray, np.ndarray]:
    """Return the un-augmented training part (80 %) of scikit-learn's digits.

    Returns
    -------
    X : numpy.ndarray
        float32 of shape ``(1437, 64)``, pixel intensities scaled to [0, 1].
    y : numpy.ndarray
        int64 labels 0..9 of shape ``(1437,)``.

    Examples
    --------
    >>> X, y = digits_train()
    >>> X.shape, X.dtype, y.dtype
    ((1437, 64), dtype('float32'), dtype('int64'))
    """
    X_train, y_train, _, _ = _split()
    return X_train.copy(), y_train.copy()


def digits_test() -> tuple[np.ndarray, np.ndarray]:
    """Return the held-out part (20 %) of scikit-learn's digits, never augmented.

    Returns
    -------
    X : numpy.ndarray
        float32 of shape ``(360, 64)``, pixel intensities scaled to [0, 1].
    y : numpy.ndarray
        int64 labels 0..9 of shape ``(360,)``.

    Examples
    --------
    >>> X, y = digits_test()
    >>> X.shape, y.shape
    ((360, 64), (360,))
    """
    _, _, X_test, y_test = _split()
    return X_test.copy(), y_test.copy()


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _validate(*, n_samples: int, seed: int, chunks: int, max_shift: int, noise: float) -> None:
    problems = []
    if not _is_int(n_samples) or n_samples < 1:
        problems.append(f"n_samples={n_samples!r} is invalid: use an integer >= 1.")
    if not _is_int(seed) or seed < 0:
        problems.append(f"seed={seed!r} is invalid: use an integer >= 0.")
    if not _is_int(chunks) or chunks < 1:
        problems.append(f"chunks={chunks!r} is invalid: use an integer >= 1 (rows per block).")
    if not _is_int(max_shift) or not 0 <= max_shift <= _MAX_SHIFT_LIMIT:
        problems.append(
            f"max_shift={max_shift!r} is invalid: use an integer from 0 to {_MAX_SHIFT_LIMIT} "
            "(pixels of shift along each axis of the 8x8 image)."
        )
    valid_noise = isinstance(noise, numbers.Real) and not isinstance(noise, bool)
    if not valid_noise or not math.isfinite(noise) or noise < 0:
        problems.append(f"noise={noise!r} is invalid: use a finite number >= 0 (gaussian std).")
    if problems:
        raise InvalidInput(problems)


def _shift_images(*, images: np.ndarray, dy: np.ndarray, dx: np.ndarray, pad: int) -> np.ndarray:
    """Shift each ``(8, 8)`` image by its own ``(dy, dx)``, filling with zeros (no wrap-around)."""
    if pad == 0:
        return images.copy()
    padded = np.pad(images, ((0, 0), (pad, pad), (pad, pad)))
    # shifted[i, r, c] = image[i, r - dy, c - dx] = padded[i, r - dy + pad, c - dx + pad]: one gather
    # for the whole block instead of a Python loop per row.
    offsets = np.arange(_SIDE)
    rows = offsets[None, :] - dy[:, None] + pad
    cols = offsets[None, :] - dx[:, None] + pad
    index = np.arange(len(images))[:, None, None]
    return padded[index, rows[:, :, None], cols[:, None, :]]


def _generate_block(
    *, seed: int, block_index: int, size: int, max_shift: int, noise: float
) -> tuple[np.ndarray, np.ndarray]:
    """Generate one block of augmented training rows; runs on a worker."""
    X_train, y_train, _, _ = _split()
    # Seeded from (seed, block_index) only, so a block is the same whichever worker computes it,
    # however many workers there are and however often it is recomputed after a loss.
    rng = np.random.default_rng(np.random.SeedSequence([seed, block_index]))
    picks = rng.integers(0, len(X_train), size=size)
    dy = rng.integers(-max_shift, max_shift + 1, size=size)
    dx = rng.integers(-max_shift, max_shift + 1, size=size)
    images = X_train[picks].reshape(size, _SIDE, _SIDE)
    X = _shift_images(images=images, dy=dy, dx=dx, pad=max_shift).reshape(size, _N_FEATURES)
    if noise > 0:
        X += np.float32(noise) * rng.standard_normal(X.shape, dtype=np.float32)
    np.clip(X, 0.0, 1.0, out=X)
    return X, y_train[picks]


def digits(
    n_samples: int = 1_100_000,
    *,
    seed: int = 0,
    chunks: int = 50_000,
    max_shift: int = 1,
    noise: float = 0.05,
) -> tuple[da.Array, da.Array]:
    """Handwritten digits as dask arrays of any size, generated on the workers.

    The training 80 % of scikit-learn's bundled digits (see :func:`digits_train`) is inflated to
    ``n_samples`` rows: each row is a random training image shifted by an integer in
    ``[-max_shift, max_shift]`` along each axis (zero fill), plus gaussian noise of std ``noise``,
    clipped to [0, 1]. The held-out 20 % (:func:`digits_test`) is never used, so it stays a fair test.

    Parameters
    ----------
    n_samples : int
        Number of rows to generate, >= 1.
    seed : int
        Seed, >= 0. The same ``seed`` and ``chunks`` give the same data on any cluster.
    chunks : int
        Rows per block; one task generates one block.
    max_shift : int
        Largest shift in pixels along each axis, 0 to 3.
    noise : float
        Standard deviation of the added gaussian noise, >= 0.

    Returns
    -------
    X : dask.array.Array
        float32 of shape ``(n_samples, 64)`` in chunks of ``(chunks, 64)``.
    y : dask.array.Array
        int64 labels 0..9 of shape ``(n_samples,)`` in chunks of ``(chunks,)``.

    Raises
    ------
    InvalidInput
        If any argument is out of range; every problem is listed.

    Examples
    --------
    >>> X, y = digits(1_000, chunks=500)
    >>> X.shape, X.chunks[0], y.dtype
    ((1000, 64), (500, 500), dtype('int64'))
    """
    _validate(n_samples=n_samples, seed=seed, chunks=chunks, max_shift=max_shift, noise=noise)
    # Here, not at the top: the held-out split alone (a plain torch script) never needs it, and
    # a worker generating rows imports this module.
    import dask.array as da

    params = {"seed": int(seed), "max_shift": int(max_shift), "noise": float(noise)}
    # Keys are named from a token of every argument (what pure=True would do per call, but computed
    # once: tokenizing thousands of calls dominated graph construction). Equal calls share keys, and
    # Dask may recompute a lost block anywhere and get the same rows.
    token = tokenize(n_samples, chunks, params)
    generate = dask.delayed(_generate_block, pure=True, nout=2)
    X_parts, y_parts = [], []
    for block_index, start in enumerate(range(0, n_samples, chunks)):
        size = min(chunks, n_samples - start)
        X_block, y_block = generate(
            block_index=block_index,
            size=size,
            **params,
            dask_key_name=f"{BLOCK_TASK_PREFIX}-{token}-{block_index}",
        )
        X_parts.append(
            da.from_delayed(
                X_block,
                shape=(size, _N_FEATURES),
                meta=_X_META,
                name=f"digits-X-{token}-{block_index}",
            )
        )
        y_parts.append(
            da.from_delayed(y_block, shape=(size,), meta=_Y_META, name=f"digits-y-{token}-{block_index}")
        )
    return da.concatenate(X_parts), da.concatenate(y_parts)
