"""One parameter-server shard's state (its flat parameter slice and optimizer state) as tensors.

The optimizer state is stored as safetensors tensors plus JSON text in the file's metadata, never
as a pickle, so reading a checkpoint cannot run code. Hyper-parameters are not restored: they come
from the resumed run's own configuration (a resumed run may lower the learning rate on purpose).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from dask_train.checkpoint._io import (
    PathLike,
    _check_metadata,
    _prepare,
    _read_header,
    _write,
    encode,
    options_of,
)
from dask_train.errors import InvalidInput

# torch and safetensors load inside the functions (see _io): importing the checkpoint package for
# its config or store must not import torch.
if TYPE_CHECKING:
    import torch

PARAM = "param"
#: The model's trained buffers (float64, see ``models._buffers``), in the one shard holding them.
BUFFERS = "buffers"
OPTIM_PREFIX = "optim."
_OPTIMIZER_KEY = "optimizer"
_SCALARS_KEY = "optim_scalars"
_RESERVED = (_OPTIMIZER_KEY, _SCALARS_KEY)


@dataclass
class ShardState:
    """A shard as read back by :func:`load_shard`.

    Attributes
    ----------
    param : torch.Tensor
        The flat parameter slice.
    optimizer_state : dict
        The optimizer's per-parameter state by key (``exp_avg``, ``step``, ...): tensors, or plain
        ints, floats and None.
    optimizer_name : str
        The optimizer's class name, e.g. ``"Adam"``.
    metadata : dict of str to str
        The caller's own metadata given to :func:`save_shard`.
    buffers : torch.Tensor or None
        The model's buffers as a flat float64 vector, when this shard holds them.
    """

    param: torch.Tensor
    optimizer_state: dict[str, Any] = field(default_factory=dict)
    optimizer_name: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    buffers: torch.Tensor | None = None


def _only_param(optimizer: torch.optim.Optimizer, *, where: str) -> torch.Tensor:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if len(params) != 1:
        raise InvalidInput(
            [f"{where}: the optimizer holds {len(params)} parameters; a shard's optimizer must hold "
             "exactly one, the shard's flat parameter slice."]
        )
    return params[0]  # type: ignore[no-any-return]


def save_shard(
    path: PathLike,
    *,
    param: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    metadata: Mapping[str, str] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    buffers: torch.Tensor | None = None,
) -> str:
    """Write a shard's parameters and optimizer state to one safetensors file, atomically.

    Parameters
    ----------
    path : str or os.PathLike
        A local path or an fsspec URL, e.g. from :meth:`CheckpointStore.shard_path`.
    param : torch.Tensor
        The shard's flat parameter slice.
    optimizer : torch.optim.Optimizer
        An optimizer over exactly one parameter, the slice. Tensor state values are stored as
        ``optim.<key>`` tensors; scalar ones (int, float, bool, None) as JSON in the metadata.
    metadata : mapping of str to str, optional
        Extra text (shard index, step, ...), returned as :attr:`ShardState.metadata`. The keys
        ``"optimizer"`` and ``"optim_scalars"`` are reserved.
    storage_options : mapping, optional
        Passed to fsspec (object-store credentials).
    buffers : torch.Tensor, optional
        The model's buffers (running statistics) as one flat vector, stored as the ``buffers``
        tensor of the same file, so parameters and buffers are written in one atomic step.

    Returns
    -------
    str
        ``path`` as given.

    Raises
    ------
    InvalidInput
        If the optimizer does not hold exactly one parameter, a state value is neither a tensor
        nor a plain scalar, or the metadata is not text or uses a reserved key.

    Examples
    --------
    >>> import tempfile, torch
    >>> p = torch.nn.Parameter(torch.zeros(3))
    >>> opt = torch.optim.Adam([p], lr=0.1)
    >>> path = save_shard(tempfile.mkdtemp() + "/shard-0.safetensors", param=p, optimizer=opt)
    >>> load_shard(path).optimizer_name
    'Adam'
    """
    tensors, text = _shard_file(param=param, optimizer=optimizer, metadata=metadata, buffers=buffers,
                                where=f"save_shard({os.fspath(path)!r})")
    _write(tensors=tensors, metadata=text, path=path, storage_options=storage_options)
    return os.fspath(path)


def encode_shard(*, param: torch.Tensor, optimizer: torch.optim.Optimizer,
                 metadata: Mapping[str, str] | None = None,
                 buffers: torch.Tensor | None = None) -> bytes:
    """The file :func:`save_shard` writes, as bytes that share nothing with ``param`` or the
    optimizer's state: a holder encodes under its lock and writes after it (see
    ``engines.holders.optim``), so a slow store holds up that write only, not the training."""
    tensors, text = _shard_file(param=param, optimizer=optimizer, metadata=metadata,
                                buffers=buffers, where="encode_shard")
    return encode(tensors=tensors, metadata=text)


def _shard_file(*, param: torch.Tensor, optimizer: torch.optim.Optimizer,
                metadata: Mapping[str, str] | None, buffers: torch.Tensor | None, where: str
                ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A shard file's checked tensors and text metadata (see :func:`save_shard`)."""
    opt_param = _only_param(optimizer, where=where)
    problems: list[str] = []
    tensors: dict[str, object] = {PARAM: param}
    if buffers is not None:
        tensors[BUFFERS] = buffers
    state, scalars = _split_state(optimizer.state.get(opt_param, {}), problems)
    tensors.update(state)
    problems += [
        f"metadata[{key!r}] is reserved for the optimizer state: use another key."
        for key in (metadata or {}) if key in _RESERVED
    ]
    prepared = _prepare(tensors=tensors, problems=problems)
    text = _check_metadata(metadata=metadata, problems=problems) or {}
    if problems:
        raise InvalidInput(problems)
    text[_OPTIMIZER_KEY] = type(optimizer).__name__
    # allow_nan: a float state such as an infinite running maximum must round-trip exactly.
    text[_SCALARS_KEY] = json.dumps(scalars)
    return prepared, text


def _split_state(state: Mapping[Any, Any], problems: list[str]
                 ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """An optimizer's per-parameter state as ``optim.<key>`` tensors and JSON-able scalars (int,
    float, bool, None); anything else is a problem (it could only be stored as a pickle)."""
    import torch

    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            tensors[f"{OPTIM_PREFIX}{key}"] = value
        elif value is None or isinstance(value, (bool, int, float)):
            scalars[str(key)] = value
        else:
            problems.append(
                f"optimizer state {key!r} is a {type(value).__name__}: only tensors and plain "
                "scalars can be checkpointed without pickle."
            )
    return tensors, scalars


def load_shard(path: PathLike, *, storage_options: Mapping[str, Any] | None = None) -> ShardState:
    """Read a shard written by :func:`save_shard`; never unpickles.

    Parameters
    ----------
    path : str or os.PathLike
        A local path or an fsspec URL.
    storage_options : mapping, optional
        Passed to fsspec.

    Returns
    -------
    ShardState

    Raises
    ------
    InvalidInput
        If the file is not a safetensors file written by :func:`save_shard`.

    Examples
    --------
    >>> import tempfile, torch
    >>> p = torch.nn.Parameter(torch.ones(2))
    >>> path = save_shard(tempfile.mkdtemp() + "/s.safetensors", param=p,
    ...                   optimizer=torch.optim.SGD([p], lr=0.1), metadata={"shard": "0"})
    >>> state = load_shard(path)
    >>> state.param, state.metadata
    (tensor([1., 1.]), {'shard': '0'})
    """
    import safetensors
    import safetensors.torch

    shown = os.fspath(path)
    fs, fs_path = url_to_fs(shown, **options_of(path, storage_options))
    # The header first: a file that is not safetensors fails here with a clear message.
    header = _read_header(fs=fs, fs_path=fs_path, shown=shown)
    text = {str(k): str(v) for k, v in (header.get("__metadata__") or {}).items()}
    fix = "pass a shard file written by save_shard."
    if PARAM not in header or _OPTIMIZER_KEY not in text or _SCALARS_KEY not in text:
        raise InvalidInput([f"path={shown!r} is a safetensors file but not a checkpoint shard: {fix}"])
    try:
        if isinstance(fs, LocalFileSystem):
            tensors = safetensors.torch.load_file(fs_path)
        else:
            tensors = safetensors.torch.load(fs.cat_file(fs_path))
        scalars = json.loads(text.pop(_SCALARS_KEY))
    except (safetensors.SafetensorError, ValueError) as exc:
        raise InvalidInput([f"path={shown!r} is damaged or truncated ({exc}): {fix}"]) from exc
    if not isinstance(scalars, dict):
        raise InvalidInput([f"path={shown!r} has invalid optimizer scalars: {fix}"])
    state: dict[str, Any] = dict(scalars)
    state.update(
        {name[len(OPTIM_PREFIX):]: t for name, t in tensors.items() if name.startswith(OPTIM_PREFIX)}
    )
    name = text.pop(_OPTIMIZER_KEY)
    return ShardState(param=tensors[PARAM], optimizer_state=state, optimizer_name=name, metadata=text,
                      buffers=tensors.get(BUFFERS))


def _copy_for(value: Any, *, shape: torch.Size) -> Any:
    import torch

    if not isinstance(value, torch.Tensor):
        return value
    copy = value.detach().clone()
    # Per-parameter buffers take the parameter's shape; 0-d values such as ``step`` stay scalars.
    return copy.reshape(shape) if copy.dim() > 0 else copy


def restore_optimizer(optimizer: torch.optim.Optimizer, state: ShardState) -> None:
    """Load a shard's optimizer state into ``optimizer``, keeping its own hyper-parameters.

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
        Built by the resumed run over one parameter of the shard's size (typically a
        ``torch.nn.Parameter`` made from ``state.param``).
    state : ShardState
        From :func:`load_shard`.

    Raises
    ------
    InvalidInput
        If the optimizer class or the parameter size differs from the shard's.

    Examples
    --------
    >>> import torch
    >>> old = torch.nn.Parameter(torch.ones(2))
    >>> opt = torch.optim.Adam([old], lr=0.1)
    >>> old.grad = torch.ones(2); opt.step()
    >>> state = ShardState(old.detach().clone(), {k: v.clone() for k, v in opt.state[old].items()}, "Adam")
    >>> new = torch.nn.Parameter(state.param.clone())
    >>> fresh = torch.optim.Adam([new], lr=0.1)
    >>> restore_optimizer(fresh, state)
    >>> int(fresh.state[new]["step"])
    1
    """
    import torch

    param = _only_param(optimizer, where="restore_optimizer")
    problems = []
    name = type(optimizer).__name__
    if name != state.optimizer_name:
        problems.append(
            f"the checkpoint holds {state.optimizer_name or 'no'} optimizer state but the optimizer is "
            f"{name}: resume with the optimizer the checkpoint was written with, or start afresh."
        )
    size = param.numel()
    if state.param.numel() != size:
        problems.append(
            f"the checkpoint's shard has {state.param.numel()} parameters but the optimizer's has "
            f"{size}: resume with the same model and number of parameter servers."
        )
    problems += [
        f"optimizer state {key!r} has {value.numel()} values for a shard of {size}: the checkpoint "
        "does not belong to this model."
        for key, value in state.optimizer_state.items()
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() != size
    ]
    if problems:
        raise InvalidInput(problems)
    # Clones: load_state_dict keeps tensors it need not cast, and a ShardState restored twice must
    # not have two optimizers update one buffer in place.
    values = {key: _copy_for(value, shape=param.shape) for key, value in state.optimizer_state.items()}
    # The optimizer's own groups: hyper-parameters (lr, betas, ...) come from the new run's config.
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [0]} for g in optimizer.param_groups
    ]
    optimizer.load_state_dict({"state": {0: values} if values else {}, "param_groups": groups})


def read_slice(files: Sequence[Mapping[str, Any]], start: int, stop: int) -> Any:
    """The checkpointed state of flat positions ``[start, stop)``, from the shard files covering it.

    ``files`` are the manifest's shard records (``path``, ``start``, ``stop``). The slices may be cut
    differently from the new shards (another number of servers): every optimizer here keeps its
    state element by element, so a slice of the concatenation is exact. Scalar state (Adam's step)
    is the same in every shard and is taken from the first.
    """
    import torch  # here, not at the top: reading a manifest must not import torch

    params: list[Any] = []
    pieces: dict[str, list[Any]] = {}
    first: Any = None
    buffers: Any = None  # in the one shard file that holds them (the first holder's)
    for record in sorted(files, key=lambda r: int(r["start"])):
        lo, hi = max(start, int(record["start"])), min(stop, int(record["stop"]))
        if lo >= hi:
            continue
        shard = load_shard(record["path"])
        first = first or shard
        if shard.buffers is not None:
            buffers = shard.buffers
        a, b = lo - int(record["start"]), hi - int(record["start"])
        params.append(shard.param.reshape(-1)[a:b])
        n = shard.param.numel()
        for key, value in shard.optimizer_state.items():
            if isinstance(value, torch.Tensor) and value.numel() == n and n > 1:
                pieces.setdefault(key, []).append(value.reshape(-1)[a:b])
    if first is None or sum(p.numel() for p in params) != stop - start:
        raise ValueError(
            f"the checkpoint's shard files do not cover parameters [{start}, {stop}); "
            "it was written for another model"
        )
    state = dict(first.optimizer_state)
    state.update({key: torch.cat(parts) for key, parts in pieces.items()})
    return ShardState(param=torch.cat(params), optimizer_state=state,
                      optimizer_name=first.optimizer_name, metadata=dict(first.metadata),
                      buffers=buffers)
