"""The harness's pure parts (no root needed): link settings, tc arguments, names it may remove."""

from __future__ import annotations

import os

import pytest

from dask_train.bench._netns import _NAME, MAX_HOSTS, Link, NetnsCluster, _new_tag, _qdisc
from dask_train.errors import InvalidInput


def test_link_settings_are_checked_and_described() -> None:
    assert Link(rate_mbit=1000, delay_ms=0.5).describe() == "1000 Mbit/s, 0.5 ms"
    assert Link(rate_mbit=None).describe() == "unshaped"
    with pytest.raises(InvalidInput) as info:
        Link(rate_mbit=0, delay_ms=-1)
    assert "rate_mbit=0 is invalid" in str(info.value) and "delay_ms=-1 is invalid" in str(info.value)
    with pytest.raises(InvalidInput, match=f"from 0 to {MAX_HOSTS}"):
        NetnsCluster(MAX_HOSTS + 1)


def test_tc_arguments_shape_both_directions_and_delay_only_the_way_out() -> None:
    # A token bucket each way: one millisecond of burst at 1 Gbit/s (125 kB), 20 ms of queue.
    assert _qdisc(Link(rate_mbit=1000), outbound=True) == [
        "tbf", "rate", "1000mbit", "burst", "125000", "latency", "20ms"]
    assert _qdisc(Link(rate_mbit=10), outbound=False)[:5] == [
        "tbf", "rate", "10mbit", "burst", "16384"]  # never less than a few full packets
    # netem on the way out carries the delay and the rate; the way in keeps the token bucket.
    assert _qdisc(Link(rate_mbit=100, delay_ms=0.5), outbound=True) == [
        "netem", "delay", "0.5ms", "limit", "100000", "rate", "100mbit"]
    assert _qdisc(Link(rate_mbit=100, delay_ms=0.5), outbound=False)[0] == "tbf"
    assert _qdisc(Link(rate_mbit=None), outbound=True) == []


def test_names_fit_linux_limits_and_only_ours_match_the_cleanup_pattern() -> None:
    tag = _new_tag()
    assert tag != _new_tag()  # a counter: two clusters of one process never share names
    pid = int(_NAME.match(f"{tag}-s").group(1), 36)  # type: ignore[union-attr]
    assert pid == os.getpid()
    longest = f"{tag}v{MAX_HOSTS - 1}"
    assert _NAME.match(longest) and len(longest) <= 15  # interface names: 15 characters at most
    for name in (f"{tag}b", f"{tag}n3", f"{tag}-12", f"{tag}p"):
        assert _NAME.match(name), name
    for other in ("eth0", "docker0", "dtnfoo", "dtn12x3-extra", "dm123x1br", "veth12ab"):
        assert not _NAME.match(other), other
