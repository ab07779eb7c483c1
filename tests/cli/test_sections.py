"""read_sections: the one reader of a YAML config's sections (train/search/predict and run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dask_train.cli._config import read_sections
from dask_train.errors import InvalidInput

NAMES = ("data", "stop", "out")


def test_no_config_gives_every_section_empty() -> None:
    assert read_sections(None, NAMES, command="run") == ({"data": {}, "stop": {}}, None)


def test_sections_and_out_are_read(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  chunk_rows: 10\nout: runs/a\n")
    assert read_sections(path, NAMES, command="run") == ({"data": {"chunk_rows": 10}, "stop": {}},
                                                         "runs/a")


def test_every_section_problem_is_said_at_once(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("data: 3\nextra: {}\n")
    with pytest.raises(InvalidInput) as info:
        read_sections(path, NAMES, command="run")
    problems = info.value.problems
    assert len(problems) == 2
    assert "extra: unknown section; use data, stop, out." in problems
    assert "data: must be a mapping, got int." in problems


@pytest.mark.parametrize(("text", "said"), [
    ("data: [1\n", "is not valid YAML"),
    ("- data\n", "must be a mapping of sections (data, stop, out)"),
])
def test_a_file_that_is_no_mapping_of_sections_is_named(tmp_path: Path, text: str,
                                                         said: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(InvalidInput, match="c.yaml") as info:
        read_sections(path, NAMES, command="run")
    assert said in str(info.value)


def test_a_missing_file_names_the_command_whose_help_shows_one(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match=r"dask-train run --help shows an example"):
        read_sections(tmp_path / "none.yaml", NAMES, command="run")
