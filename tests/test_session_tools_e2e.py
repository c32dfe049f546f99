"""Issue 35.3 under real torchrun: what Accelerate and Fabric give a loop, on a session, with exact resume.

One script (tests/scripts/session_tools_run.py) runs ``s.steps(n)`` with a kept ``numpy.random.Generator`` drawing
each step's data, ``s.micro_batches`` under ``train.grad_accum``, ``s.autocast``/``s.backward``/``s.step`` under
``train.amp``, then an evaluation (``s.eval_batches``, ``s.mean``, ``s.sum``, ``s.gather``, an ``s.log`` outside a
step), ``s.main_first``, ``s.print`` and ``s.global_step``.
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest
import torch
from conftest import REPO, read_summary
from test_session_e2e import kill_and_restart, replica_digests, run_script

pytestmark = pytest.mark.e2e

SCRIPT = REPO / "tests" / "scripts" / "session_tools_run.py"
STEPS = 12


def results(out: Path, world: int) -> list[dict]:
    return [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(world)]


def assert_evaluated(found: list[dict], summary: dict) -> None:
    """Every rank: the full set's mean exactly (0..100: 50), its count, and every sample once, in order."""
    for rank in found:
        assert rank["mean"] == 50.0 and rank["count"] == 101.0 and rank["sum_tensor"] == [5050.0, 101.0], rank
        assert rank["gathered"] == [float(index) for index in range(101)], rank["gathered"]
        assert rank["cache"] == "0"  # s.main_first: rank 0 made it before the others looked
    assert summary["eval_metrics"] == {"eval_mean": 50.0}  # an s.log after the steps: kept, at its step


def test_fp16_accumulated_steps_without_a_dataset_resume_bit_exact_with_the_scaler_and_the_numpy_rng(
    tmp_path: Path,
) -> None:
    """fp16 on CPU with the gradient scaler (its first steps overflow and are skipped, so its scale moves), 4
    micro-batches a step, data drawn from a kept numpy Generator in s.steps(12): SIGTERM to one worker after step 6,
    its agent's restart of both (the same command, resumed: workers that exit 75 are started again), and the
    uninterrupted digest; the checkpoint holds the scaler's lowered scale; both replicas equal. The uninterrupted
    run is the script under plain torchrun, as its users start it (cold: every worker a new interpreter); the
    preempted one runs under ``ddp-service launch --script`` (its workers and their restart forked)."""
    sets = ("train.amp=fp16", "train.grad_accum=4", "train.log_every=1", "logging.all_ranks=true")
    out = tmp_path / "straight-out"
    output = run_script(SCRIPT, 2, tmp_path / "straight", sets, (str(out), str(STEPS), "0.15"), str(REPO))
    straight = read_summary(tmp_path / "straight")
    assert straight["status"] == "completed" and straight["global_step"] == STEPS, output[-3000:]
    assert straight["grad_accum"] == 4
    assert straight["nonfinite_steps"] >= 1  # the scaler skipped overflowing steps: its state matters on a resume
    digests = replica_digests(output)
    assert digests[0] == digests[1] == straight["model_digest"], output[-3000:]
    found = results(out, 2)
    assert found[0]["weights"] == found[1]["weights"] and found[0]["started_at"] == 0
    assert found[0]["indices"] == list(range(STEPS))
    assert len(re.findall(r"tools: starting at step 0", output)) == 1  # s.print: rank 0 only
    assert [rank["log_level"] for rank in found] == [20, 20]  # logging.all_ranks: INFO everywhere
    assert_evaluated(found, straight)
    last = sorted((tmp_path / "straight" / "checkpoints").glob("step-*.pt"))[-1]
    scaler = torch.load(last, weights_only=True)["__scaler__"]
    assert 0 < scaler["scale"] < 65536.0, scaler  # lowered from the initial 2**16, and kept

    args = (str(tmp_path / "run-out"), str(STEPS), "0.15")
    stopped, resumed, text = preempt_and_restart(tmp_path / "run", sets, args, at=6)
    assert stopped < STEPS, text[-3000:]
    assert resumed["status"] == "completed" and resumed["resumed_from"]["step"] == stopped
    assert resumed["model_digest"] == straight["model_digest"], text[-4000:]
    again = results(tmp_path / "run-out", 2)
    assert [rank["started_at"] for rank in again] == [stopped] * 2  # s.global_step, restored
    assert again[0]["indices"] == list(range(stopped, STEPS))
    assert again[0]["weights"] == found[0]["weights"]


def preempt_and_restart(run_dir: Path, sets: tuple[str, ...], args: tuple[str, ...], at: int
                        ) -> tuple[int, dict, str]:  # fmt: skip
    """The script under ``ddp-service launch --script --max-restarts=1``, SIGTERM to rank 1 at step ``at``
    (``kill_and_restart``): the step it stopped at, the summary, the output."""
    summary, text = kill_and_restart(SCRIPT, run_dir, sets, args, str(REPO), at, sig=signal.SIGTERM, start="warm")
    assert re.search(r"\[rank [01]\] WARNING SIGTERM received", text), text[-4000:]
    found = re.search(r"\[rank \d\] INFO done: preempted at step (\d+)", text)  # the first start's summary
    assert found, text[-4000:]
    stopped = int(found.group(1))
    assert stopped >= at and re.search(r"(?i)exitcode\W+75", text), text[-4000:]  # the agent saw "preempted"
    return stopped, summary, text


def test_accumulation_matches_the_unaccumulated_step_and_an_evaluation_is_exact_at_three_processes(
    tmp_path: Path,
) -> None:
    """fp32 at 3 processes: 4 micro-batches of 2 samples a rank, no_sync on the first 3, give the weights of one
    unaccumulated batch of all 24 samples (a world of one: ``python SCRIPT``) within float rounding, equal on every
    rank; and in the same run (101 eval samples: shards of 33, 34, 34) the evaluation's mean, count and gathered
    samples are the full set's exactly."""
    out = tmp_path / "three"
    sets = ("train.amp=off", "train.grad_accum=4")
    run_script(SCRIPT, 3, tmp_path / "run3", sets, (str(out), "6", "0"), str(REPO), start="warm")
    found = results(out, 3)
    assert found[0]["weights"] == found[1]["weights"] == found[2]["weights"]
    assert_evaluated(found, read_summary(tmp_path / "run3"))
    one = tmp_path / "one"
    run_script(SCRIPT, 1, tmp_path / "run1", ("train.amp=off", "train.grad_accum=1"), (str(one), "6", "0"), str(REPO),
               start="alone")  # fmt: skip
    reference = [torch.tensor(values) for values in results(one, 1)[0]["weights"]]
    for accumulated, unaccumulated in zip(found[0]["weights"], reference, strict=True):
        torch.testing.assert_close(torch.tensor(accumulated), unaccumulated, rtol=1e-5, atol=1e-6)


def test_the_actor_critic_example_stops_every_rank_at_the_same_episode(tmp_path: Path) -> None:
    """examples/actor_critic.py: episodes through s.steps(n), each rank its own environment (its numpy Generator and
    running reward kept per rank); once the world's mean running reward passes the threshold (s.mean), both ranks
    stop at the same step, before n, with equal replicas, and the run is completed with its checkpoint."""
    sets = ("logging.all_ranks=true",)
    output = run_script(REPO / "examples" / "actor_critic.py", 2, tmp_path / "run", sets,
                        ("--episodes", "400", "--threshold", "14"), str(REPO), start="warm")  # fmt: skip
    summary = read_summary(tmp_path / "run")
    assert summary["status"] == "completed" and summary["global_step"] < 400, output[-3000:]
    assert output.count("solved at episode") == 1  # s.print: rank 0's
    done = re.findall(r"\[rank (\d)\] INFO done: completed at step (\d+), model digest ([0-9a-f]{64})", output)
    assert sorted(done) == [("0", str(summary["global_step"]), summary["model_digest"]),
                            ("1", str(summary["global_step"]), summary["model_digest"])], output[-3000:]  # fmt: skip
    assert summary["checkpoint"]["last"].endswith(f"step-{summary['global_step']:08d}.pt")
