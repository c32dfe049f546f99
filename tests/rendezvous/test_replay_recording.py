"""bench/rendezvous_replay.py replays, for a thousand nodes from one process, the requests a real native handler
makes in a round: the recording in bench/rendezvous_recording.json. These tests hold the two together: a real
round's requests are exactly the recording's (a handler change that adds, drops or changes a request fails here
until the recording is made again, ``python bench/rendezvous_replay.py --record``), and the replay builds each
request back from its template unchanged. No timing is asserted.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from .conftest import EtcdMember

REPO = Path(__file__).resolve().parents[2]


def _bench_module(name: str) -> Any:
    """A bench module by its path (bench/ on sys.path would shadow this package with bench/rendezvous.py)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


rr = _bench_module("rendezvous_recording")


def _example_fill(names: Any) -> Any:
    """Values for every placeholder, such that the template of what they build is the template again."""
    values = {
        "{node_record}": json.dumps({"node": names.node, "addr": "127.0.0.1", "pid": 1, "round": 0}),
        "{seal_record}": json.dumps({"round": 0, "world": 1, "cutoff": 5, "sealed_by": "x"}),
        "{rank_record}": json.dumps({"round": 0, "rank": 0, "world": 1, "cutoff": 5, "sealed_by": "x"}),
        "{job_record}": json.dumps({"fingerprint": "f"}),
        "{run_lease}": str(names.run_lease),
        "{port}": "29500",
        "{addr}": "127.0.0.1",
    }
    keys = {"node": names.node, "run_id": names.run_id, "round": "0" * rr.ROUND_DIGITS,
            "round+1": f"{1:0{rr.ROUND_DIGITS}d}", "store_round": "0", "sealer": "127.0.0.2_1_sealer",
            "member": "127.0.0.3_1_member"}  # fmt: skip

    def fill(field: str, placeholder: str) -> Any:
        if placeholder == "{node_lease}":
            return names.node_lease
        if placeholder == "{run_lease}" and field != "value":
            return names.run_lease
        if placeholder == "{rev}":
            return 7
        if placeholder == "{decided+1}":
            return names.decided + 1
        if field == "value":
            return values[placeholder].encode()
        return rr.fill_text(placeholder, keys).encode()

    return fill


def test_the_replay_builds_every_recorded_request_back_from_its_template() -> None:
    recording = rr.load()
    assert rr.missing_parts(recording) == []
    names = rr.Names("127.0.0.1_4242_0badcafe", "replay-run", 0x1111, 0x2222, decided=10)
    fill = _example_fill(names)
    ops = [op for phase in recording["parts"].values() for stream in phase.values() for part in stream.values()
           for op in part]  # fmt: skip
    assert {op["rpc"] for op in ops} >= {"KV/Range", "KV/Txn", "Lease/LeaseGrant", "Watch/Watch"}
    for op in ops:
        assert rr.template(rr.build(op["rpc"], op["request"], fill), names) == op["request"], op


@pytest.mark.e2e
def test_a_real_round_makes_exactly_the_requests_the_replay_replays(etcd_server: EtcdMember, run_id: str) -> None:
    """Four real handlers (torch's registry, this project's defaults) form one round with a recorder on their
    channels: every part is played (the run's first agent, the sealing first joiner, the two other sealers, a
    plain member, rank 0), and each node's requests, phase by phase, are the recording's."""
    played, handlers = rr.record_round(etcd_server.endpoint, run_id, nodes=4)
    try:
        recording = rr.load()
        settings = recording["settings"]
        options = handlers[0]._parts.options
        assert (settings["keep_alive_interval"], settings["run_lease_ttl"], settings["key_prefix"]) == (
            options.keep_alive_interval, options.ttl, options.key_prefix)  # fmt: skip
        assert settings["node_lease_ttl"] == handlers[0]._lease.ttl
    finally:
        for handler in handlers:
            handler.shutdown()
    parts = [rr.parts_of(one)["unary"] for one in played]
    assert {p["round"] for p in parts} == {"seals", "sealer", "member"}
    assert {p["start"] for p in parts} == {"first", "other"} and {p["sealed"] for p in parts} == {"rank0", "other"}
    problems = [problem for one in played for problem in rr.compare(recording, one)]
    assert problems == [], "\n".join(problems)
    planted = json.loads(json.dumps(recording))  # a request the handler does not make is found
    planted["parts"]["round"]["unary"]["member"].append({"rpc": "KV/Range", "request": {"key": "/extra"}})
    assert any("round/unary/member" in p for one in played for p in rr.compare(planted, one))
