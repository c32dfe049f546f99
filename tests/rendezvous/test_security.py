"""TLS and etcd authentication against real etcd servers, built the way torchrun builds the plugin.

Certificates come from the openssl CLI at test time (a throw-away CA, a server
certificate for 127.0.0.1, a client certificate, and an unrelated CA). Every
backend is made from a ``--rdzv-conf`` string through torch's own parser and
``factory.build_parts``, exactly as ``--rdzv-backend=etcd3`` makes it.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config

from service.rendezvous.factory import build_parts
from service.rendezvous.parts import Etcd3Parts

from .agents import Agent
from .conftest import (
    REPO,
    EtcdMember,
    TlsFiles,
    enable_auth,
    make_tls_files,
    require_openssl,
    start_single,
)
from .states import state_bytes as S

USER = "ddp"
PASSWORD = "pw-" + uuid.uuid4().hex
PREFIX = "/torchelastic/etcd3"  # the plugin's default key_prefix
# Failures must come within read_timeout plus start-up, never as a hang.
FAST = "read_timeout=1"
FAIL_WITHIN = 6.0

PartsFactory = Callable[..., Etcd3Parts]


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(require_openssl(), tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def etcd_tls(etcd_binary: str, tls: TlsFiles, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdMember]:
    """etcd serving https on 127.0.0.1 with --client-cert-auth."""
    member = start_single(etcd_binary, tmp_path_factory.mktemp("etcd-tls"), "tls", tls=tls)
    yield member
    member.kill()


@pytest.fixture(scope="module")
def etcd_auth(etcd_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdMember]:
    """etcd with authentication on; user ``ddp`` may read and write the plugin's prefix only.

    Simple tokens expire after 1 s idle, so the client's re-login is exercised for real.
    """
    member = start_single(etcd_binary, tmp_path_factory.mktemp("etcd-auth"), "auth", extra=["--auth-token-ttl=1"])
    try:
        enable_auth(member.endpoint, USER, PASSWORD, PREFIX + "/")
    except BaseException:
        member.kill()
        raise
    yield member
    member.kill()


@pytest.fixture
def password_file(tmp_path: Path) -> Path:
    path = tmp_path / "etcd-password"
    path.write_text(PASSWORD + "\n")
    return path


@pytest.fixture
def make_parts(run_id: str) -> Iterator[PartsFactory]:
    """``build_parts`` from a ``--rdzv-conf`` string, the way torchrun hands it to the plugin."""
    made: list[Etcd3Parts] = []

    def build(endpoint: str, conf: str) -> Etcd3Parts:
        params = RendezvousParameters(
            backend="etcd3",
            endpoint=endpoint,
            run_id=run_id,
            min_nodes=1,
            max_nodes=1,
            **_parse_rendezvous_config(conf),
        )
        parts = build_parts(params)
        made.append(parts)
        return parts

    yield build
    for parts in made:
        parts.close()


def tls_conf(cacert: Path, tls: TlsFiles, with_client_cert: bool = True) -> str:
    conf = f"cacert={cacert}"
    if with_client_cert:
        conf += f",cert={tls.client_cert},key={tls.client_key}"
    return conf


def assert_round_trip(parts: Etcd3Parts) -> None:
    """set_state/get_state with real tokens, then the store as torch wraps it."""
    backend = parts.backend
    assert backend.get_state() is None
    state, token, won = backend.set_state(S("state-1"))
    assert (state, won) == (S("state-1"), True)
    assert backend.get_state() == (S("state-1"), token)
    state, token2, won = backend.set_state(S("state-2"), token)
    assert (state, won) == (S("state-2"), True) and token2 > token
    # A stale token loses and gets the current state back.
    assert backend.set_state(S("stale"), token) == (S("state-2"), token2, False)

    store = dist.PrefixStore("torch.rendezvous.run.0", parts.store)
    store.set("k", b"v")
    assert store.get("k") == b"v"
    assert store.add("n", 2) == 2
    assert store.add("n", 3) == 5


def assert_fails_fast(build: Callable[[], object], error: type[Exception], *fragments: str) -> str:
    started = time.monotonic()
    with pytest.raises(error) as info:
        build()
    elapsed = time.monotonic() - started
    message = str(info.value)
    assert elapsed < FAIL_WITHIN, f"took {elapsed:.1f} s: {message}"
    for fragment in fragments:
        assert fragment in message, message
    assert message[0].isupper() and message.rstrip().endswith("."), message
    return message


# -- TLS -------------------------------------------------------------------------


@pytest.mark.e2e
def test_tls_backend_and_store_work_with_ca_and_client_cert(
    etcd_tls: EtcdMember, tls: TlsFiles, make_parts: PartsFactory
) -> None:
    parts = make_parts(etcd_tls.endpoint, tls_conf(tls.ca, tls))
    assert parts.options.client.secure
    assert_round_trip(parts)


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("case", "reason"),
    [("no CA (plaintext)", "UNAVAILABLE"), ("wrong CA", "handshake"), ("no client certificate", "handshake")],
)
def test_tls_misconfiguration_fails_fast_with_connection_error(
    case: str, reason: str, etcd_tls: EtcdMember, tls: TlsFiles, make_parts: PartsFactory
) -> None:
    conf = {
        "no CA (plaintext)": FAST,
        "wrong CA": f"{tls_conf(tls.other_ca, tls)},{FAST}",
        "no client certificate": f"{tls_conf(tls.ca, tls, with_client_cert=False)},{FAST}",
    }[case]
    message = assert_fails_fast(
        lambda: make_parts(etcd_tls.endpoint, conf),
        RendezvousConnectionError,
        f"etcd at {etcd_tls.endpoint} is unreachable",
        "TLS options",
    )
    # gRPC's reason survives pyetcd's generic "etcd connection failed".
    assert reason in message, message


@pytest.mark.e2e
@pytest.mark.parametrize("option", ["cacert", "cert", "key"])
def test_tls_file_that_is_not_pem_is_refused_at_start(
    option: str, etcd_tls: EtcdMember, tls: TlsFiles, make_parts: PartsFactory, tmp_path: Path
) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    files = {"cacert": tls.ca, "cert": tls.client_cert, "key": tls.client_key, option: junk}
    conf = ",".join(f"{k}={v}" for k, v in files.items())
    assert_fails_fast(lambda: make_parts(etcd_tls.endpoint, conf), ValueError, str(junk), f"'{option}'", "no PEM")


@pytest.mark.e2e
def test_torchrun_smoke_script_over_tls(etcd_tls: EtcdMember, tls: TlsFiles, tmp_path: Path, run_id: str) -> None:
    """One real torchrun agent, --rdzv-backend=etcd3 with --rdzv-conf=cacert=...,cert=...,key=..."""
    agent = Agent(
        tmp_path / "agent.log",
        "127.0.0.2",
        "etcd3",
        etcd_tls.endpoint,
        run_id,
        "1",
        1,
        [str(REPO / "tests" / "scripts" / "allreduce_smoke.py")],
        max_restarts=0,
        rdzv_conf=tls_conf(tls.ca, tls),
    )
    try:
        rc = agent.wait(60)
        assert rc == 0, f"torchrun exited {rc}:\n{agent.log()[-4000:]}"
        assert "world=1 sum=1 expected=1 ok=True" in agent.log(), agent.log()[-4000:]
    finally:
        agent.kill()


# -- authentication --------------------------------------------------------------


@pytest.mark.e2e
def test_auth_password_file_works_for_backend_and_store(
    etcd_auth: EtcdMember, password_file: Path, make_parts: PartsFactory
) -> None:
    parts = make_parts(etcd_auth.endpoint, f"user={USER},password_file={password_file}")
    assert_round_trip(parts)


@pytest.mark.e2e
def test_auth_password_env_works(
    etcd_auth: EtcdMember, make_parts: PartsFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DDP_TEST_ETCD_PASSWORD", PASSWORD)
    parts = make_parts(etcd_auth.endpoint, f"user={USER},password_env=DDP_TEST_ETCD_PASSWORD")
    assert_round_trip(parts)


@pytest.mark.e2e
def test_auth_wrong_password_names_the_user(etcd_auth: EtcdMember, make_parts: PartsFactory, tmp_path: Path) -> None:
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-password")
    message = assert_fails_fast(
        lambda: make_parts(etcd_auth.endpoint, f"user={USER},password_file={wrong},{FAST}"),
        RendezvousConnectionError,
        f"login of user '{USER}'",
        etcd_auth.endpoint,
    )
    assert "not-the-password" not in message and "password" in message


@pytest.mark.e2e
def test_auth_without_user_is_refused_clearly(etcd_auth: EtcdMember, make_parts: PartsFactory) -> None:
    assert_fails_fast(
        lambda: make_parts(etcd_auth.endpoint, FAST),
        RendezvousConnectionError,
        etcd_auth.endpoint,
        "user name is empty",
    )


@pytest.mark.e2e
def test_auth_prefix_without_permission_is_refused(
    etcd_auth: EtcdMember, password_file: Path, make_parts: PartsFactory
) -> None:
    assert_fails_fast(
        lambda: make_parts(
            etcd_auth.endpoint, f"user={USER},password_file={password_file},key_prefix=/elsewhere,{FAST}"
        ),
        RendezvousConnectionError,
        "PERMISSION_DENIED",
        "permissions on the key prefix",
    )


@pytest.mark.e2e
def test_auth_expired_token_logs_in_again(etcd_auth: EtcdMember, password_file: Path, make_parts: PartsFactory) -> None:
    parts = make_parts(etcd_auth.endpoint, f"user={USER},password_file={password_file}")
    _, token, _ = parts.backend.set_state(S("before"))
    first_login = parts.client.raw.metadata
    time.sleep(2.5)  # past --auth-token-ttl=1 and etcd's 1 s expiry tick
    assert parts.backend.set_state(S("after"), token)[1:] != (token, False)
    assert parts.backend.get_state()[0] == S("after")
    assert parts.client.raw.metadata != first_login, "the client did not log in again"


@pytest.mark.e2e
def test_worker_never_sees_the_password_or_the_secret(etcd_auth: EtcdMember, tmp_path: Path, run_id: str) -> None:
    """A real torchrun agent reads both from its environment, removes them, and its worker sees neither."""
    secret = "rdzv-secret-" + uuid.uuid4().hex
    env = {"DDP_TEST_ETCD_PW": PASSWORD, "DDP_TEST_RDZV_SECRET": secret}
    agent = Agent(
        tmp_path / "agent.log",
        "127.0.0.2",
        "etcd3",
        etcd_auth.endpoint,
        run_id,
        "1",
        1,
        [str(REPO / "tests" / "scripts" / "print_env.py")],
        max_restarts=0,
        env=env,
        rdzv_conf=f"user={USER},password_env=DDP_TEST_ETCD_PW,secret_env=DDP_TEST_RDZV_SECRET",
    )
    try:
        rc = agent.wait(90)
        log = agent.log()
        assert rc == 0, f"torchrun exited {rc}:\n{log[-4000:]}"
        found = re.search(r"worker-env (\{.*\})", log)
        assert found, log[-4000:]
        seen = json.loads(found.group(1))
        assert "RANK" in seen["names"] and "TORCHELASTIC_RUN_ID" in seen["names"], seen["names"]
        assert not {"DDP_TEST_ETCD_PW", "DDP_TEST_RDZV_SECRET"} & set(seen["names"])
        for value in (PASSWORD, secret):
            assert hashlib.sha256(value.encode()).hexdigest() not in seen["value_hashes"]
            assert value not in log
    finally:
        agent.kill()


def test_plugin_scrubs_secret_variables_even_when_the_start_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.elastic.rendezvous.api import RendezvousParameters as Params

    from service.rendezvous.plugin import create_rendezvous_handler

    monkeypatch.setenv("DDP_TEST_RDZV_SECRET", "0123456789abcdef-secret")
    monkeypatch.setenv("KEEP_ME", "1")
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # the plugin sets it; restored after
    params = Params("etcd3", "127.0.0.1:1", "scrub", 1, 1, secret_env="DDP_TEST_RDZV_SECRET", read_timeout="0.5")
    with pytest.raises(RendezvousConnectionError):
        create_rendezvous_handler(params)
    assert "DDP_TEST_RDZV_SECRET" not in os.environ and os.environ["KEEP_ME"] == "1"


# -- not etcd at all, and bad numbers ---------------------------------------------


class _ServerThatIsNotEtcd:
    """A listening socket on 127.0.0.1 that answers as ``kind``: plain bytes, HTTP/1.1, or gRPC without etcd."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._stop: Callable[[], None]
        if kind == "http":
            server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _QuietHandler)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            self.port = server.server_address[1]
            self._stop = lambda: (server.shutdown(), server.server_close())
        elif kind == "grpc":
            server = grpc.server(futures.ThreadPoolExecutor(2))
            self.port = server.add_insecure_port("127.0.0.1:0")
            server.start()
            self._stop = lambda: server.stop(0)
        else:
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sock.listen(8)
            self.port = sock.getsockname()[1]
            threading.Thread(target=self._banner, args=(sock,), daemon=True).start()
            self._stop = sock.close

    @staticmethod
    def _banner(sock: socket.socket) -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            try:
                conn.sendall(b"220 smtp.example ESMTP ready\r\n")
            except OSError:
                pass
            conn.close()

    def stop(self) -> None:
        self._stop()


class _QuietHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("tcp", "does not speak gRPC over plain HTTP/2"),
        ("http", "does not speak gRPC over plain HTTP/2"),
        ("grpc", "is not an etcd v3 server"),
    ],
)
def test_endpoint_that_is_not_etcd_gets_the_right_reason(kind: str, reason: str, make_parts: PartsFactory) -> None:
    server = _ServerThatIsNotEtcd(kind)
    try:
        endpoint = f"127.0.0.1:{server.port}"
        message = assert_fails_fast(lambda: make_parts(endpoint, FAST), RendezvousConnectionError, endpoint, reason)
        assert "password" not in message and "user" not in message, message
        assert "--rdzv-endpoint" in message, message
    finally:
        server.stop()


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("conf", "fragment"),
    [
        ("ttl=100000000000000", "'ttl' is 100000000000000, outside its allowed range of 2 to 9000000000 seconds"),
        ("ttl=1e20", "'ttl' is 100000000000000000000, outside its allowed range"),
        ("read_timeout=99999", "'read_timeout' is 99999, outside its allowed range of 0.1 to 3600 seconds"),
    ],
)
def test_huge_numbers_are_refused_before_etcd_is_asked(
    conf: str, fragment: str, etcd_server: EtcdMember, make_parts: PartsFactory
) -> None:
    message = assert_fails_fast(lambda: make_parts(etcd_server.endpoint, conf), ValueError, fragment)
    assert "password" not in message, message
