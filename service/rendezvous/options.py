"""Parse torchrun's ``--rdzv-endpoint`` and ``--rdzv-conf`` into one frozen value.

Kept free of torch and etcd imports so it is cheap to unit-test and safe to
import while torch's rendezvous package is still loading.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_PORT = 2379

# Recovery after a lost node is about keep_alive_interval * keep_alive_max_attempt
# + last_call_timeout plus worker start-up. torch's defaults (5 s x 3, 30 s) took
# 15.9 s here; these give about 5 s. See docs/rendezvous.md for the trade-off.
# read_timeout stays under the liveness timeout less one interval (checked below): a
# keep-alive stuck on a frozen etcd member must fail, and go to the next endpoint,
# before the node's lease runs out. With 5 s, a 4 s freeze of one member of three
# expired every node's 3 s lease.
DEFAULTS: dict[str, float] = {
    "ttl": 60,
    "read_timeout": 1,
    "grace_period": 30,
    "failed_node_retry": 1,
    "join_timeout": 600,
    "last_call_timeout": 1,
    "close_timeout": 30,
    "heartbeat_timeout": 5,
    "keep_alive_interval": 1,
    "keep_alive_max_attempt": 3,
}

PATH_OPTIONS = ("cacert", "cert", "key", "password_file", "secret_file")
TEXT_OPTIONS = ("key_prefix", "user", "password_env", "secret_env", "impl")
# The handler behind --rdzv-backend=etcd3: the etcd-native one (leases, per-node keys, watches) or torch's
# DynamicRendezvousHandler on a compare-and-set state key. See docs/rendezvous.md for the figures.
IMPLS = ("native", "dynamic")
DEFAULT_IMPL = "native"
# torchrun adds ``timeout`` (the legacy etcd join timeout) to every backend's
# configuration and ``rank`` for the static one; accept and ignore them.
IGNORED_OPTIONS = ("timeout", "rank")
KNOWN_OPTIONS = tuple(DEFAULTS) + PATH_OPTIONS + TEXT_OPTIONS + IGNORED_OPTIONS


@dataclass(frozen=True)
class Endpoint:
    """One etcd client URL, reduced to what gRPC needs."""

    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


@dataclass(frozen=True)
class ClientOptions:
    """How to reach etcd: endpoints, timeouts, TLS and authentication."""

    endpoints: tuple[Endpoint, ...]
    read_timeout: float
    grace_period: float
    failed_node_retry: float
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = None
    # How long a start keeps retrying an etcd that is there but slow (a mass start): the rendezvous sets its
    # join_timeout here. None: a start gets one request deadline per endpoint (the admin and doctor tools).
    start_timeout: float | None = None

    @property
    def secure(self) -> bool:
        """TLS is on when a CA certificate is given."""
        return self.cacert is not None

    def describe_endpoints(self) -> str:
        """The endpoints as a user typed them, for error messages."""
        return ",".join(str(e) for e in self.endpoints)


@dataclass(frozen=True)
class RendezvousOptions:
    """Everything the etcd3 rendezvous needs, validated once."""

    run_id: str
    client: ClientOptions
    key_prefix: str
    ttl: int
    secret: bytes | None
    join_timeout: float
    last_call_timeout: float
    close_timeout: float
    heartbeat_timeout: float
    keep_alive_interval: float
    keep_alive_max_attempt: int
    impl: str = DEFAULT_IMPL

    def __repr__(self) -> str:
        # Never print the secret or the password.
        return (
            f"RendezvousOptions(run_id={self.run_id!r}, endpoints="
            f"{self.client.describe_endpoints()!r}, key_prefix={self.key_prefix!r}, "
            f"ttl={self.ttl}, signed={self.secret is not None})"
        )


def parse_endpoints(text: str | None) -> tuple[Endpoint, ...]:
    """Split ``HOST[:PORT][,HOST[:PORT]...]``; an optional ``http://`` is allowed."""
    if not text or not text.strip():
        raise ValueError("The rendezvous endpoint must list at least one etcd server as HOST[:PORT].")
    endpoints = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            raise ValueError(f"The rendezvous endpoint '{text}' contains an empty entry.")
        endpoints.append(_parse_one_endpoint(item))
    return tuple(endpoints)


def _parse_one_endpoint(item: str) -> Endpoint:
    for scheme in ("http://", "https://"):
        if item.lower().startswith(scheme):
            item = item[len(scheme) :]
    item = item.rstrip("/")
    if item.startswith("["):
        host, sep, rest = item[1:].partition("]")
        if not sep:
            raise ValueError(f"The etcd endpoint '{item}' has an unclosed '['.")
        port_text = rest[1:] if rest.startswith(":") else ""
    elif item.count(":") == 1:
        host, port_text = item.split(":")
    else:
        host, port_text = item, ""
    if not host:
        raise ValueError(f"The etcd endpoint '{item}' has no host name.")
    if not port_text:
        return Endpoint(host, DEFAULT_PORT)
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(
            f"The etcd endpoint '{item}' has port '{port_text}', which is not a number between 1 and 65535."
        )
    return Endpoint(host, int(port_text))


def parse_options(
    endpoint: str | None,
    run_id: str,
    config: Mapping[str, Any],
    environ: Mapping[str, str] | None = None,
) -> RendezvousOptions:
    """Validate the whole configuration, so a typo fails at start and not mid-run."""
    environ = os.environ if environ is None else environ
    if not run_id or not str(run_id).strip():
        raise ValueError("The run id (--rdzv-id) must be a non-empty string.")
    _reject_unknown(config)
    numbers = {name: _number(config, name, default) for name, default in DEFAULTS.items()}
    _check_ranges(numbers)
    paths = {name: _existing_path(config, name) for name in PATH_OPTIONS}
    if (paths["cert"] is None) != (paths["key"] is None):
        raise ValueError("The options 'cert' and 'key' must be given together.")
    if paths["cert"] is not None and paths["cacert"] is None:
        raise ValueError("The option 'cert' needs 'cacert' as well, because TLS is off without it.")
    client = ClientOptions(
        endpoints=parse_endpoints(endpoint),
        read_timeout=numbers["read_timeout"],
        grace_period=numbers["grace_period"],
        failed_node_retry=numbers["failed_node_retry"],
        cacert=paths["cacert"],
        cert=paths["cert"],
        key=paths["key"],
        user=_text(config, "user"),
        password=_password(config, paths["password_file"], environ),
    )
    return RendezvousOptions(
        run_id=str(run_id).strip(),
        client=client,
        key_prefix=_key_prefix(config),
        ttl=int(numbers["ttl"]),
        secret=_secret(config, paths["secret_file"], environ),
        join_timeout=numbers["join_timeout"],
        last_call_timeout=numbers["last_call_timeout"],
        close_timeout=numbers["close_timeout"],
        heartbeat_timeout=numbers["heartbeat_timeout"],
        keep_alive_interval=numbers["keep_alive_interval"],
        keep_alive_max_attempt=int(numbers["keep_alive_max_attempt"]),
        impl=_impl(config),
    )


def _reject_unknown(config: Mapping[str, Any]) -> None:
    if "password" in config:
        raise ValueError(
            "The etcd password is never read from the command line; use 'password_file' or 'password_env' instead."
        )
    if "secret" in config:
        raise ValueError(
            "The signing secret is never read from the command line; use 'secret_file' or 'secret_env' instead."
        )
    unknown = sorted(set(config) - set(KNOWN_OPTIONS))
    if unknown:
        raise ValueError(
            f"The rendezvous option(s) {', '.join(repr(u) for u in unknown)} are not known to "
            f"the etcd3 backend; the known options are {', '.join(sorted(KNOWN_OPTIONS))}."
        )


def _number(config: Mapping[str, Any], name: str, default: float) -> float:
    value = config.get(name, default)
    try:
        number = float(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"The rendezvous option '{name}' must be a number, not '{value}'.") from exc
    if not math.isfinite(number):
        raise ValueError(f"The rendezvous option '{name}' must be a finite number, not '{value}'.")
    return number


# (lowest, highest, unit) of each number. etcd keeps leases of 2 s to 9e9 s; the
# timeouts end in torch's datetime arithmetic, which overflows past year 9999, and a
# value beyond a day or a year there is a typo rather than a plan.
_DAY = 86_400
ETCD_MAX_LEASE_TTL = 9_000_000_000
BOUNDS: dict[str, tuple[float, float, str]] = {
    "ttl": (2, ETCD_MAX_LEASE_TTL, "seconds"),
    "read_timeout": (0.1, 3_600, "seconds"),
    "grace_period": (0, _DAY, "seconds"),
    "failed_node_retry": (0, 3_600, "seconds"),
    "join_timeout": (0.1, 365 * _DAY, "seconds"),
    "last_call_timeout": (0.01, _DAY, "seconds"),
    "close_timeout": (0.1, _DAY, "seconds"),
    "heartbeat_timeout": (0.1, _DAY, "seconds"),
    "keep_alive_interval": (0.1, 3_600, "seconds"),
    "keep_alive_max_attempt": (3, 1_000, "attempts"),
}
_WHOLE_NUMBERS = ("ttl", "keep_alive_max_attempt")


def _check_ranges(numbers: Mapping[str, float]) -> None:
    for name in _WHOLE_NUMBERS:
        if numbers[name] != int(numbers[name]):
            raise ValueError(f"The rendezvous option '{name}' must be a whole number, not {numbers[name]:g}.")
    if numbers["keep_alive_max_attempt"] < 3:
        # torch's timer fires every interval, but a beat is sent only when the last one is
        # at least an interval old, so beats can come 2 intervals apart; with fewer than 3
        # attempts a live node ages past the limit, drops itself from the state, stops
        # beating, and the others start a round without it.
        raise ValueError(
            "The rendezvous option 'keep_alive_max_attempt' must be at least 3, because torch "
            "sends a heartbeat only every second interval at worst and live nodes would be "
            f"declared dead; it is {_show(numbers['keep_alive_max_attempt'])}."
        )
    if numbers["ttl"] < 2:
        raise ValueError(
            f"The rendezvous option 'ttl' must be at least 2 seconds, the shortest lease etcd keeps; "
            f"it is {_show(numbers['ttl'])}."
        )
    for name, value in numbers.items():
        low, high, unit = BOUNDS[name]
        if not low <= value <= high:
            raise ValueError(
                f"The rendezvous option '{name}' is {_show(value)}, outside its allowed range of "
                f"{_show(low)} to {_show(high)} {unit}; give a value in that range."
            )
    _check_read_timeout(numbers)


def _check_read_timeout(numbers: Mapping[str, float]) -> None:
    """One request deadline plus one keep-alive interval must fit in the liveness timeout.

    A keep-alive sent to a hung etcd member fails only after ``read_timeout``; the retry on the next
    endpoint must still land before the node's lease (``keep_alive_interval x keep_alive_max_attempt``)
    expires, or every node counts as dead although a healthy member was there all along.
    """
    interval, attempts = numbers["keep_alive_interval"], numbers["keep_alive_max_attempt"]
    budget = interval * (attempts - 1)
    if numbers["read_timeout"] >= budget:
        raise ValueError(
            f"The rendezvous option 'read_timeout' is {_show(numbers['read_timeout'])}, but it must be under "
            f"{budget:g} s: the liveness timeout (keep_alive_interval x keep_alive_max_attempt = "
            f"{interval * attempts:g} s) less one keep-alive interval, so that a request to a hung etcd member "
            "fails and is retried on the next endpoint before the node's lease expires. Lower 'read_timeout', "
            "or raise 'keep_alive_interval' or 'keep_alive_max_attempt'."
        )


def _show(value: float) -> str:
    return str(int(value)) if value == int(value) else f"{value:g}"


def _text(config: Mapping[str, Any], name: str) -> str | None:
    value = config.get(name)
    if value is None:
        return None
    value = str(value).strip()
    if not value:
        raise ValueError(f"The rendezvous option '{name}' must not be empty.")
    return value


def _existing_path(config: Mapping[str, Any], name: str) -> str | None:
    value = _text(config, name)
    if value is not None and not Path(value).is_file():
        raise ValueError(f"The file '{value}' given as rendezvous option '{name}' does not exist.")
    return value


def _impl(config: Mapping[str, Any]) -> str:
    impl = _text(config, "impl") or DEFAULT_IMPL
    if impl not in IMPLS:
        raise ValueError(
            f"The rendezvous option 'impl' is '{impl}', which is not a handler of the etcd3 backend; "
            f"use {' or '.join(repr(i) for i in IMPLS)}."
        )
    return impl


def _key_prefix(config: Mapping[str, Any]) -> str:
    prefix = _text(config, "key_prefix") or "/torchelastic/etcd3"
    if not prefix.startswith("/"):
        raise ValueError(f"The rendezvous option 'key_prefix' must start with '/', not '{prefix}'.")
    return prefix.rstrip("/") or "/"


def _from_env(environ: Mapping[str, str], var: str, what: str) -> str:
    value = environ.get(var)
    if not value:
        raise ValueError(f"The environment variable {var}, named as the {what}, is not set or is empty.")
    return value


def _read_file(path: str, what: str) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ValueError(f"The {what} file '{path}' cannot be read: {exc.strerror}.") from exc
    if not text:
        raise ValueError(f"The {what} file '{path}' is empty.")
    return text


def _password(config: Mapping[str, Any], path: str | None, environ: Mapping[str, str]) -> str | None:
    user = _text(config, "user")
    var = _text(config, "password_env")
    if user is None:
        if path is not None or var is not None:
            raise ValueError("An etcd password was given without 'user'; set 'user' as well.")
        return None
    if path is not None and var is not None:
        raise ValueError("Give the etcd password either by 'password_file' or by 'password_env', not both.")
    if path is not None:
        return _read_file(path, "etcd password")
    if var is not None:
        return _from_env(environ, var, "etcd password")
    raise ValueError(f"The etcd user '{user}' needs a password; give 'password_file' or 'password_env'.")


def _secret(config: Mapping[str, Any], path: str | None, environ: Mapping[str, str]) -> bytes | None:
    var = _text(config, "secret_env")
    if path is not None and var is not None:
        raise ValueError("Give the signing secret either by 'secret_file' or by 'secret_env', not both.")
    if path is not None:
        secret = _read_file(path, "signing secret")
    elif var is not None:
        secret = _from_env(environ, var, "signing secret")
    else:
        return None
    if len(secret) < 16:
        raise ValueError("The signing secret must be at least 16 characters long.")
    return secret.encode("utf-8")


SECRET_ENV_OPTIONS = ("password_env", "secret_env")


def scrub_secret_env(config: Mapping[str, Any], environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Remove the variables named by ``password_env`` and ``secret_env`` from ``environ``.

    torchrun's agent hands its own environment to every worker it starts, so a
    password or signing secret left there would reach the training script and
    every process that script starts. The plugin calls this in the agent once
    the options are read. Returns the names removed.
    """
    environ = os.environ if environ is None else environ
    removed = []
    for option in SECRET_ENV_OPTIONS:
        value = config.get(option)
        name = str(value).strip() if value is not None else ""
        if name and environ.pop(name, None) is not None:
            removed.append(name)
    return removed
