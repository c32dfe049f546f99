"""The etcd3 ``Store`` as torch and its agent use it, through torch's PrefixStore too."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.utils.store import barrier, synchronize

from service.rendezvous.factory import Etcd3Parts
from service.rendezvous.options import parse_options

from .conftest import EtcdMember


@pytest.fixture
def parts(etcd_server: EtcdMember, run_id: str) -> Iterator[Etcd3Parts]:
    made = Etcd3Parts(parse_options(etcd_server.endpoint, run_id, {}))
    made.connect()
    yield made
    made.close()


@pytest.fixture
def store(parts: Etcd3Parts) -> dist.Store:
    """Wrapped the way torch's handler hands it out, so the C++ trampoline is exercised."""
    return dist.PrefixStore("torch.rendezvous.run.0", parts.store)


def test_set_get_bytes_and_str(store: dist.Store) -> None:
    store.set("b", b"\x00\xffbin")
    store.set("s", "text")
    assert store.get("b") == b"\x00\xffbin"
    assert store.get("s") == b"text"


def test_get_blocks_until_the_key_appears(store: dist.Store) -> None:
    threading.Timer(0.3, store.set, ("late", b"here")).start()
    started = time.monotonic()
    assert store.get("late") == b"here"
    assert 0.25 < time.monotonic() - started < 3


def test_get_and_wait_time_out_with_dist_store_error(store: dist.Store) -> None:
    store.set_timeout(timedelta(seconds=0.3))
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        store.get("never")
    with pytest.raises(dist.DistStoreError):
        store.wait(["never"], timedelta(seconds=0.2))
    with pytest.raises(dist.DistStoreError):
        store.multi_get(["never", "either"])
    assert time.monotonic() - started < 3


def test_wait_and_check(store: dist.Store) -> None:
    assert not store.check(["a", "b"])
    store.set("a", b"1")
    assert not store.check(["a", "b"])
    store.set("b", b"2")
    store.wait(["a", "b"], timedelta(seconds=1))
    assert store.check(["a", "b"])


def test_multi_set_and_multi_get(store: dist.Store) -> None:
    store.multi_set(["x", "y"], [b"1", b"2"])
    assert store.multi_get(["y", "x"]) == [b"2", b"1"]


def test_add_is_atomic_across_threads(parts: Etcd3Parts, etcd_server: EtcdMember, run_id: str) -> None:
    others = [Etcd3Parts(parse_options(etcd_server.endpoint, run_id, {})) for _ in range(3)]
    stores = [parts.store] + [o.store for o in others]
    assert parts.store.add("counter", 0) == 0

    def bump(s: dist.Store) -> None:
        for _ in range(15):
            s.add("counter", 1)

    threads = [threading.Thread(target=bump, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert parts.store.add("counter", 0) == 60
    assert parts.store.get("counter") == b"60"
    for o in others:
        o.close()


def test_compare_set_follows_tcpstore(store: dist.Store) -> None:
    assert store.compare_set("k", "", "first") == b"first"  # absent, empty expectation: set
    assert store.compare_set("k", "wrong", "second") == b"first"  # mismatch: current value
    assert store.compare_set("k", "first", "second") == b"second"
    assert store.compare_set("absent", "expected", "x") == b"expected"
    assert not store.check(["absent"])


def test_delete_key_and_num_keys(parts: Etcd3Parts) -> None:
    store = parts.store
    assert store.num_keys() == 0
    store.set("a", b"1")
    store.set("b", b"2")
    assert store.num_keys() == 2
    assert dist.PrefixStore("p", store).num_keys() == 2
    assert store.delete_key("a") is True
    assert store.delete_key("a") is False
    assert store.num_keys() == 1


def test_torch_barrier_and_synchronize(parts: Etcd3Parts, etcd_server: EtcdMember, run_id: str) -> None:
    others = [Etcd3Parts(parse_options(etcd_server.endpoint, run_id, {})) for _ in range(2)]
    stores = [parts.store] + [o.store for o in others]
    results: dict[int, list[bytes]] = {}

    def agent(rank: int) -> None:
        results[rank] = synchronize(stores[rank], f"d{rank}".encode(), rank, 3, "sync/", timeout=10)
        barrier(stores[rank], 3, "exit-barrier", barrier_timeout=10)

    threads = [threading.Thread(target=agent, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results == {r: [b"d0", b"d1", b"d2"] for r in range(3)}
    # A barrier nobody else joins times out with the type the agent catches.
    with pytest.raises(dist.DistStoreError):
        barrier(parts.store, 2, "lonely", barrier_timeout=0.3)
    for o in others:
        o.close()
