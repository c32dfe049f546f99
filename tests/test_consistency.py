"""Ranks of one world started with different training configs: every rank refuses at start, naming the fields."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from rendezvous.agents import Agent, train_args
from rendezvous.conftest import free_port

from service.state.consistency import EXIT_CONFIG_MISMATCH, differences


def test_differences_name_each_rank_and_field():
    fields = [{"train.lr": 0.05, "seed": 0}, {"train.lr": 0.05, "seed": 0}, {"train.lr": 0.1, "seed": 0, "x": 1}]
    assert differences(fields) == ["rank 2: train.lr (rank 0: 0.05, rank 2: 0.1), x (rank 0: None, rank 2: 1)"]
    assert differences(fields[:2]) == []


@pytest.mark.e2e
def test_two_nodes_with_different_configs_both_refuse_before_training(tmp_path: Path):
    """A stale config on one node: two c10d agents, one with another lr; nobody trains a blend."""
    endpoint, run_id, run_dir = f"127.0.0.1:{free_port()}", f"mismatch-{uuid.uuid4().hex[:8]}", tmp_path / "run"
    agents = [
        Agent(
            tmp_path / f"{addr}.log",
            addr,
            "c10d",
            endpoint,
            run_id,
            "2",
            1,
            train_args(run_dir, 20, "--set", f"train.lr={lr}"),
            max_restarts=0,
        )  # fmt: skip
        for addr, lr in (("127.0.0.2", 0.05), ("127.0.0.3", 0.1))
    ]
    try:
        codes = [agent.wait(120) for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    logs = "".join(agent.log() for agent in agents)
    assert all(code != 0 for code in codes), logs[-3000:]
    assert "rank 1: train.lr (rank 0: 0.05, rank 1: 0.1)" in logs, logs[-3000:]
    assert f"exitcode: {EXIT_CONFIG_MISMATCH}" in logs or f"exitcode  : {EXIT_CONFIG_MISMATCH}" in logs
    assert " INFO step " not in logs and not (run_dir / "checkpoints").exists()
