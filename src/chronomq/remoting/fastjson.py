"""JSON bodies as Apache RocketMQ's Java servers write them (fastjson), sans-IO.

RocketMQ serializes its remoting bodies with fastjson, which writes a map's non-string keys bare:
``{"brokerAddrs":{0:"127.0.0.1:10911"}}`` for a ``Map<Long, String>``, and a map keyed by an object as
the object itself: ``{"offsetTable":{{"brokerName":"b","queueId":0,"topic":"T"}:{"brokerOffset":5}}}``.
Neither is standard JSON. ``loads`` reads standard JSON at ``json.loads``'s speed and falls back, only
when that fails, to a small parser that also takes those keys: a bare number key becomes its text
(``"0"``, as a standard writer would quote it), an object or array key becomes its canonical JSON text
(sorted keys, no spaces), so it stays hashable and can be read back with ``json.loads``. Anything else
that is not JSON raises ``ValueError`` with the position, like ``json.loads``.
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["canonical_key", "loads"]

_WS = re.compile(r"[ \t\n\r]*")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(\.\d+)?([eE][-+]?\d+)?")
_BARE = re.compile(r"[A-Za-z_$][A-Za-z0-9_$]*")
_LITERALS = {"true": True, "false": False, "null": None}
_decode_at = json.JSONDecoder().raw_decode  # (text, index) -> (value, index after it), as json.loads reads


def _string_at(text: str, pos: int) -> tuple[str, int]:
    """The JSON string whose opening quote is at ``pos``, and the index after its closing quote."""
    s, end = _decode_at(text, pos)
    return s, end


def canonical_key(value: Any) -> str:
    """The text a structured key is kept under: canonical JSON (sorted keys, no spaces)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def loads(data: bytes | str) -> Any:
    """Parse a JSON body, also as fastjson writes it (bare number keys, object keys)."""
    text = data.decode("utf-8") if isinstance(data, bytes | bytearray | memoryview) else data
    try:
        return json.loads(text)
    except ValueError:
        pass
    parser = _Lenient(text)
    value = parser.value()
    parser.skip()
    if parser.pos != len(text):
        raise parser.error("extra data")
    return value


class _Lenient:
    """Recursive descent over ``text``; depth is bounded by Python's recursion limit (RecursionError
    is turned into ValueError, so a hostile body cannot take the caller down another way)."""

    __slots__ = ("pos", "text")

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def error(self, what: str) -> ValueError:
        return ValueError(f"{what} at char {self.pos}")

    def skip(self) -> None:
        m = _WS.match(self.text, self.pos)
        assert m is not None  # a run of zero or more: it matches the empty string too
        self.pos = m.end()

    def value(self) -> Any:
        try:
            return self._value()
        except RecursionError:
            raise self.error("nesting too deep") from None

    def _value(self) -> Any:
        self.skip()
        text, pos = self.text, self.pos
        if pos >= len(text):
            raise self.error("expected a value, found the end")
        c = text[pos]
        if c == "{":
            return self._object()
        if c == "[":
            return self._array()
        if c == '"':
            s, self.pos = _string_at(text, pos)
            return s
        m = _NUMBER.match(text, pos)
        if m:
            self.pos = m.end()
            return float(m.group()) if m.group(1) or m.group(2) else int(m.group())
        m = _BARE.match(text, pos)
        if m and m.group() in _LITERALS:
            self.pos = m.end()
            return _LITERALS[m.group()]
        raise self.error("expected a value")

    def _key(self) -> str:
        self.skip()
        text, pos = self.text, self.pos
        if pos < len(text) and text[pos] == '"':
            s, self.pos = _string_at(text, pos)
            return s
        if pos < len(text) and text[pos] in "{[":
            return canonical_key(self._value())
        m = _NUMBER.match(text, pos) or _BARE.match(text, pos)
        if not m:
            raise self.error("expected a key")
        self.pos = m.end()
        return m.group()

    def _expect(self, char: str) -> None:
        self.skip()
        if self.pos >= len(self.text) or self.text[self.pos] != char:
            raise self.error(f"expected {char!r}")
        self.pos += 1

    def _peek(self, char: str) -> bool:
        self.skip()
        if self.pos < len(self.text) and self.text[self.pos] == char:
            self.pos += 1
            return True
        return False

    def _object(self) -> dict[str, Any]:
        self.pos += 1
        out: dict[str, Any] = {}
        if self._peek("}"):
            return out
        while True:
            key = self._key()
            self._expect(":")
            out[key] = self._value()
            if self._peek("}"):
                return out
            self._expect(",")

    def _array(self) -> list[Any]:
        self.pos += 1
        out: list[Any] = []
        if self._peek("]"):
            return out
        while True:
            out.append(self._value())
            if self._peek("]"):
                return out
            self._expect(",")
