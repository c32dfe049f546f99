"""Registration through ``torchrun.handlers``: the circular-import trap and the TCPStore default."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .conftest import REPO, EtcdMember

pytestmark = pytest.mark.e2e  # every test here starts a process (etcd, torchrun, Slurm)


def run_python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO, env=full_env
    )


def test_plugin_module_imports_nothing_of_torch() -> None:
    done = run_python(
        "import sys, service.rendezvous.plugin as p; p.entrypoint(); "
        "print(sorted(m for m in sys.modules if m.startswith('torch'))[:3])"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_torch_registers_etcd3_without_warnings() -> None:
    done = run_python(
        "import logging; logging.basicConfig(level=logging.WARNING)\n"
        "from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as r\n"
        "print('etcd3' in r._registry)"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"
    assert "out of tree plugin" not in done.stderr, done.stderr


CREATE = (
    "import json, os\n"
    "from torch.distributed.elastic.rendezvous import RendezvousParameters\n"
    "from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler\n"
    "h = get_rendezvous_handler(RendezvousParameters('etcd3', '{endpoint}', 'plugin-{tag}', 1, 2, **{conf}))\n"
    "s = getattr(h, 'settings', None)\n"
    "print(json.dumps([h.get_backend(), h.use_agent_store, os.environ['TORCH_DISABLE_SHARE_RDZV_TCP_STORE'],"
    " type(h).__name__, s and s.keep_alive_interval.total_seconds(), s and s.timeout.last_call.total_seconds()]))\n"
)
NATIVE = ["NativeRendezvousHandler", None, None]
DYNAMIC = ["DynamicRendezvousHandler", 1.0, 1.0]


@pytest.mark.parametrize(("conf", "made"), [({}, NATIVE), ({"impl": "native"}, NATIVE), ({"impl": "dynamic"}, DYNAMIC)])
def test_handler_turns_off_the_shared_tcp_store_by_default(etcd_server: EtcdMember, conf: dict, made: list) -> None:
    done = run_python(CREATE.format(endpoint=etcd_server.endpoint, tag="default", conf=conf))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == ["etcd3", False, "1", *made]


@pytest.mark.parametrize("impl", ["native", "dynamic"])
def test_an_explicit_user_setting_wins(etcd_server: EtcdMember, impl: str) -> None:
    done = run_python(
        CREATE.format(endpoint=etcd_server.endpoint, tag="user", conf={"impl": impl}),
        {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"},
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)[1:3] == [True, "0"]


def test_an_unknown_impl_is_refused_by_name(etcd_server: EtcdMember) -> None:
    done = run_python(CREATE.format(endpoint=etcd_server.endpoint, tag="bad", conf={"impl": "fancy"}))
    assert done.returncode != 0
    assert "The rendezvous option 'impl' is 'fancy'" in done.stderr and "'native' or 'dynamic'" in done.stderr
