"""RocketMQ ACL 1.0 request signatures (sans-IO): HMAC-SHA1, keyed with the secret key, over the values of
every ext field except ``Signature`` (and the query flag ``_UNIQUE_KEY_QUERY``), concatenated in ascending
order of their names, followed by the body; Base64. The keys themselves are not signed. A client adds
``AccessKey`` (and the C++ client ``OnsChannel``) before signing, then ``Signature``. chronomq's client
also signs ``Timestamp`` (epoch ms) and a random ``Nonce``, with which a broker refuses a replayed request
(RocketMQ's ACL 1.0 has no such fields: a request without them is checked as RocketMQ checks it)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Mapping
from typing import Any

from .codec import RemotingCommand, _ext_value

ACCESS_KEY = "AccessKey"
SIGNATURE = "Signature"
SECURITY_TOKEN = "SecurityToken"
TIMESTAMP = "Timestamp"
NONCE = "Nonce"
UNSIGNED = frozenset({SIGNATURE, "_UNIQUE_KEY_QUERY"})


def content(ext_fields: Mapping[str, Any], body: bytes | None) -> bytes:
    """The signed bytes of a request."""
    text = "".join(_ext_value(ext_fields[k]) for k in sorted(ext_fields)
                   if k not in UNSIGNED and ext_fields[k] is not None)
    return text.encode("utf-8") + (body or b"")


def signature(ext_fields: Mapping[str, Any], body: bytes | None, secret_key: str) -> str:
    mac = hmac.new(secret_key.encode("utf-8"), content(ext_fields, body), hashlib.sha1)
    return base64.b64encode(mac.digest()).decode("ascii")


def sign(cmd: RemotingCommand, access_key: str, secret_key: str, now_ms: int | None = None
         ) -> RemotingCommand:
    """Add AccessKey and Signature to a request about to be sent (its ext fields final); with ``now_ms``
    also Timestamp and a fresh Nonce, so that every sending of it is signed differently."""
    if now_ms is not None:
        cmd.ext_fields[TIMESTAMP] = str(now_ms)
        cmd.ext_fields[NONCE] = secrets.token_hex(8)
    cmd.ext_fields[ACCESS_KEY] = access_key
    cmd.ext_fields.pop(SIGNATURE, None)
    cmd.ext_fields[SIGNATURE] = signature(cmd.ext_fields, cmd.body, secret_key)
    return cmd
