"""Models whose forward returns more than one tensor: a Hugging Face sequence classifier (its
``ModelOutput``), a dict, a tuple. Built-in losses, accuracy and ``dt.predict`` read the logits;
a loss of your own gets the whole output and picks what it needs."""

from __future__ import annotations

from pathlib import Path

import dask.array as da
import numpy as np
import pytest
import torch

# In the dev extra (make test installs it): missing, this module fails to import, naming it.
import transformers  # noqa: E402
from distributed import Client
from torch import nn

import dask_train as dt

N_CLASSES = 4


def marked(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids: 12 tokens from 5..19 with one marker token 1..4 at a random place; the label
    is which marker (a task a small transformer learns from attention)."""
    rng = np.random.default_rng(seed)
    x = rng.integers(5, 20, size=(n, 12))
    y = rng.integers(0, N_CLASSES, size=n)
    x[np.arange(n), rng.integers(0, 12, size=n)] = y + 1
    return x.astype(np.int64), y.astype(np.int64)


def bert() -> nn.Module:
    """A small BERT sequence classifier built from a config: nothing is downloaded."""
    config = transformers.BertConfig(
        vocab_size=20, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=16, num_labels=N_CLASSES)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config)


class TwoHeads(nn.Module):
    """Returns a dict: class scores under a name of its own, and an embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.scores = nn.Linear(16, N_CLASSES)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(x).max(dim=1).values
        return {"scores": self.scores(h), "embedding": h}


class WithState(nn.Module):
    """Returns a tuple, as an RNN does: the predictions first."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.head = nn.Linear(16, N_CLASSES)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.embed(x).max(dim=1).values
        return self.head(h), h


@pytest.fixture(scope="module")
def tokens() -> tuple:
    x, y = marked(8_000, 0)
    return da.from_array(x, chunks=2_000), da.from_array(y, chunks=2_000), marked(1_000, 1), x, y


def _accuracy(module: nn.Module, x: np.ndarray, y: np.ndarray, pick) -> float:
    module.eval()
    with torch.no_grad():
        return float((pick(module(torch.from_numpy(x))).argmax(1).numpy() == y).mean())


def _plain_torch(module: nn.Module, x: np.ndarray, y: np.ndarray, pick, *, batch: int) -> nn.Module:
    opt = torch.optim.Adam(module.parameters(), lr=3e-3)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    for i in range(0, len(xt), batch):
        opt.zero_grad()
        nn.functional.cross_entropy(pick(module(xt[i : i + batch])), yt[i : i + batch]).backward()
        opt.step()
    return module


@pytest.mark.parametrize("strategy", ["async-ps", "sync"])
def test_a_hugging_face_classifier_trains_and_predicts(client: Client, tokens: tuple,
                                                      strategy: str) -> None:
    X, y, (xv, yv), x, yy = tokens
    logits = lambda out: out.logits  # noqa: E731
    reference = _accuracy(_plain_torch(bert(), x, yy, logits, batch=64 if strategy == "async-ps"
                                       else 128), xv, yv, logits)
    # A metric function gets the whole ModelOutput and picks its logits.
    hits = lambda out, target: (out.logits.argmax(1) == target).float().mean()  # noqa: E731
    result = dt.Trainer(bert(), strategy=strategy, workers=2, lr=3e-3, batch_size=64, epochs=1,
                        progress=False, client=client, metrics={"hits": hits},
                        # one push at a time: staleness that load cannot grow
                        prefetch=strategy == "sync").fit(X, y, validation=(xv, yv))
    got = _accuracy(result.model, xv, yv, logits)
    assert got >= reference - (0.1 if strategy == "async-ps" else 0.05), (got, reference)
    np.testing.assert_allclose(result.history["hits"], result.history["accuracy"], atol=1e-6)
    assert isinstance(result.model, transformers.BertForSequenceClassification)
    scores = dt.predict(result.model, da.from_array(xv, chunks=250)).compute()
    assert scores.shape == (len(xv), N_CLASSES)
    labels = dt.predict(result.model, da.from_array(xv, chunks=250), method="argmax").compute()
    assert float((labels == yv).mean()) == pytest.approx(got)
    named = dt.predict(result.model, da.from_array(xv, chunks=250), output="logits").compute()
    np.testing.assert_allclose(named, scores, rtol=1e-5, atol=1e-5)


def test_a_hugging_face_classifier_resumes_exactly(client: Client, tokens: tuple,
                                                   tmp_path: Path) -> None:
    X, y, (xv, yv), _, _ = tokens

    def trainer(steps: int, path: Path | None) -> dt.Trainer:
        # One rank: the run is deterministic (dropout included: the RNG state is checkpointed).
        return dt.Trainer(bert(), strategy="sync", workers=1, lr=3e-3, batch_size=64, epochs=3,
                          stop=[dt.StopAtStep(steps)], progress=False, client=client, scorer=0,
                          checkpoint=None if path is None else dt.CheckpointConfig(path))

    first = trainer(80, tmp_path).fit(X, y)
    resumed = trainer(160, tmp_path).fit(X, y, resume=True)
    straight = trainer(160, None).fit(X, y)
    assert (first.steps, resumed.steps, straight.steps) == (80, 160, 160)
    for (name, a), (_, b) in zip(resumed.model.state_dict().items(),
                                 straight.model.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


def test_a_dict_output_with_a_loss_that_picks_its_field(client: Client, tokens: tuple) -> None:
    X, y, (xv, yv), _, _ = tokens

    def loss(out: dict, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out["scores"], target)

    torch.manual_seed(0)
    untrained = TwoHeads()
    with torch.no_grad():
        before = float(loss(untrained(torch.from_numpy(xv)), torch.from_numpy(yv)))
    result = dt.Trainer(untrained, loss=loss, workers=2, lr=1e-2, batch_size=64, epochs=1,
                        progress=False, client=client).fit(X, y, validation=(xv, yv))
    assert result.history["loss"].iloc[-1] < before / 4  # scored with the loss that picks
    scores = dt.predict(result.model, da.from_array(xv, chunks=500), output="scores").compute()
    embedding = dt.predict(result.model, da.from_array(xv, chunks=500),
                           output=lambda out: out["embedding"]).compute()
    assert scores.shape == (len(xv), N_CLASSES) and embedding.shape == (len(xv), 16)
    assert float((scores.argmax(1) == yv).mean()) > 0.9
    # A built-in loss cannot know which of two fields to read: said before any work.
    with pytest.raises(dt.InvalidInput, match="no 'logits'"):
        dt.Trainer(TwoHeads(), workers=2, progress=False, client=client).fit(X, y)


def test_a_tuple_output_trains_on_its_first_element(client: Client, tokens: tuple) -> None:
    X, y, (xv, yv), _, _ = tokens
    torch.manual_seed(0)
    result = dt.Trainer(WithState(), strategy="sync", workers=2, lr=1e-2, batch_size=64,
                        epochs=1, progress=False, client=client).fit(X, y, validation=(xv, yv))
    assert float(result.history["accuracy"].iloc[-1]) > 0.9
    assert _accuracy(result.model, xv, yv, lambda out: out[0]) == pytest.approx(
        float(result.history["accuracy"].iloc[-1]))
