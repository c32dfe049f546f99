"""Issue 25 under real torchrun: scripts that keep their own loop (``service.Session``), each interrupted mid-epoch
(a SIGTERM to one worker and a rerun; the TBPTT one a SIGKILL, resumed in place from an in-memory snapshot), end
with an uninterrupted run's digest.

- DCGAN (pytorch/examples, 9 lines changed): two models, two Adam optimizers, alternating updates in one step;
- the word language model's truncated BPTT (14 lines changed): each rank its own share of the corpus, in order,
  with its hidden state carried from step to step (``keep_rank``, in the snapshot) and its hand-annealed learning
  rate kept;
- nanoGPT on a Hugging Face ``datasets`` stream of local JSON-lines files, read by two loader workers a rank.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import QUICK, REPO, child_env, kill_group, read_summary
from procs import worker_pids
from test_resume_e2e import LineWatcher, finish

pytestmark = pytest.mark.e2e

EXAMPLES = REPO / "examples"


def paths(*extra: Path) -> str:
    """The service, the examples and the tests' tasks; torchvision's stand-in where torchvision does not import."""
    found = [REPO, EXAMPLES, *extra, REPO / "tests" / "tasks"]
    if importlib.util.find_spec("torchvision") is None:
        found.append(EXAMPLES / "stand_ins")
    return os.pathsep.join(str(path) for path in found)


def script_cmd(script: Path, nproc: int, run_dir: Path, sets: tuple[str, ...], args: tuple[str, ...],
               restarts: int = 0, start: str = "cold") -> list[str]:  # fmt: skip
    """``torchrun SCRIPT`` (cold: each worker a new interpreter), or with ``start="warm"`` ``ddp-service launch
    --script SCRIPT`` (the same agent, its workers forked from the fork server: conftest.STARTS), for the runs that
    only give a test its reference; ``start="alone"``: ``python SCRIPT``, one process, a world of one (no agent)."""
    if start == "alone" and nproc == 1 and not restarts:
        cmd = [sys.executable, str(script)]
    elif start == "warm":
        cmd = [sys.executable, "-m", "service", "launch", f"--nproc-per-node={nproc}", f"--max-restarts={restarts}",
               "--script", str(script)]  # fmt: skip
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               f"--max-restarts={restarts}", str(script)]  # fmt: skip
    for override in (*QUICK, f"run_dir={run_dir}", *sets):
        cmd += ["--set", override]
    return [*cmd, *(["--"] if start == "warm" else []), *args]


def launch_script_cmd(script: Path, run_dir: Path, sets: tuple[str, ...], args: tuple[str, ...]) -> list[str]:
    """``ddp-service launch --script`` at 2 processes: its workers forked from the fork server."""
    return script_cmd(script, 2, run_dir, sets, args, start="warm")


def sigterm_at_step_5(cmd: list[str], pythonpath: str) -> LineWatcher:
    """Run ``cmd`` (a launch), SIGTERM it once rank 0 logs step 5, and check it exits 75; its output's watcher."""
    proc, watcher = watch_with(cmd, pythonpath)
    try:
        watcher.wait_for(r"\[rank 0\] INFO step 5/", timeout=180)
        proc.send_signal(signal.SIGTERM)
        assert finish(proc, watcher, timeout=120) == 75, watcher.text()[-4000:]
    finally:
        kill_group(proc)
    return watcher


def run_script(script: Path, nproc: int, run_dir: Path, sets: tuple[str, ...], args: tuple[str, ...], pythonpath: str,
               expect: int = 0, start: str = "cold") -> str:  # fmt: skip
    done = subprocess.run(script_cmd(script, nproc, run_dir, sets, args, start=start), cwd=REPO, capture_output=True,
                          text=True, env=child_env(PYTHONPATH=pythonpath), timeout=300)  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == expect, f"exit {done.returncode}:\n{output[-6000:]}"
    return output


def watch_with(cmd: list[str], pythonpath: str) -> tuple[subprocess.Popen, LineWatcher]:
    env = child_env(PYTHONUNBUFFERED="1", PYTHONPATH=pythonpath)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    return proc, LineWatcher(proc)


def preempt_and_rerun(script: Path, run_dir: Path, sets: tuple[str, ...], args: tuple[str, ...], pythonpath: str,
                      at: int) -> tuple[dict, dict, str]:  # fmt: skip
    """Start, SIGTERM rank 1 once rank 0 logged step ``at``, then run the same command again to the end."""
    proc, watcher = watch_with(script_cmd(script, 2, run_dir, sets, args), pythonpath)
    try:
        watcher.wait_for(rf"\[rank 0\] INFO step {at}/", timeout=180)
        os.kill(worker_pids(proc.pid)[1], signal.SIGTERM)
        assert finish(proc, watcher, timeout=120) != 0, watcher.text()[-4000:]  # torchrun: a worker exited 75
    finally:
        kill_group(proc)
    first = read_summary(run_dir)
    assert first["status"] == "preempted" and first["stopped_at_step"] >= at, watcher.text()[-4000:]
    assert re.search(r"\[rank [01]\] WARNING SIGTERM received", watcher.text())
    output = run_script(script, 2, run_dir, sets, args, pythonpath, start="warm")  # the rerun: any start resumes
    return first, read_summary(run_dir), watcher.text() + output


def kill_and_restart(script: Path, run_dir: Path, sets: tuple[str, ...], args: tuple[str, ...], pythonpath: str,
                     at: int, sig: signal.Signals = signal.SIGKILL, start: str = "cold"
                     ) -> tuple[dict, str]:  # fmt: skip
    """Start under --max-restarts=1, send rank 1 ``sig`` once rank 0 logged step ``at``; the agent restarts both
    workers in place. SIGKILL: they resume from the node's in-memory snapshot (no disk checkpoint but the end's);
    SIGTERM: every rank stops at one step, rank 0 checkpoints it, the workers exit 75, and they resume from it."""
    proc, watcher = watch_with(script_cmd(script, 2, run_dir, sets, args, restarts=1, start=start), pythonpath)
    try:
        watcher.wait_for(rf"\[rank 0\] INFO step {at}/", timeout=180)
        os.kill(worker_pids(proc.pid)[1], sig)
        assert finish(proc, watcher, timeout=180) == 0, watcher.text()[-4000:]
    finally:
        kill_group(proc)
    summary = read_summary(run_dir)
    assert (summary["status"], summary["restarts"]) == ("completed", 1), watcher.text()[-4000:]
    return summary, watcher.text()


def replica_digests(output: str) -> dict[int, str]:
    """Each rank's kept-module digest from its last "done:" line (logging.all_ranks)."""
    return {int(rank): digest for rank, digest in re.findall(r"\[rank (\d)\] INFO done: \w+ at step \d+, model digest "
                                                             r"([0-9a-f]{64})", output)}  # fmt: skip


def test_dcgan_with_two_optimizers_resumes_bit_exact_and_logs_both_losses(tmp_path: Path) -> None:
    """Upstream's two networks and two Adam optimizers, alternating updates: SIGTERM to one worker at step 5 of a
    62-step epoch, a rerun, and the digest of an uninterrupted run. loss_D and loss_G are in rank 0's log line and in
    TensorBoard; the replicas of netD (and netG) are equal on every rank at the end."""
    pythonpath = paths()
    args = ("--dataset", "fake", "--imageSize", "64", "--ngf", "8", "--ndf", "8", "--nz", "16", "--batchSize", "8",
            "--workers", "0", "--manualSeed", "1", "--outf", str(tmp_path / "out"))  # fmt: skip
    sets = ("train.max_steps=10", "train.epochs=1", "train.log_every=1", "metrics.tensorboard=true",
            "logging.all_ranks=true", "checkpoint.best={metric: loss_G, mode: min}")  # fmt: skip
    (tmp_path / "out").mkdir()
    script = EXAMPLES / "dcgan.py"
    output = run_script(script, 2, tmp_path / "straight", sets, args, pythonpath, start="warm")
    straight = read_summary(tmp_path / "straight")
    assert straight["status"] == "completed" and straight["global_step"] == 10, output[-3000:]
    assert re.search(r"\[rank 0\] INFO step 4/10 epoch 0 loss_D [\d.]+ loss_G [\d.]+ D_x [\d.]+ ", output), output[
        -3000:
    ]
    digests = replica_digests(output)
    assert sorted(digests) == [0, 1] and digests[0] == digests[1] == straight["model_digest"], (digests, output[-2000:])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "straight" / "tensorboard" / "rank0"))
    events.Reload()
    assert {"train/loss_D", "train/loss_G", "train/D_x"} <= set(events.Tags()["scalars"])
    assert [event.step for event in events.Scalars("train/loss_D")] == list(range(1, 11))
    best = json.loads((tmp_path / "straight" / "checkpoints" / "best.json").read_text())  # ranked by a logged number
    assert best["metric"] == "loss_G" and 1 <= best["step"] <= 10
    assert_exports_one_kept_module(tmp_path / "straight", tmp_path)

    # #35.1: dcgan's module-level `s = service.Session().start()` (no `with`) under `ddp-service launch --script`,
    # whose workers are forks that never ran atexit: SIGTERM to the launcher at step 5 (exit 75), then a rerun
    # under launch that ends as under torchrun: its final checkpoint, summary.json, the lock released, the digest.
    run_dir = tmp_path / "run"
    watcher = sigterm_at_step_5(launch_script_cmd(script, run_dir, sets, args), pythonpath)
    first = read_summary(run_dir)
    assert first["status"] == "preempted" and 5 <= first["stopped_at_step"] < 10, watcher.text()[-4000:]
    done = subprocess.run(launch_script_cmd(script, run_dir, sets, args), cwd=REPO, capture_output=True, text=True,
                          env=child_env(PYTHONPATH=pythonpath), timeout=300)  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "launch: exit 0 (completed)" in output, output[-4000:]
    resumed = read_summary(run_dir)
    assert (resumed["status"], resumed["global_step"]) == ("completed", 10), output[-4000:]
    assert resumed["resumed_from"]["step"] == first["stopped_at_step"]
    assert resumed["model_digest"] == straight["model_digest"], output[-4000:]
    assert (run_dir / "checkpoints" / "step-00000010.pt").is_file() and not (run_dir / ".lock").exists()


def assert_exports_one_kept_module(run_dir: Path, tmp_path: Path) -> None:
    """#25.5: export of a run that kept two modules needs --module (exit 2 naming both); with it, the module's
    weights alone, its own keys, as its state dict has them."""
    import torch
    from safetensors.torch import load_file

    from service.cli import main

    assert main(["export", str(run_dir), str(tmp_path / "both.safetensors")]) == 2
    assert main(["export", str(run_dir), "--module", "netG", str(tmp_path / "netG.safetensors")]) == 0
    saved = torch.load(sorted((run_dir / "checkpoints").glob("step-*.pt"))[-1], weights_only=True)["netG"]
    exported = load_file(str(tmp_path / "netG.safetensors"))
    assert sorted(exported) == sorted(saved) and all(torch.equal(exported[key], saved[key]) for key in saved)
    assert not any(key.startswith("module.") for key in exported)


def corpus(directory: Path, words: int) -> Path:
    """train/valid/test.txt of a small vocabulary, line by line, as word_language_model's data.Corpus reads them."""
    import random

    directory.mkdir()
    rng = random.Random(25)
    vocabulary = [f"w{index}" for index in range(40)]
    for name, count in (("train", words), ("valid", words // 4), ("test", words // 4)):
        lines = [" ".join(rng.choice(vocabulary) for _ in range(10)) for _ in range(count // 10)]
        (directory / f"{name}.txt").write_text("\n".join(lines) + "\n")
    return directory


def test_tbptt_word_lm_keeps_each_ranks_order_and_hidden_state_through_a_resume(tmp_path: Path) -> None:
    """shard=False, shuffle=False: each rank walks its own batchified share of the corpus in order 0, 1, 2, ...,
    with its LSTM's hidden state carried from step to step (keep_rank) and dropout on. SIGKILL of a worker mid-epoch
    of the second epoch (after the first epoch's evaluation annealed nothing or the learning rate: it is kept too):
    torchrun restarts the workers, they resume from the in-memory snapshot of a step with no checkpoint, and end with
    the uninterrupted digest, so the snapshot held that step's hidden states (issue 39, 2: gathered only for
    checkpoints, it held none). The trace shows every chunk once per epoch, in order (a step the crash made run
    again, twice alike)."""
    pythonpath = paths(EXAMPLES / "word_language_model")
    data = corpus(tmp_path / "corpus", 1800)
    args = ("--data", str(data), "--emsize", "16", "--nhid", "16", "--nlayers", "1", "--batch_size", "4", "--bptt",
            "8", "--dropout", "0.2", "--log-interval", "1000", "--save", str(tmp_path / "model.pt"))  # fmt: skip
    sets = ("train.epochs=2", "train.log_every=1", "data.trace=true")
    script = EXAMPLES / "word_lm_tbptt.py"
    output = run_script(script, 2, tmp_path / "straight", sets, args, pythonpath, start="warm")
    straight = read_summary(tmp_path / "straight")
    assert straight["status"] == "completed" and straight["epochs_completed"] == 2, output[-3000:]
    assert "End of training" in output  # upstream's own end: the best model saved, loaded back and tested
    steps_per_epoch = straight["global_step"] // 2

    resumed, text = kill_and_restart(script, tmp_path / "run", (*sets, "checkpoint.snapshot_every=1"), args, pythonpath,
                                     at=steps_per_epoch + 3)  # fmt: skip
    source = resumed["resumed_from"]  # no checkpoint but the end's (checkpoint.every_steps=0): snapshot-only steps
    assert source["source"] == "snapshot" and source["step"] > steps_per_epoch, (source, text[-4000:])
    assert resumed["model_digest"] == straight["model_digest"], text[-4000:]
    for rank in (0, 1):
        lines = [json.loads(line) for line in (tmp_path / "run" / "trace" / f"world2-rank{rank}.jsonl").read_text()
                 .splitlines()]  # fmt: skip
        by_step: dict[int, dict] = {}
        for line in lines:
            assert by_step.setdefault(line["step"], line) == line, (rank, line)  # a step run again: the same chunk
        for epoch in (0, 1):
            chunks = [index for line in by_step.values() if line["epoch"] == epoch for index in line["indices"]]
            assert chunks == list(range(steps_per_epoch)), (rank, epoch, chunks)


def stream_files(directory: Path) -> Path:
    directory.mkdir()
    for part in range(4):
        lines = [json.dumps({"text": f"part {part} line {line}: the quick brown fox jumps over the lazy dog"})
                 for line in range(40)]  # fmt: skip
        (directory / f"part{part}.jsonl").write_text("\n".join(lines) + "\n")
    return directory


def test_a_datasets_stream_with_two_workers_resumes_exactly_and_refuses_another_world_size(tmp_path: Path) -> None:
    """nanoGPT on a Hugging Face datasets stream (streaming=True, local JSON lines), 2 processes x 2 loader workers,
    started with `ddp-service launch --script`: SIGTERM to the launcher at step 5 (exit 75), a rerun, the
    uninterrupted digest. The stream's position belongs to the world that saved it: a resume at 1 process is
    refused, naming the fix, and data.stream_resume=restart starts the stream afresh."""
    pythonpath = paths()
    data = stream_files(tmp_path / "data")
    args = ("--data", str(data), "--block_size", "16", "--batch_size", "4")
    sets = ("train.max_steps=12", "train.log_every=1", "data.num_workers=2")
    script = EXAMPLES / "stream_gpt.py"
    output = run_script(script, 2, tmp_path / "straight", sets, args, pythonpath, start="warm")
    straight = read_summary(tmp_path / "straight")
    assert straight["status"] == "completed" and straight["global_step"] == 12, output[-3000:]

    # Preempted through `ddp-service launch --script`: SIGTERM to the launcher, the workers stop, exit 75.
    launch = [sys.executable, "-m", "service", "launch", "--nproc-per-node=2", "--script", str(script)]
    for override in (*QUICK, f"run_dir={tmp_path / 'run'}", *sets):
        launch += ["--set", override]
    watcher = sigterm_at_step_5([*launch, "--", *args], pythonpath)
    first = read_summary(tmp_path / "run")
    assert first["status"] == "preempted" and first["stopped_at_step"] >= 5
    output = run_script(script, 2, tmp_path / "run", sets, args, pythonpath, start="warm")
    resumed = read_summary(tmp_path / "run")
    assert resumed["resumed_from"]["step"] == first["stopped_at_step"]
    assert resumed["model_digest"] == straight["model_digest"], watcher.text()[-3000:] + output[-3000:]

    before = (tmp_path / "run" / "summary.json").read_bytes()
    # The world of one: the script alone (python SCRIPT, no agent); the exit status is the worker's own.
    refused = run_script(script, 1, tmp_path / "run", ("train.max_steps=14", "data.num_workers=2"), args, pythonpath,
                         expect=2, start="alone")  # fmt: skip
    assert "position was saved at world size 2; this start has 1 ranks" in refused, refused[-3000:]
    assert "data.stream_resume=restart" in refused
    assert "feeds.py" not in refused  # #35.1: bad input (exit 2), no traceback
    assert (tmp_path / "run" / "summary.json").read_bytes() == before  # and the good run's summary stays
    restarted = run_script(script, 1, tmp_path / "run", ("train.max_steps=14", "data.stream_resume=restart"), args,
                           pythonpath, start="alone")  # fmt: skip
    assert "it starts afresh (data.stream_resume=restart)" in restarted
    assert read_summary(tmp_path / "run")["global_step"] == 14


def test_misuses_of_the_session_api_are_named_with_their_fix(tmp_path: Path) -> None:
    """Each misuse in a session of its own (one process, a world of one): the error names the call and the fix."""
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, str(REPO / "tests" / "scripts" / "session_errors.py"), str(out),
                           str(tmp_path)], cwd=REPO, env=child_env(), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    found = json.loads(out.read_text())
    expected = {
        "batches_before_keep": (
            "UsageError",
            r"s\.batches\(\.\.\.\) came before any s\.keep\(\.\.\.\).*Keep them first",
        ),
        "batches_of_another_dataset": (
            "UsageError",
            r"s\.batches\(\.\.\.\): this run trains on one dataset, and "
            r"another came.*pass the same data",
        ),
        "model_after_training_started": ("UsageError", r"s\.model\(\.\.\.\) came after training started"),
        "keep_after_training_started": ("KeepError", r"s\.keep\(opt\) came after s\.batches.*Move the s\.keep"),
        "keep_without_state_dict": ("KeepError", r"s\.keep\(lr=\.\.\.\) got a float, which has no state_dict"),
        "model_of_a_wrapped_module": ("WrapError", r"s\.model\(\.\.\.\) got a model it wrapped already"),
        "log_of_a_vector": ("LogError", r"s\.log\(outputs=\.\.\.\) got a tensor of shape \(8, 1\).*\.mean\(\)"),
        "stream_without_max_steps": ("FeedError", r"a stream .* with no length.*Set train\.max_steps"),
        "keep_a_reserved_name": ("KeepError", r"'loop' is the name of one of the checkpoint's own entries"),
        "grad_clip_set": ("SystemExit", "2"),
        "amp_without_backward": ("SystemExit", "2"),
        "accum_without_micro_batches": ("SystemExit", "2"),
        "lr_set": ("SystemExit", "2"),
        "micro_batches_indivisible": ("ToolError", r"shape \(8, 4\) does not split into train\.grad_accum=3 equal"),
        "resume_unexpected_name": ("KeepError", r"holds no 'optG'.*Unexpected: optG\. Missing so far: netD\."),
        "resume_missing_name": ("KeepError", r"holds netD, which this run never kept.*Missing: netD\."),
        # issue 35: nested or side-by-side s.batches, refused at once; state a resume could not load, refused at
        # its first save (nothing saved); a DataLoader's settings named with what replaces each
        "empty_stream": (
            "FeedError",
            r"The stream __main__\.Empty gave no batch in epoch 0 .*Make the stream's "
            r"__iter__ start it afresh",
        ),
        "nested_batches": ("SessionError", r"another s\.batches loop is still running .*one s\.batches loop at a"),
        "batches_side_by_side": ("SessionError", r"another s\.batches loop is still running"),
        "keep_unloadable": (
            "KeepError",
            r"s\.keep\(thing=\.\.\.\) \(a __main__\.Thing\): its "
            r"state_dict\(\)\['inner'\] is a __main__\.Custom, which a resume could not load back",
        ),
        "dataloader_given": (
            "FeedError",
            r"got a torch DataLoader.*num_workers=2 .*data\.num_workers.*a sampler "
            r"that draws with replacement has no s\.batches form",
        ),
    }
    for case, (kind, pattern) in expected.items():
        assert found[case] is not None and found[case][0] == kind, (case, found[case])
        assert re.search(pattern, found[case][1]), (case, found[case][1])
    assert found["keep_unloadable_saved"] == []  # refused before its first checkpoint
    # a dataset made anew each epoch: the feed before it is let go, its loader's worker shut down; none at the end
    assert found["loader_processes_by_epoch"] == [1, 1, 1, 1] and found["loader_processes_at_end"] == 0, found
    assert "train.grad_clip=1.0: the script steps its own optimizer" in done.stderr
    # #35.4: a setting only a session tool applies, with none used, is refused at the end of the first step
    assert "train.amp=fp16: a session applies it through s.autocast() and s.backward(loss)" in done.stderr
    assert "train.grad_accum=4: a session accumulates through `for mb in s.micro_batches(batch):`" in done.stderr
    assert "train.lr=0.1: the script builds its own optimizer: pass the learning rate to it" in done.stderr


ENDS = REPO / "tests" / "scripts" / "session_ends.py"
ENDS_SETS = ("train.max_steps=6", "train.epochs=1", "train.log_every=1")


def end_session(run_dir: Path, end: str, nproc: int = 2, start: str = "cold") -> tuple[int, str, float]:
    """tests/scripts/session_ends.py ending as ``end``: (torchrun's exit status, its output, when it ended)."""
    import time

    done = subprocess.run(script_cmd(ENDS, nproc, run_dir, ENDS_SETS, (), start=start), cwd=REPO,
                          capture_output=True, text=True, env=child_env(PYTHONPATH=paths(), SESSION_END=end),
                          timeout=300)  # fmt: skip
    return done.returncode, done.stdout + done.stderr, time.time()


def worker_exits(output: str) -> list[int]:
    """The workers' exit codes in torchrun's failure report (none when every worker exited 0)."""
    return sorted(int(code) for code in re.findall(r"^\s+exitcode\s*:\s*(-?\d+)", output, re.MULTILINE))


def test_a_break_on_every_rank_completes_there_its_rerun_trains_nothing_and_other_kept_names_exit_2(
    tmp_path: Path,
) -> None:
    """#35.1: a `break` after step 3's body on every rank: completed at step 3 with its checkpoint (left_loop says
    every rank left there); a rerun trains nothing (the same digest, not one more step); a rerun that keeps other
    names is refused on every rank, exit 2, its message and no traceback, and summary.json stays as it was."""
    run = tmp_path / "run"
    code, output, _ = end_session(run, "with:break")
    first = read_summary(run)
    assert code == 0 and first["status"] == "completed" and first["global_step"] == 3, output[-4000:]
    assert first["exit_code"] == 0 and first["left_loop"] == {"step": 3, "ranks": [0, 1], "every_rank": True,
                                                              "went_on": []}  # fmt: skip
    assert first["checkpoint"]["last"].endswith("step-00000003.pt")

    code, output, _ = end_session(run, "with:break", start="warm")  # the rerun: any start resumes
    again = read_summary(run)
    assert code == 0 and "this run completed at step 3: nothing to train" in output, output[-4000:]
    assert again["global_step"] == 3 and again["resumed_from"]["step"] == 3
    assert again["model_digest"] == first["model_digest"]

    before = (run / "summary.json").read_bytes()
    code, output, _ = end_session(run, "with:rename")
    assert code != 0 and worker_exits(output) == [2, 2], output[-4000:]
    for rank in (0, 1):
        assert re.search(rf"\[rank {rank}\] ERROR s\.keep\(other=\.\.\.\): the checkpoint .* holds no 'other'", output)
    assert output.count("Traceback (most recent call last)") <= 1 and "kept.py" not in output  # torchrun's own
    assert (run / "summary.json").read_bytes() == before


@pytest.mark.parametrize(
    ("end", "code", "status"),
    [("with:exit-0", 0, "completed"), ("start:exit-3", 3, "failed"), ("with:exit-2", 2, "failed")],
)
def test_sys_exit_in_the_loop_lands_in_the_summary_and_the_exit_status(tmp_path: Path, end: str, code: int,
                                                                     status: str) -> None:  # fmt: skip
    """#35.1: sys.exit(0) after step 3's body is completed at step 3 with its checkpoint; sys.exit(N) is failed
    with exit_code N in summary.json, and every worker exits N; in both forms (`with`, and `.start()` at module
    level, whose end at exit reads the code through the session's sys.exit)."""
    run = tmp_path / "run"
    returned, output, _ = end_session(run, end)
    summary = read_summary(run)
    assert summary["status"] == status and summary["exit_code"] == code, output[-4000:]
    if code == 0:
        assert returned == 0 and summary["global_step"] == 3 and summary["left_loop"]["every_rank"]
        assert summary["checkpoint"]["last"].endswith("step-00000003.pt")
    else:
        assert returned != 0 and worker_exits(output) == [code, code], output[-4000:]
        assert summary["error"] == f"SystemExit: {code}"


def test_a_break_on_one_rank_ends_the_job_within_seconds_naming_it(tmp_path: Path) -> None:
    """#35.1: rank 1 breaks out after step 3, rank 0 goes on into step 4 (its gradient all-reduce waits for rank 1).
    Rank 1 sees rank 0 past step 3 and ends the job: exit 1 within seconds (no hang), and summary.json (rank 0's)
    names rank 1, the step and the fix."""
    run = tmp_path / "run"
    returned, output, ended = end_session(run, "with:break-rank1")
    left_at = float(re.search(r"rank 1 leaves its loop at ([\d.]+)", output).group(1))  # type: ignore[union-attr]
    assert returned != 0 and ended - left_at < 30, output[-4000:]
    summary = read_summary(run)
    assert summary["status"] == "failed" and summary["exit_code"] == 1, output[-4000:]
    assert summary["left_loop"] == {"step": 3, "ranks": [1], "every_rank": False, "went_on": [0]}
    assert summary["error"].startswith("rank(s) 1 left the loop after step 3"), summary["error"]
    assert "every rank must leave at the same step" in summary["error"]
    assert re.search(r"\[rank 1\] ERROR rank\(s\) 1 left the loop after step 3 .*rank\(s\) 0 went on", output)


SIGNALLER = REPO / "tests" / "scripts" / "signal_at_step.py"


def signalled_then_rerun(script: Path, run_dir: Path, sets: tuple[str, ...], args: tuple[str, ...], at: int,
                         monkeypatch: pytest.MonkeyPatch, pythonpath: str) -> tuple[dict, dict, str]:  # fmt: skip
    """Run ``script`` under tests/scripts/signal_at_step.py, whose rank 1 sends itself SIGTERM in step ``at`` (at its
    ``s.log``; whatever the load, no watcher's lag), then the script again to its end: (the first summary, the
    rerun's, the rerun's output)."""
    monkeypatch.setenv("SIGNAL_SCRIPT", str(script))
    monkeypatch.setenv("SIGNAL_AT_STEP", str(at))
    first = subprocess.run(script_cmd(SIGNALLER, 2, run_dir, sets, args), cwd=REPO, capture_output=True, text=True,
                           env=child_env(PYTHONPATH=pythonpath), timeout=300)  # fmt: skip
    monkeypatch.delenv("SIGNAL_AT_STEP")
    stopped = read_summary(run_dir)
    assert first.returncode != 0 and stopped["status"] == "preempted", (first.stdout + first.stderr)[-4000:]
    assert stopped["stopped_at_step"] >= at
    output = run_script(script, 2, run_dir, sets, args, pythonpath, start="warm")  # the rerun: any start resumes
    return stopped, read_summary(run_dir), output


def test_s_epochs_takes_the_scripts_own_count_and_a_preempted_run_resumes_in_its_epoch_digest_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """#35.3: ``for epoch in s.epochs(3): for x, y in s.batches(...)`` with no train.epochs given: 3 epochs of 8
    steps (not train.epochs' default 2), each epoch numbered at its first step; SIGTERM to rank 1 in step 10 (epoch
    1), a rerun that starts in the epoch it stopped in, at the stopped step, and the uninterrupted digest."""
    monkeypatch.setenv("SESSION_END", "with:epochs-3")
    sets = ("train.log_every=1",)
    output = run_script(ENDS, 2, tmp_path / "straight", sets, (), paths(), start="warm")  # the reference
    straight = read_summary(tmp_path / "straight")
    assert (straight["status"], straight["global_step"], straight["epochs_completed"]) == ("completed", 24, 3), output
    assert re.findall(r"rank 0: epoch (\d) at step (\d+)", output) == [("0", "0"), ("1", "8"), ("2", "16")]

    first, resumed, rerun = signalled_then_rerun(ENDS, tmp_path / "run", sets, (), 10, monkeypatch, paths())
    stopped = first["stopped_at_step"]
    assert stopped < 24, first
    assert resumed["status"] == "completed" and resumed["resumed_from"]["step"] == stopped, rerun[-4000:]
    epoch = stopped // 8  # the epoch it goes on in (a stop at an epoch's last step: the next one, at its start)
    expected = [(str(epoch), str(stopped))] + [(str(later), str(8 * later)) for later in range(epoch + 1, 3)]
    # A stop agreed at an epoch's last step, before that epoch ended, gives that epoch back first with no batch
    # left, so the script's code after its batches (an evaluation) runs as it did in the straight run.
    ended_early = [(str(epoch - 1), str(stopped))] if stopped % 8 == 0 else []
    found = re.findall(r"rank 0: epoch (\d) at step (\d+)", rerun)
    assert found in (expected, ended_early + expected), rerun[-4000:]
    assert (resumed["global_step"], resumed["epochs_completed"]) == (24, 3)
    assert resumed["model_digest"] == straight["model_digest"], rerun[-4000:]
