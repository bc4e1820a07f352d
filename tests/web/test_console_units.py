"""The console's pieces that need no cluster: password hashes, the users file, sessions and CSRF, the
login lockout, rate sampling, time parsing and the SVG charts."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette", reason="the web extra is not installed")

from chronomq.clock import VirtualClock
from chronomq.web import auth, charts, is_loopback
from chronomq.web.app import BadInput, _safe_next, ms_text, parse_time
from chronomq.web.views import TpsSampler, is_system_topic

FAST = {"n": 2**4, "r": 1, "p": 1}  # cheap parameters: these tests check the format, not the cost


def test_password_hash_verifies_only_its_password():
    h = auth.hash_password("s3cret", **FAST)
    assert h.startswith("scrypt$16$1$1$") and "s3cret" not in h
    assert auth.verify_password("s3cret", h)
    assert not auth.verify_password("s3cret ", h)
    assert auth.hash_password("s3cret", **FAST) != h  # a new salt each time
    with pytest.raises(ValueError):
        auth.hash_password("")


@pytest.mark.parametrize("bad", ["plain", "scrypt$16$1$1$!!$AAAA", "scrypt$15$1$1$AAAA$AAAA",
                                 "bcrypt$16$1$1$AAAA$AAAA", "scrypt$16$1$1$$AAAA"])
def test_malformed_hashes_are_refused(bad):
    with pytest.raises(ValueError):
        auth.verify_password("x", bad)


def test_users_file(tmp_path):
    good = tmp_path / "users.yml"
    good.write_text(f"users:\n  - name: ops\n    password_hash: '{auth.hash_password('pw', **FAST)}'\n")
    users = auth.load_users(good)
    assert list(users) == ["ops"]
    accounts = auth.Accounts(users)
    assert accounts.check("ops", "pw") and not accounts.check("ops", "nope") and not accounts.check("x", "pw")
    cases = {
        "missing.yml": None,
        "empty.yml": "",
        "notyaml.yml": "users: [",
        "clear.yml": "users:\n  - name: ops\n    password: pw\n",
        "noname.yml": f"users:\n  - password_hash: '{auth.hash_password('pw', **FAST)}'\n",
        "badhash.yml": "users:\n  - name: ops\n    password_hash: 'md5$abc'\n",
    }
    for name, text in cases.items():
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        with pytest.raises(auth.UsersFileError):
            auth.load_users(path)


def test_sessions_expire_and_csrf_is_per_session():
    clock = VirtualClock(1_000_000)
    sessions = auth.Sessions(clock.now_ms, ttl_ms=60_000)
    a, b = sessions.create(), sessions.create("ops")
    assert sessions.get(a.id) is a and sessions.get(b.id).user == "ops"
    assert auth.Sessions.csrf_ok(a, a.csrf)
    assert not auth.Sessions.csrf_ok(a, b.csrf) and not auth.Sessions.csrf_ok(a, "") \
        and not auth.Sessions.csrf_ok(None, a.csrf) and not auth.Sessions.csrf_ok(a, None)
    clock.advance_sync(60_000)
    assert sessions.get(a.id) is None and sessions.get(b.id) is None
    assert sessions.get("forged") is None and sessions.get(None) is None


def test_login_lockout_after_repeated_failures():
    clock = VirtualClock(0)
    sessions = auth.Sessions(clock.now_ms)
    for _ in range(auth.MAX_FAILURES - 1):
        sessions.failed("10.0.0.9")
    assert not sessions.locked_out("10.0.0.9")
    sessions.failed("10.0.0.9")
    assert sessions.locked_out("10.0.0.9") and not sessions.locked_out("10.0.0.8")
    clock.advance_sync(auth.FAILURE_WINDOW_MS)
    assert not sessions.locked_out("10.0.0.9")
    sessions.failed("10.0.0.9")
    sessions.succeeded("10.0.0.9")
    assert not sessions.locked_out("10.0.0.9")


def test_tps_sampler_measures_between_readings():
    clock = VirtualClock(0)
    tps = TpsSampler(clock.now_ms, min_gap_ms=1_000)
    assert tps.rate("t", 100) is None
    clock.advance_sync(500)
    assert tps.rate("t", 150) is None  # too soon to say
    clock.advance_sync(1_500)
    assert tps.rate("t", 300) == pytest.approx(100.0)  # 200 more in 2 s
    clock.advance_sync(100)
    assert tps.rate("t", 310) == pytest.approx(100.0)  # the last rate until the next full gap
    assert tps.rate("t", 5) is None  # the counter went back: start again


def test_time_parsing_and_display():
    assert parse_time("", "x") is None
    assert parse_time("1700000000123", "x") == 1_700_000_000_123
    assert parse_time("2026-11-24T14:05:00.250", "x") == parse_time("2026-11-24T14:05:00.250Z", "x")
    assert ms_text(parse_time("2026-11-24T14:05", "x")) == "2026-11-24 14:05:00.000 UTC"
    with pytest.raises(BadInput):
        parse_time("yesterday", "x")
    assert ms_text(None) == "-"


def test_only_local_paths_are_followed_after_login():
    assert _safe_next("/topics?x=1") == "/topics?x=1"
    for bad in ("https://evil.example/", "//evil.example/", "", None, "javascript:alert(1)"):
        assert _safe_next(bad) == "/"


def test_loopback_and_system_topics():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("example.com")
    assert is_system_topic("%DLQ%g") and is_system_topic("SCHEDULE_TOPIC_XXXX")
    assert not is_system_topic("Orders")


def test_charts_escape_and_scale():
    svg = charts.bars([("<script>", 10), ("b", 5)], title="t&t", unit=" ms")
    assert "<script>" not in svg and "&lt;script&gt;" in svg and "t&amp;t" in svg
    assert 'width="420.0"' in svg and 'width="210.0"' in svg  # the largest fills the width
    assert "no data yet" in charts.bars([], title="empty")
    h = charts.histogram([(1, 2), (5, 7), (10, 7), (20, 7)], 9, title="lateness")
    assert "&lt;= 1 ms" in h and "&lt;= 5 ms" in h and "&gt; 20 ms" in h
    assert ">2</text>" in h and ">5</text>" in h and ">2</text>" in h  # 2, then 7-2, then 9-7 above


def test_a_console_beyond_loopback_needs_users(tmp_path):
    from chronomq.web import ConsoleConfig, ConsoleServer

    with pytest.raises(ValueError, match="without a login"):
        ConsoleServer(ConsoleConfig(host="0.0.0.0", port=0))
    users = tmp_path / "u.yml"
    users.write_text(f"users:\n  - name: ops\n    password_hash: '{auth.hash_password('pw', **FAST)}'\n")
    ConsoleServer(ConsoleConfig(host="0.0.0.0", port=0, users_file=str(users)))  # accepted
