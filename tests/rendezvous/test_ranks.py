"""The native handler's ranks: one key per member, written by the sealer in transactions of at most
``RANKS_PER_TXN`` operations, each member reading its own (O(1) bytes per node), racing sealers kept apart by
the sealer's id in the key, forged rank keys ignored on a signed run, and departures counted without a member list.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

from service.rendezvous.client import EtcdClient, prefix_end
from service.rendezvous.lease import NodeLease
from service.rendezvous.native.ranges import Range
from service.rendezvous.native.records import Layout, RankRecord, RecordError, SealRecord
from service.rendezvous.native.rounds import RANKS_PER_TXN, Joiner, RoundView, read_rank, seal_due, try_seal
from service.rendezvous.native.watching import RoundWatches
from service.rendezvous.requests import DELETES

from . import test_native
from .conftest import EtcdMember
from .test_native import PREFIX, SECRET, Make, _joined, _view, client_for, together, wait_until

make = test_native.make  # the handler fixture


@contextmanager
def _client_and_lease(etcd: EtcdMember) -> Iterator[tuple[EtcdClient, NodeLease]]:
    """A client of ``etcd`` and a run lease on it (what a sealer writes its seal and ranks on); both given back."""
    client = client_for(etcd.endpoint)
    lease = NodeLease(client, 30, 10, lambda reason: None)
    try:
        yield client, lease
    finally:
        lease.revoke()
        client.close()


def _synthetic(round_no: int, names: list[str]) -> RoundView:
    """A round whose joiners (in join order ``names``) are not in etcd: the seal's compares still hold."""
    joined = tuple(Joiner(100 + i, name, "127.0.0.1") for i, name in enumerate(names))
    return RoundView(round=round_no, joined=joined, earlier=0, seal=None, seal_created=0, closed=False)


def _counting(client: EtcdClient) -> list[Any]:
    """Every transaction ``client`` sends from now on, recorded."""
    sent: list[Any] = []
    real = client.txn

    def txn(request: Any, *args: Any, **kw: Any) -> Any:
        sent.append(request)
        return real(request, *args, **kw)

    client.txn = txn  # type: ignore[method-assign]
    return sent


def _names(count: int, seed: int) -> list[str]:
    names = [f"10.0.{i % 7}.{i}_{1000 + i}_{i:08x}" for i in range(count)]
    random.Random(seed).shuffle(names)  # join order is not node-id order
    return names


def test_a_re_formed_world_is_due_now_only_with_a_member_of_the_previous_round() -> None:
    def view(round_no: int, member_of: int) -> RoundView:
        joined = (Joiner(1, "a", "x", member_of), Joiner(2, "b", "x"))
        return RoundView(round=round_no, joined=joined, earlier=0, seal=None, seal_created=0, closed=False)

    assert seal_due(view(0, -1), 1, 4) == "last_call"  # round 0: nobody was a member of round -1
    assert seal_due(view(5, 4), 1, 4) == "now"
    assert seal_due(view(5, 3), 1, 4) == "last_call"  # a member of an older world is no re-formed one


@pytest.mark.e2e
def test_a_seal_of_250_writes_every_rank_in_transactions_of_at_most_100_and_each_member_reads_its_own(
    etcd_server: EtcdMember, run_id: str
) -> None:
    layout = Layout.of(PREFIX, run_id)
    names = _names(260, seed=1)
    with _client_and_lease(etcd_server) as (client, lease):
        sent = _counting(client)
        view = _synthetic(0, names)
        assert try_seal(client, layout, view, 1_000_000, 250, "sealer-node", lease.grant())
        assert len(sent) == 3 and all(len(t.success) <= RANKS_PER_TXN for t in sent), [len(t.success) for t in sent]
        puts = [op.request_put.key for t in sent for op in t.success if op.HasField("request_put")]
        assert len(puts) == 251 and puts[-1] == layout.seal_key(0)  # 250 ranks, the seal last, with the last chunk
        assert all(len(t.compare) == 4 for t in sent)  # every chunk under the seal's conditions
        seal = _view(client, layout, 0)[1].seal
        assert seal is not None and seal.world == 250 and seal.cutoff == 100 + 249
        members = sorted(names[:250])
        ranks = {name: read_rank(client, layout, 0, seal, name) for name in names}
        assert [ranks[name] for name in members] == list(range(250))  # node-id order
        assert all(ranks[name] is None for name in names[250:])  # joined, beyond max_nodes: no rank key


@pytest.mark.e2e
def test_two_sealers_racing_on_a_big_round_never_mix_their_ranks(etcd_server: EtcdMember, run_id: str) -> None:
    """Two sealers with different views of the round (the second saw one more joiner, ranked first) seal at once:
    both may have written chunks of ranks, one seal wins, and every member reads the winner's ranks."""
    clients = [client_for(etcd_server.endpoint) for _ in range(2)]
    layout = Layout.of(PREFIX, run_id)
    lease = NodeLease(clients[0], 30, 10, lambda reason: None)
    names = _names(220, seed=2)
    views = [_synthetic(0, names), _synthetic(0, ["0.early_1_0", *names])]  # "0.early" sorts first: ranks shift
    try:
        barrier = threading.Barrier(2)

        def seal(i: int) -> bool:
            barrier.wait(10)
            return try_seal(clients[i], layout, views[i], 1_000_000, 1000, f"sealer-{i}", lease.grant())

        won = together(lambda: seal(0), lambda: seal(1))
        assert sorted(won) == [False, True], won
        seal_record = _view(clients[0], layout, 0)[1].seal
        assert seal_record is not None and seal_record.sealed_by == f"sealer-{won.index(True)}"
        members = sorted(j.node for j in views[won.index(True)].joined)
        assert seal_record.world == len(members)
        assert [read_rank(clients[1], layout, 0, seal_record, m) for m in members] == list(range(len(members)))
        if won.index(True) == 0:
            assert read_rank(clients[1], layout, 0, seal_record, "0.early_1_0") is None
    finally:
        lease.revoke()
        for c in clients:
            c.close()


def _seal_two(client: EtcdClient, layout: Layout, lease: NodeLease) -> SealRecord:
    assert try_seal(client, layout, _synthetic(0, ["b", "a"]), 1_000_000, 2, "a", lease.grant())
    seal = _view(client, layout, 0)[1].seal
    assert seal is not None
    return seal


@pytest.mark.e2e
def test_a_forged_rank_key_on_a_signed_run_is_ignored_and_deleted(
    etcd_server: EtcdMember, run_id: str, caplog: Any
) -> None:
    layout = Layout.of(PREFIX, run_id, SECRET.encode())
    with _client_and_lease(etcd_server) as (client, lease):
        seal = _seal_two(client, layout, lease)
        assert [read_rank(client, layout, 0, seal, n) for n in "ab"] == [0, 1]
        unsigned = Layout.of(PREFIX, run_id)
        rank0 = RankRecord(round=0, rank=0, world=2, cutoff=101, sealed_by="a")
        planted = {  # a non-member made rank 0, and a member's rank overwritten, without the secret
            layout.rank_key(0, "a", "x"): unsigned.encode(b"", rank0),
            layout.rank_key(0, "a", "b"): b'{"round": 0, "rank": 0, "world": 2, "cutoff": 101, "sealed_by": "a"}',
        }
        for key, value in planted.items():
            client.call(lambda c, k=key, v=value: c.put(k, v), "planting")
        assert read_rank(client, layout, 0, seal, "x") is None  # not obeyed: x is no member
        assert read_rank(client, layout, 0, seal, "b") is None  # not obeyed: b does not take rank 0
        assert all(client.call(lambda c, k=k: c.get(k), "read")[0] is None for k in planted)  # deleted
        assert "ignored and deleted" in caplog.text


@pytest.mark.e2e
def test_a_bad_rank_key_is_refused_by_name_and_a_failed_tries_means_no_membership(
    etcd_server: EtcdMember, run_id: str
) -> None:
    layout = Layout.of(PREFIX, run_id)
    with _client_and_lease(etcd_server) as (client, lease):
        seal = _seal_two(client, layout, lease)
        key = layout.rank_key(0, "a", "b")
        assert seal.cutoff == 101
        for bad in [b"not json", layout.encode(key, RankRecord(round=0, rank=2, world=2, cutoff=101, sealed_by="a"))]:
            client.call(lambda c, v=bad: c.put(key, v), "planting")  # not JSON of a rank; a rank out of range
            with pytest.raises(RecordError, match=key.decode()):
                read_rank(client, layout, 0, seal, "b")
        # Left by a failed try of the same sealer (its chunks landed, its seal did not): another world or cutoff
        # than the seal's names another member set, so the node is not in the sealed one.
        for stale in [RankRecord(round=0, rank=1, world=3, cutoff=101, sealed_by="a"),
                      RankRecord(round=0, rank=1, world=2, cutoff=100, sealed_by="a")]:  # fmt: skip
            value = layout.encode(key, stale)
            client.call(lambda c, v=value: c.put(key, v), "planting")
            assert read_rank(client, layout, 0, seal, "b") is None


@pytest.mark.e2e
def test_a_joiner_beyond_max_nodes_reads_no_rank_and_joins_the_next_round(
    etcd_server: EtcdMember, run_id: str, make: Make
) -> None:
    """Two nodes joined before it: this handler is the third joiner of a 2-node round. It seals the round as a
    backup sealer (the first joiner, a key alone, never does), finds no rank key of its own, and moves on."""
    client = client_for(etcd_server.endpoint)
    layout = Layout.of(PREFIX, run_id)
    leases = _joined(client, layout, 0, ["a", "b"])
    try:
        late = make(etcd_server.endpoint, 2, 2, join_timeout="8")
        reads: list[str] = []
        real = late._read_rank
        late._read_rank = lambda round_no, seal: reads.append(f"{round_no}") or real(round_no, seal)
        with pytest.raises(RendezvousTimeoutError, match="round 1 was not sealed"):
            late.next_rendezvous()
        seal = _view(client, layout, 0)[1].seal
        assert seal is not None and seal.world == 2 and seal.sealed_by == late.node
        assert reads == ["0"]  # one read of its rank key in round 0, which found none
        assert [read_rank(client, layout, 0, seal, n) for n in ("a", "b", late.node)] == [0, 1, None]
    finally:
        for lease in leases:
            lease.revoke()
        client.close()


@pytest.mark.e2e
def test_a_member_counts_departures_from_its_watch_and_after_a_re_read(etcd_private: EtcdMember, make: Make) -> None:
    """A world of 3: one departure is seen on the watch; two more nodes of the round go (a member and a joiner
    beyond the world) while the watch is down, and the count after the re-read is the members that left."""
    a, b, c = (make(etcd_private.endpoint, 3, 3) for _ in range(3))
    infos = together(a.next_rendezvous, b.next_rendezvous, c.next_rendezvous)
    assert sorted(i.rank for i in infos) == [0, 1, 2], infos
    assert a.num_nodes_waiting() == 0
    client = client_for(etcd_private.endpoint)
    try:
        client.call(lambda c_: c_.revoke_lease(c._lease._id), "revoking")
        assert wait_until(a.num_nodes_waiting, 10) == 1  # from the watch's deletion event
        # Now a re-read: the deletions watch was done; start it over, as a rebuilt stream reads the round afresh.
        layout, mirror = a._layout, a._mirror
        overflow = NodeLease(client, 30, 10, lambda reason: None)
        key = layout.node_key(0, "zz-overflow")  # joined after the seal's cutoff: not a member
        client.call(lambda c_: c_.put(key, b"{}", lease=overflow.grant()), "planting")
        with mirror.cond:
            rng = mirror.range("round")
            assert rng is not None
            rng.done, rng.present, rng.deleted, rng.read_at = False, None, {}, 0
            mirror._stream._call.cancel()  # the stream breaks: every range not done is read again
        resyncs = mirror.resyncs
        client.call(lambda c_: c_.revoke_lease(b._lease._id), "revoking")
        overflow.revoke()
        wait_until(lambda: mirror.resyncs > resyncs, 10)
        with mirror.cond:
            assert rng.read_at > a._seal_revision and rng.present is not None
        assert a.num_nodes_waiting() == 2  # b and c left; the overflow key was no member
    finally:
        client.close()


def test_a_member_gone_between_the_sealers_decision_and_the_seal_is_a_departure() -> None:
    """The seal's compare sees new and changed keys of the round, not deleted ones: a member whose key went after
    the sealer decided (revision 10) but before the seal landed (revision 20) is in the world and gone; a key that
    went before the decision was no member."""
    watches = RoundWatches()
    watches._sealed = SealRecord(round=0, world=3, cutoff=8, sealed_by="a", decided_at=10)
    watches._seal_revision, watches._key = 20, b"r/0/me"
    round_deletions = Range("round", b"r/0/", b"r/00", DELETES, deleted={b"r/0/early": 9})
    assert watches._departed(round_deletions) == 0
    round_deletions.deleted[b"r/0/b"] = 15  # between the decision and the seal
    assert watches._departed(round_deletions) == 1
    round_deletions.deleted[b"r/0/me"] = 25  # its own key: the split-brain guard's, not a departure
    assert watches._departed(round_deletions) == 1


@pytest.mark.e2e
def test_a_waiting_node_takes_the_seat_of_a_dead_sealer_and_seals_without_watching_the_round(
    etcd_server: EtcdMember, run_id: str, make: Make
) -> None:
    """The round's first three joiners took its three seats; the fourth, a real handler, watches only its own key,
    the seats and the seals (no watch of the round's keys, which etcd would match against every join). All three
    seat holders die before the seal: their seats go with their leases, the fourth takes one and seals alone."""
    client = client_for(etcd_server.endpoint)
    layout = Layout.of(PREFIX, run_id)
    leases = _joined(client, layout, 0, ["a", "b", "c"])
    try:
        seats = client.list_prefix(layout.seats_of_round(0), "reading the seats")[1]
        assert sorted(kv.key for kv in seats) == [layout.seat_key(0, i) for i in range(3)]
        late = make(etcd_server.endpoint, 1, 8, last_call_timeout="1", join_timeout="15")
        added: list[tuple[str, bytes, bytes | None]] = []
        real = late._mirror.add
        late._mirror.add = lambda rng: added.append((rng.name, rng.key, rng.end)) or real(rng)
        threading.Timer(1.0, lambda: [lease.revoke() for lease in leases]).start()  # they die while it waits
        info = late.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        seal = _view(client, layout, 0)[1].seal
        assert seal is not None and (seal.world, seal.sealed_by) == (1, late.node)
        own, round_prefix = layout.node_key(0, late.node), layout.round_prefix(0)
        seats_prefix = layout.seats_of_round(0)
        assert added == [
            ("own", own, None),  # waiting: its own key's deletion, and the seats' deletions
            ("seats", seats_prefix, prefix_end(seats_prefix)),
            ("rounds", layout.rounds, prefix_end(layout.rounds)),  # with a seat: the whole round, to seal it
            ("round", round_prefix, prefix_end(round_prefix)),  # a member: the round's deletions, for departures
            ("later", layout.round_prefix(1), prefix_end(layout.rounds)),
        ], added
    finally:
        for lease in leases:
            lease.revoke()
        client.close()


@pytest.mark.e2e
def test_on_a_signed_run_forged_seats_are_deleted_at_a_join_and_the_run_seals(
    etcd_server: EtcdMember, run_id: str, make: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Someone without the secret fills every seat of round 0 before anyone joins: the first joiner finds them
    taken, deletes the forged values, and the joiners take the seats and seal."""
    monkeypatch.setenv("S", SECRET)
    client = client_for(etcd_server.endpoint)
    layout = Layout.of(PREFIX, run_id, SECRET.encode())
    try:
        for key in [layout.seat_key(0, seat) for seat in range(3)]:
            client.call(lambda c, k=key: c.put(k, b"{}"), "planting")
        a, b = (make(etcd_server.endpoint, 2, 2, secret_env="S", join_timeout="15") for _ in range(2))
        infos = together(a.next_rendezvous, b.next_rendezvous)
        assert sorted(getattr(i, "rank", i) for i in infos) == [0, 1], infos
        seats = client.list_prefix(layout.seats_of_round(0), "reading the seats")[1]
        assert seats and all(layout.forgery(kv.key, kv.value) is None for kv in seats)
    finally:
        client.close()
