"""``fit(data="auto")``: persist what fits in half the workers' memory limits, stream the rest."""

from __future__ import annotations

from dask_train.policy._data_mode import EMBEDDED_LIMIT, check_data_mode, choose_data_mode

GIB = 2**30


def test_auto_streams_data_over_half_the_memory_and_says_why() -> None:
    mode, why = choose_data_mode("auto", nbytes=int(2.3 * GIB),
                                 memory_limits={"a": int(1.2 * GIB), "b": int(1.2 * GIB)})
    assert mode == "stream"
    # The numbers behind the choice: the data, the share, the limits and the room they leave.
    assert "2.3 GiB" in why and "50%" in why and "2 workers" in why and "2.4 GiB" in why
    assert "1.2 GiB" in why


def test_auto_persists_what_fits_and_what_has_no_limit() -> None:
    limits = {"a": GIB, "b": GIB}
    assert choose_data_mode("auto", nbytes=GIB, memory_limits=limits)[0] == "persist"
    assert choose_data_mode("auto", nbytes=GIB + 1, memory_limits=limits)[0] == "stream"
    mode, why = choose_data_mode("auto", nbytes=100 * GIB, memory_limits={"a": 0, "b": GIB})
    assert mode == "persist" and "no memory limit" in why


def test_auto_persists_a_graph_that_carries_its_data() -> None:
    mode, why = choose_data_mode("auto", nbytes=10 * GIB, memory_limits={"a": GIB},
                                 graph_bytes=EMBEDDED_LIMIT + 1)
    assert mode == "persist" and "inside the graph" in why


def test_an_explicit_mode_is_kept() -> None:
    limits = {"a": GIB}
    assert choose_data_mode("stream", nbytes=1, memory_limits=limits)[0] == "stream"
    assert choose_data_mode("persist", nbytes=10 * GIB, memory_limits=limits)[0] == "persist"


def test_bad_data_mode_names_the_value_and_the_fix() -> None:
    [problem] = check_data_mode("disk", in_memory=False, full_batch=False)
    assert "data='disk'" in problem and "'stream'" in problem
    [problem] = check_data_mode("stream", in_memory=True, full_batch=False)
    assert "in memory" in problem and "da.from_zarr" in problem
    [problem] = check_data_mode("stream", in_memory=False, full_batch=True)
    assert "ArrayModel" in problem
    assert check_data_mode("auto", in_memory=True, full_batch=True) == []
