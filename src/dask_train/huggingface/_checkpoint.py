"""Hugging Face's checkpoint directory as the job's checkpoint, and back.

``Trainer`` saves ``checkpoint-<step>/`` as files: the weights (safetensors), the optimizer's,
the scheduler's and the RNG states (``torch.save`` pickles of tensors and plain values), the
trainer's state and the model's config (JSON). :func:`capture` reads what the saving process
wrote into one nested state of tensors, numbers and strings, which ``ctx.report`` writes as every
``dt.run`` checkpoint is written (one safetensors file, the structure as JSON in its header);
:func:`rebuild` writes the files back into a local directory that ``Trainer.train(
resume_from_checkpoint=...)`` reads. The job's checkpoint holds no pickle: the ``.pt`` files HF
loads on resume are written here by ``torch.save`` from tensors the job read back itself, and HF
loads them with ``weights_only=True``.
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any

import numpy as np

from dask_train.errors import InvalidInput

logger = logging.getLogger(__name__)

#: The version of the layout below, checked on restore.
FORMAT = "dask-train.huggingface/1"

#: Files a resume does not read: the pickled ``TrainingArguments`` (HF writes it for people,
#: never loads it), which is not a state of tensors.
SKIPPED = frozenset({"training_args.bin"})

#: Files that are ``torch.save`` pickles of tensors and plain values.
PICKLED = (".pt", ".pth", ".bin")


def capture(directory: str) -> dict[str, Any]:
    """The files of HF's checkpoint ``directory`` as one state (see the module docstring).

    Each file becomes an entry by its path inside the directory: ``{"safetensors": tensors,
    "metadata": header}``, ``{"torch": value}`` (a ``.pt``/``.pth``/``.bin`` loaded with
    ``weights_only=True``), ``{"text": str}`` (JSON and other text) or ``{"bytes": uint8 array}``.
    """
    files: dict[str, Any] = {}
    for root, _dirs, names in os.walk(directory):
        for name in sorted(names):
            path = os.path.join(root, name)
            relative = os.path.relpath(path, directory).replace(os.sep, "/")
            if name in SKIPPED or name.startswith("."):
                continue
            files[relative] = _read(path)
    return {"format": FORMAT, "name": os.path.basename(os.path.normpath(directory)),
            "files": files}


def _read(path: str) -> dict[str, Any]:
    if path.endswith(".safetensors"):
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(path, framework="pt") as f:
            metadata = dict(f.metadata() or {})
        return {"safetensors": load_file(path), "metadata": metadata}
    if path.endswith(PICKLED):
        import torch
        from transformers.trainer_pt_utils import safe_globals

        # Written a moment ago by this process's Trainer; HF reads these files back with
        # weights_only=True (numpy's RNG state allowed by its safe_globals), and so do we.
        with safe_globals():
            return {"torch": torch.load(path, map_location="cpu", weights_only=True)}
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return {"text": raw.decode("utf-8")}
    except UnicodeDecodeError:
        return {"bytes": np.frombuffer(raw, dtype=np.uint8).copy()}


def rng_files(directory: str, rank: int) -> dict[str, Any]:
    """This rank's RNG file of HF's checkpoint ``directory`` as :func:`capture` reads it
    (``{}`` when it wrote none: one process, or a save made elsewhere).

    With several processes HF writes ``rng_state_<rank>.pth`` on every rank (Python's, numpy's
    and torch's generators), each in its own ``output_dir``: rank 0's directory holds only its
    own, or, on a shared disk, the others' only once they got there.
    """
    name = f"rng_state_{rank}.pth"
    path = os.path.join(directory, name)
    return {name: _read(path)} if os.path.isfile(path) else {}


def gather_to_first(files: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's ``files`` on rank 0 (``[]`` on the others, and ``[files]`` without a
    process group of several ranks). A collective: every rank calls it at the same save."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return [files]
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    # Between the job's live ranks, not from a file: what they send is what they just read.
    dist.gather_object(files, gathered, dst=0)
    return [g for g in gathered or [] if g]


def check(state: Any) -> None:
    """Raise InvalidInput unless ``state`` is a checkpoint :func:`capture` read."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise InvalidInput(["checkpoint_path(ctx): the job's checkpoint is not Hugging Face's "
                            "(it was not reported by dt.huggingface.Report(ctx, "
                            "checkpoint=True)); read it with ctx.restore()."])


def rebuild(state: Any, root: str) -> str:
    """Write the checkpoint :func:`capture` read (one that passed :func:`check`) into a new
    directory under ``root``; its path.

    Every rank's RNG file is written (``rng_state_<rank>.pth``, gathered at the save, see
    :func:`rng_files`): HF's resume on rank ``r`` reads its own.
    """
    import torch
    from safetensors.torch import save_file

    root = tempfile.mkdtemp(prefix="resume-", dir=root)
    directory = os.path.join(root, str(state.get("name") or "checkpoint"))
    for relative, entry in state["files"].items():
        path = os.path.join(directory, *relative.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if "safetensors" in entry:
            tensors = {k: v.contiguous() for k, v in entry["safetensors"].items()}
            save_file(tensors, path, metadata=entry.get("metadata") or None)
        elif "torch" in entry:
            torch.save(entry["torch"], path)
        elif "text" in entry:
            with open(path, "w", encoding="utf-8") as f:
                f.write(entry["text"])
        else:
            with open(path, "wb") as f:
                f.write(np.asarray(entry["bytes"], dtype=np.uint8).tobytes())
    return directory
