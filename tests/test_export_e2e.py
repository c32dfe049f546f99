"""Issue 17 under real torchrun: init_from a safetensors file, the best checkpoint across pruning and a resume, and
the export of what the run wrote. Two short runs (2 ranks, then 1; evaluated every 4 steps, an epoch), about 25 s."""

from __future__ import annotations

import json
import re

import pytest
import safetensors.torch
import torch
from conftest import read_summary, run_job

from service.cli import main
from service.tasks.shapes import UNet

pytestmark = pytest.mark.e2e

TINY = ("task_options.image_size=16", "task_options.train_size=64", "task_options.eval_size=16",
        "task_options.width=4", "checkpoint.every_steps=2", "checkpoint.keep=2",
        "checkpoint.best={metric: loss, mode: max}", "train.epochs=10", "train.eval_every=4")  # fmt: skip


def evals(output: str) -> dict[int, float]:
    """step → eval loss, from rank 0's log lines."""
    found = re.findall(r"\[rank 0\] INFO eval epoch \d+ step (\d+) loss ([\d.]+)", output)
    return {int(step): float(loss) for step, loss in found}


def test_init_from_best_across_pruning_and_resume_and_export_round_trip(tmp_path, capsys):
    # A head bias of ±25 no 12 steps of clipped SGD can undo: the exported weights show init_from was applied.
    torch.manual_seed(123)
    start = UNet(width=4).state_dict()
    start["head.bias"] = torch.tensor([-25.0, 25.0])
    init = tmp_path / "init.safetensors"
    safetensors.torch.save_file(start, init)
    run_dir = tmp_path / "run"
    first = run_job(run_dir, 2, *TINY, "train.max_steps=12", f"init_from={init}", "logging.all_ranks=true",
                    start="warm")  # fmt: skip
    assert first.stdout.count(f"init_from: loaded 40 tensors from {init}") == 2  # every rank, before DDP
    losses = evals(first.stdout)
    assert sorted(losses) == [4, 8, 12]
    best_step = max(losses, key=losses.__getitem__)  # mode max: the highest eval loss
    assert best_step == 4, f"the test needs the best in the first epoch (losses {losses})"
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step-*.pt")) == [f"step-{s:08d}.pt" for s in (4, 10, 12)]
    assert read_summary(run_dir)["checkpoint"]["best"]["step"] == 4

    # Resume (1 rank): the checkpoint wins over init_from, and the best so far is carried on.
    second = run_job(run_dir, 1, *TINY, "train.max_steps=16", f"init_from={init}", start="alone")
    assert "resuming from" in second.stdout and "init_from: loaded" not in second.stdout
    assert evals(second.stdout) and max(evals(second.stdout).values()) < losses[4]  # its own best is worse
    best = json.loads((checkpoints / "best.json").read_text())
    assert best["step"] == 4 and best["value"] == pytest.approx(losses[4], abs=1e-4)
    assert (checkpoints / "step-00000004.pt").exists()  # keep=2 pruned 10 and 12 around it

    saved = {name: torch.load(checkpoints / f"step-{step:08d}.pt", weights_only=True)["model"] for name, step in
             (("latest", 16), ("best", 4))}  # fmt: skip
    for which, out in (("latest", tmp_path / "last.safetensors"), ("best", tmp_path / "best.pt")):
        assert main(["export", str(run_dir), "--step", which, str(out)]) == 0
        weights = safetensors.torch.load_file(out) if out.suffix == ".safetensors" else torch.load(
            out, weights_only=True)  # fmt: skip
        model = UNet(width=4)
        model.load_state_dict(weights, strict=True)
        assert all(torch.equal(weights[key], value) for key, value in saved[which].items())
        assert weights["head.bias"][1] - weights["head.bias"][0] > 30
    assert "exported step 4" in capsys.readouterr().out
