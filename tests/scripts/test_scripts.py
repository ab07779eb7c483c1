"""The README's quickstart run the way people run it: pasted into a file, ``python file.py``,
with and without the ``if __name__ == "__main__":`` guard, and read from stdin as a notebook-like
session; a normal run's output has no ERROR line and no traceback.

Without the guard it runs in tests/test_doc_blocks.py (the README page's blocks, the quickstart
first, as one unguarded ``python page.py`` with the same smaller data): here the guarded file
and stdin, which that test does not run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"


def readme_quickstart() -> str:
    """The first Python block under "## Quickstart" in README.md."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quickstart", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README.md has no python block under ## Quickstart"
    return match.group(1)


def _smaller(code: str) -> str:
    # The same program on a smaller dataset, so the suite stays fast; nothing else changes (the
    # tests read how it stopped, not what it reached: 3 epochs of 20,000 rows do).
    return code.replace("n_samples=1_100_000", "n_samples=20_000")


def _run(args: list[str], *, cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, input=stdin, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(SRC)})


def _assert_clean(proc: subprocess.CompletedProcess) -> None:
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "Traceback" not in log and " ERROR " not in log and "- ERROR -" not in log, log[-4000:]
    assert "result.stopped_by" not in log  # the script printed its results instead
    assert re.search(r"stopped by (StopAtScore|StopAfter|epochs)", log), log[-2000:]


_REPORT = textwrap.dedent(
    """
    print("stopped by", result.stopped_by, "accuracy", result.history["accuracy"].iloc[-1])
    """)


def test_the_readme_quickstart_runs_as_a_guarded_script(tmp_path: Path) -> None:
    code = _smaller(readme_quickstart()) + _REPORT
    code = "def main():\n" + textwrap.indent(code, "    ") + \
        '\n\nif __name__ == "__main__":\n    main()\n'
    (tmp_path / "quickstart.py").write_text(code)
    proc = _run([sys.executable, "quickstart.py"], cwd=tmp_path)
    _assert_clean(proc)
    assert (tmp_path / "scores.png").exists()


def test_the_readme_quickstart_runs_from_stdin(tmp_path: Path) -> None:
    # A program read from stdin has no file to re-run in the workers (as in a notebook).
    proc = _run([sys.executable, "-"], cwd=tmp_path, stdin=_smaller(readme_quickstart()) + _REPORT)
    _assert_clean(proc)
