"""``--rdzv-endpoint`` and ``--rdzv-conf`` parsing: pure logic, no etcd."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.rendezvous.options import DEFAULTS, Endpoint, parse_endpoints, parse_options
from service.rendezvous.signing import StateCodec, StateIntegrityError


def test_defaults_recover_within_six_seconds() -> None:
    o = parse_options("h:2379", "job", {"timeout": "900"}, {})
    # Node loss is detected after interval x attempts, then the last call waits.
    assert o.keep_alive_interval * o.keep_alive_max_attempt + o.last_call_timeout <= 4
    assert (o.ttl, o.client.read_timeout, o.client.grace_period) == (60, 5, 30)
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
        ("h", {"read_timeout": "0"}, {}, "must be positive"),
        ("h", {"grace_period": "-1"}, {}, "must not be negative"),
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
    codec = StateCodec(b"k" * 16)
    blob = codec.encode(b"state", b"/p/run-a/state")
    assert codec.decode(blob, b"/p/run-a/state") == b"state"
    with pytest.raises(StateIntegrityError, match="HMAC"):
        codec.decode(blob, b"/p/run-b/state")
    with pytest.raises(StateIntegrityError, match="corrupt"):
        codec.decode(b"junk", b"/p/run-a/state")
    assert codec.encode(b"state", b"k") != codec.encode(b"state", b"k")  # fresh nonce each write


def test_defaults_table_is_complete() -> None:
    assert set(DEFAULTS) >= {"join_timeout", "last_call_timeout", "close_timeout", "keep_alive_interval"}
