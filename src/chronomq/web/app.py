"""The web console: a Starlette application that reads and changes the cluster only through
``chronomq.client``'s Admin, like any other client.

Rules: every page is server-rendered (Jinja2, autoescaped) with no script; every state-changing action
(cancel, reschedule, re-send, logout) is a POST that carries the session's CSRF token and is reached
through a confirmation page; with accounts configured every page needs a login; a failure of the
cluster or of the input is a page that says what went wrong, never a traceback.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote

from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from chronomq import message as m
from chronomq.client import (
    Admin,
    BrokerError,
    ClientError,
    ConnectFailed,
    NoRouteError,
    NotPermitted,
    TopicNotFound,
)

from . import charts
from .auth import Accounts, Session, Sessions
from .views import ClusterView, TpsSampler

log = logging.getLogger("chronomq.web")

HERE = Path(__file__).parent
COOKIE = "chronomq_session"
MAX_FORM_BYTES = 64 * 1024
REFUSED_INPUT = {"MESSAGE_ILLEGAL", "MSG_ILLEGAL", "ILLEGAL_DELIVERY_TIME"}
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


class BadInput(ValueError):
    """A request the console refuses (400), with the reason shown to the user."""


def ms_text(ms: int | None) -> str:
    if ms is None or ms <= 0:
        return "-"
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"


def parse_time(text: str, name: str) -> int | None:
    """A form's UTC date-time (``YYYY-MM-DDTHH:MM[:SS[.fff]]``, as a datetime-local input sends it, or
    epoch milliseconds) as epoch ms; empty gives None."""
    text = (text or "").strip()
    if not text:
        return None
    if text.isdigit():
        return int(text)
    try:
        dt = datetime.fromisoformat(text.replace(" ", "T").removesuffix("Z").removesuffix(" UTC"))
    except ValueError:
        raise BadInput(f"{name}: {text!r} is not a date-time (YYYY-MM-DDTHH:MM[:SS], UTC) "
                       "or epoch ms") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return int(dt.timestamp() * 1000)


def _body_text(body: bytes) -> tuple[str, bool]:
    """The body for display: (text, is_text); a binary body as a hex dump of its first 4 KiB."""
    try:
        return body.decode("utf-8"), True
    except UnicodeDecodeError:
        head = body[:4096]
        return " ".join(f"{b:02x}" for b in head) + (" ..." if len(body) > len(head) else ""), False


def _status_of(e: ClientError) -> int:
    """404 for what does not exist (no route, no such topic, message or group), 403 for what the cluster
    does not permit, 400 for input it refused (a deliver time beyond the maximum delay, ...), else 502."""
    if isinstance(e, NoRouteError | TopicNotFound):
        return 404
    if isinstance(e, NotPermitted):
        return 403
    if isinstance(e, BrokerError) and e.code_name in REFUSED_INPUT:
        return 400
    text = str(e).lower()
    return 404 if "not found" in text or "no message" in text or text.startswith("no ") else 502


def _safe_next(target: str | None) -> str:
    return target if target and target.startswith("/") and not target.startswith("//") else "/"


class Console:
    """The pages. ``require_login``: every page needs a logged-in account from ``accounts``."""

    def __init__(self, admin: Admin, *, accounts: Accounts | None, require_login: bool,
                 now_ms: Callable[[], int], secure_cookies: bool = False, broker_tls: bool = False) -> None:
        if require_login and accounts is None:
            raise ValueError("a console that requires a login needs accounts")
        self.admin = admin
        self.accounts = accounts
        self.require_login = require_login
        self.secure_cookies = secure_cookies  # served over HTTPS: the cookie never goes over plain HTTP
        self.broker_tls = broker_tls
        self.now_ms = now_ms
        self.sessions = Sessions(now_ms)
        self.view = ClusterView(admin, TpsSampler(now_ms))
        self.env = Environment(loader=FileSystemLoader(HERE / "templates"),
                               autoescape=select_autoescape(default=True, default_for_string=True))
        self.env.filters["ts"] = ms_text
        self.env.filters["num"] = lambda v: f"{v:,}" if isinstance(v, int) else v
        self.env.filters["q"] = lambda v: quote(str(v), safe="")

    # --- plumbing -----------------------------------------------------------------------------------------
    def _session(self, request: Request) -> tuple[Session, bool]:
        s = self.sessions.get(request.cookies.get(COOKIE))
        if s is not None:
            return s, False
        return self.sessions.create(), True

    def _render(self, request: Request, session: Session, new: bool, template: str, status: int = 200,
                **ctx: Any) -> Response:
        html = self.env.get_template(template).render(
            request_path=request.url.path, user=session.user, csrf=session.csrf,
            login_enabled=self.accounts is not None, now=ms_text(self.now_ms()), **ctx)
        resp = HTMLResponse(html, status_code=status)
        return self._finish(resp, session, new)

    def _finish(self, resp: Response, session: Session, new: bool) -> Response:
        for k, v in SECURITY_HEADERS.items():
            resp.headers[k] = v
        if new:
            resp.set_cookie(COOKIE, session.id, httponly=True, samesite="strict", path="/",
                            secure=self.secure_cookies)
        return resp

    async def _form(self, request: Request) -> dict[str, str]:
        body = await request.body()
        if len(body) > MAX_FORM_BYTES:
            raise BadInput("the form is too large")
        try:
            fields = parse_qs(body.decode("utf-8"), keep_blank_values=True, max_num_fields=50)
        except (UnicodeDecodeError, ValueError) as e:
            raise BadInput(f"the form cannot be read: {e}") from None
        return {k: v[-1] for k, v in fields.items()}

    def page(self, template: str, handler: Callable[[Request, Session], Awaitable[dict[str, Any] | Response]],
             *, post: bool = False) -> Callable[[Request], Awaitable[Response]]:
        """An endpoint: session and login check, CSRF check for a POST, the handler's context rendered
        into ``template``, and errors turned into an error page. A handler may return a Response."""

        async def endpoint(request: Request) -> Response:
            session, new = self._session(request)
            if self.require_login and session.user is None:
                if post:
                    return self._error(request, session, new, 403, "log in first")
                target = quote(request.url.path + (f"?{request.url.query}" if request.url.query else ""))
                return self._finish(RedirectResponse(f"/login?next={target}", 303), session, new)
            try:
                if post:
                    form = await self._form(request)
                    if not Sessions.csrf_ok(session, form.get("csrf")):
                        return self._error(request, session, new, 403,
                                           "the form's security token is missing or stale: reload the page "
                                           "and try again")
                    request.state.form = form
                ctx = await handler(request, session)
            except ValueError as e:  # BadInput, or an argument the client refused
                return self._error(request, session, new, 400, str(e))
            except ClientError as e:  # the cluster's refusal, said plainly
                return self._error(request, session, new, _status_of(e), self._reason(e))
            except OSError as e:
                return self._error(request, session, new, 502, f"the cluster cannot be reached: {e}")
            except Exception as e:  # a bug of the console: logged in full, a plain page for the user
                log.exception("console: %s %s failed", request.method, request.url.path)
                return self._error(request, session, new, 500, f"the console failed ({type(e).__name__}); "
                                   "the details are in its log")
            if isinstance(ctx, Response):
                return self._finish(ctx, session, new)
            return self._render(request, session, new, template, **ctx)

        return endpoint

    def _reason(self, e: ClientError) -> str:
        text = str(e)
        if isinstance(e, ConnectFailed) and not self.broker_tls:
            text += (" (a name server or broker whose tlsServerMode is enforcing closes plaintext "
                     "connections: start the console with --broker-tls)")
        return text

    def _error(self, request: Request, session: Session, new: bool, status: int, text: str) -> Response:
        return self._render(request, session, new, "error.html", status=status, message=text,
                            status_code=status)

    # --- login --------------------------------------------------------------------------------------------
    async def login_page(self, request: Request) -> Response:
        session, new = self._session(request)
        target = _safe_next(request.query_params.get("next"))
        return self._render(request, session, new, "login.html", next=target, failed=False)

    async def login(self, request: Request) -> Response:
        session, new = self._session(request)
        if self.accounts is None:
            return self._finish(RedirectResponse("/", 303), session, new)
        try:
            form = await self._form(request)
        except BadInput as e:
            return self._error(request, session, new, 400, str(e))
        if not Sessions.csrf_ok(session, form.get("csrf")):
            return self._error(request, session, new, 403, "the login form is stale: reload the page")
        addr = request.client.host if request.client else "?"
        target = _safe_next(form.get("next"))
        if self.sessions.locked_out(addr):
            return self._render(request, session, new, "login.html", status=429, next=target, failed=True,
                                message="too many failed logins from this address: wait a few minutes")
        if not self.accounts.check(form.get("username", ""), form.get("password", "")):
            self.sessions.failed(addr)
            log.warning("console: failed login for %r from %s", form.get("username", ""), addr)
            return self._render(request, session, new, "login.html", status=401, next=target, failed=True,
                                message="wrong user name or password")
        self.sessions.succeeded(addr)
        self.sessions.drop(session.id)  # a new id on login: a planted cookie never becomes a login
        fresh = self.sessions.create(form.get("username", ""))
        return self._finish(RedirectResponse(target, 303), fresh, True)

    async def _logout(self, request: Request, session: Session) -> Response:
        self.sessions.drop(session.id)
        resp = RedirectResponse("/login" if self.accounts is not None else "/", 303)
        resp.delete_cookie(COOKIE, path="/")
        return resp

    # --- pages --------------------------------------------------------------------------------------------
    async def _cluster(self, request: Request, session: Session) -> dict[str, Any]:
        return {"brokers": await self.view.brokers()}

    async def _topics(self, request: Request, session: Session) -> dict[str, Any]:
        show_system = request.query_params.get("system") == "1"
        rows = await self.view.topics(show_system)
        chart = charts.bars([(r["topic"], r["messages"]) for r in rows[:25]],
                            title="messages stored per topic")
        return {"rows": rows, "show_system": show_system, "chart": chart}

    async def _topic(self, request: Request, session: Session) -> dict[str, Any]:
        topic = request.path_params["topic"]
        detail = await self.view.topic(topic)
        chart = charts.bars([(f"queue {q['queue_id']}", q["max"] - q["min"]) for q in detail["queues"]],
                            title="messages per queue")
        recent = await self.admin.browse(topic, limit=20)
        return {"topic": topic, "detail": detail, "chart": chart, "recent": recent}

    async def _groups(self, request: Request, session: Session) -> dict[str, Any]:
        rows = await self.view.groups()
        chart = charts.bars([(r["group"], r["lag"]) for r in rows[:25]],
                            title="messages not yet consumed (lag)")
        return {"rows": rows, "chart": chart}

    async def _group(self, request: Request, session: Session) -> dict[str, Any]:
        group = request.path_params["group"]
        detail = await self.view.group(group)
        chart = charts.bars([(f"{p['topic']} #{p['queue_id']}", p["lag"]) for p in detail["queues"]],
                            title="lag per queue")
        return {"group": group, "detail": detail, "chart": chart}

    async def _messages(self, request: Request, session: Session) -> dict[str, Any] | Response:
        q = request.query_params
        topic, key, msg_id = q.get("topic", "").strip(), q.get("key", "").strip(), q.get("id", "").strip()
        begin, end = parse_time(q.get("begin", ""), "from"), parse_time(q.get("end", ""), "to")
        results = None
        searched = bool(topic or key or msg_id or begin or end)
        if msg_id:
            msg = await self.admin.get_message(msg_id, topic or None)
            return RedirectResponse(f"/messages/view?id={quote(msg.offset_msg_id)}", 303)
        if searched:
            if not topic:
                raise BadInput("name the topic to search (or give a message id)")
            if key:
                results = await self.admin.query_messages(topic, key, 64, begin or 0, end)
            else:
                results = await self.admin.browse(topic, begin_ms=begin, end_ms=end, limit=100)
        return {"form": {"topic": topic, "key": key, "id": msg_id, "begin": q.get("begin", ""),
                         "end": q.get("end", "")}, "results": results}

    async def _message(self, request: Request, session: Session) -> dict[str, Any]:
        msg_id = request.query_params.get("id", "").strip()
        if not msg_id:
            raise BadInput("which message? (?id=<offset message id>)")
        msg = await self.admin.get_message(msg_id)
        text, is_text = _body_text(msg.body)
        trace, trace_error = [], None
        try:  # the message is shown whatever becomes of its trace
            trace = await self.admin.message_trace(msg.id)
        except (ClientError, OSError) as e:
            trace_error = str(e)
        return {"msg": msg, "body": text, "is_text": is_text, "trace": trace, "trace_error": trace_error,
                "dead_letter": msg.raw_topic.startswith(m.DLQ_GROUP_TOPIC_PREFIX)}

    async def _delayed(self, request: Request, session: Session) -> dict[str, Any]:
        q = request.query_params
        topic, key = q.get("topic", "").strip(), q.get("key", "").strip()
        stats = await self.view.delay()
        pending, next_cursor = None, None
        if topic or key or q.get("browse"):
            page = await self.admin.pending(topic=topic or None, key=key or None, limit=100,
                                            cursor=q.get("cursor") or None)
            pending, next_cursor = page.items, page.next_cursor
        lateness = charts.histogram(stats["lateness_buckets"], stats["lateness_count"],
                                    title="timer lateness: due time to store put")
        levels_chart = charts.bars([(f"level {lv['level']} ({lv['delay']})", lv["pending"])
                                    for lv in stats["levels"] if lv["pending"]],
                                   title="pending per delay level")
        topics_chart = charts.bars(sorted(stats["timer_by_topic"].items(), key=lambda kv: -kv[1])[:25],
                                   title="pending in the timer per topic")
        return {"stats": stats, "pending": pending, "next_cursor": next_cursor,
                "form": {"topic": topic, "key": key},
                "lateness_chart": lateness, "levels_chart": levels_chart, "topics_chart": topics_chart}

    async def _delayed_confirm(self, request: Request, session: Session) -> dict[str, Any]:
        q = request.query_params
        action, msg_id = q.get("action", ""), q.get("id", "").strip()
        if action not in ("cancel", "reschedule") or not msg_id:
            raise BadInput("confirm what? (?action=cancel|reschedule&id=<message id>)")
        return {"action": action, "id": msg_id, "topic": q.get("topic", ""), "due": q.get("due", "")}

    async def _delayed_cancel(self, request: Request, session: Session) -> dict[str, Any]:
        form = request.state.form
        msg_id = form.get("id", "").strip()
        if not msg_id:
            raise BadInput("which message? (id)")
        results = await self.admin.cancel(msg_id, by_key=form.get("by_key") == "1")
        log.info("console: %s cancelled %s: %s", session.user or "local user", msg_id,
                 ", ".join(str(r.outcome) for r in results))
        return {"action": "cancel", "id": msg_id, "results": results}

    async def _delayed_reschedule(self, request: Request, session: Session) -> dict[str, Any]:
        form = request.state.form
        msg_id = form.get("id", "").strip()
        when = parse_time(form.get("deliver_at", ""), "new deliver time")
        if not msg_id or when is None:
            raise BadInput("give the message id and the new deliver time")
        results = await self.admin.reschedule(msg_id, when, by_key=form.get("by_key") == "1")
        log.info("console: %s rescheduled %s to %s: %s", session.user or "local user", msg_id, ms_text(when),
                 ", ".join(str(r.outcome) for r in results))
        return {"action": "reschedule", "id": msg_id, "results": results}

    async def _dlq(self, request: Request, session: Session) -> dict[str, Any]:
        rows = await self.view.dead_letters()
        chart = charts.bars([(r["group"], r["messages"]) for r in rows[:25]], title="dead letters per group")
        return {"rows": rows, "chart": chart}

    async def _dlq_group(self, request: Request, session: Session) -> dict[str, Any]:
        group = request.path_params["group"]
        msgs = await self.admin.browse(m.DLQ_GROUP_TOPIC_PREFIX + group, limit=100)
        return {"group": group, "messages": msgs}

    async def _dlq_confirm(self, request: Request, session: Session) -> dict[str, Any]:
        msg_id = request.query_params.get("id", "").strip()
        if not msg_id:
            raise BadInput("which dead letter? (?id=<offset message id>)")
        msg = await self.admin.get_message(msg_id)
        props = msg.properties
        target = props.get(m.PROPERTY_RETRY_TOPIC) or props.get(m.PROPERTY_DLQ_ORIGIN_TOPIC) or "?"
        return {"msg": msg, "target": target}

    async def _dlq_resend(self, request: Request, session: Session) -> dict[str, Any]:
        msg_id = request.state.form.get("id", "").strip()
        if not msg_id:
            raise BadInput("which dead letter? (id)")
        new_id = await self.admin.resend_dead_letter(msg_id)
        log.info("console: %s re-sent dead letter %s as %s", session.user or "local user", msg_id, new_id)
        return {"id": msg_id, "new_id": new_id}

    def routes(self) -> list[Any]:
        p = self.page
        return [
            Route("/", p("cluster.html", self._cluster)),
            Route("/topics", p("topics.html", self._topics)),
            Route("/topics/{topic:path}", p("topic.html", self._topic)),
            Route("/groups", p("groups.html", self._groups)),
            Route("/groups/{group:path}", p("group.html", self._group)),
            Route("/messages", p("messages.html", self._messages)),
            Route("/messages/view", p("message.html", self._message)),
            Route("/delayed", p("delayed.html", self._delayed)),
            Route("/delayed/confirm", p("delayed_confirm.html", self._delayed_confirm)),
            Route("/delayed/cancel", p("delayed_done.html", self._delayed_cancel, post=True),
                  methods=["POST"]),
            Route("/delayed/reschedule", p("delayed_done.html", self._delayed_reschedule, post=True),
                  methods=["POST"]),
            Route("/dlq", p("dlq.html", self._dlq)),
            Route("/dlq/confirm", p("dlq_confirm.html", self._dlq_confirm)),
            Route("/dlq/resend", p("dlq_done.html", self._dlq_resend, post=True), methods=["POST"]),
            Route("/dlq/{group:path}", p("dlq_group.html", self._dlq_group)),
            Route("/login", self.login_page, methods=["GET"]),
            Route("/login", self.login, methods=["POST"]),
            Route("/logout", p("error.html", self._logout, post=True), methods=["POST"]),
            Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
        ]


def create_app(admin: Admin, *, accounts: Accounts | None = None, require_login: bool = False,
               now_ms: Callable[[], int] | None = None, own_admin: bool = True, secure_cookies: bool = False,
               broker_tls: bool = False) -> Starlette:
    """The console as an ASGI app, on ``admin``'s clock unless ``now_ms`` is given. With ``own_admin`` the
    app starts ``admin`` and closes it on shutdown; otherwise the caller does both. ``secure_cookies``:
    served over HTTPS (the session cookie is marked Secure); ``broker_tls``: ``admin`` connects over TLS
    (else a refused connection's page says how to turn it on)."""
    console = Console(admin, accounts=accounts, require_login=require_login,
                      now_ms=now_ms or admin.clock.now_ms, secure_cookies=secure_cookies,
                      broker_tls=broker_tls)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if own_admin:
            await admin.start()
        try:
            yield
        finally:
            if own_admin:
                await admin.close()

    app = Starlette(routes=console.routes(), lifespan=lifespan)
    app.state.console = console
    return app
