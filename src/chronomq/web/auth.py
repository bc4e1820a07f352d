"""The console's accounts, sessions and CSRF tokens.

Rules: a password is kept only as a scrypt hash (``scrypt$<n>$<r>$<p>$<salt b64>$<hash b64>``); a
session is a random id in an HttpOnly, SameSite=Strict cookie, mapped here in memory to its user and
its CSRF token; every state-changing request must carry that token; secrets are compared in constant
time; repeated failed logins from one address are refused for a while.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

SCHEME = "scrypt"
DEFAULT_N, DEFAULT_R, DEFAULT_P = 2**14, 8, 1
SESSION_TTL_MS = 8 * 3600 * 1000
MAX_SESSIONS = 10_000
MAX_FAILURES = 10  # failed logins from one address within FAILURE_WINDOW_MS before it is refused
FAILURE_WINDOW_MS = 5 * 60 * 1000


class UsersFileError(ValueError):
    """The users file cannot be used (missing, unreadable, or an entry without a valid hash)."""


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def hash_password(password: str, *, salt: bytes | None = None, n: int = DEFAULT_N, r: int = DEFAULT_R,
                  p: int = DEFAULT_P) -> str:
    """The stored form of ``password``."""
    if not password:
        raise ValueError("the password is empty")
    salt = salt if salt is not None else secrets.token_bytes(16)
    digest = hashlib.scrypt(password.encode(), salt=salt, n=n, r=r, p=p, maxmem=128 * n * r * 2, dklen=32)
    return f"{SCHEME}${n}${r}${p}${_b64(salt)}${_b64(digest)}"


def _parse_hash(encoded: str) -> tuple[int, int, int, bytes, bytes]:
    parts = encoded.split("$")
    if len(parts) != 6 or parts[0] != SCHEME:
        raise ValueError(f"not a {SCHEME} password hash (make one with `chronomq dashboard --hash-password`)")
    try:
        n, r, p = int(parts[1]), int(parts[2]), int(parts[3])
        salt, digest = base64.b64decode(parts[4], validate=True), base64.b64decode(parts[5], validate=True)
    except ValueError as e:
        raise ValueError(f"malformed {SCHEME} password hash: {e}") from None
    if n < 2 or n & (n - 1) or not 1 <= r <= 64 or not 1 <= p <= 16 or n > 2**20 or not salt or not digest:
        raise ValueError(f"{SCHEME} password hash parameters out of range")
    return n, r, p, salt, digest


def verify_password(password: str, encoded: str) -> bool:
    n, r, p, salt, digest = _parse_hash(encoded)
    got = hashlib.scrypt(password.encode(), salt=salt, n=n, r=r, p=p, maxmem=128 * n * r * 2,
                         dklen=len(digest))
    return hmac.compare_digest(got, digest)


def load_users(path: str | Path) -> dict[str, str]:
    """``users:`` a list of ``{name: ..., password_hash: ...}`` (YAML). Returns name -> hash; raises
    UsersFileError for anything it cannot use, so a typo never leaves the console open."""
    try:
        data: Any = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise UsersFileError(f"{path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise UsersFileError(f"{path}: not valid YAML: {e}") from None
    entries = data.get("users") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise UsersFileError(f"{path}: expected a non-empty list under 'users:'")
    users: dict[str, str] = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"].strip():
            raise UsersFileError(f"{path}: users[{i}] needs a 'name'")
        h = entry.get("password_hash")
        if not isinstance(h, str):
            raise UsersFileError(f"{path}: user {entry['name']!r} needs a 'password_hash' "
                                 "(never a clear password)")
        try:
            _parse_hash(h)
        except ValueError as err:
            raise UsersFileError(f"{path}: user {entry['name']!r}: {err}") from None
        users[entry["name"].strip()] = h
    return users


@dataclass
class Session:
    id: str
    csrf: str
    user: str | None
    expires_ms: int


class Sessions:
    """Sessions in memory (a console restart logs everyone out). ``now_ms`` is the clock."""

    def __init__(self, now_ms: Callable[[], int], ttl_ms: int = SESSION_TTL_MS) -> None:
        self.now_ms = now_ms
        self.ttl_ms = ttl_ms
        self._by_id: dict[str, Session] = {}
        self._failures: dict[str, list[int]] = {}

    def create(self, user: str | None = None) -> Session:
        now = self.now_ms()
        if len(self._by_id) >= MAX_SESSIONS:
            self._by_id = {k: s for k, s in self._by_id.items() if s.expires_ms > now}
            while len(self._by_id) >= MAX_SESSIONS:  # still full: the oldest go
                del self._by_id[min(self._by_id, key=lambda k: self._by_id[k].expires_ms)]
        s = Session(secrets.token_urlsafe(32), secrets.token_urlsafe(32), user, now + self.ttl_ms)
        self._by_id[s.id] = s
        return s

    def get(self, sid: str | None) -> Session | None:
        s = self._by_id.get(sid) if sid else None
        if s is None:
            return None
        if s.expires_ms <= self.now_ms():
            del self._by_id[s.id]
            return None
        return s

    def drop(self, sid: str | None) -> None:
        if sid:
            self._by_id.pop(sid, None)

    @staticmethod
    def csrf_ok(session: Session | None, token: str | None) -> bool:
        return session is not None and bool(token) and hmac.compare_digest(session.csrf, str(token))

    # --- failed logins ----------------------------------------------------------------------------------
    def locked_out(self, addr: str) -> bool:
        now = self.now_ms()
        recent = [t for t in self._failures.get(addr, []) if now - t < FAILURE_WINDOW_MS]
        if recent:
            self._failures[addr] = recent
        else:
            self._failures.pop(addr, None)
        return len(recent) >= MAX_FAILURES

    def failed(self, addr: str) -> None:
        if len(self._failures) > MAX_SESSIONS:
            self._failures.clear()
        self._failures.setdefault(addr, []).append(self.now_ms())

    def succeeded(self, addr: str) -> None:
        self._failures.pop(addr, None)


class Accounts:
    """Who may log in: name -> scrypt hash (from load_users)."""

    def __init__(self, users: dict[str, str]) -> None:
        self.users = users
        self._dummy = hash_password(secrets.token_urlsafe(8))  # unknown names cost the same time

    def check(self, name: str, password: str) -> bool:
        h = self.users.get(name)
        ok = verify_password(password, h if h is not None else self._dummy)
        return ok and h is not None
