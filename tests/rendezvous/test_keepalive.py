"""Lease keep-alives on one stream kept open (service/rendezvous/keepalive.py), against a real etcd: the leases
live, every refresh of a client goes over one stream (etcd's own count of the LeaseKeepAlive calls opened), a
restarted etcd gets a new stream, and a frozen one fails the refresh in its read_timeout and is refreshed again,
on a new stream, once it thaws."""

from __future__ import annotations

import os
import re
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from service.rendezvous.client import EtcdClient, EtcdError
from service.rendezvous.options import ClientOptions, parse_endpoints

from .conftest import EtcdMember, wait_healthy

pytestmark = pytest.mark.e2e  # every test here starts a process (etcd, torchrun, Slurm)


def streams_opened(member: EtcdMember) -> int:
    """LeaseKeepAlive streams this etcd has seen opened since it started (its gRPC metrics)."""
    with urllib.request.urlopen(f"http://{member.endpoint}/metrics", timeout=5) as response:
        text = response.read().decode()
    started = re.search(r'^grpc_server_started_total\{grpc_method="LeaseKeepAlive"[^}]*\} (\d+)', text, re.M)
    return int(started.group(1)) if started else 0


def freeze(pid: int, timeout: float = 5) -> None:
    """SIGSTOP ``pid`` and wait until every thread of it has stopped: a running thread may answer once more."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = {
            (task / "stat").read_text().rsplit(")", 1)[1].split()[0] for task in Path(f"/proc/{pid}/task").iterdir()
        }
        if states <= {"T", "t"}:
            return
        time.sleep(0.01)
    raise AssertionError(f"etcd (pid {pid}) did not stop within {timeout} s of SIGSTOP")


def refresh_once_back(client: EtcdClient, lease: int, timeout: float = 15) -> None:
    """Refresh ``lease`` until etcd answers again (a refresh that meets the outage itself may fail)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            assert client.refresh_lease(lease, "refreshing after an outage") > 0
            return
        except EtcdError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.fixture
def client(etcd_private: EtcdMember):
    options = ClientOptions(parse_endpoints(etcd_private.endpoint), read_timeout=1, grace_period=0, failed_node_retry=0)
    made = EtcdClient(options)
    yield made
    made.close()


def test_two_leases_live_past_their_ttl_on_one_stream_and_an_unknown_lease_reads_zero(
    client: EtcdClient, etcd_private: EtcdMember
) -> None:
    before = streams_opened(etcd_private)
    leases = [client.call(lambda c: c.lease(2).id, "granting a lease") for _ in range(2)]
    client.call(lambda c: c.put(b"/keepalive-test/held", b"1", lease=leases[0]), "writing a key")
    ttls = []
    ended = time.monotonic() + 4  # twice the TTL: the key would be gone without the refreshes
    while time.monotonic() < ended:
        ttls += [client.refresh_lease(lease, "refreshing a test lease") for lease in leases]
        time.sleep(0.25)
    assert min(ttls) > 0 and len(ttls) >= 20
    value, _ = client.call(lambda c: c.get(b"/keepalive-test/held"), "reading the key")
    assert value == b"1"
    assert streams_opened(etcd_private) == before + 1  # every refresh of both leases went over one stream
    assert client.refresh_lease(0x7E57, "refreshing a lease etcd never granted") == 0
    assert streams_opened(etcd_private) == before + 1


def test_a_restarted_etcd_gets_a_new_stream_and_a_frozen_one_fails_in_time_then_recovers(
    client: EtcdClient, etcd_private: EtcdMember
) -> None:
    lease = client.call(lambda c: c.lease(30).id, "granting a lease")
    assert client.refresh_lease(lease, "refreshing") > 0
    etcd_private.kill()
    etcd_private.start()
    etcd_private.wait_listening()
    wait_healthy(etcd_private.endpoint)
    refresh_once_back(client, lease)  # the old stream died with the old etcd: this refresh is on a new one
    assert streams_opened(etcd_private) == 1  # the restarted etcd's count: one new stream
    for _ in range(5):
        assert client.refresh_lease(lease, "refreshing after a restart") > 0
    assert streams_opened(etcd_private) == 1

    assert etcd_private.proc is not None
    freeze(etcd_private.proc.pid)
    try:
        started = time.monotonic()
        with pytest.raises(EtcdError):
            client.refresh_lease(lease, "refreshing a frozen etcd")
        waited = time.monotonic() - started
        assert 0.8 < waited < 3, waited  # its read_timeout (1 s), not forever
    finally:
        os.kill(etcd_private.proc.pid, signal.SIGCONT)
    refresh_once_back(client, lease)
    assert streams_opened(etcd_private) == 2  # the timed-out stream was dropped, one new one serves
