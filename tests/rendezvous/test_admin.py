"""``ddp-service rdzv list|show|retire`` against a real etcd and in-process rendezvous handlers."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousParameters

from service.cli import main
from service.rendezvous.dynamic.signing import StateCodec
from service.rendezvous.factory import build_handler

from .conftest import EtcdMember, etcdctl

pytestmark = pytest.mark.e2e  # every test here starts a process (etcd, torchrun, Slurm)

PREFIX = "/torchelastic/etcd3"


def rdzv(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["rdzv", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(params=["native", "dynamic"])
def impl(request: pytest.FixtureRequest) -> str:
    return request.param


def joined_handler(endpoint: str, run_id: str, impl: str) -> Any:
    """An in-process agent that has completed round 0 as a world of one."""
    params = RendezvousParameters("etcd3", endpoint, run_id, 1, 2, local_addr="127.0.0.1", impl=impl)
    handler = build_handler(params)
    assert handler.next_rendezvous().world_size == 1
    return handler


def keys_of(endpoint: str, run_id: str) -> list[str]:
    out = etcdctl(endpoint, "get", "--prefix", "--keys-only", f"{PREFIX}/{run_id}/")
    return [line for line in out.splitlines() if line.strip()]


def test_list_and_show_a_running_run(
    etcd_server: EtcdMember, run_id: str, capsys: pytest.CaptureFixture[str], impl: str
) -> None:
    joined_handler(etcd_server.endpoint, run_id, impl)
    code, out, _ = rdzv(capsys, "list", "--endpoint", etcd_server.endpoint, "--json")
    assert code == 0
    row = next(r for r in json.loads(out) if r["run_id"] == run_id)
    assert row["round"] == 0 and row["closed"] is False and row["participants"] == 1 and row["decoded"]
    assert 0 < row["lease_ttl_left"] <= 60

    code, out, _ = rdzv(capsys, "show", "--endpoint", etcd_server.endpoint, "--prefix", PREFIX, run_id, "--json")
    assert code == 0
    shown = json.loads(out)
    assert shown["round"] == 0 and shown["complete"] is True and shown["closed"] is False
    assert [p["rank"] for p in shown["participants"]] == [0]
    assert shown["participants"][0]["node"].startswith("127.0.0.1_")
    assert shown["participants"][0]["heartbeat_age"] < 30
    assert shown["wait_list"] == [] and int(shown["lease_id"], 16) > 0
    assert 0 < shown["lease_ttl_left"] <= shown["lease_granted_ttl"] == 60
    assert len(shown["job"]["fingerprint"]) == 64

    code, out, _ = rdzv(capsys, "show", "--endpoint", etcd_server.endpoint, run_id)
    assert code == 0 and f"run:          {run_id}" in out and "closed: False" in out and "(rank 0," in out


def test_show_of_an_unknown_run_says_so(
    etcd_server: EtcdMember, run_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = rdzv(capsys, "show", "--endpoint", etcd_server.endpoint, run_id)
    assert code == 1 and f"no run '{run_id}' under the prefix {PREFIX}" in err


def test_bad_conf_is_a_usage_error(etcd_server: EtcdMember, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = rdzv(capsys, "list", "--endpoint", etcd_server.endpoint, "--conf", "nonsense")
    assert code == 2 and "'nonsense' is not KEY=VALUE" in err


def test_retire_refuses_a_live_run_unless_forced(
    etcd_server: EtcdMember, run_id: str, capsys: pytest.CaptureFixture[str], impl: str
) -> None:
    joined_handler(etcd_server.endpoint, run_id, impl)
    code, _, err = rdzv(capsys, "retire", "--endpoint", etcd_server.endpoint, run_id)
    assert code == 1 and "is not closed and has live nodes" in err and "127.0.0.1_" in err and "--force" in err
    assert keys_of(etcd_server.endpoint, run_id)  # untouched

    code, out, _ = rdzv(capsys, "retire", "--endpoint", etcd_server.endpoint, run_id, "--force", "--json")
    assert code == 0
    result = json.loads(out)
    assert result["marked_closed"] is True and result["lease_revoked"] is True
    assert keys_of(etcd_server.endpoint, run_id) == []


def test_retire_a_finished_run_frees_its_id(
    etcd_server: EtcdMember, run_id: str, capsys: pytest.CaptureFixture[str], impl: str
) -> None:
    handler = joined_handler(etcd_server.endpoint, run_id, impl)
    handler.set_closed()  # what torchrun does when the job ends
    code, out, _ = rdzv(capsys, "retire", "--endpoint", etcd_server.endpoint, run_id)
    assert code == 0 and f"retired run '{run_id}'" in out and "can be reused" in out
    assert keys_of(etcd_server.endpoint, run_id) == []
    # A new job (another fingerprint even) can use the id at once instead of RendezvousClosedError.
    fresh = build_handler(
        RendezvousParameters("etcd3", etcd_server.endpoint, run_id, 1, 1, local_addr="127.0.0.1", impl=impl)
    )
    assert fresh.next_rendezvous().world_size == 1


class _Boom:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (Path(self.marker).touch, ())


def test_show_never_runs_a_hostile_state(
    etcd_server: EtcdMember, run_id: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "pwned"
    key = f"{PREFIX}/{run_id}/state".encode()
    forged = StateCodec(None).encode(pickle.dumps(_Boom(str(marker))), key)
    from service.rendezvous.client import EtcdClient
    from service.rendezvous.options import parse_options

    client = EtcdClient(parse_options(etcd_server.endpoint, run_id, {}).client)
    try:
        client.call(lambda c: c.put(key, forged), "forging")
    finally:
        client.close()
    code, out, _ = rdzv(capsys, "show", "--endpoint", etcd_server.endpoint, run_id, "--json")
    assert code == 0 and not marker.exists()
    shown = json.loads(out)
    assert not shown["decoded"] and "refers to" in shown["note"] and "never" in shown["note"]
    # Not decodable means not provably finished: retire wants --force.
    code, _, err = rdzv(capsys, "retire", "--endpoint", etcd_server.endpoint, run_id)
    assert code == 1 and "Cannot tell whether run" in err and not marker.exists()
    assert rdzv(capsys, "retire", "--endpoint", etcd_server.endpoint, run_id, "--force")[0] == 0
    assert not marker.exists() and keys_of(etcd_server.endpoint, run_id) == []


def test_show_reads_heartbeats_written_naive_by_an_older_torch(
    etcd_server: EtcdMember, run_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Older torch stamped heartbeats with ``datetime.utcnow()`` (naive); ``show`` and ``list`` still give ages."""
    from service.rendezvous.client import EtcdClient
    from service.rendezvous.options import parse_options

    from .states import state_bytes

    key = f"{PREFIX}/{run_id}/state".encode()
    client = EtcdClient(parse_options(etcd_server.endpoint, run_id, {}).client)
    try:
        client.call(lambda c: c.put(key, StateCodec(None).encode(state_bytes("old"), key)), "writing")
    finally:
        client.close()
    code, out, _ = rdzv(capsys, "show", "--endpoint", etcd_server.endpoint, run_id, "--json")
    assert code == 0
    ages = [p["heartbeat_age"] for p in json.loads(out)["participants"]]
    assert len(ages) == 2 and all(age > 0 for age in ages)  # one naive, one aware: both since 2024
    assert rdzv(capsys, "list", "--endpoint", etcd_server.endpoint, "--json")[0] == 0
