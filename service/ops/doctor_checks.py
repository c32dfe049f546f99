"""The checks of ``ddp-service doctor``; each returns :class:`Check` values and never raises for what it finds.

Every check looks at the real thing: a socket is bound or connected, a file is
written, etcd is asked over gRPC (the same pyetcd client, TLS and login as the
rendezvous) and over HTTP for its clock, and the model is built on the CPU
(no process group) and serialized to measure a checkpoint.
"""

from __future__ import annotations

import dataclasses
import errno
import http.client
import io
import os
import shlex
import shutil
import socket
import ssl
import tempfile
import time
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

from service.config import JobConfig
from service.rendezvous.options import ClientOptions, Endpoint, RendezvousOptions
from service.rendezvous.ports import EPHEMERAL_RANGE_FILE, ephemeral_range
from service.state.checkpoint_io import nearest_existing
from service.state.snapshot import MARKER, areas_root, list_areas, read_owner
from service.state.snapshot_area import foreign
from service.world.holder import pid_alive, process_start

MiB = 1 << 20
PREFETCH_FACTOR = 2  # torch's DataLoader default: batches in flight per worker


@dataclasses.dataclass(frozen=True)
class Check:
    """One line of the report: ``status`` is ok, warn, fail or skip; a failed check always has a ``fix``."""

    name: str
    status: str
    detail: str
    fix: str = ""


def ok(name: str, detail: str) -> Check:
    return Check(name, "ok", detail)


def fail(name: str, detail: str, fix: str) -> Check:
    return Check(name, "fail", detail, fix)


def _mib(size: float) -> str:
    return f"{size / MiB:.1f} MiB"


# --------------------------------------------------------------------------- sockets


def bind_state(host: str, port: int) -> str:
    """``free``, ``busy`` (something holds it), or ``not local`` (no address of this machine)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return "not local"
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(address)
        except OSError as exc:
            return "busy" if exc.errno == errno.EADDRINUSE else "not local"
    return "free"


def connect_state(host: str, port: int, timeout: float = 2.0) -> str:
    """``listening``, ``refused``, ``timeout`` or ``unresolved``/another reason, by a real TCP connect."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return "listening"
    except socket.gaierror as exc:
        return f"unresolved ({exc.strerror})"
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:
        return "timeout"
    except OSError as exc:
        return exc.strerror or str(exc)


def check_store_address(name: str, host: str, port: int, hosts_here: bool, what: str) -> Check:
    """A TCP store address: free to bind where this process will host it, else reachable."""
    where = f"{host}:{port}"
    if hosts_here:
        state = bind_state(host, port)
        if state == "free":
            return ok(name, f"{where} is free on this machine; {what} will listen there")
        if state == "not local":
            return fail(name, f"{where}: {host} is not an address of this machine, yet this process hosts {what}",
                        "Set the address to a host name or IP of this machine that the other nodes reach.")  # fmt: skip
    state = connect_state(host, port)
    if state == "listening":
        return ok(name, f"{where} accepts connections ({what})")
    return fail(
        name,
        f"{where} cannot be reached: {state}",
        f"Start {what} first (the rank-0 node's launcher), or correct the host and port; check that no firewall "
        f"drops TCP port {port} between the nodes (`nc -vz {host} {port}` from this machine).",
    )


def ephemeral_hazard(ports: range, source: Path = EPHEMERAL_RANGE_FILE) -> str:
    """Why ports chosen now and listened on later should not lie in the kernel's ephemeral range ('' if none does)."""
    low, high = ephemeral_range(source)
    inside = [port for port in ports if low <= port <= high]
    if not inside:
        return ""
    return (f"but {inside[0]} lies in this machine's ephemeral range {low}-{high} ({source}), which outgoing "
            "connections take their local ports from: until a worker listens there (after its imports), one may "
            f"take it and the worker fails with EADDRINUSE, and a scrape from this machine may connect to itself. "
            f"A metrics.port at most {low - len(ports)} (e.g. 9400) avoids both.")  # fmt: skip


def check_metrics_ports(config: JobConfig, nproc: int) -> Check:
    port, host = config.metrics.port, config.metrics.host
    if not isinstance(port, int) or port == 0:
        return ok("metrics ports", f"metrics.port={port}: nothing to reserve")
    busy = [(rank, port + rank) for rank in range(nproc) if bind_state(host, port + rank) != "free"]
    if not busy:
        free = f"{host}:{port}-{port + nproc - 1} are free for {nproc} local rank(s)"
        hazard = ephemeral_hazard(range(port, port + nproc))
        return Check("metrics ports", "warn", f"{free}, {hazard}") if hazard else ok("metrics ports", free)
    listed = ", ".join(f"{p} (local rank {r})" for r, p in busy)
    return fail(
        "metrics ports",
        f"in use or not bindable on {host}: {listed}",
        f"Stop what holds them (`ss -ltnp 'sport = :{busy[0][1]}'` names it), or set metrics.port to a base "
        f"with {nproc} free ports after it, or metrics.port=auto.",
    )


# --------------------------------------------------------------------------- etcd


def check_etcd(options: RendezvousOptions) -> list[Check]:
    """TCP reach of every endpoint, then health and version over gRPC, then the clock skew over HTTP."""
    from service.rendezvous.client import EtcdClient, EtcdError

    client_options = options.client
    checks = []
    reachable = []
    for endpoint in client_options.endpoints:
        state = connect_state(endpoint.host, endpoint.port, timeout=client_options.read_timeout)
        if state == "listening":
            reachable.append(endpoint)
            checks.append(ok(f"etcd {endpoint}", "accepts TCP connections"))
        else:
            checks.append(fail(f"etcd {endpoint}", f"cannot be reached: {state}",
                               f"Start etcd there (`etcdctl --endpoints={endpoint} endpoint health`), or correct "
                               "--rdzv-endpoint."))  # fmt: skip
    if not reachable:
        return checks
    client = EtcdClient(dataclasses.replace(client_options, endpoints=tuple(reachable)))
    try:
        status = client.call(lambda c: c.status(), "asking for the member status")
        alarms = client.call(lambda c: list(c.list_alarms()), "listing the alarms")
    except (EtcdError, ValueError) as exc:
        checks.append(fail("etcd health", str(exc), "Check the TLS options, the etcd user and its password "
                           "(--rdzv-conf cacert=,cert=,key=,user=,password_file=), and etcd's own log."))  # fmt: skip
        return checks
    finally:
        client.close()
    detail = f"etcd {status.version}, db {_mib(status.db_size)}, raft term {status.raft_term}"
    if status.leader is None:
        checks.append(fail("etcd health", f"{detail}: no leader", "Start enough members for a quorum."))
    elif alarms:
        kinds = ", ".join(str(alarm.alarm_type) for alarm in alarms)
        checks.append(fail("etcd health", f"{detail}: alarm(s) raised: {kinds}",
                           "NOSPACE: compact and defragment etcd (`etcdctl compact`, `etcdctl defrag`), "
                           "then `etcdctl alarm disarm`."))  # fmt: skip
    elif tuple(int(part) for part in status.version.split(".")[:2]) < (3, 4):
        checks.append(fail("etcd health", detail, "Use etcd 3.4 or newer."))
    else:
        checks.append(ok("etcd health", f"{detail}, leader {status.leader.name or status.leader.id}, no alarm"))
    checks.append(check_clock(reachable[0], client_options, options))
    return checks


def etcd_skew(endpoint: Endpoint, client: ClientOptions, budget: float = 2.5) -> tuple[float, float]:
    """(etcd's clock minus ours, half the uncertainty), in seconds, from the ``Date`` header of ``/version``.

    ``Date`` has whole seconds. Requests ~20 ms apart watch for the moment it turns: that instant lies
    between the start of the last request that saw the old second and the end of the first that saw
    the new one, so the skew is known to about half that span (tens of ms on a LAN). Without a turn
    within ``budget`` seconds, one request's second is used, ±0.5 s plus half its round trip.
    """
    connection = _http(endpoint, client)
    try:
        last: tuple[float, float] | None = None
        deadline = time.monotonic() + budget
        while True:
            before = time.time()
            connection.request("GET", "/version")
            response = connection.getresponse()
            response.read()
            after = time.time()
            header = response.getheader("Date")
            if header is None:
                raise OSError(f"etcd at {endpoint} sent no Date header")
            server = parsedate_to_datetime(header).timestamp()
            if last is not None and server > last[1]:
                return server - (last[0] + after) / 2, (after - last[0]) / 2
            if time.monotonic() > deadline:
                return server + 0.5 - (before + after) / 2, 0.5 + (after - before) / 2
            last = (before, server)
            time.sleep(0.02)
    finally:
        connection.close()


def _http(endpoint: Endpoint, client: ClientOptions) -> http.client.HTTPConnection:
    host = endpoint.host
    if client.cacert is None:
        return http.client.HTTPConnection(host, endpoint.port, timeout=client.read_timeout)
    context = ssl.create_default_context(cafile=client.cacert)
    if client.cert is not None:
        context.load_cert_chain(client.cert, client.key)
    return http.client.HTTPSConnection(host, endpoint.port, timeout=client.read_timeout, context=context)


def check_clock(endpoint: Endpoint, client: ClientOptions, options: RendezvousOptions) -> Check:
    """A node whose clock is off by more than half the heartbeat window looks dead to, or makes dead, another."""
    window = options.keep_alive_interval * options.keep_alive_max_attempt
    try:
        skew, error = etcd_skew(endpoint, client)
    except (OSError, ValueError, http.client.HTTPException) as exc:
        return fail("clock skew", f"cannot read etcd's clock at {endpoint}/version: {exc}",
                    "Check that the endpoint is etcd's client URL and the TLS options.")  # fmt: skip
    detail = f"{skew * 1000:+.0f} ms against etcd at {endpoint} (±{error * 1000:.0f} ms, HTTP Date of /version)"
    if abs(skew) - error > window / 2:
        return fail(
            "clock skew",
            detail,
            f"Synchronise this machine's clock (chrony or systemd-timesyncd with NTP): the rendezvous compares "
            f"heartbeats written by other nodes' clocks against a {window:g} s window, and a skew over half of it "
            "makes live nodes look dead.",
        )
    return ok("clock skew", detail)


# --------------------------------------------------------------------------- storage


def checkpoint_bytes(task: Any, config: JobConfig) -> int:
    """The size of one checkpoint of this model: model and optimizer state, serialized as the service saves them.

    The model is the task's, on the CPU; one optimizer step on zero gradients creates the optimizer's state
    (SGD's momentum, AdamW's two moments) without any process group.
    """
    import torch

    from service.model.optim import build_optimizer, make_optimizer

    model = task.model
    optimizer = build_optimizer(task, config.task, model, lambda: make_optimizer(model.parameters(), config.train))
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    return buffer.tell() + 64 * 1024  # loop state, RNG states, config: a few KiB


def check_run_dir(config: JobConfig, one_checkpoint: int | None) -> Check:
    run_dir = Path(config.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        return fail("run_dir", f"{run_dir} is a file", "Point run_dir at a directory (or remove the file).")
    base = nearest_existing(run_dir.absolute())
    try:
        with tempfile.NamedTemporaryFile(dir=base, prefix=".doctor-") as probe:
            probe.write(b"\0" * 4096)
            probe.flush()
    except OSError as exc:
        return fail("run_dir", f"cannot write in {base}: {exc.strerror or exc}",
                    f"Make {base} writable for this user, or set run_dir to a writable place.")  # fmt: skip
    free = shutil.disk_usage(base).free
    if one_checkpoint is None:
        return ok("run_dir", f"{run_dir} is writable; {_mib(free)} free (checkpoint size unknown)")
    keep = config.checkpoint.keep
    need = (keep + 1) * one_checkpoint  # keep complete ones, and the next one being written
    detail = (f"{run_dir}: {_mib(free)} free; a checkpoint of this model is {_mib(one_checkpoint)}, "
              f"checkpoint.keep={keep} needs {_mib(need)} (keep + the one being written)")  # fmt: skip
    if free < need:
        return fail("run_dir", detail, f"Free {_mib(need - free)} on {base}'s filesystem, point run_dir at a larger "
                    "one, or lower checkpoint.keep (at least 2).")  # fmt: skip
    return ok("run_dir", detail)


def batch_bytes(task: Any, batch_size: int) -> int:
    """Bytes of one batch of training samples, from the first sample's tensors (in any nesting)."""
    from service.data.batches import tensors

    return sum(tensor.nbytes for tensor in tensors(task.train_set[0])) * batch_size


def check_shm(config: JobConfig, nproc: int, one_batch: int | None, shm: Path = Path("/dev/shm"),
              snapshot: int | None = None) -> Check:  # fmt: skip
    """Shared memory for the DataLoader workers (``prefetch_factor`` batches each) and, with
    ``checkpoint.snapshot_every`` on this tmpfs, two in-memory snapshots of ``snapshot`` bytes."""
    workers = config.data.num_workers
    snapshots = bool(config.checkpoint.snapshot_every) and Path(config.checkpoint.snapshot_dir) == shm
    if workers == 0 and not snapshots:
        return ok("/dev/shm", "data.num_workers=0: batches are loaded in the training process; no snapshots here")
    try:
        usage = shutil.disk_usage(shm)
    except OSError as exc:
        return fail("/dev/shm", f"{shm}: {exc.strerror or exc}", "Mount a tmpfs on /dev/shm, or data.num_workers=0.")
    parts, need = [], 0
    if workers and one_batch is not None:
        need += nproc * workers * PREFETCH_FACTOR * one_batch
        parts.append(f"{nproc} rank(s) × {workers} worker(s) × {PREFETCH_FACTOR} batches of {_mib(one_batch)}")
    if snapshots and snapshot is not None:
        need += 2 * snapshot
        parts.append(f"2 in-memory snapshots of {_mib(snapshot)} (checkpoint.snapshot_every)")
    if not parts:
        return ok("/dev/shm", f"{_mib(usage.free)} free of {_mib(usage.total)} (batch or state size unknown)")
    detail = f"{_mib(usage.free)} free of {_mib(usage.total)}; {' + '.join(parts)} need {_mib(need)}"
    if usage.free < need:
        return fail(
            "/dev/shm",
            detail,
            "Give the container more shared memory (docker --shm-size=1g; Kubernetes: an emptyDir with medium: "
            "Memory on /dev/shm), or lower data.num_workers or train.batch_size; without room for two snapshots "
            "the job keeps none (checkpoint.snapshot_every=0 says so; checkpoint.snapshot_dir picks another tmpfs).",
        )
    return ok("/dev/shm", detail)


# --------------------------------------------------------------------------- in-memory snapshots


def _started_at(pid: int) -> float | None:
    """When ``pid`` started (Unix seconds, 10 ms ticks), from ``/proc``; None where it cannot be read."""
    ticks = process_start(pid)
    try:
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return None if ticks is None else time.time() - uptime + int(ticks) / os.sysconf("SC_CLK_TCK")


def _tree_bytes(path: Path) -> int:
    total = 0
    for directory, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(Path(directory) / name).st_size
            except OSError:
                pass
    return total


def stale_reason(area: Path, host: str) -> str | None:
    """Why the snapshot area ``area`` is stale (its agent is gone from this host), or None while it may be used."""
    try:
        owner = read_owner(area)
    except FileNotFoundError:
        return f"no {MARKER}: no job owns it"
    except ValueError as exc:
        return str(exc)
    return agent_gone(area, owner, host)


def agent_gone(area: Path, owner: dict[str, Any], host: str) -> str | None:
    """Why the area whose marker says ``owner`` (:func:`read_owner`) is stale, or None while its agent lives."""
    if owner["host"] != host:
        return None  # another host's: its agent cannot be looked for here
    agent, written = owner["agent"], os.lstat(area / MARKER).st_mtime
    if not pid_alive(agent, None):
        return f"its agent process {agent} is gone (run_dir {owner.get('run_dir')}, run id {owner.get('run_id')})"
    started = _started_at(agent)
    if started is not None and started > written + 1:  # the pid came back as another process since
        return f"its agent process {agent} is gone; that pid is another process now (run_dir {owner.get('run_dir')})"
    return None


def check_snapshot_areas(config: JobConfig, host: str | None = None) -> Check:
    """The in-memory snapshot areas of this user under ``checkpoint.snapshot_dir`` whose agent process is gone:
    a job that ended past its clean-up left them (the hang watchdog's exit, a SIGKILLed agent), and nothing
    reads them again. Listed with their size and the command that removes them; doctor removes nothing."""
    root = areas_root(config.checkpoint.snapshot_dir)
    host = host or socket.gethostname()
    squatted = foreign(root)
    if squatted is not None:  # a job here would keep no snapshots
        return Check("snapshot areas", "warn", f"in-memory snapshots are off for this user's jobs here: {squatted}")
    try:
        areas = list_areas(config.checkpoint.snapshot_dir)
    except FileNotFoundError:
        return ok("snapshot areas", f"none under {root}")
    except OSError as exc:
        return Check("snapshot areas", "warn", f"cannot list {root}: {exc.strerror or exc}")
    stale = [(area, why, _tree_bytes(area)) for area in areas if (why := stale_reason(area, host)) is not None]
    if not stale:
        return ok("snapshot areas", f"{len(areas)} under {root}, none stale")
    lines = [f"{area}: {_mib(size)}, {why}" for area, why, size in stale]
    total = sum(size for _, _, size in stale)
    remove = "rm -rf " + " ".join(shlex.quote(str(area)) for area, _, _ in stale)
    return Check("snapshot areas", "warn", f"{len(stale)} stale in-memory snapshot area(s) under {root} hold "
                 f"{_mib(total)} of shared memory that no job reads again (doctor removes nothing; remove them with "
                 f"`{remove}`):\n" + "\n".join(lines))  # fmt: skip
