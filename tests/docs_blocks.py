"""The Python blocks of README.md and docs/*.md as a user pastes them, and the markers that say
how the suite runs them (read by tests/test_doc_blocks.py).

Each page's runnable blocks, in order, make one script: a reader pastes a page's blocks into one
file or notebook, so a later block may use the names an earlier one made. Markers are HTML
comments on the lines just before a block's fence, invisible on the rendered page:

``<!-- docs-test: skip REASON -->``
    The block is not run here. REASON names what this machine cannot have and must start with
    one of :data:`SKIP_REASONS` ("needs the network", "needs Kubernetes", ...); the page itself
    says so to its reader, and gives an offline variant where one can exist.
``<!-- docs-test: fragment WHAT -->``
    The block is a part of a script, not a whole one (a loop's body left out as ``...``, the
    reader's own ``LightningModule``): WHAT says which part. Not run.
``<!-- docs-test: file NAME -->``
    The block is a program of its own that the page's other blocks run (a torchrun script
    ``dt.launch`` starts): written to NAME in the page's directory, not part of the script.
``<!-- docs-test: replace OLD => NEW -->``
    Run the block with OLD replaced by NEW (each OLD must occur in it): smaller data than the
    page's, for the suite's time, and nothing else.
``<!-- docs-test: setup`` ... ``-->``
    Lines run before the block: what the page leaves to the reader (their own dataframe ``df``),
    made small.

``python tests/docs_blocks.py PAGE.md`` prints the script a page's test runs.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: What a skipped block may need: what a test machine of this project does not have.
SKIP_REASONS = ("needs the network", "needs Kubernetes", "needs a GPU", "needs Slurm",
                "needs a cluster of several hosts", "needs TensorFlow")

_FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_MARKER = re.compile(r"<!--\s*docs-test:\s*(\w+)\s*(.*?)-->", re.S)


@dataclass
class Block:
    """One Python block of a page, with its markers."""

    page: str
    line: int
    code: str
    skip: str = ""
    fragment: str = ""
    file: str = ""
    replace: list[tuple[str, str]] = field(default_factory=list)
    setup: str = ""

    @property
    def runs(self) -> bool:
        """Whether the suite runs it in the page's script (neither skipped, a fragment nor a
        file of its own)."""
        return not (self.skip or self.fragment or self.file)

    def runnable(self) -> str:
        """The code the suite runs: setup first, then the block with its replacements."""
        code = self.code
        for old, new in self.replace:
            if old not in code:
                raise ValueError(f"{self.page}:{self.line}: replace {old!r}: not in the block")
            code = code.replace(old, new)
        return (self.setup + "\n" if self.setup else "") + code


def blocks(page: Path) -> list[Block]:
    """Every ```python block of ``page`` with the markers on the lines just before it."""
    text = page.read_text()
    found = []
    for match in _FENCE.finditer(text):
        before = text[:match.start()]
        # The markers: the comments between the previous paragraph and the fence.
        head = before.rstrip("\n")
        markers = []
        while head.endswith("-->"):
            start = head.rfind("<!--")
            marker = _MARKER.fullmatch(head[start:])
            if start < 0 or marker is None:
                break
            markers.insert(0, marker)
            head = head[:start].rstrip("\n")
        block = Block(page=page.name, line=before.count("\n") + 1, code=match.group(1))
        for marker in markers:
            kind, body = marker.group(1), marker.group(2).strip()
            if kind == "skip":
                block.skip = body
            elif kind == "fragment":
                block.fragment = body
            elif kind == "file":
                block.file = body
            elif kind == "replace":
                old, sep, new = body.partition(" => ")
                if not sep:
                    raise ValueError(f"{page.name}:{block.line}: replace needs 'OLD => NEW'")
                block.replace.append((old, new))
            elif kind == "setup":
                block.setup = body
            else:
                raise ValueError(f"{page.name}:{block.line}: unknown docs-test marker {kind!r}")
        found.append(block)
    return found


def pages() -> list[Path]:
    """README.md and every page of docs/ that has a Python block."""
    return [p for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
            if blocks(p)]


def files(page: Path) -> dict[str, str]:
    """The programs of its own a page's script runs: file name -> code (``file`` markers)."""
    return {b.file: b.runnable() for b in blocks(page) if b.file and not b.skip}


def script(page: Path) -> str:
    """The script a page's test runs: its runnable blocks in order."""
    return "\n\n".join(b.runnable() for b in blocks(page) if b.runs)


if __name__ == "__main__":
    print(script(Path(sys.argv[1])))
