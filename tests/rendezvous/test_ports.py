"""Rank 0's store port: outside the range the kernel hands outgoing connections their local ports from."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.rendezvous.ports import (
    LINUX_DEFAULT_RANGE,
    LOWEST,
    can_listen,
    candidate_ranges,
    ephemeral_range,
    listen_port,
    listen_ports,
)


def range_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "ip_local_port_range"
    path.write_text(text)
    return path


def test_the_range_is_read_from_the_kernel_and_linuxs_default_stands_in_for_a_bad_one(tmp_path):
    assert ephemeral_range(range_file(tmp_path, "40000\t50000\n")) == (40000, 50000)
    for bad in ("", "40000", "x y", "50000 40000", "0 70000"):
        assert ephemeral_range(range_file(tmp_path, bad)) == LINUX_DEFAULT_RANGE, bad
    assert ephemeral_range(tmp_path / "missing") == LINUX_DEFAULT_RANGE


@settings(max_examples=300, deadline=None)
@given(low=st.integers(1, 65535), width=st.integers(0, 65535))
def test_the_candidates_are_exactly_the_ports_outside_the_range_from_lowest_up(low, width):
    high = min(65535, low + width)
    spans = candidate_ranges(low, high)
    assert all(LOWEST <= port <= 65535 and not low <= port <= high for span in spans for port in (span[0], span[-1]))
    expected = sum(1 for port in range(LOWEST, 65536) if not low <= port <= high)
    assert sum(len(span) for span in spans) == expected


@settings(max_examples=100, deadline=None)
@given(low=st.integers(1, 65535), width=st.integers(0, 65535), seed=st.integers(0, 2**32))
def test_a_chosen_port_is_outside_the_ephemeral_range_when_there_is_room(tmp_path_factory, low, width, seed):
    high = min(65535, low + width)
    port = listen_port(random.Random(seed), range_file(tmp_path_factory.mktemp("range"), f"{low} {high}"))
    assert 1 <= port <= 65535
    if sum(len(span) for span in candidate_ranges(low, high)) >= 1000:  # else every pick may be taken: the kernel's
        assert LOWEST <= port and not low <= port <= high, (port, low, high)


class _FirstPick(random.Random):
    """Draws as a seeded generator, except that the first draw picks ``port`` (an index below the range)."""

    def __init__(self, port: int, seed: int) -> None:
        super().__init__(seed)
        self._first: int | None = port - LOWEST

    def randrange(self, start, stop=None, step=1):  # type: ignore[override]
        if self._first is not None:
            index, self._first = self._first, None
            return index
        return super().randrange(start, stop, step)


def test_a_taken_port_is_passed_over_and_the_kernels_own_pick_is_the_ephemeral_kind_avoided():
    low, high = ephemeral_range()
    with socket.socket() as sock:  # what torch's get_free_port hands out
        sock.bind(("", 0))
        assert low <= sock.getsockname()[1] <= high
    taken = next(port for port in range(LOWEST, low) if can_listen(port))
    with socket.socket() as listener:
        listener.bind(("", taken))
        listener.listen()
        assert _FirstPick(taken, 0).randrange(1) == taken - LOWEST  # the helper does name the taken port first
        chosen = {listen_port(_FirstPick(taken, seed)) for seed in range(20)}
    assert taken not in chosen
    assert all(LOWEST <= port and not low <= port <= high for port in chosen), (chosen, low, high)


@settings(max_examples=100, deadline=None)
@given(low=st.integers(LOWEST + 1, 65535), width=st.integers(0, 65535), count=st.integers(2, 8),
       seed=st.integers(0, 2**32))  # fmt: skip
def test_consecutive_ports_all_lie_outside_the_range_or_none_is_given(tmp_path_factory, low, width, count, seed):
    """A metrics endpoint per local rank, or a Slurm cluster's daemons, listen on base + i: every one of them must
    be outside the ephemeral range, or a scrape before it listens may connect to itself (the CI failure)."""
    high = min(65535, low + width)
    source = range_file(tmp_path_factory.mktemp("range"), f"{low} {high}")
    room = max((len(span) for span in candidate_ranges(low, high)), default=0)
    try:
        base = listen_ports(count, random.Random(seed), source)
    except RuntimeError as error:
        assert room < 1000 and f"No {count} consecutive free ports" in str(error) and f"{low}-{high}" in str(error)
        return
    ports = range(base, base + count)
    assert all(LOWEST <= port <= 65535 and not low <= port <= high for port in ports), (base, count, low, high)


def test_a_count_below_one_is_refused_and_a_run_straddling_a_taken_port_is_passed_over():
    with pytest.raises(ValueError, match="count=0"):
        listen_ports(0)
    low, _ = ephemeral_range()
    taken = next(port for port in range(LOWEST + 1, low - 2) if all(can_listen(p) for p in (port - 1, port, port + 1)))
    with socket.socket() as listener:
        listener.bind(("", taken))
        listener.listen()
        chosen = {listen_ports(2, _FirstPick(taken - 1, seed)) for seed in range(20)}  # first pick: taken - 1, taken
    assert taken - 1 not in chosen and taken not in chosen
    assert all(not ephemeral_range()[0] <= base + 1 <= ephemeral_range()[1] for base in chosen)
