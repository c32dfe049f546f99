"""What the etcd3 backend adds to the contract: leases, signatures, timing, recovery."""

from __future__ import annotations

import pickle
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousStateError,
)

from service.rendezvous.client import EtcdUncertainError
from service.rendezvous.factory import Etcd3Parts, build_handler
from service.rendezvous.options import parse_options

from .conftest import EtcdMember, free_port

SECRET = "correct horse battery staple"


def parts_for(endpoint: str, run_id: str, environ: dict[str, str] | None = None, **conf: Any) -> Etcd3Parts:
    parts = Etcd3Parts(parse_options(endpoint, run_id, conf, environ or {}))
    parts.connect()
    return parts


def lease_count(endpoint: str) -> int:
    """etcd's own count of live leases (pyetcd lacks LeaseLeases)."""
    etcdctl = Path(sys.executable).parent / "etcdctl"
    out = subprocess.run(
        [str(etcdctl), "--endpoints", endpoint, "lease", "list"], capture_output=True, text=True, timeout=10, check=True
    ).stdout
    return int(re.search(r"found (\d+) leases", out).group(1))


# -- leases -------------------------------------------------------------------
def test_one_lease_per_run_covers_state_and_store_keys(etcd_server: EtcdMember, run_id: str) -> None:
    first = parts_for(etcd_server.endpoint, run_id)
    second = parts_for(etcd_server.endpoint, run_id)
    try:
        assert first.lease.id() == second.lease.id()
        before = lease_count(etcd_server.endpoint)
        _, token, _ = first.backend.set_state(b"s0")
        for i in range(30):
            token = (first if i % 2 else second).backend.set_state(f"s{i + 1}".encode(), token)[1]
            second.store.set(f"k{i}", b"v")
        assert lease_count(etcd_server.endpoint) == before
        _, state_meta = first.client.call(lambda c: c.get(first.backend.key), "read")
        _, store_meta = first.client.call(lambda c: c.get(first.store._k("k3")), "read")
        assert state_meta.lease_id == store_meta.lease_id == first.lease.id()
    finally:
        first.close()
        second.close()


def test_abandoned_run_expires_while_a_kept_alive_run_lives(etcd_server: EtcdMember, run_id: str) -> None:
    alive = parts_for(etcd_server.endpoint, run_id + "-alive", ttl=2)
    gone = parts_for(etcd_server.endpoint, run_id + "-gone", ttl=2)
    try:
        alive.backend.set_state(b"alive")
        gone.backend.set_state(b"gone")
        gone.store.set("k", b"v")
        gone.lease.stop()  # the last agent of this run is gone
        stopped = time.monotonic()
        while gone.backend.get_state() is not None and time.monotonic() < stopped + 10:
            time.sleep(0.2)
        assert gone.backend.get_state() is None
        assert not gone.store.check(["k"])
        time.sleep(max(0.0, stopped + 3.5 - time.monotonic()))
        assert alive.backend.get_state()[0] == b"alive"  # longer than ttl, but kept alive
    finally:
        alive.close()
        gone.close()


def test_reusing_a_closed_run_id_raises_closed_error(etcd_server: EtcdMember, run_id: str) -> None:
    def params() -> RendezvousParameters:
        return RendezvousParameters("etcd3", etcd_server.endpoint, run_id, 1, 1, local_addr="127.0.0.1")

    handler = build_handler(params())
    assert handler.next_rendezvous().world_size == 1
    handler.set_closed()
    with pytest.raises(RendezvousClosedError):
        build_handler(params()).next_rendezvous()


# -- HMAC ---------------------------------------------------------------------
def test_signed_state_round_trips(etcd_server: EtcdMember, run_id: str) -> None:
    parts = parts_for(etcd_server.endpoint, run_id, {"S": SECRET}, secret_env="S")
    try:
        _, token, _ = parts.backend.set_state(b"payload")
        assert parts.backend.get_state() == (b"payload", token)
        raw, _ = parts.client.call(lambda c: c.get(parts.backend.key), "read")
        assert raw.endswith(b"payload") and raw != b"payload"
    finally:
        parts.close()


@pytest.mark.parametrize("attack", ["flip-payload-byte", "flip-mac-byte", "unsigned-forgery", "other-secret"])
def test_tampered_state_is_refused(etcd_server: EtcdMember, run_id: str, tmp_path: Path, attack: str) -> None:
    env = {"S": SECRET, "OTHER": "another secret, 16+ chars"}
    victim = parts_for(etcd_server.endpoint, run_id, env, secret_env="S")
    attacker = parts_for(etcd_server.endpoint, run_id, env, **({"secret_env": "OTHER"} if attack == "other-secret" else {}))
    try:
        victim.backend.set_state(b"honest state")
        raw, _ = victim.client.call(lambda c: c.get(victim.backend.key), "read")
        if attack == "flip-payload-byte":
            forged = raw[:-1] + bytes([raw[-1] ^ 1])
        elif attack == "flip-mac-byte":
            header = len(raw) - len(b"honest state") - 32
            forged = raw[:header] + bytes([raw[header] ^ 1]) + raw[header + 1:]
        else:
            forged = attacker.backend._codec.encode(b"evil state", victim.backend.key)
        attacker.client.call(lambda c: c.put(victim.backend.key, forged), "forging")
        with pytest.raises(RendezvousStateError):
            victim.backend.get_state()
        with pytest.raises(RendezvousStateError):
            victim.backend.set_state(b"next", 1)  # the failure branch decodes too
    finally:
        victim.close()
        attacker.close()


class _Boom:
    """A pickle that creates a marker file when it is loaded."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (Path(self.marker).touch, ())


def test_forged_pickle_never_reaches_torch(
    etcd_server: EtcdMember, run_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "pwned"
    monkeypatch.setenv("S", SECRET)
    handler = build_handler(
        RendezvousParameters("etcd3", etcd_server.endpoint, run_id, 1, 2, local_addr="127.0.0.1", secret_env="S")
    )
    forger = parts_for(etcd_server.endpoint, run_id)
    try:
        forged = forger.backend._codec.encode(pickle.dumps(_Boom(str(marker))), forger.backend.key)
        forger.client.call(lambda c: c.put(forger.backend.key, forged), "forging")
        with pytest.raises(RendezvousStateError):
            handler.num_nodes_waiting()
        assert not marker.exists()
    finally:
        forger.close()


# -- connection errors and the grace window ----------------------------------
def test_unreachable_etcd_fails_at_start_within_read_timeout_naming_endpoint(run_id: str) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match=endpoint):
        parts_for(endpoint, run_id, read_timeout=1)
    assert time.monotonic() - started < 2.5


@pytest.mark.parametrize("operation", ["get_state", "set_state"])
def test_connection_error_arrives_within_timeout(etcd_private: EtcdMember, run_id: str, operation: str) -> None:
    parts = parts_for(etcd_private.endpoint, run_id, read_timeout=1, grace_period=1, failed_node_retry=0.2)
    try:
        _, token, _ = parts.backend.set_state(b"before")
        etcd_private.kill()
        started = time.monotonic()
        with pytest.raises(RendezvousConnectionError, match=etcd_private.endpoint):
            if operation == "get_state":
                parts.backend.get_state()
            else:
                parts.backend.set_state(b"after", token)
        # grace window (1 s) + at most one RPC deadline (1 s) + backoff slack
        assert time.monotonic() - started < 3.5
    finally:
        parts.close()


def test_etcd_restart_inside_grace_window_is_survived(etcd_private: EtcdMember, run_id: str) -> None:
    parts = parts_for(etcd_private.endpoint, run_id, read_timeout=1, grace_period=15, failed_node_retry=0.2)
    try:
        _, token, _ = parts.backend.set_state(b"before")
        etcd_private.kill()
        restarter = threading.Timer(2.0, etcd_private.start)
        restarter.start()
        started = time.monotonic()
        assert parts.backend.get_state() == (b"before", token)
        assert 1.5 < time.monotonic() - started < 12
        assert parts.backend.set_state(b"after", token)[2] is True
        restarter.join()
    finally:
        parts.close()


def test_pyetcd_failed_node_error_is_retried(etcd_server: EtcdMember, run_id: str) -> None:
    parts = parts_for(etcd_server.endpoint, run_id, failed_node_retry=0.5)
    try:
        assert all(ep.time_retry == 0.5 for ep in parts.client.raw.endpoints.values())
        calls = []

        def flaky(client: Any) -> str:
            calls.append(1)
            if len(calls) == 1:
                raise ValueError("Trying to use a failed node")
            return "ok"

        assert parts.client.call(flaky, "a flaky call") == "ok"
        assert len(calls) == 2
        with pytest.raises(ValueError, match="unrelated"):
            parts.client.call(lambda c: (_ for _ in ()).throw(ValueError("unrelated")), "x")
    finally:
        parts.close()


# -- uncertain writes -----------------------------------------------------------
@pytest.mark.parametrize("landed", [True, False])
def test_uncertain_write_is_decided_by_a_re_read(
    etcd_server: EtcdMember, run_id: str, monkeypatch: pytest.MonkeyPatch, landed: bool
) -> None:
    parts = parts_for(etcd_server.endpoint, run_id)
    try:
        _, token, _ = parts.backend.set_state(b"v1")
        real_call = parts.client.call
        failures = []

        def timing_out_call(op: Any, what: str, retry: bool = True) -> Any:
            if not retry and not failures:  # the compare-and-set transaction
                failures.append(what)
                if landed:
                    real_call(op, what, retry)
                raise EtcdUncertainError("deadline exceeded (injected)")
            return real_call(op, what, retry)

        monkeypatch.setattr(parts.client, "call", timing_out_call)
        state, new_token, has_set = parts.backend.set_state(b"v2", token)
        assert failures and (state, has_set) == (b"v2", True)
        assert parts.backend.get_state() == (b"v2", new_token)
    finally:
        parts.close()
