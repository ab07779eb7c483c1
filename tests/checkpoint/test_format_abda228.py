"""Checkpoints written by commit abda228 still resume with today's code.

abda228 is an older commit of main (63 commits before f570c39); issue 58's restructuring keeps
the checkpoint format unchanged, and these fixtures hold it to that. The fixtures under
``fixtures/vabda228/`` were written by ``fixtures/make_fixtures.py --out
tests/checkpoint/fixtures/vabda228 --cases async_ps sync run`` with that commit's code (its
docstring says how): the same jobs as test_format_339c3eb.py's fixtures (a 64-16-10 MLP with Adam,
12 steps of async-ps with 2 shards and of sync, 2 epochs of a ``dt.run`` job).

The checks are test_format_339c3eb.py's, run here on these fixtures: a resume starts from the
checkpoint's step and its tensors bit for bit and trains on; ``ctx.restore()`` gives every rank the
state as reported; the step, the epochs, the history and the ledger go on from the checkpoint's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import test_format_339c3eb as base

fixtures = base.fixtures
FIXTURES = fixtures.HERE / "vabda228"

# test_format_339c3eb.py's tests, collected here, where fixture_root names abda228's fixtures.
test_an_abda228_checkpoint_resumes_at_its_step_with_its_tensors = (
    base.test_a_339c3eb_checkpoint_resumes_at_its_step_with_its_tensors)
test_an_abda228_checkpoint_trains_on_from_its_step = (
    base.test_a_339c3eb_checkpoint_trains_on_from_its_step)
test_an_abda228_run_checkpoint_restores_its_state_and_goes_on = (
    base.test_a_339c3eb_run_checkpoint_restores_its_state_and_goes_on)


@pytest.fixture
def fixture_root() -> Path:
    """abda228's fixtures, for the tests above."""
    return FIXTURES
