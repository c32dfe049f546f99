"""``ddp-service doctor`` against real causes: a live and a stopped etcd (plain and TLS), a closed master port,
a full tmpfs as run_dir, a busy metrics port and a small tmpfs as /dev/shm."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import fill
from rendezvous.conftest import (
    EtcdMember,
    free_port,
    free_ports,
    make_tls_files,
    require_etcd,
    require_openssl,
    start_single,
)

from service.config import load_config
from service.ops.doctor import main
from service.ops.doctor_checks import batch_bytes, check_shm
from service.rendezvous.ports import can_listen, ephemeral_range
from service.tasks.loader import load_task

pytestmark = pytest.mark.e2e


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdMember]:
    member = start_single(require_etcd(), tmp_path)
    yield member
    member.kill()


def doctor(capsys, *argv: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, dict]]:
    """Run the real command in this process; returns the exit code and the checks by name."""
    code = main(["--json", *argv], env or {})
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] == (code == 0)
    checks = {check["name"]: check for check in report["checks"]}
    for check in checks.values():
        assert (check["status"] == "fail") == bool(check["fix"]), check  # a fix for every failed check, only there
    return code, checks


def failed(checks: dict[str, dict]) -> list[str]:
    return [name for name, check in checks.items() if check["status"] == "fail"]


def test_a_healthy_node_passes_every_check_and_measures_no_clock_skew(etcd, tmp_path, capsys):
    port = free_port()
    code, checks = doctor(capsys, "--rdzv-backend=etcd3", f"--rdzv-endpoint={etcd.endpoint}", "--nnodes=2",
                          "--set", f"run_dir={tmp_path / 'run'}", "--set", f"metrics.port={port}",
                          "--set", "data.num_workers=1")  # fmt: skip
    assert code == 0 and not failed(checks), checks
    assert checks["etcd health"]["detail"].startswith("etcd 3.")
    assert f"127.0.0.1:{port}-{port + 1} are free for 2 local rank(s)" in checks["metrics ports"]["detail"]
    skew = checks["clock skew"]["detail"]
    milliseconds = int(skew.split(" ms")[0])
    assert abs(milliseconds) < 250, skew  # etcd runs on this machine's clock


def test_a_stopped_etcd_fails_the_endpoint_check_with_a_fix(etcd, tmp_path, capsys):
    endpoint = etcd.endpoint
    etcd.kill()
    code, checks = doctor(capsys, "--rdzv-backend=etcd3", f"--rdzv-endpoint={endpoint}", "--nnodes=2",
                          "--set", f"run_dir={tmp_path / 'run'}")  # fmt: skip
    assert code == 1 and failed(checks) == [f"etcd {endpoint}"], checks
    assert checks[f"etcd {endpoint}"]["detail"] == "cannot be reached: refused"
    assert "etcd health" not in checks
    assert main(["--rdzv-backend=etcd3", f"--rdzv-endpoint={endpoint}", "--nnodes=2"], {}) == 1
    table = capsys.readouterr().out
    assert f"FAIL    etcd {endpoint}" in table and "fix: Start etcd there" in table and "1 check(s) failed." in table


def test_etcd_over_tls_is_checked_with_the_rendezvous_tls_options(tmp_path, capsys):
    tls = make_tls_files(require_openssl(), tmp_path / "tls")
    member = start_single(require_etcd(), tmp_path, tls=tls)
    try:
        conf = f"cacert={tls.ca},cert={tls.client_cert},key={tls.client_key}"
        code, checks = doctor(capsys, "--rdzv-backend=etcd3", f"--rdzv-endpoint={member.endpoint}",
                              f"--rdzv-conf={conf}", "--nnodes=2", "--set", f"run_dir={tmp_path / 'run'}")  # fmt: skip
        assert code == 0, checks
        assert checks["clock skew"]["status"] == "ok"  # over https, with the client certificate
        wrong_ca = f"cacert={tls.other_ca},cert={tls.client_cert},key={tls.client_key},read_timeout=1"
        code, checks = doctor(capsys, "--rdzv-backend=etcd3", f"--rdzv-endpoint={member.endpoint}", "--nnodes=2",
                              f"--rdzv-conf={wrong_ca}", "--set", f"run_dir={tmp_path / 'run'}")  # fmt: skip
        assert code == 1 and failed(checks) == ["etcd health"], checks  # a CA that did not sign etcd's certificate
    finally:
        member.kill()


def test_a_closed_master_port_fails_on_a_non_zero_rank(tmp_path, capsys):
    port = free_port()  # nothing listens there
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    code, checks = doctor(capsys, "--set", f"run_dir={tmp_path / 'run'}", env=env)
    assert code == 1 and failed(checks) == ["master"], checks
    assert checks["master"]["detail"] == f"127.0.0.1:{port} cannot be reached: refused"
    with socket.create_server(("127.0.0.1", port)):  # now rank 0's store listens
        code, checks = doctor(capsys, "--set", f"run_dir={tmp_path / 'run'}", env=env)
    assert code == 0, checks


def test_a_full_filesystem_fails_the_run_dir_check(small_fs, capsys):
    root = small_fs(size="2m")
    args = ("--set", f"run_dir={root / 'run'}", "--set", "checkpoint.keep=3")
    code, checks = doctor(capsys, *args)
    assert code == 0 and "checkpoint.keep=3 needs" in checks["run_dir"]["detail"], checks
    fill(root, leave=64 * 1024)
    code, checks = doctor(capsys, *args)
    assert code == 1 and failed(checks) == ["run_dir"], checks
    assert "lower checkpoint.keep" in checks["run_dir"]["fix"]


def test_a_busy_metrics_port_fails_naming_the_port_and_local_rank(tmp_path, capsys):
    with socket.create_server(("127.0.0.1", 0)) as server:
        busy = server.getsockname()[1]
        code, checks = doctor(capsys, "--nproc-per-node=2", "--set", f"metrics.port={busy - 1}",
                              "--set", f"run_dir={tmp_path / 'run'}")  # fmt: skip
    assert code == 1 and failed(checks) == ["metrics ports"], checks
    assert checks["metrics ports"]["detail"] == f"in use or not bindable on 127.0.0.1: {busy} (local rank 1)"


def test_a_small_dev_shm_fails_against_the_dataloader_workers(small_fs):
    shm = small_fs(size="1m")
    config = load_config(None, ["data.num_workers=4", "train.batch_size=64"])
    task = load_task(config.task, config.seed, config.task_options)
    one_batch = batch_bytes(task, 64)
    assert one_batch > 0
    result = check_shm(config, 2, one_batch, shm=shm)
    assert result.status == "fail" and "--shm-size" in result.fix, result
    assert check_shm(load_config(None, ["data.num_workers=0"]), 2, one_batch, shm=shm).status == "ok"


def test_dev_shm_without_room_for_two_snapshots_fails_naming_both_sizes_and_the_ways_out(small_fs):
    shm = small_fs(size="1m")
    config = load_config(None, ["data.num_workers=0", f"checkpoint.snapshot_dir={shm}"])
    result = check_shm(config, 2, None, shm=shm, snapshot=600 * 1024)
    assert result.status == "fail" and "2 in-memory snapshots of 0.6 MiB" in result.detail, result
    assert "checkpoint.snapshot_every=0" in result.fix and "--shm-size" in result.fix
    assert check_shm(config, 2, None, shm=shm, snapshot=100 * 1024).status == "ok"
    off = load_config(None, ["data.num_workers=0", f"checkpoint.snapshot_dir={shm}", "checkpoint.snapshot_every=0"])
    assert check_shm(off, 2, None, shm=shm, snapshot=600 * 1024).status == "ok"


def test_stale_snapshot_areas_are_listed_with_their_size_and_the_command_and_none_is_removed(tmp_path, capsys):
    """Issue 24: an area whose agent is gone (the hang watchdog's os._exit, a SIGKILLed agent) stayed in /dev/shm
    until reboot and nothing named it. Areas made by the real snapshot code, each with 3 MiB of state."""
    from service.state.snapshot import MARKER, node_area

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    root = tmp_path / "shm"
    host = socket.gethostname()
    areas = {
        "live": node_area(str(root), str(tmp_path / "a"), "job-a", agent=os.getpid()),
        "dead": node_area(str(root), str(tmp_path / "b"), "job-b", agent=dead.pid),
        "reused": node_area(str(root), str(tmp_path / "c"), "job-c", agent=os.getpid()),
        "other host": node_area(str(root), str(tmp_path / "d"), "job-d", host=f"not-{host}", agent=dead.pid),
    }
    for area in areas.values():
        assert area is not None
        area.prepare()
        (area.path / "step-00000004.pt").write_bytes(b"\0" * 3 * 2**20)
    day_ago = time.time() - 86400  # its marker is older than the process that has its agent's pid now
    os.utime(areas["reused"].path / MARKER, (day_ago, day_ago))  # type: ignore[union-attr]
    code, checks = doctor(capsys, "--set", f"run_dir={tmp_path / 'run'}", "--set", f"checkpoint.snapshot_dir={root}")
    check = checks["snapshot areas"]
    assert code == 0 and check["status"] == "warn", check
    stale = {name: areas[name].path for name in ("dead", "reused")}  # type: ignore[union-attr]
    detail = check["detail"]
    assert f"2 stale in-memory snapshot area(s) under {root / f'ddp-service-{os.getuid()}'} hold 6.0 MiB" in detail
    assert f"{stale['dead']}: 3.0 MiB, its agent process {dead.pid} is gone (run_dir {tmp_path / 'b'}" in detail
    assert f"{stale['reused']}: 3.0 MiB, its agent process {os.getpid()} is gone; that pid is another" in detail
    assert f"`rm -rf {' '.join(sorted(str(path) for path in stale.values()))}`" in detail, detail
    assert str(areas["live"].path) not in detail and str(areas["other host"].path) not in detail  # type: ignore[union-attr]
    assert all(area.path.is_dir() for area in areas.values())  # type: ignore[union-attr]  # nothing removed
    for path in stale.values():
        shutil.rmtree(path)
    code, checks = doctor(capsys, "--set", f"run_dir={tmp_path / 'run'}", "--set", f"checkpoint.snapshot_dir={root}")
    assert checks["snapshot areas"] == {
        "name": "snapshot areas",
        "status": "ok",
        "fix": None,
        "detail": f"2 under {root / f'ddp-service-{os.getuid()}'}, none stale",
    }
    os.chown(root / f"ddp-service-{os.getuid()}", 4242, 4242)  # another user's root (issue 36): no job keeps any
    code, checks = doctor(capsys, "--set", f"run_dir={tmp_path / 'run'}", "--set", f"checkpoint.snapshot_dir={root}")
    assert checks["snapshot areas"]["status"] == "warn", checks["snapshot areas"]
    assert "snapshots are off for this user's jobs here: " in checks["snapshot areas"]["detail"]
    assert "is owned by uid 4242, not by this user" in checks["snapshot areas"]["detail"]


def test_metrics_ports_in_the_ephemeral_range_are_a_warning_naming_the_range_and_a_port_below_it(tmp_path, capsys):
    """The CI failure behind it: a test polled a job's metrics port, an ephemeral one, before the worker listened,
    and its connection was given that same port and connected to itself."""
    low, high = ephemeral_range()
    base = next(port for port in range(high - 1, low, -1) if all(can_listen(p) for p in (port, port + 1)))
    code, checks = doctor(capsys, "--nproc-per-node=2", "--set", f"metrics.port={base}",
                          "--set", f"run_dir={tmp_path / 'run'}")  # fmt: skip
    check = checks["metrics ports"]
    assert code == 0 and check["status"] == "warn", checks
    assert f"{base} lies in this machine's ephemeral range {low}-{high}" in check["detail"]
    assert f"A metrics.port at most {low - 2}" in check["detail"]
    below = free_ports(2)  # outside the range: no warning
    code, checks = doctor(capsys, "--nproc-per-node=2", "--set", f"metrics.port={below}",
                          "--set", f"run_dir={tmp_path / 'run'}")  # fmt: skip
    assert checks["metrics ports"]["status"] == "ok", checks
    straddling = low - 1  # local rank 0 below the range, local rank 1 its first port
    if all(can_listen(p) for p in (straddling, low)):
        code, checks = doctor(capsys, "--nproc-per-node=2", "--set", f"metrics.port={straddling}",
                              "--set", f"run_dir={tmp_path / 'run'}")  # fmt: skip
        assert checks["metrics ports"]["status"] == "warn" and f"but {low} lies" in checks["metrics ports"]["detail"]
