"""The console over HTTP against a real cluster with known traffic: every page, the searches, cancel and
re-send through their confirmation with CSRF, errors as pages, and the login when accounts are set."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest

pytest.importorskip("starlette", reason="the web extra is not installed")

from chronomq.web.app import ms_text
from tests.web.conftest import (
    FAILING_GROUP,
    GROUP,
    N_MESSAGES,
    TOPIC,
    Browser,
    Console,
    LoopThread,
    Traffic,
    start_console,
)

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def browser(console: Console) -> Browser:
    return Browser(console.url)


def _text(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


def test_cluster_page_lists_the_broker(browser: Browser) -> None:
    status, headers, html = browser.get("/")
    assert status == 200
    text = _text(html)
    assert "broker-a" in text and "ASYNC_MASTER" in text and "ASYNC_FLUSH" in text
    assert headers["Content-Security-Policy"].startswith("default-src 'self'")
    assert headers["X-Frame-Options"] == "DENY"
    cookie = headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie


def test_topics_and_topic_pages(browser: Browser, cluster: tuple[Any, Traffic]) -> None:
    status, _, html = browser.get("/topics")
    assert status == 200 and TOPIC in html and "SCHEDULE_TOPIC_XXXX" not in html
    assert "SCHEDULE_TOPIC_XXXX" in browser.get("/topics?system=1")[2]
    status, _, html = browser.get(f"/topics/{TOPIC}")
    assert status == 200
    maxes = re.findall(r"<tr><td>broker-a</td><td>(\d+)</td><td>([\d,]+)</td><td>([\d,]+)</td></tr>", html)
    assert len(maxes) == 2  # the topic was created with 2 queues
    # the timed ones are not stored yet
    assert sum(int(hi.replace(",", "")) for _q, _lo, hi in maxes) == N_MESSAGES
    assert f"{N_MESSAGES} messages stored" in _text(html)
    assert "order 39 body" in html or "order 0 body" in html  # the newest messages are listed


def test_groups_and_group_pages(browser: Browser) -> None:
    status, _, html = browser.get("/groups")
    assert status == 200 and GROUP in html and FAILING_GROUP in html
    status, _, html = browser.get(f"/groups/{GROUP}")
    assert status == 200
    rows = re.findall(r"<tr><td>" + TOPIC + r"</td><td>broker-a</td><td>\d</td><td>([\d,]+)</td>\s*"
                      r"<td>([\d,]+)</td><td>([\d,]+)</td></tr>", html)
    assert len(rows) == 2 and all(lag == "0" for _b, _c, lag in rows)
    assert sum(int(c.replace(",", "")) for _b, c, _lag in rows) == N_MESSAGES
    assert "none connected" not in html  # the group's consumer is listed


def test_search_by_key_by_id_and_by_time(browser: Browser, cluster: tuple[Any, Traffic]) -> None:
    traffic = cluster[1]
    status, _, html = browser.get(f"/messages?topic={TOPIC}&key=order-7")
    assert status == 200 and "1 found" in html and "order 7 body" in html
    status, headers, _ = browser.get(f"/messages?id={traffic.sent['order-7']}")
    assert status == 303 and headers["location"].startswith("/messages/view?id=")
    status, _, html = browser.get(headers["location"])
    assert status == 200 and "order 7 body" in html and "KEYS" in html and "order-7" in html
    status, _, html = browser.get(f"/messages?topic={TOPIC}&begin=0")
    assert status == 200 and f"{N_MESSAGES} found" in html


def test_bad_input_and_missing_things_are_pages(browser: Browser) -> None:
    for path, want in (("/messages?key=x", 400), ("/messages/view", 400),
                       ("/messages?topic=T&begin=yesterday", 400),
                       ("/delayed/confirm?action=explode&id=x", 400)):
        status, _, html = browser.get(path)
        assert status == want, (path, status)
        assert 'id="error"' in html and "Traceback" not in html
    status, _, html = browser.get("/topics/NoSuchTopicHere")
    assert status in (404, 502) and 'id="error"' in html and "Traceback" not in html
    status, _, html = browser.get("/messages?id=NOT-AN-ID")
    assert status in (400, 404, 502) and 'id="error"' in html


def test_delayed_page_and_cancel_with_confirmation(browser: Browser, cluster: tuple[Any, Traffic]) -> None:
    traffic = cluster[1]
    status, _, html = browser.get("/delayed")
    assert status == 200 and 'id="timer-pending"' in html and "timer lateness" in html
    pending = int(re.search(r'id="timer-pending">([\d,]+)<', html).group(1).replace(",", ""))
    assert pending >= 1  # (other tests cancel and reschedule the others)
    status, _, html = browser.get("/delayed?browse=1&key=timed-1")
    handle = traffic.timed["timed-1"]
    assert status == 200 and handle in html and "Cancel…" in html
    status, _, html = browser.get(f"/delayed/confirm?action=cancel&id={handle}")
    assert status == 200 and "cannot be undone" in html
    token = Browser.csrf(html)
    # without the token, or with another one: refused, nothing cancelled
    assert browser.post("/delayed/cancel", {"id": handle})[0] == 403
    assert browser.post("/delayed/cancel", {"id": handle, "csrf": "forged"})[0] == 403
    other = Browser(browser.base)  # another session's token is no good either
    assert other.post("/delayed/cancel", {"id": handle, "csrf": token})[0] == 403
    status, _, html = browser.post("/delayed/cancel", {"id": handle, "csrf": token})
    assert status == 200 and ">CANCELLED<" in html
    status, _, html = browser.post("/delayed/cancel", {"id": handle, "csrf": token})
    assert status == 200 and ">ALREADY_CANCELLED<" in html
    assert handle not in browser.get("/delayed?browse=1&key=timed-1")[2]


def test_reschedule_through_the_console(browser: Browser, cluster: tuple[Any, Traffic]) -> None:
    handle = cluster[1].timed["timed-2"]
    token = Browser.csrf(browser.get(f"/delayed/confirm?action=reschedule&id={handle}")[2])
    when = int(time.time() * 1000) + 7_200_000
    status, _, html = browser.post("/delayed/reschedule",
                                   {"id": handle, "csrf": token, "deliver_at": str(when)})
    assert status == 200 and ">RESCHEDULED<" in html and ms_text(when) in html
    status, _, html = browser.post("/delayed/reschedule", {"id": handle, "csrf": token, "deliver_at": "soon"})
    assert status == 400 and "not a date-time" in html
    # beyond the broker's maximum delay: its refusal, as a page
    status, _, html = browser.post("/delayed/reschedule", {"id": handle, "csrf": token,
                                                           "deliver_at": "2099-01-01T00:00:00"})
    assert status == 400 and "maximum" in html and 'id="error"' in html


def test_dead_letters_browse_and_resend(browser: Browser, cluster: tuple[Any, Traffic],
                                        web_loop: LoopThread) -> None:
    status, _, html = browser.get("/dlq")
    assert status == 200 and FAILING_GROUP in html
    status, _, html = browser.get(f"/dlq/{FAILING_GROUP}")
    assert status == 200 and "this one always fails" in html
    offset_id = re.search(r'/dlq/confirm\?id=([0-9A-F]+)"', html).group(1)
    status, _, html = browser.get(f"/dlq/confirm?id={offset_id}")
    assert status == 200 and "ConsoleDead" in html
    status, _, html = browser.post("/dlq/resend", {"id": offset_id, "csrf": Browser.csrf(html)})
    assert status == 200 and "was sent again as" in html
    new_id = re.search(r"sent again as <code>([^<]+)</code>", html).group(1)

    from chronomq.client import Admin

    async def copies() -> list[Any]:
        async with Admin(cluster[0].namesrv_addr) as admin:
            return await admin.query_messages("ConsoleDead", new_id, unique_key=True)

    found = web_loop.run(copies())
    assert len(found) == 1 and found[0].body == b"this one always fails"
    assert found[0].properties.get("DLQ_REDRIVE_FROM") == offset_id


def test_login_is_required_when_accounts_are_set(tmp_path, cluster: tuple[Any, Traffic],
                                                 web_loop: LoopThread) -> None:
    from chronomq.web.auth import MAX_FAILURES, hash_password

    users = tmp_path / "users.yml"
    h = hash_password("right horse", n=2**4, r=1)
    users.write_text(f"users:\n  - name: ops\n    password_hash: '{h}'\n")
    c = start_console(web_loop, cluster[0].namesrv_addr, str(users))
    try:
        b = Browser(c.url)
        status, headers, _ = b.get("/delayed?browse=1")
        assert status == 303 and headers["location"].startswith("/login?next=")
        status, _, html = b.get("/login?next=/delayed")
        token = Browser.csrf(html)
        assert b.post("/delayed/cancel", {"id": "x", "csrf": token})[0] == 403  # not logged in
        status, _, html = b.post("/login", {"username": "ops", "password": "wrong", "csrf": token,
                                            "next": "/"})
        assert status == 401 and "wrong user name or password" in html
        status, headers, _ = b.post("/login", {"username": "ops", "password": "right horse", "csrf": token,
                                               "next": "/delayed"})
        assert status == 303 and headers["location"] == "/delayed"
        status, _, html = b.get("/delayed")
        assert status == 200 and "ops" in html and "Log out" in html
        status, headers, _ = b.post("/logout", {"csrf": Browser.csrf(html)})
        assert status == 303
        assert b.get("/")[0] == 303  # logged out
        # guessing is cut short
        attacker = Browser(c.url)
        tok = Browser.csrf(attacker.get("/login")[2])
        codes = [attacker.post("/login", {"username": "ops", "password": f"guess{i}", "csrf": tok})[0]
                 for i in range(MAX_FAILURES + 1)]
        assert codes[:MAX_FAILURES] == [401] * MAX_FAILURES and codes[-1] == 429
    finally:
        web_loop.run(c.server.stop())
