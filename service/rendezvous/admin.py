"""``ddp-service rdzv list|show|retire``: look at and retire etcd3 rendezvous runs.

Deleting a live run's keys with ``etcdctl del --prefix`` lets a second agent
with the same run id form a world of its own. ``retire`` is the safe way to
free a run id: it refuses a run that still has live nodes (unless ``--force``),
marks the run closed, so an agent that reads it in between is told the run is
over, then revokes the run's lease and deletes its keys.

The state is decoded with a restricted unpickler that allows only the classes
torch's ``_RendezvousState`` is made of; nothing else from etcd is executed.
torch is imported only when a state must be decoded.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

from service.rendezvous.dynamic.admin import AdminError, load_state

DEFAULT_LIVE_WITHIN = 30.0


# -- what the commands report ----------------------------------------------------
@dataclass
class RunInfo:
    """One run as ``show`` reports it."""

    run_id: str
    keys: int = 0
    has_state: bool = False
    decoded: bool = False
    note: str = ""
    round: int | None = None
    complete: bool | None = None
    closed: bool | None = None
    participants: list[dict[str, Any]] = field(default_factory=list)
    wait_list: list[dict[str, Any]] = field(default_factory=list)
    lease_id: str | None = None
    lease_ttl_left: int | None = None
    lease_granted_ttl: int | None = None
    job: dict[str, Any] | None = None

    def live_nodes(self, within: float) -> list[str]:
        """Participants and waiting nodes whose last heartbeat is younger than ``within`` seconds."""
        nodes = self.participants + self.wait_list
        return [n["node"] for n in nodes if n["heartbeat_age"] is not None and n["heartbeat_age"] < within]


class Admin:
    """The admin commands on one etcd and key prefix."""

    def __init__(self, client: Any, key_prefix: str, codec: Any) -> None:
        self._client = client
        self._prefix = key_prefix.rstrip("/")
        self._codec = codec

    def _key(self, run_id: str, leaf: str) -> bytes:
        from service.rendezvous.dynamic.backend import run_key

        return run_key(self._prefix, run_id, leaf)

    def _call(self, op: Any, what: str) -> Any:
        from service.rendezvous.client import EtcdError

        try:
            return self._client.call(op, what)
        except EtcdError as exc:
            raise AdminError(f"Cannot use etcd at {self._client.endpoints} while {what}: {exc}") from exc

    def list_runs(self) -> list[str]:
        """The run ids that have any key under the prefix."""
        base = (self._prefix + "/").encode()
        found = self._call(lambda c: list(c.get_prefix(base, keys_only=True)), "listing the runs")
        runs: set[str] = set()
        for _, meta in found:
            rest = meta.key[len(base) :].decode("utf-8", errors="replace")
            for leaf in ("/state", "/lease", "/job"):
                if rest.endswith(leaf):
                    runs.add(rest[: -len(leaf)])
                    break
            else:
                for inner in ("/store/", "/rdzv/"):
                    if inner in rest:
                        runs.add(rest.split(inner, 1)[0])
        return sorted(runs)

    def show(self, run_id: str) -> RunInfo:
        """Round, participants, wait list, closed flag, lease and job of one run."""
        info = RunInfo(run_id=run_id)
        prefix = self._key(run_id, "")
        info.keys = len(self._call(lambda c: list(c.get_prefix(prefix, keys_only=True)), "listing the run's keys"))
        self._read_lease(run_id, info)
        self._read_job(run_id, info)
        from service.rendezvous.native import admin as admin_native

        if self._call(
            lambda c: admin_native.describe(c, self._prefix, run_id, info, self._codec.secret), "reading the run"
        ):
            return info
        key = self._key(run_id, "state")
        blob, _ = self._call(lambda c: c.get(key), "reading the rendezvous state")
        if blob is None:
            return info
        info.has_state = True
        state = self._decode(blob, key, info)
        if state is not None:
            self._describe_state(state, info)
        return info

    def _read_lease(self, run_id: str, info: RunInfo) -> None:
        raw, _ = self._call(lambda c: c.get(self._key(run_id, "lease")), "reading the run's lease key")
        if raw is None:
            return
        try:
            lease_id = int(raw)
        except ValueError:
            info.lease_id = f"invalid: {raw[:40]!r}"
            return
        info.lease_id = f"{lease_id:x}"
        lease = self._call(lambda c: c.get_lease_info(lease_id), "reading the run's lease")
        info.lease_ttl_left, info.lease_granted_ttl = int(lease.TTL), int(lease.grantedTTL)

    def _read_job(self, run_id: str, info: RunInfo) -> None:
        raw, _ = self._call(lambda c: c.get(self._key(run_id, "job")), "reading the run's job record")
        if raw is None:
            return
        try:
            info.job = json.loads(raw)
        except ValueError:
            info.job = {"invalid": raw[:80].decode("utf-8", errors="replace")}

    def _decode(self, blob: bytes, key: bytes, info: RunInfo) -> Any:
        from service.rendezvous.dynamic.signing import StateIntegrityError

        try:
            data = self._codec.decode(blob, key)
            state = load_state(data, key.decode())
        except (StateIntegrityError, AdminError) as exc:
            info.note = f"state not decoded: {exc}"
            return None
        info.decoded = True
        return state

    @staticmethod
    def _describe_state(state: Any, info: RunInfo) -> None:
        now = datetime.now(timezone.utc)

        def age(node: Any) -> float | None:
            beat = state.last_heartbeats.get(node)
            if beat is None:
                return None
            if beat.tzinfo is None:  # older torch wrote datetime.utcnow(), naive but UTC
                beat = beat.replace(tzinfo=timezone.utc)
            return round((now - beat).total_seconds(), 1)

        info.round, info.complete, info.closed = state.round, state.complete, state.closed
        info.participants = [
            {"node": str(node), "rank": rank, "heartbeat_age": age(node)}
            for node, rank in sorted(state.participants.items(), key=lambda item: item[1])
        ]
        info.wait_list = [{"node": str(node), "heartbeat_age": age(node)} for node in state.wait_list]
        info.wait_list.sort(key=lambda n: n["node"])

    def retire(self, run_id: str, force: bool = False, live_within: float = DEFAULT_LIVE_WITHIN) -> dict[str, Any]:
        """Refuse a live run (unless ``force``), mark it closed, revoke its lease and delete its keys."""
        info = self.show(run_id)
        if info.keys == 0:
            raise AdminError(f"There is no run '{run_id}' under the prefix {self._prefix}; nothing to retire.")
        if not force:
            self._check_finished(info, live_within)
        closed = self._mark_closed(run_id, info) if info.decoded and not info.closed else False
        revoked = self._revoke(info)
        prefix = self._key(run_id, "")
        deleted = self._call(lambda c: c.delete_prefix(prefix).deleted, "deleting the run's keys")
        return {"run_id": run_id, "marked_closed": closed, "lease_revoked": revoked, "keys_deleted": int(deleted)}

    def _check_finished(self, info: RunInfo, live_within: float) -> None:
        if info.has_state and not info.decoded:
            raise AdminError(
                f"Cannot tell whether run '{info.run_id}' has finished: {info.note} Give the run's signing "
                "secret (--conf secret_file=PATH or secret_env=VAR), or retire it with --force."
            )
        if info.closed:
            return
        live = info.live_nodes(live_within)
        if live:
            raise AdminError(
                f"Run '{info.run_id}' is not closed and has live nodes (a heartbeat in the last {live_within:g} s): "
                f"{', '.join(live)}. Retiring it would stop that job. Wait until it finishes, or pass --force "
                "to stop it: its agents then exit with an error that their run's keys were deleted."
            )

    def _mark_closed(self, run_id: str, info: RunInfo) -> bool:
        from service.rendezvous.client import EtcdError
        from service.rendezvous.dynamic.signing import StateIntegrityError
        from service.rendezvous.native import admin as admin_native

        if self._is_native(run_id):
            lease = None if info.lease_id is None or info.lease_id.startswith("invalid") else int(info.lease_id, 16)
            try:
                return admin_native.mark_closed(self._client, self._prefix, run_id, lease, self._codec.secret)
            except EtcdError:
                return False
        key = self._key(run_id, "state")
        blob, meta = self._call(lambda c: c.get(key), "reading the rendezvous state")
        if blob is None:
            return False
        try:
            state = load_state(self._codec.decode(blob, key), key.decode())
        except (StateIntegrityError, AdminError):
            return False  # changed since it was checked; the keys are deleted next anyway
        state.closed = True
        new = self._codec.encode(pickle.dumps(state), key)
        tx = self._client.raw.transactions
        put = tx.put(key, new, lease=meta.lease_id) if meta.lease_id else tx.put(key, new)
        try:
            won, _ = self._client.call(
                lambda c: c.transaction(compare=[tx.mod(key) == meta.mod_revision], success=[put], failure=[]),
                "marking the run closed",
            )
        except EtcdError:
            return False  # its lease is gone, or etcd hiccuped: the keys are deleted next anyway
        return bool(won)

    def _is_native(self, run_id: str) -> bool:
        base = self._key(run_id, "rdzv/")
        return bool(self._call(lambda c: list(c.get_prefix(base, keys_only=True, limit=1)), "reading the run"))

    def _revoke(self, info: RunInfo) -> bool:
        from service.rendezvous.client import EtcdError

        if info.lease_id is None or info.lease_id.startswith("invalid"):
            return False
        lease_id = int(info.lease_id, 16)
        try:
            self._client.call(lambda c: c.revoke_lease(lease_id), "revoking the run's lease")
        except EtcdError:
            return False  # already expired
        return True


# -- the command line ------------------------------------------------------------
def add_parser(commands: Any) -> None:
    """Add ``rdzv list|show|retire`` to ``ddp-service``'s subcommands."""
    rdzv = commands.add_parser("rdzv", help="list, show or retire etcd3 rendezvous runs")
    actions = rdzv.add_subparsers(dest="rdzv_command", required=True)
    for name, text in (
        ("list", "list the runs under the key prefix"),
        ("show", "show a run's round, nodes, closed flag, lease and job"),
        ("retire", "close a finished run and delete its keys, so its run id can be reused"),
    ):
        action = actions.add_parser(name, help=text)
        action.add_argument("--endpoint", required=True, help="etcd HOST[:PORT][,HOST[:PORT]...], as --rdzv-endpoint")
        action.add_argument("--prefix", help="key prefix (default: /torchelastic/etcd3, as the backend's key_prefix)")
        action.add_argument("--conf", default="", metavar="KEY=VALUE,...",
                            help="connection options as in --rdzv-conf: cacert, cert, key, user, password_file, "
                                 "password_env, secret_file, secret_env, read_timeout")  # fmt: skip
        action.add_argument("--json", action="store_true", help="print JSON")
        if name != "list":
            action.add_argument("run_id", help="the run id (--rdzv-id)")
        if name == "retire":
            action.add_argument("--force", action="store_true", help="retire even a run with live nodes")
            action.add_argument("--live-within", type=float, default=DEFAULT_LIVE_WITHIN, metavar="SECONDS",
                                help="a node whose last heartbeat is younger than this counts as live")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Run one ``rdzv`` command; 0 on success, 1 on a refusal or an etcd failure, 2 on bad options."""
    try:
        admin, close = _connect(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        if args.rdzv_command == "list":
            result: Any = [_summary(admin.show(run_id)) for run_id in admin.list_runs()]
            _print(result, args.json, _format_list)
        elif args.rdzv_command == "show":
            info = admin.show(args.run_id)
            if info.keys == 0:
                raise AdminError(f"There is no run '{args.run_id}' under the prefix {admin._prefix}.")
            _print(asdict(info), args.json, _format_show)
        else:
            result = admin.retire(args.run_id, force=args.force, live_within=args.live_within)
            _print(result, args.json, lambda r: (
                f"retired run '{r['run_id']}': marked closed: {r['marked_closed']}, lease revoked: "
                f"{r['lease_revoked']}, {r['keys_deleted']} key(s) deleted; the run id can be reused now."
            ))  # fmt: skip
    except AdminError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        close()
    return 0


def _connect(args: argparse.Namespace) -> tuple[Admin, Any]:
    from service.rendezvous.client import EtcdClient
    from service.rendezvous.dynamic.signing import StateCodec
    from service.rendezvous.options import parse_options

    conf: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in args.conf.split(","))):
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(
                f"The --conf entry '{item}' is not KEY=VALUE; write e.g. --conf user=ddp,password_file=PATH."
            )
        conf[name.strip()] = value.strip()
    if args.prefix is not None:
        if "key_prefix" in conf:
            raise ValueError("Give the key prefix either as --prefix or as --conf key_prefix=..., not both.")
        conf["key_prefix"] = args.prefix
    options = parse_options(args.endpoint, getattr(args, "run_id", None) or "rdzv-admin", conf)
    client = EtcdClient(options.client)
    return Admin(client, options.key_prefix, StateCodec(options.secret)), client.close


def _summary(info: RunInfo) -> dict[str, Any]:
    return {
        "run_id": info.run_id, "round": info.round, "closed": info.closed,
        "participants": len(info.participants), "waiting": len(info.wait_list),
        "lease_ttl_left": info.lease_ttl_left, "decoded": info.decoded,
    }  # fmt: skip


def _print(result: Any, as_json: bool, text: Any) -> None:
    print(json.dumps(result, indent=2, sort_keys=True) if as_json else text(result))


def _format_list(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no runs"
    lines = [f"{'RUN':30} {'ROUND':>5} {'CLOSED':>6} {'NODES':>5} {'WAIT':>4} {'TTL':>5}"]
    for r in rows:
        lines.append(
            f"{r['run_id']:30} {_dash(r['round']):>5} {_dash(r['closed']):>6} {r['participants']:>5} "
            f"{r['waiting']:>4} {_dash(r['lease_ttl_left']):>5}"
        )
    return "\n".join(lines)


def _format_show(d: dict[str, Any]) -> str:
    lines = [
        f"run:          {d['run_id']} ({d['keys']} key(s))",
        f"round:        {_dash(d['round'])}   complete: {_dash(d['complete'])}   closed: {_dash(d['closed'])}",
        (
            f"lease:        {_dash(d['lease_id'])}   ttl left: {_dash(d['lease_ttl_left'])} s"
            f" of {_dash(d['lease_granted_ttl'])} s"
        ),
        "participants: " + (", ".join(
            f"{p['node']} (rank {p['rank']}, heartbeat {_dash(p['heartbeat_age'])} s ago)" for p in d["participants"]
        ) or "-"),
        "wait list:    " + (", ".join(n["node"] for n in d["wait_list"]) or "-"),
    ]  # fmt: skip
    if d["job"]:
        job = d["job"]
        lines.append(f"job:          {str(job.get('fingerprint', '?'))[:16]} [{' '.join(job.get('command', []))}]")
    if d["note"]:
        lines.append(f"note:         {d['note']}")
    return "\n".join(lines)


def _dash(value: Any) -> str:
    return "-" if value is None else str(value)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m service.rendezvous.admin list|show|retire ...`` (the same as ``ddp-service rdzv``)."""
    parser = argparse.ArgumentParser(prog="ddp-service")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(["rdzv", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
