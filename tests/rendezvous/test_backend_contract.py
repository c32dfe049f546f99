"""The ``RendezvousBackend`` contract, case by case, run against every backend.

The same cases run against torch's own C10d backend, which shows that they
test the contract of the base class rather than this implementation.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous.api import RendezvousStateError
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

from service.rendezvous.factory import Etcd3Parts
from service.rendezvous.options import parse_options

from .conftest import free_port


@dataclass
class Kit:
    """How to make backends of one kind for one run, and to corrupt its state."""

    make: Callable[[], Any]
    corrupt: Callable[[], None]
    closers: list[Callable[[], None]] = field(default_factory=list)


def etcd3_kit(endpoint: str, run_id: str) -> Kit:
    kit = Kit(make=lambda: None, corrupt=lambda: None)

    def make() -> Any:
        parts = Etcd3Parts(parse_options(endpoint, run_id, {"read_timeout": 2}))
        parts.connect()
        kit.closers.append(parts.close)
        return parts.backend

    def corrupt() -> None:
        parts = Etcd3Parts(parse_options(endpoint, run_id, {}))
        parts.client.call(lambda c: c.put(parts.backend.key, b"\x80not a state"), "corrupting")
        parts.close()

    kit.make, kit.corrupt = make, corrupt
    return kit


def c10d_kit(run_id: str) -> Kit:
    port = free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))

    def client() -> TCPStore:
        return TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))

    kit = Kit(
        make=lambda: C10dRendezvousBackend(client(), run_id),
        corrupt=lambda: client().set("torch.rendezvous." + run_id, "garbage!!"),
    )
    kit.closers.append(lambda: server)  # keeps the server alive until teardown
    return kit


@pytest.fixture(params=["etcd3", "c10d"])
def kit(request: pytest.FixtureRequest, run_id: str) -> Iterator[Kit]:
    if request.param == "etcd3":
        made = etcd3_kit(request.getfixturevalue("etcd_server").endpoint, run_id)
    else:
        made = c10d_kit(run_id)
    yield made
    for close in made.closers:
        close()


def test_no_state_reads_as_none(kit: Kit) -> None:
    assert kit.make().get_state() is None


def test_first_write_with_none_token_succeeds_and_reads_back(kit: Kit) -> None:
    backend = kit.make()
    state, token, has_set = backend.set_state(b"state-1")
    assert (state, has_set) == (b"state-1", True)
    assert kit.make().get_state() == (b"state-1", token)


def test_token_from_a_write_is_the_current_token(kit: Kit) -> None:
    backend = kit.make()
    _, token1, _ = backend.set_state(b"one")
    state, token2, has_set = backend.set_state(b"two", token1)
    assert (state, has_set) == (b"two", True)
    assert token2 != token1
    # The token came from the write itself and is valid for the next write.
    assert backend.set_state(b"three", token2)[2] is True
    assert kit.make().get_state()[0] == b"three"


def test_stale_token_writes_nothing_and_returns_current(kit: Kit) -> None:
    backend = kit.make()
    _, stale, _ = backend.set_state(b"one")
    _, current, _ = backend.set_state(b"two", stale)
    assert backend.set_state(b"evil", stale) == (b"two", current, False)
    assert kit.make().get_state() == (b"two", current)


def test_none_token_does_not_overwrite_an_existing_state(kit: Kit) -> None:
    backend = kit.make()
    _, token, _ = backend.set_state(b"first")
    assert kit.make().set_state(b"second", None) == (b"first", token, False)
    assert backend.get_state() == (b"first", token)


@pytest.mark.parametrize("bad_token", [object(), "not-a-token", 3.5])
def test_invalid_token_writes_nothing(kit: Kit, bad_token: Any) -> None:
    backend = kit.make()
    _, token, _ = backend.set_state(b"first")
    assert backend.set_state(b"second", bad_token) == (b"first", token, False)
    assert backend.get_state() == (b"first", token)


def test_invalid_token_without_state_returns_none(kit: Kit) -> None:
    assert kit.make().set_state(b"x", "not-a-token") is None
    assert kit.make().get_state() is None


def test_corrupt_state_raises_state_error(kit: Kit) -> None:
    kit.make().set_state(b"fine")
    kit.corrupt()
    with pytest.raises(RendezvousStateError):
        kit.make().get_state()


def test_concurrent_writers_exactly_one_wins_per_token(kit: Kit) -> None:
    writers = [kit.make() for _ in range(4)]
    writers[0].set_state(b"round-0")
    for round_no in range(1, 4):
        _, token = writers[0].get_state()
        results: list[bool] = []
        barrier = threading.Barrier(len(writers))

        def write(i: int, backend: Any) -> None:
            barrier.wait(timeout=10)
            results.append(backend.set_state(f"round-{round_no}-writer-{i}".encode(), token)[2])

        threads = [threading.Thread(target=write, args=(i, b)) for i, b in enumerate(writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert sorted(results) == [False] * (len(writers) - 1) + [True]
        winner = writers[0].get_state()[0].decode()
        assert winner.startswith(f"round-{round_no}-writer-")
