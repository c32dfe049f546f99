"""The ``RendezvousBackend`` contract, case by case, run against every backend.

The same cases run against torch's own C10d backend, which shows that they
test the contract of the base class rather than this implementation.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous.api import (
    RendezvousStateError,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
    C10dRendezvousBackend,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)

from service.rendezvous.options import parse_options
from service.rendezvous.parts import Etcd3Parts

from .conftest import free_port
from .states import state_bytes as S
from .states import tag_of


@dataclass
class Kit:
    """How to make backends of one kind for one run (with a store for torch's handler), and to corrupt its state."""

    make: Callable[[], Any]
    corrupt: Callable[[], None]
    closers: list[Callable[[], None]] = field(default_factory=list)
    make_with_store: Callable[[], tuple[Any, Any]] | None = None


def etcd3_kit(endpoint: str, run_id: str) -> Kit:
    kit = Kit(make=lambda: None, corrupt=lambda: None)

    def make_with_store() -> tuple[Any, Any]:
        parts = Etcd3Parts(parse_options(endpoint, run_id, {"read_timeout": 1}))
        parts.connect()
        kit.closers.append(parts.close)
        return parts.backend, parts.store

    def make() -> Any:
        return make_with_store()[0]

    def corrupt() -> None:
        parts = Etcd3Parts(parse_options(endpoint, run_id, {}))
        parts.client.call(lambda c: c.put(parts.backend.key, b"\x80not a state"), "corrupting")
        parts.close()

    kit.make, kit.corrupt, kit.make_with_store = make, corrupt, make_with_store
    return kit


def c10d_kit(run_id: str) -> Kit:
    port = free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))

    def client() -> TCPStore:
        return TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))

    def make_with_store() -> tuple[Any, Any]:
        store = client()
        return C10dRendezvousBackend(store, run_id), store

    kit = Kit(
        make=lambda: C10dRendezvousBackend(client(), run_id),
        corrupt=lambda: client().set("torch.rendezvous." + run_id, "garbage!!"),
        make_with_store=make_with_store,
    )
    kit.closers.append(lambda: server)  # keeps the server alive until teardown
    return kit


@pytest.fixture(params=[pytest.param("etcd3", marks=pytest.mark.e2e), "c10d"])  # etcd3: a real etcd process
def kit(request: pytest.FixtureRequest, run_id: str) -> Iterator[Kit]:
    if request.param == "etcd3":
        made = etcd3_kit(request.getfixturevalue("etcd_server").endpoint, run_id)
    else:
        made = c10d_kit(run_id)
    yield made
    for close in reversed(made.closers):  # handlers before the clients they use
        close()


def test_no_state_reads_as_none(kit: Kit) -> None:
    assert kit.make().get_state() is None


def test_first_write_with_none_token_succeeds_and_reads_back(kit: Kit) -> None:
    backend = kit.make()
    state, token, has_set = backend.set_state(S("state-1"))
    assert (state, has_set) == (S("state-1"), True)
    assert kit.make().get_state() == (S("state-1"), token)


def test_token_from_a_write_is_the_current_token(kit: Kit) -> None:
    backend = kit.make()
    _, token1, _ = backend.set_state(S("one"))
    state, token2, has_set = backend.set_state(S("two"), token1)
    assert (state, has_set) == (S("two"), True)
    assert token2 != token1
    # The token came from the write itself and is valid for the next write.
    assert backend.set_state(S("three"), token2)[2] is True
    assert kit.make().get_state()[0] == S("three")


def test_stale_token_writes_nothing_and_returns_current(kit: Kit) -> None:
    backend = kit.make()
    _, stale, _ = backend.set_state(S("one"))
    _, current, _ = backend.set_state(S("two"), stale)
    assert backend.set_state(S("evil"), stale) == (S("two"), current, False)
    assert kit.make().get_state() == (S("two"), current)


def test_none_token_does_not_overwrite_an_existing_state(kit: Kit) -> None:
    backend = kit.make()
    _, token, _ = backend.set_state(S("first"))
    assert kit.make().set_state(S("second"), None) == (S("first"), token, False)
    assert backend.get_state() == (S("first"), token)


@pytest.mark.parametrize("bad_token", [object(), "not-a-token", 3.5])
def test_invalid_token_writes_nothing(kit: Kit, bad_token: Any) -> None:
    backend = kit.make()
    _, token, _ = backend.set_state(S("first"))
    assert backend.set_state(S("second"), bad_token) == (S("first"), token, False)
    assert backend.get_state() == (S("first"), token)


def test_invalid_token_without_state_returns_none(kit: Kit) -> None:
    assert kit.make().set_state(S("x"), "not-a-token") is None
    assert kit.make().get_state() is None


def test_corrupt_state_raises_state_error(kit: Kit) -> None:
    kit.make().set_state(S("fine"))
    kit.corrupt()
    with pytest.raises(RendezvousStateError):
        kit.make().get_state()


def test_concurrent_writers_exactly_one_wins_per_token(kit: Kit) -> None:
    writers = [kit.make() for _ in range(4)]
    writers[0].set_state(S("round-0"))
    for round_no in range(1, 4):
        _, token = writers[0].get_state()
        results: list[bool] = []
        barrier = threading.Barrier(len(writers))

        def write(
            i: int, backend: Any, barrier: threading.Barrier, results: list[bool], round_no: int, token: Any
        ) -> None:
            barrier.wait(timeout=10)
            results.append(backend.set_state(S(f"round-{round_no}-writer-{i}"), token)[2])

        threads = [
            threading.Thread(target=write, args=(i, b, barrier, results, round_no, token))
            for i, b in enumerate(writers)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert sorted(results) == [False] * (len(writers) - 1) + [True]
        winner = tag_of(writers[0].get_state()[0])
        assert winner.startswith(f"round-{round_no}-writer-")


def test_torch_handlers_rendezvous_through_the_backend(kit: Kit, run_id: str) -> None:
    """Two of torch's own handlers form a world of 2; a third waits for the next round, then gives up.

    The states they write carry participants, a wait list, heartbeats and a
    deadline, so every kind of field torch pickles passes the backend's checks.
    """

    def handler(max_nodes: int, join: float) -> DynamicRendezvousHandler:
        backend, store = kit.make_with_store()
        timeout = RendezvousTimeout(join=timedelta(seconds=join), last_call=timedelta(seconds=0.2))
        made = DynamicRendezvousHandler.from_backend(
            run_id, store, backend, 2, max_nodes, local_addr="127.0.0.1", timeout=timeout, keep_alive_interval=1
        )
        kit.closers.append(made.shutdown)
        return made

    first = [handler(3, 60), handler(3, 60)]
    infos: dict[int, Any] = {}
    threads = [threading.Thread(target=lambda i=i: infos.update({i: first[i].next_rendezvous()})) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert sorted(info.rank for info in infos.values()) == [0, 1]
    assert {info.world_size for info in infos.values()} == {2}

    late = handler(3, 3)
    outcome: list[BaseException] = []

    def wait_in_vain() -> None:
        try:
            late.next_rendezvous()
        except RendezvousTimeoutError as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=wait_in_vain)
    waiter.start()
    deadline = time.monotonic() + 20
    while first[0].num_nodes_waiting() == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert first[0].num_nodes_waiting() == 1  # read back a state with a wait list
    waiter.join(timeout=30)
    assert outcome and isinstance(outcome[0], RendezvousTimeoutError)
