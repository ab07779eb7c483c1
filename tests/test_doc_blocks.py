"""Every runnable Python block of README.md and docs/ runs as a user pastes it: a page's blocks in
order as one script, ``python page.py`` in an empty directory, with the page's markers applied
(smaller data, a reader's own dataframe made small; see tests/docs_blocks.py). A normal run's
output has no traceback and no ERROR line. Blocks that need what this machine cannot have (the
network, Kubernetes, a GPU) are marked so on the page, with the reason."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from docs_blocks import ROOT, SKIP_REASONS, blocks, files, pages, script  # noqa: E402

SRC = ROOT / "src"

def test_every_marker_is_known_and_applies() -> None:
    for page in pages():
        for block in blocks(page):  # an unknown marker raises here
            block.runnable()  # a replace whose text is not in its block raises here
            assert not block.skip or block.skip.startswith(SKIP_REASONS), \
                f"{page.name}:{block.line}: skip {block.skip!r}: say what it needs, one of " \
                f"{SKIP_REASONS}"
            assert not (block.skip and block.fragment), f"{page.name}:{block.line}: one of them"


def _runnable_pages() -> list[Path]:
    return [p for p in pages() if any(b.runs for b in blocks(p))]


@pytest.mark.parametrize("page", _runnable_pages(), ids=lambda p: p.name)
def test_a_pages_blocks_run_as_pasted(page: Path, tmp_path: Path) -> None:
    code = script(page)
    for name, program in files(page).items():
        (tmp_path / name).write_text(program)
    (tmp_path / "page.py").write_text(code)
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "page.py"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=400, env=env)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{page.name} (python tests/docs_blocks.py {page.name}):\n" \
        f"{log[-5000:]}"
    assert "Traceback" not in log and " ERROR " not in log and "- ERROR -" not in log, \
        log[-5000:]
