"""The etcd3 ``Store`` as torch and its agent use it, through torch's PrefixStore too."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.utils.store import barrier, synchronize

from service.rendezvous.options import parse_options
from service.rendezvous.parts import Etcd3Parts
from service.rendezvous.store import Etcd3Store

from .conftest import REPO, EtcdMember, kill_group

pytestmark = pytest.mark.e2e  # every test here starts a process (etcd, torchrun, Slurm)


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
    """Like torch's own stores: DistStoreError, and the message says it timed out."""
    store.set_timeout(timedelta(seconds=0.3))
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="Timed out.*timeout of 0.3 s"):
        store.get("never")
    with pytest.raises(dist.DistStoreError, match="Timed out.*timeout of 0.2 s"):
        store.wait(["never"], timedelta(seconds=0.2))
    with pytest.raises(dist.DistStoreError, match="(?i)timeout") as info:
        store.multi_get(["never", "either"])
    assert "never" in str(info.value) and "either" in str(info.value)
    assert time.monotonic() - started < 3


def test_clone_is_a_new_client_on_the_same_keys(parts: Etcd3Parts) -> None:
    parts.store.set_timeout(timedelta(seconds=7))
    twin = parts.store.clone()
    assert isinstance(twin, Etcd3Store) and twin is not parts.store
    assert twin._client is not parts.store._client and twin._client.options == parts.store._client.options
    assert twin.timeout == timedelta(seconds=7)
    twin.set("from-clone", b"1")
    parts.store.set("from-original", b"2")
    assert parts.store.get("from-clone") == b"1" and twin.get("from-original") == b"2"
    assert twin.add("n", 2) == 2 and parts.store.add("n", 3) == 5
    # Written on the run's lease, like every key of the original.
    _, meta = parts.client.call(lambda c: c.get(twin._k("from-clone")), "read")
    assert meta.lease_id == parts.lease.id()
    # torch clones through its PrefixStore in C++ (split and shrunk groups): the clone keeps its methods.
    prefixed = dist.PrefixStore("grp", parts.store).clone()
    gc.collect()
    prefixed.set("k", b"v")
    assert dist.PrefixStore("grp", twin).get("k") == b"v"
    # Closing the original's parts closes the clones' clients too.
    parts.store.close()
    with pytest.raises(ValueError, match="closed channel"):
        twin._client.raw.get(b"/x")


@pytest.mark.e2e
def test_gloo_world_of_two_on_the_store_with_new_group_and_a_clone(etcd_server: EtcdMember, run_id: str) -> None:
    """Two processes: init_process_group over the etcd3 store, dist.new_group, and a gloo group on a clone."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    script = str(REPO / "tests" / "scripts" / "etcd3_store_group.py")
    procs = [
        subprocess.Popen(
            [sys.executable, script, etcd_server.endpoint, run_id, str(rank), "2"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        for rank in range(2)
    ]
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=120)
            outputs.append(out)
            assert proc.returncode == 0, out[-3000:]
    finally:
        for proc in procs:
            kill_group(proc)
    for rank, out in enumerate(outputs):
        assert f"etcd3-group rank={rank} world=3 sub=20 clone=200 peer={1 - rank}" in out, out[-3000:]


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
