"""The etcd-native handler (``impl=native``): sealing races, lease loss, watches across an etcd restart, scale.

Real etcd servers, real handlers (in-process threads, or forked processes for
the 64-node round); the rules of ``rounds.py`` also get a property test.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.elastic.rendezvous.api import (
    RendezvousParameters,
    RendezvousStateError,
    RendezvousTimeoutError,
)

from service.rendezvous.client import EtcdClient, EtcdError
from service.rendezvous.factory import build_handler
from service.rendezvous.lease import NodeLease, RunLostError
from service.rendezvous.native.ranges import Entry
from service.rendezvous.native.records import ClosedRecord, Layout, NodeRecord, RankRecord, RecordError, SealRecord
from service.rendezvous.native.rounds import read_rank, seal_due, try_join, try_seal, view_round
from service.rendezvous.options import parse_options
from service.rendezvous.ports import ephemeral_range
from service.rendezvous.requests import RangeRead

from .conftest import REPO, EtcdMember, wait_healthy

PREFIX = "/torchelastic/etcd3"
SECRET = "correct horse battery staple"
Make = Callable[..., Any]


@pytest.fixture
def make(run_id: str) -> Iterator[Make]:
    """``make(endpoint, min, max, impl="native", **conf)``: a handler, closed on teardown."""
    made: list[Any] = []

    def build(endpoint: str, min_nodes: int, max_nodes: int, impl: str = "native", **conf: Any) -> Any:
        conf = {"last_call_timeout": "0.3", "join_timeout": "60", **conf}
        params = RendezvousParameters(
            "etcd3", endpoint, run_id, min_nodes, max_nodes, local_addr="127.0.0.1", impl=impl, **conf
        )
        handler = build_handler(params)
        made.append(handler)
        return handler

    yield build
    for handler in made:
        handler.shutdown()


def together(*calls: Callable[[], Any], timeout: float = 60) -> list[Any]:
    """Run ``calls`` in threads at once; their results (or exceptions) in order."""
    results: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as exc:  # reported to the test
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return results


def client_for(endpoint: str) -> EtcdClient:
    return EtcdClient(parse_options(endpoint, "probe", {"read_timeout": 1}).client)


def wait_until(check: Callable[[], Any], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"Not true within {timeout} s: {check}")


# -- torch's handler contract, native next to dynamic ------------------------------------------
@pytest.mark.e2e
@pytest.mark.parametrize("impl", ["native", "dynamic"])
def test_two_form_a_world_and_a_third_waits_for_the_next_round(etcd_server: EtcdMember, make: Make, impl: str) -> None:
    first = [make(etcd_server.endpoint, 2, 3, impl), make(etcd_server.endpoint, 2, 3, impl)]
    infos = together(*(h.next_rendezvous for h in first))
    assert sorted(i.rank for i in infos) == [0, 1] and {i.world_size for i in infos} == {2}
    stores = {(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos}
    assert len(stores) == 1
    if impl == "native":  # rank 0's worker listens there later: not a port the kernel may give a connection meanwhile
        low, high = ephemeral_range()
        assert not low <= stores.pop()[1] <= high
    late = make(etcd_server.endpoint, 2, 3, impl, join_timeout="3")
    outcome = together(late.next_rendezvous, lambda: wait_until(lambda: first[0].num_nodes_waiting() == 1, 20))
    assert isinstance(outcome[0], RendezvousTimeoutError), outcome
    assert not first[0].is_closed()
    first[1].set_closed()
    assert wait_until(first[0].is_closed, 10)


# -- sealing races -------------------------------------------------------------------------------
def _joined(client: EtcdClient, layout: Layout, round_no: int, names: list[str]) -> list[NodeLease]:
    leases = []
    for name in names:
        lease = NodeLease(client, 10, 3, lambda reason: None)
        record = NodeRecord(node=name, addr="127.0.0.1", pid=1, round=round_no)
        assert try_join(client, layout, round_no, record, lease.grant(), None)[0] > 0
        leases.append(lease)
    return leases


def _view(client: EtcdClient, layout: Layout, round_no: int) -> tuple[int, Any]:
    revision, kvs = client.list_prefix(layout.base, "reading")
    entries = {kv.key: Entry(kv.value, kv.create_revision, kv.mod_revision) for kv in kvs}
    return revision, view_round(layout, entries, round_no)


@pytest.mark.e2e
def test_two_sealers_that_both_see_max_nodes_seal_once_and_read_the_same_record(
    etcd_server: EtcdMember, run_id: str
) -> None:
    clients = [client_for(etcd_server.endpoint) for _ in range(2)]
    layout = Layout.of(PREFIX, run_id)
    leases = _joined(clients[0], layout, 0, ["b-node", "a-node", "c-node"])
    try:
        revision, view = _view(clients[0], layout, 0)
        assert seal_due(view, 2, 2) == "now"  # both see max_nodes reached
        barrier = threading.Barrier(2)

        def seal(i: int) -> bool:
            barrier.wait(10)
            return try_seal(clients[i], layout, view, revision, 2, f"sealer-{i}", leases[0].grant())

        won = together(lambda: seal(0), lambda: seal(1))
        assert sorted(won) == [False, True], won
        records = [_view(c, layout, 0)[1].seal for c in clients]
        assert records[0] is not None and records[0] == records[1]
        # the first two joiners, ranked by node id; the third is not a member
        ranks = [read_rank(clients[1], layout, 0, records[0], n) for n in ("a-node", "b-node", "c-node")]
        assert records[0].world == 2 and ranks == [0, 1, None]
    finally:
        for lease in leases:
            lease.revoke()
        for c in clients:
            c.close()


@pytest.mark.e2e
def test_a_joiner_during_the_seal_is_either_sealed_in_or_refused(etcd_server: EtcdMember, run_id: str) -> None:
    client = client_for(etcd_server.endpoint)
    layout = Layout.of(PREFIX, run_id)
    leases = _joined(client, layout, 0, ["a", "b"])
    try:
        revision, view = _view(client, layout, 0)
        leases += _joined(client, layout, 0, ["c"])  # lands between the sealer's read and its write
        assert not try_seal(client, layout, view, revision, 8, "a", leases[0].grant())
        assert _view(client, layout, 0)[1].seal is None
        revision, view = _view(client, layout, 0)
        assert try_seal(client, layout, view, revision, 8, "a", leases[0].grant())
        seal = _view(client, layout, 0)[1].seal
        assert seal.world == 3 and [read_rank(client, layout, 0, seal, n) for n in "abc"] == [0, 1, 2]
        late = NodeLease(client, 10, 3, lambda reason: None)
        leases.append(late)
        written, _, seal, closed, _ = try_join(
            client, layout, 0, NodeRecord(node="d", addr="x", pid=1, round=0), late.grant(), None
        )
        assert written == 0 and closed is None and SealRecord.model_validate_json(seal).world == 3
    finally:
        for lease in leases:
            lease.revoke()
        client.close()


@settings(max_examples=60, deadline=None)
@given(
    revisions=st.lists(st.integers(1, 10_000), min_size=1, max_size=12, unique=True),
    min_nodes=st.integers(1, 6),
    extra=st.integers(0, 6),
    earlier=st.integers(0, 2),
    member_of=st.sampled_from([-1, 1, 2]),
    order=st.randoms(),
)
def test_members_are_the_first_joiners_whatever_order_the_keys_arrive_in(
    revisions: list[int], min_nodes: int, extra: int, earlier: int, member_of: int, order: Any
) -> None:
    """Members by join order; sealed at once when full or when a member of the previous round (2) is back."""
    layout = Layout.of(PREFIX, "prop")
    items = [
        (
            layout.node_key(3, f"n{r}"),
            Entry(
                NodeRecord(node=f"n{r}", addr="h", pid=1, round=3, member_of=member_of if r == revisions[-1] else -1)
                .model_dump_json()
                .encode(),
                r,
                r,
            ),
        )
        for r in revisions
    ]
    items += [(layout.node_key(2, f"old{i}"), Entry(b"{}", 1, 1)) for i in range(earlier)]
    order.shuffle(items)
    view = view_round(layout, dict(items), 3)
    max_nodes = min_nodes + extra
    assert [j.node for j in view.members(max_nodes)] == [f"n{r}" for r in sorted(revisions)][:max_nodes]
    due = seal_due(view, min_nodes, max_nodes)
    if earlier or len(revisions) < min_nodes:
        assert due is None  # never while a previous member is still around, never below min
    else:
        assert due == ("now" if len(revisions) >= max_nodes or member_of == 2 else "last_call")


# -- lease loss, departures, steady state ------------------------------------------------------------
@pytest.mark.e2e
def test_lease_loss_mid_run_fails_loudly_and_never_forms_a_second_world(etcd_server: EtcdMember, make: Make) -> None:
    a, b = make(etcd_server.endpoint, 1, 2), make(etcd_server.endpoint, 1, 2)
    assert {i.world_size for i in together(a.next_rendezvous, b.next_rendezvous)} == {2}
    client = client_for(etcd_server.endpoint)
    try:
        client.call(lambda c: c.revoke_lease(a._lease._id), "revoking")  # what an expiry during a stall does
    finally:
        client.close()

    def a_lost() -> bool:
        try:
            a.num_nodes_waiting()
        except RunLostError as exc:
            return "gone for this node" in str(exc) and "split brain" in str(exc)
        return False

    wait_until(a_lost, 5)
    assert wait_until(b.num_nodes_waiting, 5) >= 1  # the survivor sees the departure
    info = b.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    with pytest.raises(RunLostError):
        a.next_rendezvous()  # sticky: the lost node never joins again
    assert b._sealed is not None and b._sealed.world == 1 and b._round == 1


@pytest.mark.e2e
def test_keys_lost_to_a_frozen_etcd_rejoin_instead_of_failing(etcd_private: EtcdMember, make: Make) -> None:
    """Issue 15, finding 2: a frozen etcd expires every node lease when it wakes; nobody who could reach etcd
    did that, so the members leave their round (their workers are restarted) and rejoin, instead of RunLostError."""
    a, b = make(etcd_private.endpoint, 2, 2), make(etcd_private.endpoint, 2, 2)
    assert {i.world_size for i in together(a.next_rendezvous, b.next_rendezvous)} == {2}
    assert etcd_private.proc is not None
    os.kill(etcd_private.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(a._lease.ttl + 1.5)  # past the node leases' TTL, and etcd's 0.5 s expiry tick
    finally:
        os.kill(etcd_private.proc.pid, signal.SIGCONT)
    assert wait_until(lambda: a.num_nodes_waiting() and b.num_nodes_waiting(), 15) == 1  # evicted, not lost
    infos = together(a.next_rendezvous, b.next_rendezvous)
    assert sorted((i.rank, i.world_size) for i in infos) == [(0, 2), (1, 2)], infos
    assert a._round == b._round == 1


@pytest.mark.e2e
def test_a_node_that_dies_leaves_within_the_lease_ttl_and_steady_state_writes_nothing(
    etcd_server: EtcdMember, make: Make
) -> None:
    a, b = make(etcd_server.endpoint, 1, 2), make(etcd_server.endpoint, 1, 2)
    together(a.next_rendezvous, b.next_rendezvous)
    # The liveness timeout is keep_alive_interval x keep_alive_max_attempt (whole seconds, etcd's 2 s at least),
    # read from the options, not the handler's own TTL: a lease granted 3 times too long must fail here.
    options = a._parts.options
    ttl = max(2, math.ceil(options.keep_alive_interval * options.keep_alive_max_attempt))
    client = client_for(etcd_server.endpoint)
    try:
        granted = int(client.call(lambda c: c.get_lease_info(a._lease._id), "reading the node lease").grantedTTL)
        assert granted == ttl, (
            f"the node lease was granted {granted} s; keep_alive_interval {options.keep_alive_interval} x "
            f"keep_alive_max_attempt {options.keep_alive_max_attempt} makes {ttl} s"
        )

        def written() -> list[tuple[bytes, int]]:  # this run's keys and their last writes (the etcd is shared)
            return sorted((kv.key, kv.mod_revision) for kv in client.list_prefix(a._mirror._prefix, "keys")[1])

        before = written()
        time.sleep(ttl + 0.5)  # more than a lease TTL of keep-alives
        assert before and written() == before  # keep-alives write nothing: no key of the run changes
    finally:
        client.close()
    a._lease._stop.set()  # a dies: its keep-alives stop, nothing is cleaned up
    died = time.monotonic()
    wait_until(lambda: b.num_nodes_waiting() >= 1, ttl + 10)
    seen = time.monotonic() - died
    assert seen <= ttl + 1.5, f"the departure was seen {seen:.2f} s after the node died; its lease TTL is {ttl} s"


@dataclasses.dataclass(frozen=True)
class _CompactingRead(RangeRead):
    """A read whose request, as it is built, has etcd compact up to its newest revision first (through a second
    client), while ``compactions`` lasts: the compaction lands between two reads of one ``read_ranges``."""

    endpoint: str = ""
    compactions: list[int] = dataclasses.field(default_factory=lambda: [1])

    def request(self) -> Any:
        if self.compactions[0] > 0:
            self.compactions[0] -= 1
            other = client_for(self.endpoint)
            try:
                other.call(lambda c: c.put("/compacting/bump", "x"), "writing")
                revision = other.list_prefix(b"/nothing/", "revision")[0]
                other.call(lambda c: c.compact(revision, physical=True), "compacting")
            finally:
                other.close()
        return super().request()


@pytest.mark.e2e
def test_reads_at_one_revision_overtaken_by_a_compaction_are_read_again_and_a_compaction_each_time_is_named(
    etcd_private: EtcdMember,
) -> None:
    """CI, once: an etcd restart's re-read of the rendezvous keys met a compaction between its first read and the
    next, pinned to the first one's revision; etcd refused that one (OUT_OF_RANGE, compacted), and the handler
    failed with it. All are read again from a new first read; a compaction before every second read fails by name."""
    client = client_for(etcd_private.endpoint)
    try:
        client.call(lambda c: c.put("/t/a", "1"), "writing")
        client.call(lambda c: c.put("/t/b", "2"), "writing")
        compacting = _CompactingRead(b"/t/b", endpoint=etcd_private.endpoint)
        revision, found = client.read_ranges([RangeRead(b"/t/a"), compacting], "reading")
        assert compacting.compactions == [0]  # the compaction came between the two reads
        assert [[(kv.key, kv.value) for kv in kvs] for kvs in found] == [[(b"/t/a", b"1")], [(b"/t/b", b"2")]]
        assert revision == client.list_prefix(b"/nothing/", "revision")[0]  # read after the compaction
        always = _CompactingRead(b"/t/b", endpoint=etcd_private.endpoint, compactions=[100])
        with pytest.raises(EtcdError, match="OUT_OF_RANGE.*compacted"):
            client.read_ranges([RangeRead(b"/t/a"), always], "reading")
        assert always.compactions == [95]  # five reads, each overtaken
    finally:
        client.close()


@pytest.mark.e2e
def test_a_watch_broken_by_an_etcd_restart_resumes_without_missing_a_departure(
    etcd_private: EtcdMember, make: Make
) -> None:
    a, b = make(etcd_private.endpoint, 1, 2), make(etcd_private.endpoint, 1, 2)
    together(a.next_rendezvous, b.next_rendezvous)
    b_lease = b._lease._id
    etcd_private.kill()
    etcd_private.start()
    etcd_private.wait_listening()
    wait_healthy(etcd_private.endpoint)
    client = client_for(etcd_private.endpoint)
    try:
        client.call(lambda c: c.revoke_lease(b_lease), "revoking")  # b departs while a's watch is being rebuilt
        revision = client.list_prefix(b"/nothing/", "revision")[0]
        client.call(lambda c: c.compact(revision, physical=True), "compacting")  # its delete event is gone
    finally:
        client.close()
    assert wait_until(a.num_nodes_waiting, 20) >= 1
    # the rebuilt watch counts itself just after its re-read shows the departure (CI once read it in between)
    assert wait_until(lambda: a._mirror.resyncs, 5) >= 1
    info = a.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)


@pytest.mark.e2e
def test_a_stream_that_ends_while_it_is_being_opened_is_rebuilt_and_a_departure_still_seen(
    etcd_private: EtcdMember, make: Make
) -> None:
    """etcd can end a watch right after confirming it (a compaction while the new watch still catches up: a CI run
    of the test above once waited 20 s in vain). If that end comes before the opening thread keeps the stream, the
    opening rebuilds it; before, the end was dropped and the node watched nothing until its next round."""
    a, b = make(etcd_private.endpoint, 1, 2), make(etcd_private.endpoint, 1, 2)
    together(a.next_rendezvous, b.next_rendezvous)
    mirror = a._mirror
    real, ended = mirror._client.open_watch_stream, []

    def open_then_end(watches: Any, on_response: Any, on_end: Any, *rest: Any) -> Any:
        """The next stream ends, and the mirror hears of it, before the opening thread keeps the stream."""
        if ended:
            return real(watches, on_response, on_end, *rest)
        heard = threading.Event()

        def end_heard(error: BaseException | None) -> None:
            on_end(error)
            heard.set()

        stream = real(watches, on_response, end_heard, *rest)
        stream._call.cancel()  # it breaks, as when etcd ends it (a stream closed here is not rebuilt)
        assert heard.wait(10), "the closed stream's end never reached the mirror"
        ended.append(stream)
        return stream

    mirror._client.open_watch_stream = open_then_end
    resyncs = mirror.resyncs
    etcd_private.kill()  # breaks a's stream: its rebuild opens the stream that ends at once
    etcd_private.start()
    etcd_private.wait_listening()
    wait_healthy(etcd_private.endpoint)
    wait_until(lambda: ended, 20)
    assert wait_until(lambda: mirror.resyncs >= resyncs + 2, 10)  # the broken stream's rebuild, then the ended one's
    client = client_for(etcd_private.endpoint)
    try:
        client.call(lambda c: c.revoke_lease(b._lease._id), "revoking")  # b departs: a's live watch must see it
    finally:
        client.close()
    assert wait_until(a.num_nodes_waiting, 10) >= 1


@pytest.mark.e2e
def test_a_rebuilt_watch_sees_a_departure_whose_deletion_etcd_compacted_at_the_watch_start(
    etcd_private: EtcdMember, make: Make
) -> None:
    """etcd before 3.5.16 (etcd-io/etcd#18089; 3.5.1 here) drops a deletion from a watch that starts at the very
    revision a compaction was made at, when that revision is the deletion and the compaction came before the watch
    caught up: neither the event nor a refusal comes. Here b departs, and someone compacts at its departure, between
    the read of a's rebuild and a's new watch, which starts at that departure's revision: the read after etcd
    confirmed the watch sees the departure (the flake of the restart test above, made certain)."""
    a, b = make(etcd_private.endpoint, 1, 2), make(etcd_private.endpoint, 1, 2)
    together(a.next_rendezvous, b.next_rendezvous)
    mirror = a._mirror
    real, compacted_at, starts = mirror._client.open_watch_stream, [], {}

    def depart_then_watch(*args: Any) -> Any:
        if not compacted_at:  # the rebuild has read the keys; b departs at the next revision, compacted at once
            client = client_for(etcd_private.endpoint)
            try:
                client.call(lambda c: c.revoke_lease(b._lease._id), "revoking")
                compacted_at.append(client.list_prefix(b"/nothing/", "revision")[0])
                client.call(lambda c: c.compact(compacted_at[0], physical=True), "compacting")
            finally:
                client.close()
            starts.update({rng.name: spec.start_revision for rng, spec in args[0]})
        return real(*args)

    mirror._client.open_watch_stream = depart_then_watch
    resyncs = mirror.resyncs
    with mirror.cond:
        assert mirror._stream is not None
        mirror._stream._call.cancel()  # a's stream breaks
    assert wait_until(lambda: mirror.resyncs > resyncs, 10)
    assert starts["round"] == compacted_at[0], "the case of etcd's bug: the watch starts at the compacted departure"
    assert a.num_nodes_waiting() == 1, "a missed b's departure"


# -- nothing from etcd is unpickled or trusted unsigned ------------------------------------------------
@pytest.mark.e2e
def test_planted_values_are_refused_and_nothing_runs(
    etcd_server: EtcdMember, make: Make, run_id: str, tmp_path: Any
) -> None:
    """Without a secret every value is read, so a pickle planted as a member is refused by name, never run."""
    marker = tmp_path / "pwned"
    handler = make(etcd_server.endpoint, 1, 2)
    handler.next_rendezvous()
    planted = Layout.of(PREFIX, run_id).node_key(1, "intruder")
    client = client_for(etcd_server.endpoint)
    try:
        client.call(lambda c: c.put(planted, pickle.dumps(_Touch(str(marker)))), "planting")
        deadline = time.monotonic() + 5
        with pytest.raises(RendezvousStateError) as info:
            while time.monotonic() < deadline:  # until the watch brings the planted key
                handler.num_nodes_waiting()
                time.sleep(0.05)
    finally:
        client.close()
    assert planted.decode() in str(info.value) and "did not write" in str(info.value) and not marker.exists()


def test_a_signed_layout_refuses_unsigned_and_wrongly_signed_values_without_etcd() -> None:
    """The promise behind a signed run, record by record: a value without this run's signature is a forgery
    (:meth:`Layout.forgery`), and decoding one is refused (:meth:`Layout.decode`), whatever record it pretends to be."""
    signed = Layout.of(PREFIX, "run", SECRET.encode())
    unsigned, other = Layout.of(PREFIX, "run"), Layout.of(PREFIX, "run", b"another secret, 16+ chars")
    records = [
        (signed.node_key(0, "a"), NodeRecord(node="a", addr="x", pid=1, round=0)),
        (signed.seal_key(0), SealRecord(round=0, world=1, cutoff=5, sealed_by="a")),
        (signed.rank_key(0, "a", "a"), RankRecord(round=0, rank=0, world=1, cutoff=5, sealed_by="a")),
        (signed.closed, ClosedRecord(closed_by="a")),
    ]
    for key, record in records:
        model = type(record)
        assert signed.decode(model, signed.encode(key, record), key) == record  # the run's own value
        bare = unsigned.encode(key, record)  # what a writer without the secret puts: the valid JSON alone
        assert signed.forgery(key, bare) == "it is unsigned"
        for decode in (signed.decode, signed.decode_uncached):
            with pytest.raises(RecordError, match="holds an unsigned value, but this run is signed"):
                decode(model, bare, key)
        for forged, why in ((other.encode(key, record), "another secret"),
                            (signed.encode(signed.node_key(9, "b"), record), "another key's signature")):  # fmt: skip
            assert signed.forgery(key, forged) == "its signature does not match this run's secret", why
            with pytest.raises(RecordError, match="signature does not match"):
                signed.decode(model, forged, key)
        with pytest.raises(RecordError, match="holds a signed value, but this agent has no signing secret"):
            unsigned.decode(model, signed.encode(key, record), key)
        assert unsigned.forgery(key, bare) is None and unsigned.decode(model, bare, key) == record  # an unsigned run


def _forgeries(run_id: str) -> dict[bytes, bytes]:
    """What a writer without the run's secret can put: the finding's two, a seal, and a wrongly signed member."""
    layout = Layout.of(PREFIX, run_id)
    other = Layout.of(PREFIX, run_id, b"another secret, 16+ chars")
    intruder = layout.node_key(1, "intruder")
    return {
        layout.closed: b"x",  # unsigned: once obeyed as "the job has finished"
        layout.rounds + b"000000000099/evil": b"x",  # unsigned, no lease: once fatal (RecordError) within 3 s
        layout.seal_key(99): SealRecord(round=99, world=1, cutoff=1, sealed_by="evil").model_dump_json().encode(),
        intruder: other.encode(intruder, NodeRecord(node="intruder", addr="evil", pid=1, round=1)),
    }


@pytest.mark.e2e
def test_forged_values_on_a_signed_run_are_ignored_deleted_and_never_fatal(
    etcd_server: EtcdMember, make: Make, run_id: str, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """Issue 15, finding 6: on a signed run an unsigned or wrongly signed value is neither obeyed nor fatal."""
    monkeypatch.setenv("S", SECRET)
    a, b = make(etcd_server.endpoint, 1, 2, secret_env="S"), make(etcd_server.endpoint, 1, 2, secret_env="S")
    assert {i.world_size for i in together(a.next_rendezvous, b.next_rendezvous)} == {2}
    forged = _forgeries(run_id)
    client = client_for(etcd_server.endpoint)
    try:
        for key, value in forged.items():
            client.call(lambda c, k=key, v=value: c.put(k, v), "planting")
        for _ in range(20):  # nothing is obeyed and nothing is fatal: no member waits, the run is open
            assert (a.num_nodes_waiting(), b.num_nodes_waiting(), a.is_closed()) == (0, 0, False)
            time.sleep(0.05)
        gone = lambda: all(client.call(lambda c, k=k: c.get(k), "read")[0] is None for k in forged)  # noqa: E731
        wait_until(gone, 5)  # every agent that sees a forged value deletes it: it cannot poison the run id
        for key, value in forged.items():  # and while a forged value is there, it is ignored the same way
            client.call(lambda c, k=key, v=value: c.put(k, v), "planting")
        # A node is lost: b re-forms alone, neither stopped by the forged `closed` nor sent on to round 100.
        client.call(lambda c: c.revoke_lease(a._lease._id), "revoking")
        assert wait_until(b.num_nodes_waiting, 5) >= 1
        info = b.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1) and b._round == 1
    finally:
        client.close()
    assert "ignored and deleted" in caplog.text and "unsigned" in caplog.text and "does not match" in caplog.text


@pytest.mark.e2e
def test_a_join_refused_by_a_forged_seal_or_closed_deletes_it_and_joins(etcd_server: EtcdMember, run_id: str) -> None:
    client = client_for(etcd_server.endpoint)
    layout = Layout.of(PREFIX, run_id, SECRET.encode())
    lease = NodeLease(client, 10, 3, lambda reason: None)
    try:
        for key in (layout.closed, layout.seal_key(0)):
            client.call(lambda c, k=key: c.put(k, b'{"closed_by": "evil"}'), "planting")
        written, _, seal, closed, _ = try_join(
            client, layout, 0, NodeRecord(node="a", addr="x", pid=1, round=0), lease.grant(), None
        )
        assert written > 0 and (seal, closed) == (None, None)
        assert client.call(lambda c: c.get(layout.closed), "read")[0] is None
    finally:
        lease.revoke()
        client.close()


class _Touch:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        from pathlib import Path

        return (Path(self.path).touch, ())


# -- scale --------------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_64_forked_handlers_complete_one_round(etcd_server: EtcdMember) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "rendezvous_scale.py"), "--one", "native", "64",
         "--endpoint", etcd_server.endpoint],
        capture_output=True, text=True, timeout=240, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    point = json.loads(done.stdout.strip().splitlines()[-1])
    assert "error" not in point, point
    assert point["worlds"] == [64] and point["seconds"] < 60, point
    assert point["writes_per_node"] <= 2, point  # one join, and a seal by one of them: O(1) per node
    print(f"64 native handlers: one round in {point['seconds']:.2f} s, {point['requests_per_node']:.1f} requests/node")
