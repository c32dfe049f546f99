"""``--rdzv-endpoint`` and ``--rdzv-conf`` parsing: pure logic, no etcd."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.rendezvous.dynamic.signing import StateCodec, StateIntegrityError
from service.rendezvous.options import (
    BOUNDS,
    DEFAULTS,
    Endpoint,
    parse_endpoints,
    parse_options,
    scrub_secret_env,
)

from .states import state_bytes


def test_defaults_recover_within_six_seconds() -> None:
    o = parse_options("h:2379", "job", {"timeout": "900"}, {})
    # Node loss is detected after interval x attempts, then the last call waits.
    assert o.keep_alive_interval * o.keep_alive_max_attempt + o.last_call_timeout <= 4
    assert (o.ttl, o.client.read_timeout, o.client.grace_period) == (60, 1, 30)
    assert o.secret is None and o.client.user is None


def test_endpoints_several_with_default_port_and_ipv6() -> None:
    assert parse_endpoints("a:1, http://b ,[::1]:3") == (Endpoint("a", 1), Endpoint("b", 2379), Endpoint("::1", 3))
    assert str(Endpoint("::1", 3)) == "[::1]:3"


def test_numbers_override_defaults() -> None:
    o = parse_options("h", "job", {"ttl": "30", "last_call_timeout": "0.5", "keep_alive_max_attempt": "5"}, {})
    assert (o.ttl, o.last_call_timeout, o.keep_alive_max_attempt) == (30, 0.5, 5)


def test_password_from_file_or_env_only(tmp_path: Path) -> None:
    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    assert parse_options("h", "j", {"user": "u", "password_file": str(pw)}, {}).client.password == "s3cret"
    assert parse_options("h", "j", {"user": "u", "password_env": "PW"}, {"PW": "x"}).client.password == "x"


def test_secret_from_env_and_repr_hides_it(tmp_path: Path) -> None:
    o = parse_options("h", "j", {"secret_env": "K"}, {"K": "0123456789abcdef!"})
    assert o.secret == b"0123456789abcdef!"
    assert "0123456789" not in repr(o)


@pytest.mark.parametrize(
    ("endpoint", "conf", "env", "message"),
    [
        ("", {}, {}, "at least one etcd server"),
        ("h:99999", {}, {}, "between 1 and 65535"),
        ("h:1,,h:2", {}, {}, "empty entry"),
        ("h", {"bogus": "1"}, {}, "not known"),
        ("h", {"password": "pw"}, {}, "never read from the command line"),
        ("h", {"secret": "pw"}, {}, "never read from the command line"),
        ("h", {"ttl": "abc"}, {}, "must be a number"),
        ("h", {"ttl": "1"}, {}, "at least 2 seconds"),
        ("h", {"read_timeout": "0"}, {}, "'read_timeout' is 0, outside its allowed range of 0.1 to 3600 seconds"),
        ("h", {"grace_period": "-1"}, {}, "'grace_period' is -1, outside its allowed range of 0 to 86400 seconds"),
        ("h", {"keep_alive_max_attempt": "3.5"}, {}, "whole number"),
        ("h", {"keep_alive_max_attempt": "2"}, {}, "at least 3"),
        ("h", {"last_call_timeout": "nan"}, {}, "finite"),
        ("h", {"key_prefix": "no-slash"}, {}, "must start with '/'"),
        ("h", {"cacert": "/does/not/exist"}, {}, "does not exist"),
        ("h", {"user": "u"}, {}, "needs a password"),
        ("h", {"password_env": "PW"}, {"PW": "x"}, "without 'user'"),
        ("h", {"user": "u", "password_env": "PW"}, {}, "is not set"),
        ("h", {"secret_env": "K"}, {"K": "short"}, "at least 16 characters"),
    ],
)
def test_invalid_options_raise_whole_sentences(endpoint: str, conf: dict, env: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        parse_options(endpoint, "job", conf, env)
    text = str(info.value)
    assert text[0].isupper() and text.endswith("."), text


def test_cert_and_key_go_together(tmp_path: Path) -> None:
    f = tmp_path / "f.pem"
    f.write_text("x")
    with pytest.raises(ValueError, match="together"):
        parse_options("h", "j", {"cert": str(f), "cacert": str(f)}, {})
    with pytest.raises(ValueError, match="needs 'cacert'"):
        parse_options("h", "j", {"cert": str(f), "key": str(f)}, {})


def test_empty_run_id_is_refused() -> None:
    with pytest.raises(ValueError, match="run id"):
        parse_options("h", " ", {}, {})


def test_codec_binds_state_to_its_key() -> None:
    codec = StateCodec(b"k" * 16, "run-a")
    state = state_bytes()
    blob = codec.encode(state, b"/p/run-a/state")
    assert codec.decode(blob, b"/p/run-a/state") == state
    with pytest.raises(StateIntegrityError, match="HMAC"):
        codec.decode(blob, b"/p/run-b/state")
    with pytest.raises(StateIntegrityError, match="corrupt"):
        codec.decode(b"junk", b"/p/run-a/state")
    assert codec.encode(state, b"k") != codec.encode(state, b"k")  # fresh nonce each write


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_codec_passes_real_states_of_every_pickle_protocol(protocol: int) -> None:
    state = state_bytes(protocol=protocol)
    for secret in (None, b"k" * 16):
        codec = StateCodec(secret, "run")
        assert codec.decode(codec.encode(state, b"/p/run/state"), b"/p/run/state") == state


# Rendezvous numbers: (option, value, what the message must say). Every bound, both sides.
BAD_NUMBERS = [
    ("ttl", "1", "'ttl' must be at least 2 seconds"),
    ("ttl", "100000000000000", "'ttl' is 100000000000000, outside its allowed range of 2 to 9000000000 seconds"),
    ("ttl", "1e20", "'ttl' is 100000000000000000000, outside its allowed range"),
    ("ttl", "2.5", "'ttl' must be a whole number"),
    ("ttl", "inf", "'ttl' must be a finite number"),
    ("read_timeout", "0.01", "'read_timeout' is 0.01, outside its allowed range of 0.1 to 3600 seconds"),
    ("read_timeout", "1e6", "'read_timeout' is 1000000, outside its allowed range of 0.1 to 3600 seconds"),
    ("grace_period", "-0.5", "'grace_period' is -0.5, outside its allowed range of 0 to 86400 seconds"),
    ("grace_period", "1e9", "'grace_period' is 1000000000, outside"),
    ("failed_node_retry", "-1", "'failed_node_retry' is -1, outside its allowed range of 0 to 3600 seconds"),
    ("failed_node_retry", "7200", "'failed_node_retry' is 7200, outside"),
    ("join_timeout", "0", "'join_timeout' is 0, outside its allowed range of 0.1 to 31536000 seconds"),
    ("join_timeout", "1e14", "'join_timeout' is 100000000000000, outside"),
    ("last_call_timeout", "0", "'last_call_timeout' is 0, outside its allowed range of 0.01 to 86400 seconds"),
    ("last_call_timeout", "1e10", "'last_call_timeout' is 10000000000, outside"),
    ("close_timeout", "-3", "'close_timeout' is -3, outside its allowed range of 0.1 to 86400 seconds"),
    ("close_timeout", "1e7", "'close_timeout' is 10000000, outside"),
    ("heartbeat_timeout", "0", "'heartbeat_timeout' is 0, outside its allowed range of 0.1 to 86400 seconds"),
    ("heartbeat_timeout", "90000", "'heartbeat_timeout' is 90000, outside"),
    ("keep_alive_interval", "0.001", "'keep_alive_interval' is 0.001, outside its allowed range of 0.1 to 3600"),
    ("keep_alive_interval", "4000", "'keep_alive_interval' is 4000, outside"),
    ("keep_alive_max_attempt", "2", "'keep_alive_max_attempt' must be at least 3"),
    (
        "keep_alive_max_attempt",
        "5000",
        "'keep_alive_max_attempt' is 5000, outside its allowed range of 3 to 1000 attempts",
    ),
]


@pytest.mark.parametrize(("option", "value", "message"), BAD_NUMBERS)
def test_numeric_bounds_name_option_value_and_range(option: str, value: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_options("h", "job", {option: value}, {})
    text = str(info.value)
    assert message in text, text
    assert text[0].isupper() and text.endswith("."), text
    assert "password" not in text


# The bounds of read_timeout and keep_alive_interval are admitted with a consistent other one (see below).
CONSISTENT = {"read_timeout": {"keep_alive_interval": "3600"}, "keep_alive_interval": {"read_timeout": "0.1"}}


def test_bounds_cover_every_number_and_admit_the_defaults() -> None:
    assert set(BOUNDS) == set(DEFAULTS)
    assert {option for option, _, _ in BAD_NUMBERS} == set(DEFAULTS)
    for name, (low, high, _) in BOUNDS.items():
        parse_options("h", "job", {name: str(low), **CONSISTENT.get(name, {})}, {})
        parse_options("h", "job", {name: str(high), **CONSISTENT.get(name, {})}, {})
        assert low <= DEFAULTS[name] <= high


@pytest.mark.parametrize(
    "conf",
    [
        {"read_timeout": "5"},  # the old default: a keep-alive stuck on a frozen member outlived the 3 s lease
        {"read_timeout": "2"},  # 1 s interval + 2 s deadline = the whole 3 s lease: no time left to fail over
        {"keep_alive_interval": "0.5", "read_timeout": "1"},
    ],
)
def test_a_request_deadline_that_outlives_the_node_lease_is_refused(conf: dict[str, str]) -> None:
    """Issue 15, finding 2: the request deadline must leave time to fail over before the liveness timeout."""
    with pytest.raises(ValueError) as info:
        parse_options("h1,h2", "job", conf, {})
    text = str(info.value)
    assert f"'read_timeout' is {conf['read_timeout']}, but it must be under" in text, text
    assert "Lower 'read_timeout', or raise 'keep_alive_interval' or 'keep_alive_max_attempt'." in text, text


def test_the_defaults_leave_time_to_fail_over_within_the_node_lease() -> None:
    o = parse_options("h1,h2,h3", "job", {}, {})
    assert o.client.read_timeout + o.keep_alive_interval < o.keep_alive_interval * o.keep_alive_max_attempt
    slow = parse_options("h", "job", {"read_timeout": "5", "keep_alive_interval": "3", "keep_alive_max_attempt": "10"})
    assert slow.client.read_timeout == 5  # a long deadline is fine with a long enough liveness timeout


def test_scrub_removes_only_the_named_secret_variables() -> None:
    env = {"PW": "p", "KEY": "k", "PATH": "/bin", "OTHER": "o"}
    removed = scrub_secret_env({"password_env": "PW", "secret_env": " KEY ", "user": "u"}, env)
    assert sorted(removed) == ["KEY", "PW"]
    assert env == {"PATH": "/bin", "OTHER": "o"}
    assert scrub_secret_env({"password_env": "PW"}, env) == []  # already gone: nothing to do
    assert scrub_secret_env({}, env) == [] and env == {"PATH": "/bin", "OTHER": "o"}


def test_defaults_table_is_complete() -> None:
    assert set(DEFAULTS) >= {"join_timeout", "last_call_timeout", "close_timeout", "keep_alive_interval"}
