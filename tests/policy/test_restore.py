"""What a restart starts from, as tables: which store is read, which state is chosen, its label."""

from __future__ import annotations

import pytest

from dask_train.policy._restore import (
    Candidate,
    RestartChoice,
    Source,
    Store,
    choose_restart,
    restart_store,
)

CK, CP = Store.CHECKPOINTS, Store.COPIES

STORES = [
    # copied, checkpointed, has_checkpoint_store -> the store read
    (True, False, True, CP),  # copies beside checkpoint= until its first checkpoint
    (True, False, False, CP),  # copies alone
    (True, True, True, CK),  # checkpoint= holds one: its store, even if copies were made
    (False, False, True, CK),  # no copy yet: checkpoint='s (the one resumed from, or none)
    (False, True, True, CK),
    (False, False, False, CP),  # no checkpoint=: the copies (there may be none)
]


@pytest.mark.parametrize(("copied", "checkpointed", "has_store", "store"), STORES)
def test_restart_store(copied: bool, checkpointed: bool, has_store: bool, store: Store) -> None:
    assert restart_store(copied=copied, checkpointed=checkpointed,
                         has_checkpoint_store=has_store) is store


S, ST, G, INIT = Source.SURVIVORS, Source.STORED, Source.GENERATION, Source.INITIAL
A = Candidate(step=30, samples=960)  # the survivors'
B = Candidate(step=20, samples=640)  # the store's newest
C = Candidate(step=10, samples=320)  # the state the generation started from
NEWER = Candidate(step=25, samples=800)  # a hand-over's, newer than the store's
SAME = Candidate(step=20, samples=600)  # as new as the store's

CHOICES = [
    # survivors, stored, started, store, applied -> source, label, redone
    (A, B, C, CK, 1000, S, "survivors", 40),  # the survivors' first, whatever else there is
    (A, None, None, CP, 1000, S, "survivors", 40),
    (A, B, NEWER, CP, 900, S, "survivors", 0),  # never negative
    (None, B, C, CK, 1000, ST, "checkpoint", 360),  # the store's newest, named by its store
    (None, B, C, CP, 1000, ST, "copy", 360),
    (None, B, None, CK, 1000, ST, "checkpoint", 360),  # the first generation: started from nothing
    (None, B, SAME, CP, 1000, ST, "copy", 360),  # a tie goes to the store
    (None, B, NEWER, CK, 1000, G, "generation", 200),  # newer than the store's: a hand-over's
    (None, None, C, CK, 1000, G, "generation", 680),  # nothing stored: where it started
    (None, None, C, CP, 100, G, "generation", 0),
    (None, None, None, CK, 1000, INIT, "start", 1000),  # nothing at all: the initial parameters
    (None, None, None, CP, 0, INIT, "start", 0),
]


@pytest.mark.parametrize(
    ("survivors", "stored", "started", "store", "applied", "source", "label", "redone"), CHOICES)
def test_choose_restart(survivors: Candidate | None, stored: Candidate | None,
                        started: Candidate | None, store: Store, applied: int, source: Source,
                        label: str, redone: int) -> None:
    choice = choose_restart(survivors=survivors, stored=stored, started=started, store=store,
                            applied=applied)
    assert choice == RestartChoice(source=source, label=label, redone=redone)


def test_the_labels_are_the_failure_records_words() -> None:
    # result.failures' "from": what users and the docs read.
    assert {s.value for s in Store} == {"checkpoint", "copy"}
    assert {Source.SURVIVORS.value, Source.GENERATION.value, Source.INITIAL.value} == \
        {"survivors", "generation", "start"}
