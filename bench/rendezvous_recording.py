"""The requests one node's native rendezvous handler makes in a round, recorded from real handlers against a real
etcd, and kept as data (``rendezvous_recording.json``) for ``bench/rendezvous_replay.py`` to replay at scale.

A gRPC interceptor on each handler's channel records every request it sends: the unary ones (lease grants, range
reads, puts, transactions) as they are made, and every message on its watch and lease keep-alive streams as gRPC
sends it. Each request becomes a template: etcd's message as a dict, with the node's id, the run id, the round,
its leases and revisions abstracted (``{node}``, ``{run_id}``, ``{round}``, ``{node_lease}``, ``{run_lease}``,
``{rev}``), and the values it writes named by what they hold (``{node_record}``, ``{seal_record}``,
``{rank_record}``, ...), and the revision a member watches its round's deletions from (``{decided+1}``: after the
seal's ``decided_at``). A rank key names the node that sealed the round (``{sealer}``) and a member: the node's
own (``{node}``, the key it reads) or any (``{member}``); the seal's rank puts, one per member, are kept as one
put (the replay writes one per member of its round, in chunks of ``rounds.RANKS_PER_TXN`` operations, as the
handler does).

A round has three phases (``start``: the agent's handler is built; ``round``: ``next_rendezvous`` until the seal;
``sealed``: after it), and in each a node plays a part: the first agent of the run grants and publishes the run's
lease (``first``), the first joiner seals (``seals``), the first three joiners take the round's seats and watch the
whole round (``sealer``), everyone else only waits for the seal (``member``: its own key, the seats and the seals),
rank 0 publishes the store's address (``rank0``). The recording holds, per phase and part, the unary requests in
order and the watch stream's messages (as a set: a cancel is sent once etcd confirmed the watch, so its place among
the creates varies); the keep-alives are periodic (``keepalive``: the leases refreshed and how often).

``python bench/rendezvous_replay.py --record`` records a fresh round (4 handlers, so every part is played) and
rewrites the JSON; ``tests/rendezvous/test_replay_recording.py`` checks that a real round still makes exactly
these requests.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor
from pyetcd import etcdrpc

RECORDING = Path(__file__).with_name("rendezvous_recording.json")
PHASES = ("start", "round", "sealed")
UNARY_PARTS = {"start": ("first", "other"), "round": ("seals", "sealer", "member"), "sealed": ("rank0", "other")}
WATCH_PARTS = {"start": ("any",), "round": ("sealer", "member"), "sealed": ("sealer", "member")}
REQUESTS = {
    "KV/Range": etcdrpc.RangeRequest,
    "KV/Put": etcdrpc.PutRequest,
    "KV/DeleteRange": etcdrpc.DeleteRangeRequest,
    "KV/Txn": etcdrpc.TxnRequest,
    "Lease/LeaseGrant": etcdrpc.LeaseGrantRequest,
    "Lease/LeaseRevoke": etcdrpc.LeaseRevokeRequest,
    "Lease/LeaseKeepAlive": etcdrpc.LeaseKeepAliveRequest,
    "Watch/Watch": etcdrpc.WatchRequest,
}
_REVISIONS = {"revision", "start_revision", "mod_revision", "create_revision"}
_LEASES = {"lease", "ID"}
ROUND_DIGITS = 12  # records.py's zero-padded round numbers
_RANK_KEY = re.compile(r"^(.*/rdzv/ranks/[0-9]{12}/)([^/]+)/([^/]+)$")


# -- recording ---------------------------------------------------------------------------------------------------
@dataclass
class Sent:
    """One request as sent: the phase it belongs to, which stream (``unary``, ``watch``, ``keepalive``), the RPC."""

    phase: str
    stream: str
    rpc: str
    request: Any


# When the handler asked for each watch request (id of the message -> time): gRPC sends a stream's messages when it
# pulls them, which may be after the handler moved on to the next phase; a message belongs to the phase it was
# asked for in.
_ASKED: dict[int, float] = {}


@dataclass
class Recorder(grpc.UnaryUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Records every request one client sends; ``phase(at)`` names the phase at the time ``at`` (monotonic) that
    the handler made it."""

    sent: list[Sent] = field(default_factory=list)
    phase: Callable[[float], str] = lambda at: "start"
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _add(self, stream: str, method: Any, request: Any) -> None:
        name = method.decode() if isinstance(method, bytes) else str(method)
        rpc = "/".join(name.rsplit("/", 2)[-2:]).replace("etcdserverpb.", "")
        copy = type(request)()
        copy.CopyFrom(request)
        at = _ASKED.pop(id(request), None) or time.monotonic()
        with self.lock:
            self.sent.append(Sent(self.phase(at), stream, rpc, copy))

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        self._add("unary", details.method, request)
        return continuation(details, request)

    def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        stream = "watch" if str(details.method).endswith("Watch") else "keepalive"

        def pulled() -> Iterator[Any]:
            for request in request_iterator:
                self._add(stream, details.method, request)
                yield request

        return continuation(details, pulled())

    def snapshot(self) -> list[Sent]:
        with self.lock:
            return list(self.sent)


@contextlib.contextmanager
def recording() -> Iterator[list[Recorder]]:
    """While inside, every ``EtcdClient`` built gets a recorder on its channels (in the order built)."""
    from service.rendezvous import client as client_module

    recorders: list[Recorder] = []
    build = client_module.EtcdClient._build

    def recorded_build(self: Any) -> Any:
        raw = build(self)
        recorder = Recorder()
        recorders.append(recorder)
        for endpoint in raw.endpoints.values():
            endpoint.channel = grpc.intercept_channel(endpoint.channel, recorder)
        return raw

    client_module.EtcdClient._build = recorded_build  # type: ignore[method-assign]
    try:
        yield recorders
    finally:
        client_module.EtcdClient._build = build  # type: ignore[method-assign]


@contextlib.contextmanager
def asked_times() -> Iterator[None]:
    """While inside, every watch stream built notes when each of its requests was asked for (``_ASKED``)."""
    from service.rendezvous import watchstream

    init = watchstream.WatchStream.__init__

    def stamped_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        put = self._requests.put

        def stamped_put(item: Any, *more: Any) -> None:
            if item is not None:
                _ASKED[id(item)] = time.monotonic()
            put(item, *more)

        self._requests.put = stamped_put

    watchstream.WatchStream.__init__ = stamped_init  # type: ignore[method-assign]
    try:
        yield
    finally:
        watchstream.WatchStream.__init__ = init  # type: ignore[method-assign]


# -- templates -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Names:
    """What one node's requests name, to be abstracted: its id, the run id, its leases."""

    node: str
    run_id: str
    node_lease: int
    run_lease: int
    decided: int = 0  # the seal's decided_at: a member watches its round's deletions from the revision after


def template(message: Any, names: Names) -> dict[str, Any]:
    """``message`` as a dict of its set fields, node, run, round, leases, revisions and values abstracted."""
    out: dict[str, Any] = {}
    for fd, value in message.ListFields():
        if fd.is_repeated:
            out[fd.name] = [_field(fd, v, names) for v in value]
        else:
            out[fd.name] = _field(fd, value, names)
    if isinstance(message, etcdrpc.WatchCreateRequest) and out.get("filters") == ["NOPUT"] and out.get("range_end"):
        if names.decided and message.start_revision == names.decided + 1:  # a member's watch of its round
            out["start_revision"] = "{decided+1}"
    return out


def _field(fd: Any, value: Any, names: Names) -> Any:
    if fd.type == FieldDescriptor.TYPE_MESSAGE:
        return template(value, names)
    if fd.type == FieldDescriptor.TYPE_ENUM:
        return fd.enum_type.values_by_number[value].name
    if fd.type == FieldDescriptor.TYPE_BYTES:
        return _value(value, names) if fd.name == "value" else _key(value, names)
    if fd.name in _LEASES and value:
        return {names.node_lease: "{node_lease}", names.run_lease: "{run_lease}"}.get(value, "{lease?}")
    if fd.name in _REVISIONS and value:
        return "{rev}"
    return value


def _key(raw: bytes, names: Names) -> str:
    text = raw.decode("latin-1")
    rank = _RANK_KEY.match(text)
    if rank is not None:  # ranks/<round>/<sealer>/<member>: the sealer, and the node's own key or any member's
        member = "{node}" if rank.group(3) == names.node else "{member}"
        text = f"{rank.group(1)}{{sealer}}/{member}"
    text = text.replace(names.run_id, "{run_id}").replace(names.node, "{node}")
    text = text.replace("{run_id}.0/", "{run_id}.{store_round}/")  # the store's per-round prefix (PrefixStore)
    return text.replace("0" * ROUND_DIGITS, "{round}").replace(f"{1:0{ROUND_DIGITS}d}", "{round+1}")


def _value(raw: bytes, names: Names) -> str:
    text = raw.decode("latin-1")
    if text == str(names.run_lease):
        return "{run_lease}"
    if text.isdigit():
        return "{port}"
    try:
        record = json.loads(text)
    except ValueError:
        return "{addr}"
    if not isinstance(record, dict):
        return "{value}"
    if "rank" in record:
        return "{rank_record}"
    if "cutoff" in record:
        return "{seal_record}"
    if "fingerprint" in record:
        return "{job_record}"
    if {"node", "addr", "pid", "round"} <= record.keys():
        return "{node_record}"
    return "{value}"


def build(rpc: str, tmpl: dict[str, Any], fill: Callable[[str, str], Any]) -> Any:
    """etcd's request message from ``tmpl``; ``fill(field, placeholder)`` gives each placeholder's value."""
    message = REQUESTS[rpc]()
    _fill(message, tmpl, fill)
    return message


def _fill(message: Any, tmpl: dict[str, Any], fill: Callable[[str, str], Any]) -> None:
    for name, value in tmpl.items():
        fd = message.DESCRIPTOR.fields_by_name[name]
        items = value if fd.is_repeated else [value]
        for item in items:
            if fd.type == FieldDescriptor.TYPE_MESSAGE:
                sub = getattr(message, name).add() if fd.is_repeated else None
                if sub is None:
                    sub = getattr(message, name)
                    sub.SetInParent()
                _fill(sub, item, fill)
                continue
            if fd.type == FieldDescriptor.TYPE_ENUM:
                item = fd.enum_type.values_by_name[item].number
            elif isinstance(item, str) and (fd.type == FieldDescriptor.TYPE_BYTES or "{" in item):
                item = fill(name, item)
            if fd.is_repeated:
                getattr(message, name).append(item)
            else:
                setattr(message, name, item)


def fill_text(text: str, values: dict[str, str]) -> str:
    """``text`` with every ``{name}`` of ``values`` replaced."""
    return re.sub(r"\{([a-z_+0-9]+)\}", lambda m: values.get(m.group(1), m.group(0)), text)


# -- one recorded round --------------------------------------------------------------------------------------------
@dataclass
class Played:
    """One node's requests in a recorded round and the parts it played."""

    sent: list[Sent]
    names: Names
    first: bool  # granted and published the run's lease
    seals: bool
    sealer: bool  # among the first three joiners
    rank0: bool


def parts_of(played: Played) -> dict[str, dict[str, str]]:
    """The part ``played`` played in each phase, for its unary requests and for its watch stream."""
    joined = "seals" if played.seals else "sealer" if played.sealer else "member"
    watching = "sealer" if played.sealer else "member"
    return {
        "unary": {"start": "first" if played.first else "other", "round": joined,
                  "sealed": "rank0" if played.rank0 else "other"},
        "watch": {"start": "any", "round": watching, "sealed": watching},
    }  # fmt: skip


def requests_of(played: Played) -> tuple[dict[tuple[str, str], list[dict[str, Any]]], set[str]]:
    """(phase, stream) -> the templates of its requests in order (a repeated poll once), and the leases kept alive."""
    ordered: dict[tuple[str, str], list[dict[str, Any]]] = {}
    kept_alive: set[str] = set()
    for sent in played.sent:
        request = _one_rank_put(template(sent.request, played.names))
        if sent.stream == "keepalive":
            kept_alive.add(str(request.get("ID")))
            continue
        ops = ordered.setdefault((sent.phase, sent.stream), [])
        op = {"rpc": sent.rpc, "request": request}
        if not ops or ops[-1] != op:  # a store read polled until the key is there is one request, repeated
            ops.append(op)
    for (_, stream), ops in ordered.items():
        if stream == "watch":  # a cancel waits for its watch's confirmation: its place among the creates varies
            ops.sort(key=lambda op: json.dumps(op, sort_keys=True))
    return ordered, kept_alive


def _one_rank_put(request: dict[str, Any]) -> dict[str, Any]:
    """A transaction's rank puts (one per member, whatever the round's size) as one, naming ``{member}``."""
    if "success" not in request:
        return request
    success: list[dict[str, Any]] = []
    for op in request["success"]:
        put = op.get("request_put", {})
        if "/rdzv/ranks/" in put.get("key", ""):
            op = {"request_put": {**put, "key": put["key"].rsplit("/", 1)[0] + "/{member}"}}
            if success and success[-1] == op:
                continue
        success.append(op)
    return {**request, "success": success}


def merge(recording: dict[str, Any], played: Played) -> list[str]:
    """Add ``played``'s requests to ``recording`` (a part seen twice must be the same); the differences found."""
    parts = parts_of(played)
    ordered, kept_alive = requests_of(played)
    problems = []
    for stream in ("unary", "watch"):
        for phase in PHASES:
            part = parts[stream][phase]
            ops = ordered.get((phase, stream), [])
            known = recording["parts"][phase][stream].setdefault(part, ops)
            if known != ops:
                problems.append(f"{phase}/{stream}/{part}: {json.dumps(known)} != {json.dumps(ops)}")
    recording["keepalive_leases"] = sorted(set(recording["keepalive_leases"]) | kept_alive)
    return problems


def compare(expected: dict[str, Any], played: Played) -> list[str]:
    """How ``played``'s requests differ from the recording ``expected`` (empty: none)."""
    parts = parts_of(played)
    ordered, kept_alive = requests_of(played)
    problems = []
    for stream in ("unary", "watch"):
        for phase in PHASES:
            part = parts[stream][phase]
            want = expected["parts"][phase][stream].get(part)
            got = ordered.get((phase, stream), [])
            if want != got:
                problems.append(
                    f"{phase}/{stream}/{part}: the recording has\n  {json.dumps(want)}\nbut the handler sent\n"
                    f"  {json.dumps(got)}"
                )
    if not kept_alive <= set(expected["keepalive_leases"]):
        problems.append(f"keep-alives of {sorted(kept_alive)}, the recording has {expected['keepalive_leases']}")
    return problems


def record_round(endpoint: str, run_id: str, nodes: int = 4, timeout: float = 60) -> tuple[list[Played], Any]:
    """Start ``nodes`` real native handlers (torch's registry, this project's defaults) and let them form one
    round, recording each one's requests; (what each played, the handlers, still open: the caller shuts them)."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from service.rendezvous.factory import build_handler
    from service.rendezvous.native.records import SealRecord
    from service.rendezvous.native.rounds import read_rank

    params = RendezvousParameters("etcd3", endpoint, run_id, nodes, nodes, local_addr="127.0.0.1",
                                  keep_alive_interval="1", keep_alive_max_attempt="3", last_call_timeout="1",
                                  join_timeout=str(timeout))  # fmt: skip
    handlers: list[Any] = []
    with recording() as recorders:
        for _ in range(nodes):
            handlers.append(build_handler(params))
        if len(recorders) != nodes:
            raise RuntimeError(f"{len(recorders)} etcd clients were built for {nodes} handlers; one each expected.")
    begun = time.monotonic()
    for recorder, handler in zip(recorders, handlers, strict=True):
        sealed_at: list[float] = []  # when it began to watch as a member of the sealed round
        as_member = handler._watch_as_member
        handler._watch_as_member = lambda *a, real=as_member, at=sealed_at: at.append(time.monotonic()) or real(*a)
        recorder.phase = lambda at, s=sealed_at: "start" if at < begun else "sealed" if s and at >= s[0] else "round"
    results: list[Any] = [None] * nodes

    def join(i: int) -> None:
        try:
            results[i] = handlers[i].next_rendezvous()
        except BaseException as exc:  # reported below
            results[i] = exc

    threads = [threading.Thread(target=join, args=(i,)) for i in range(nodes)]
    with asked_times():  # the watch streams start with the round
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout)
    failed = [r for r in results if not hasattr(r, "world_size")]
    if failed:
        for handler in handlers:
            handler.shutdown()
        raise RuntimeError(f"The recorded round did not form: {failed}")
    time.sleep(0.3)  # the streams' last messages are recorded as gRPC sends them
    sent = [recorder.snapshot() for recorder in recorders]  # before this function's own reads below
    layout = handlers[0]._layout
    _, [kvs, seals] = handlers[0]._parts.client.read_ranges(
        [_round_read(layout), _seal_read(layout)], "reading the recorded round"
    )
    first_three = {kv.key for kv in sorted(kvs, key=lambda kv: kv.create_revision)[:3]}
    seal = layout.decode(SealRecord, seals[0].value, seals[0].key)
    client = handlers[0]._parts.client
    ranks = {handler.node: read_rank(client, layout, 0, seal, handler.node) for handler in handlers}
    played = []
    for i, (requests, handler) in enumerate(zip(sent, handlers, strict=True)):
        names = Names(handler.node, run_id, handler._lease._id or 0, handler._parts.lease.id(), seal.decided_at)
        played.append(Played(
            sent=requests, names=names, first=i == 0, seals=seal.sealed_by == handler.node,
            sealer=layout.node_key(0, handler.node) in first_three, rank0=ranks[handler.node] == 0,
        ))  # fmt: skip
    return played, handlers


def _round_read(layout: Any) -> Any:
    from service.rendezvous.client import prefix_end
    from service.rendezvous.requests import RangeRead

    prefix = layout.round_prefix(0)
    return RangeRead(prefix, prefix_end(prefix))


def _seal_read(layout: Any) -> Any:
    from service.rendezvous.requests import RangeRead

    return RangeRead(layout.seal_key(0))


def empty_recording(settings: dict[str, Any]) -> dict[str, Any]:
    return {
        "settings": settings,
        "parts": {phase: {"unary": {}, "watch": {}} for phase in PHASES},
        "keepalive_leases": [],
    }


def load() -> dict[str, Any]:
    return json.loads(RECORDING.read_text())


def missing_parts(recording: dict[str, Any]) -> list[str]:
    """The parts a full recording must hold that this one lacks."""
    missing = []
    for phase in PHASES:
        for stream, parts in (("unary", UNARY_PARTS), ("watch", WATCH_PARTS)):
            missing += [f"{phase}/{stream}/{p}" for p in parts[phase] if p not in recording["parts"][phase][stream]]
    return missing
