"""What the etcd3 backend adds to the contract: leases, signatures, timing, recovery."""

from __future__ import annotations

import logging
import os
import pickle
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pyetcd
import pytest
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousStateError,
)

from service.rendezvous import factory
from service.rendezvous.client import EtcdUncertainError
from service.rendezvous.dynamic.backend import run_key
from service.rendezvous.dynamic.signing import StateCodec
from service.rendezvous.factory import build_handler, build_parts
from service.rendezvous.options import parse_options
from service.rendezvous.parts import Etcd3Parts

from .conftest import EtcdMember, free_port
from .states import state_bytes as S

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
@pytest.mark.e2e
def test_one_lease_per_run_covers_state_and_store_keys(etcd_server: EtcdMember, run_id: str) -> None:
    first = parts_for(etcd_server.endpoint, run_id)
    second = parts_for(etcd_server.endpoint, run_id)
    try:
        assert first.lease.id() == second.lease.id()
        before = lease_count(etcd_server.endpoint)
        _, token, _ = first.backend.set_state(S("s0"))
        for i in range(30):
            token = (first if i % 2 else second).backend.set_state(S(f"s{i + 1}"), token)[1]
            second.store.set(f"k{i}", b"v")
        assert lease_count(etcd_server.endpoint) == before
        _, state_meta = first.client.call(lambda c: c.get(first.backend.key), "read")
        _, store_meta = first.client.call(lambda c: c.get(first.store._k("k3")), "read")
        assert state_meta.lease_id == store_meta.lease_id == first.lease.id()
    finally:
        first.close()
        second.close()


@pytest.mark.e2e
def test_abandoned_run_expires_while_a_kept_alive_run_lives(etcd_server: EtcdMember, run_id: str) -> None:
    alive = parts_for(etcd_server.endpoint, run_id + "-alive", ttl=2)
    gone = parts_for(etcd_server.endpoint, run_id + "-gone", ttl=2)
    try:
        alive.backend.set_state(S("alive"))
        gone.backend.set_state(S("gone"))
        gone.store.set("k", b"v")
        gone.lease.stop()  # the last agent of this run is gone
        stopped = time.monotonic()
        # A new agent of the run sees no state; the one that saw it is told its run is gone (no split brain).
        while gone.client.call(lambda c: c.get(gone.backend.key), "read")[0] is not None:
            assert time.monotonic() < stopped + 10, "the abandoned run's state outlived its ttl"
            time.sleep(0.2)
        fresh = parts_for(etcd_server.endpoint, run_id + "-gone")
        assert fresh.backend.get_state() is None
        fresh.close()
        with pytest.raises(RendezvousStateError, match="split brain"):
            gone.backend.get_state()
        assert not gone.store.check(["k"])
        time.sleep(max(0.0, stopped + 3.5 - time.monotonic()))
        assert alive.backend.get_state()[0] == S("alive")  # longer than ttl, but kept alive
    finally:
        alive.close()
        gone.close()


@pytest.mark.e2e
def test_a_rerun_refreshes_the_run_lease_it_inherits_at_once(etcd_server: EtcdMember, run_id: str) -> None:
    """Issue 15, finding 1: a preempted job's lease, inherited with little TTL left, must not expire under the rerun.

    The first job granted a 4 s lease and was killed (no revoke); the rerun (ttl 60, so a refresh period of
    20 s by its own option) joins that lease with about 2.5 s left. It must refresh it at once, and then
    every third of the lease's own 4 s, or the run's keys vanish under the new job.
    """
    first = parts_for(etcd_server.endpoint, run_id, ttl=4)
    first.backend.set_state(S("first job"))
    lease_id = first.lease.id()
    first.close()  # preempted: the keep-alive stops, nothing is revoked
    time.sleep(1.5)
    rerun = parts_for(etcd_server.endpoint, run_id, ttl=60)
    try:
        assert rerun.lease.id() == lease_id, "the rerun did not join the published lease"
        info = rerun.client.call(lambda c: c.get_lease_info(lease_id), "read")
        assert info.TTL >= 3, f"the inherited lease was not refreshed when joined: {info.TTL} s left"
        time.sleep(5)  # longer than the inherited lease's TTL
        assert rerun.client.call(lambda c: c.get_lease_info(lease_id), "read").TTL > 0, "the lease expired"
        assert rerun.backend.get_state()[0] == S("first job")
    finally:
        rerun.close()


@pytest.mark.e2e
@pytest.mark.parametrize("impl", ["native", "dynamic"])
def test_reusing_a_closed_run_id_raises_closed_error(etcd_server: EtcdMember, run_id: str, impl: str) -> None:
    def params() -> RendezvousParameters:
        return RendezvousParameters("etcd3", etcd_server.endpoint, run_id, 1, 1, local_addr="127.0.0.1", impl=impl)

    handler = build_handler(params())
    assert handler.next_rendezvous().world_size == 1
    handler.set_closed()
    with pytest.raises(RendezvousClosedError):
        build_handler(params()).next_rendezvous()


# -- HMAC ---------------------------------------------------------------------
@pytest.mark.e2e
def test_signed_state_round_trips(etcd_server: EtcdMember, run_id: str) -> None:
    parts = parts_for(etcd_server.endpoint, run_id, {"S": SECRET}, secret_env="S")
    try:
        _, token, _ = parts.backend.set_state(S("payload"))
        assert parts.backend.get_state() == (S("payload"), token)
        raw, _ = parts.client.call(lambda c: c.get(parts.backend.key), "read")
        assert raw.endswith(S("payload")) and raw != S("payload")
    finally:
        parts.close()


@pytest.mark.e2e
@pytest.mark.parametrize(
    "attack", ["flip-payload-byte", "flip-mac-byte", "flip-last-mac-byte", "unsigned-forgery", "other-secret"]
)
def test_tampered_state_is_refused(etcd_server: EtcdMember, run_id: str, tmp_path: Path, attack: str) -> None:
    env = {"S": SECRET, "OTHER": "another secret, 16+ chars"}
    victim = parts_for(etcd_server.endpoint, run_id, env, secret_env="S")
    attacker = parts_for(
        etcd_server.endpoint, run_id, env, **({"secret_env": "OTHER"} if attack == "other-secret" else {})
    )
    try:
        victim.backend.set_state(S("honest state"))
        raw, _ = victim.client.call(lambda c: c.get(victim.backend.key), "read")
        if attack == "flip-payload-byte":
            forged = raw[:-1] + bytes([raw[-1] ^ 1])
        elif attack in ("flip-mac-byte", "flip-last-mac-byte"):
            at = len(raw) - len(S("honest state")) - (32 if attack == "flip-mac-byte" else 1)
            forged = raw[:at] + bytes([raw[at] ^ 1]) + raw[at + 1 :]
        else:
            forged = attacker.backend._codec.encode(S("evil state"), victim.backend.key)
        attacker.client.call(lambda c: c.put(victim.backend.key, forged), "forging")
        with pytest.raises(RendezvousStateError):
            victim.backend.get_state()
        with pytest.raises(RendezvousStateError):
            victim.backend.set_state(S("next"), 1)  # the failure branch decodes too
    finally:
        victim.close()
        attacker.close()


class _Boom:
    """A pickle that creates a marker file when it is loaded."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (Path(self.marker).touch, ())


@pytest.mark.e2e
def test_forged_pickle_never_reaches_torch(
    etcd_server: EtcdMember, run_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "pwned"
    monkeypatch.setenv("S", SECRET)
    handler = build_handler(
        RendezvousParameters(
            "etcd3", etcd_server.endpoint, run_id, 1, 2, local_addr="127.0.0.1", secret_env="S", impl="dynamic"
        )
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


class _Shell:
    """The attack from the issue: a pickle whose loading runs a shell command."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> Any:
        return (os.system, (self.command,))


def raw_put(endpoint: str, key: bytes, value: bytes) -> None:
    """Write straight through pyetcd, as ``etcdctl put`` would: no backend, no codec."""
    host, port = endpoint.rsplit(":", 1)
    client = pyetcd.client(host=host, port=int(port), timeout=5)
    try:
        client.put(key, value)
    finally:
        client.close()


@pytest.mark.e2e
@pytest.mark.parametrize("signed", [False, True], ids=["no-secret", "secret"])
@pytest.mark.parametrize("form", ["bare-pickle", "unsigned-envelope", "signed-by-insider"])
def test_crafted_pickle_in_etcd_runs_nothing(
    etcd_server: EtcdMember, run_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, signed: bool, form: str
) -> None:
    """An etcd writer plants a pickle that would touch a marker file; no agent runs it, with or without a secret."""
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Shell(f"touch {marker}"))
    conf = {"secret_env": "S"} if signed else {}
    monkeypatch.setenv("S", SECRET)
    handler = build_handler(
        RendezvousParameters(
            "etcd3", etcd_server.endpoint, run_id, 1, 2, local_addr="127.0.0.1", impl="dynamic", **conf
        )
    )
    key = run_key("/torchelastic/etcd3", run_id, "state")
    if form == "bare-pickle":
        blob = payload
    elif form == "unsigned-envelope":  # the backend's own format, without a signature
        blob = StateCodec(None).encode(payload, key)
    else:  # someone who holds the secret (or no secret is set) signs the attack
        blob = StateCodec(SECRET.encode() if signed else None).encode(payload, key)
    raw_put(etcd_server.endpoint, key, blob)
    for operation in (handler.num_nodes_waiting, handler.next_rendezvous):
        with pytest.raises(RendezvousStateError) as info:
            operation()
        message = str(info.value)
        assert run_id in message and key.decode() in message, message
    assert not marker.exists(), "the planted pickle ran"
    if form == "bare-pickle":
        assert "lacks the etcd3 backend's header" in message, message
    elif form == "signed-by-insider" or not signed:  # no HMAC layer, or it passed: the type check refused it
        assert "posix.system" in message and "refused unloaded" in message, message


@pytest.mark.e2e
def test_agent_without_a_secret_warns_once_at_start(
    etcd_server: EtcdMember, run_id: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(factory, "_warned_unsigned", False)
    with caplog.at_level(logging.WARNING, logger="service.rendezvous.factory"):
        for _ in range(2):
            build_parts(RendezvousParameters("etcd3", etcd_server.endpoint, run_id, 1, 1)).close()
    warnings = [r.getMessage() for r in caplog.records if "without a signing secret" in r.getMessage()]
    assert len(warnings) == 1 and run_id in warnings[0] and "secret_file" in warnings[0], warnings
    monkeypatch.setattr(factory, "_warned_unsigned", False)
    monkeypatch.setenv("S", SECRET)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="service.rendezvous.factory"):
        build_parts(RendezvousParameters("etcd3", etcd_server.endpoint, run_id, 1, 1, secret_env="S")).close()
    assert not [r for r in caplog.records if "without a signing secret" in r.getMessage()]


# -- garbage in the lease key -----------------------------------------------------
@pytest.mark.e2e
@pytest.mark.parametrize("garbage", [b"notanint", b"12345", b"-7", b""])
def test_garbage_lease_key_is_replaced_with_a_warning(
    etcd_server: EtcdMember, run_id: str, caplog: pytest.LogCaptureFixture, garbage: bytes
) -> None:
    lease_key = run_key("/torchelastic/etcd3", run_id, "lease")
    raw_put(etcd_server.endpoint, lease_key, garbage)
    with caplog.at_level(logging.WARNING, logger="service.rendezvous.lease"):
        parts = parts_for(etcd_server.endpoint, run_id, read_timeout=1)
    try:
        lease_id = parts.lease.id()
        assert lease_id > 0 and str(lease_id).encode() != garbage
        published, meta = parts.client.call(lambda c: c.get(lease_key), "read")
        assert published == str(lease_id).encode() and meta.lease_id == lease_id
        assert any(lease_key.decode() in r.getMessage() for r in caplog.records), caplog.text
        # The run works: state and store writes carry the new lease; a second agent joins it.
        _, token, _ = parts.backend.set_state(S("after garbage"))
        parts.store.set("k", b"v")
        other = parts_for(etcd_server.endpoint, run_id)
        try:
            assert other.lease.id() == lease_id
            assert other.backend.get_state() == (S("after garbage"), token)
        finally:
            other.close()
    finally:
        parts.close()


# -- connection errors and the grace window ----------------------------------
def test_unreachable_etcd_fails_at_start_within_read_timeout_naming_endpoint(run_id: str) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match=endpoint):
        parts_for(endpoint, run_id, read_timeout=1)
    assert time.monotonic() - started < 2.5


@pytest.mark.e2e
@pytest.mark.parametrize("operation", ["get_state", "set_state"])
def test_connection_error_arrives_within_timeout(etcd_private: EtcdMember, run_id: str, operation: str) -> None:
    parts = parts_for(etcd_private.endpoint, run_id, read_timeout=1, grace_period=1, failed_node_retry=0.2)
    try:
        _, token, _ = parts.backend.set_state(S("before"))
        etcd_private.kill()
        started = time.monotonic()
        with pytest.raises(RendezvousConnectionError, match=etcd_private.endpoint):
            if operation == "get_state":
                parts.backend.get_state()
            else:
                parts.backend.set_state(S("after"), token)
        # grace window (1 s) + at most one RPC deadline (1 s) + backoff slack
        assert time.monotonic() - started < 3.5
    finally:
        parts.close()


@pytest.mark.e2e
def test_etcd_restart_inside_grace_window_is_survived(etcd_private: EtcdMember, run_id: str) -> None:
    parts = parts_for(etcd_private.endpoint, run_id, read_timeout=1, grace_period=15, failed_node_retry=0.2)
    try:
        _, token, _ = parts.backend.set_state(S("before"))
        etcd_private.kill()
        restarter = threading.Timer(2.0, etcd_private.start)
        restarter.start()
        started = time.monotonic()
        assert parts.backend.get_state() == (S("before"), token)
        assert 1.5 < time.monotonic() - started < 12
        assert parts.backend.set_state(S("after"), token)[2] is True
        restarter.join()
    finally:
        parts.close()


@pytest.mark.e2e
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
@pytest.mark.e2e
@pytest.mark.parametrize("landed", [True, False])
def test_uncertain_write_is_decided_by_a_re_read(
    etcd_server: EtcdMember, run_id: str, monkeypatch: pytest.MonkeyPatch, landed: bool
) -> None:
    parts = parts_for(etcd_server.endpoint, run_id)
    try:
        _, token, _ = parts.backend.set_state(S("v1"))
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
        state, new_token, has_set = parts.backend.set_state(S("v2"), token)
        assert failures and (state, has_set) == (S("v2"), True)
        assert parts.backend.get_state() == (S("v2"), new_token)
    finally:
        parts.close()
