"""RocketMQ's SQL92 message selector: its grammar, its compile-time type checks, its evaluation.

The parser follows RocketMQ 5.x's ``SelectorParser.jj`` (the grammar is in docs/filter.md); evaluation
follows its ``ComparisonExpression``, ``LogicExpression`` and ``UnaryExpression`` value for value:
properties are strings or missing (null), logic is three-valued and only TRUE matches, a string compared
with a number converts to that number's Java type, and a conversion that fails raises FilterEvalError
(the broker counts it as no match). On purpose unlike RocketMQ, text after a complete expression and
nesting deeper than ``MAX_DEPTH`` are refused. ``compile_sql92`` compiles each text once (cached).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

log = logging.getLogger(__name__)

__all__ = ["MAX_DEPTH", "FilterEvalError", "FilterSyntaxError", "Selector", "compile_sql92", "java_compare"]

Props = Mapping[str, str]
Value = None | bool | int | float | str
Eval = Callable[[Props], Value]

MAX_DEPTH: Final = 64  # nested parentheses / unary operators, and the expression tree's depth / 4
_CACHE_SIZE: Final = 1024


class FilterSyntaxError(ValueError):
    """An expression RocketMQ's parser (or its compile-time type checks) refuses, with where."""

    def __init__(self, reason: str, text: str, offset: int, expected: Sequence[str] = ()) -> None:
        self.reason = reason
        self.text = text
        self.offset = offset
        self.line, self.column = _line_column(text, offset)
        self.expected = tuple(expected)
        msg = f"Invalid MessageSelector. {reason} at line {self.line}, column {self.column}"
        if self.expected:
            msg += ". Was expecting " + (self.expected[0] if len(self.expected) == 1
                                          else "one of: " + ", ".join(self.expected))
        super().__init__(msg)


class FilterEvalError(ValueError):
    """An evaluation that fails as RocketMQ's does (a string that does not parse as the number it is
    compared with, a boolean compared with a string): the broker counts the message as not matching."""


def _line_column(text: str, offset: int) -> tuple[int, int]:
    before = text[:offset].replace("\r\n", "\n").replace("\r", "\n")
    line = before.count("\n") + 1
    return line, len(before) - (before.rfind("\n") + 1) + 1


# --- Java values ---------------------------------------------------------------------------------------
# None (null), bool (Boolean), int (Integer), _Long (Long), float (Double), str (String).

class _Long(int):
    """A Java long (a literal past 32 bits): a string compared with it converts by Long.valueOf."""

    __slots__ = ()


_INT_MIN, _INT_MAX = -(1 << 31), (1 << 31) - 1
_LONG_MIN, _LONG_MAX = -(1 << 63), (1 << 63) - 1
_JAVA_DOUBLE_RE = re.compile(r"[+-]?(?:NaN|Infinity|(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?[fFdD]?)")
_JAVA_HEX_DOUBLE_RE = re.compile(
    r"([+-]?0[xX](?:[0-9a-fA-F]+\.?[0-9a-fA-F]*|\.[0-9a-fA-F]+)[pP][+-]?[0-9]+)[fFdD]?")
_JAVA_TRIM = "".join(chr(c) for c in range(0x21))  # String.trim(): every char <= U+0020


def _java_int(s: str, lo: int, hi: int) -> int:
    """Integer.valueOf / Long.valueOf: an optional sign and decimal digits, in range, nothing else
    (str.isdecimal is Java's Character.digit for radix 10: Unicode Nd digits, as int() reads them)."""
    digits = s[1:] if s[:1] in ("+", "-") else s
    if digits.isdecimal():
        v = int(s)
        if lo <= v <= hi:
            return v
    raise FilterEvalError(f'For input string: "{s}"')


def _java_double(s: str) -> float:
    """Double.valueOf: trimmed; NaN, Infinity, decimal with optional exponent and f/d suffix, or hex."""
    t = s.strip(_JAVA_TRIM)
    if _JAVA_DOUBLE_RE.fullmatch(t):
        body = t.rstrip("fFdD")
        if body.endswith("NaN"):
            return math.nan
        if body.endswith("Infinity"):
            return -math.inf if body[0] == "-" else math.inf
        return float(body)
    m = _JAVA_HEX_DOUBLE_RE.fullmatch(t)
    if m:
        try:
            return float.fromhex(m.group(1))
        except OverflowError:
            return -math.inf if t[0] == "-" else math.inf
    raise FilterEvalError(f'For input string: "{s}"')


def _double_compare(a: float, b: float) -> int:
    """Double.compare: NaN is above everything and equal to itself, -0.0 is below 0.0."""
    if a < b:
        return -1
    if a > b:
        return 1
    if a == b:
        if a == 0.0:
            sa, sb = math.copysign(1.0, a), math.copysign(1.0, b)
            return (sa > sb) - (sa < sb)
        return 0
    return (a != a) - (b != b)


def _string_compare(a: str, b: str) -> int:
    """String.compareTo (UTF-16 code units)."""
    if a == b:
        return 0
    ea, eb = a.encode("utf-16-be", "surrogatepass"), b.encode("utf-16-be", "surrogatepass")
    return -1 if ea < eb else 1


def java_compare(lv: Value, rv: Value) -> int:
    """ComparisonExpression.__compare with convertStringExpressions on (as SelectorParser.parse sets
    it): values of different types convert up (int -> long -> double; a string to the other side's
    type); pairs it does not convert compare as -1. Raises FilterEvalError where Java throws."""
    if type(lv) is str:
        if type(rv) is str:
            return _string_compare(lv, rv)
        if type(rv) is bool:
            lb = lv.lower() == "true"  # Boolean.valueOf
            return (lb > rv) - (lb < rv)
        if type(rv) is int:
            li = _java_int(lv, _INT_MIN, _INT_MAX)
            return (li > rv) - (li < rv)
        if type(rv) is _Long:
            li = _java_int(lv, _LONG_MIN, _LONG_MAX)
            return (li > rv) - (li < rv)
        if type(rv) is float:
            return _double_compare(_java_double(lv), rv)
        return -1
    if type(lv) is float:
        if type(rv) is float:
            return _double_compare(lv, rv)
        if type(rv) is int or type(rv) is _Long:
            return _double_compare(lv, float(rv))
        if type(rv) is str:
            return _double_compare(lv, _java_double(rv))
        return -1
    if type(lv) is int or type(lv) is _Long:
        if type(rv) is int or type(rv) is _Long:
            return (lv > rv) - (lv < rv)
        if type(rv) is float:
            return _double_compare(float(lv), rv)
        if type(rv) is str:
            ri = _java_int(rv, _INT_MIN, _INT_MAX) if type(lv) is int else _java_int(rv, _LONG_MIN, _LONG_MAX)
            return (lv > ri) - (lv < ri)
        return -1
    if type(lv) is bool:
        if type(rv) is bool:
            return (lv > rv) - (lv < rv)
        if type(rv) is str:  # Java casts the Boolean to String: ClassCastException
            raise FilterEvalError(f"a boolean cannot be compared with the string {rv!r}")
        return -1
    if rv is None:
        raise TypeError("null has no order")  # callers answer unknown before comparing a null
    return -1


def _java_equal(lv: Value, rv: Value) -> bool:
    """equals(), else compareTo() == 0 (both non-null)."""
    t = type(lv)
    if t is type(rv) and t is not float:
        return lv == rv
    return java_compare(lv, rv) == 0


# --- tokens --------------------------------------------------------------------------------------------

_KEYWORDS: Final = frozenset({"NOT", "AND", "OR", "BETWEEN", "IN", "TRUE", "FALSE", "NULL", "IS",
                              "CONTAINS", "STARTSWITH", "ENDSWITH"})
_EOF, _ID, _STRING = "<EOF>", "<ID>", "<STRING_LITERAL>"
_DECIMAL, _FLOAT = "<DECIMAL_LITERAL>", "<FLOATING_POINT_LITERAL>"
_WS: Final = " \t\n\r\f"
_ID_RE = re.compile(r"[A-Za-z_$][A-Za-z0-9_$]*")
_STRING_RE = re.compile(r"'(?:''|[^'])*'")
_DECIMAL_RE = re.compile(r"0|[1-9][0-9]*[lL]?")
_FLOAT_RE = re.compile(r"[0-9]+\.[0-9]*(?:[eE][+-]?[0-9]+)?"  # 5.5  5.  5.5E10
                       r"|\.[0-9]+(?:[eE][+-]?[0-9]+)?"      # .5  .5E10
                       r"|[0-9]+[eE][+-]?[0-9]+")             # 5E10
_BLOCK_COMMENT_RE = re.compile(r"/\*[^*]*\*+(?:[^*/][^*]*\*+)*/")
_LINE_COMMENT_RE = re.compile(r"--[^\n\r]*(?:\r\n|\n|\r)")
_PUNCT2: Final = (">=", "<=", "<>")
_PUNCT1: Final = "=><(),+-"


class _Tok:
    __slots__ = ("image", "kind", "pos")

    def __init__(self, kind: str, image: str, pos: int) -> None:
        self.kind, self.image, self.pos = kind, image, pos

    def shown(self) -> str:
        return "end of expression" if self.kind == _EOF else f'"{self.image}"'


def _tokenize(text: str) -> list[_Tok]:
    """RocketMQ's token manager: longest match, keywords before identifiers at equal length."""
    out: list[_Tok] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in _WS:
            i += 1
            continue
        if c == "-" and text.startswith("--", i):
            m = _LINE_COMMENT_RE.match(text, i)
            if m:  # a line comment needs its line end; without one the dashes are minus signs
                i = m.end()
                continue
        if c == "/":
            m = _BLOCK_COMMENT_RE.match(text, i)
            if not m:
                raise FilterSyntaxError("Lexical error: unterminated comment" if text.startswith("/*", i)
                                        else 'Lexical error: encountered "/"', text, i)
            i = m.end()
            continue
        if c == "'":
            m = _STRING_RE.match(text, i)
            if not m:
                raise FilterSyntaxError("Lexical error: unterminated string literal", text, i)
            out.append(_Tok(_STRING, m.group(), i))
            i = m.end()
            continue
        if c.isascii() and (c.isdigit() or c == "."):
            md, mf = _DECIMAL_RE.match(text, i), _FLOAT_RE.match(text, i)
            ld = md.end() if md else -1
            lf = mf.end() if mf else -1
            if ld < 0 and lf < 0:
                raise FilterSyntaxError(f'Lexical error: encountered "{c}"', text, i)
            kind, end = (_DECIMAL, ld) if ld >= lf else (_FLOAT, lf)
            out.append(_Tok(kind, text[i:end], i))
            i = end
            continue
        m = _ID_RE.match(text, i)
        if m:
            word = m.group()
            upper = word.upper()
            out.append(_Tok(upper if upper in _KEYWORDS else _ID, word, i))
            i = m.end()
            continue
        two = text[i:i + 2]
        if two in _PUNCT2:
            out.append(_Tok(two, two, i))
            i += 2
            continue
        if c in _PUNCT1:
            out.append(_Tok(c, c, i))
            i += 1
            continue
        raise FilterSyntaxError(f"Lexical error: encountered {c!r}", text, i)
    out.append(_Tok(_EOF, "", n))
    return out


# --- the expression tree, compiled to closures -----------------------------------------------------------

_CONST, _BCONST, _PROP, _BOOL, _VALUE = range(5)  # number/string constant, TRUE/FALSE/NULL, property,
#                                                   any other boolean expression, a negation


class _Node:
    __slots__ = ("depth", "end", "ev", "kind", "start", "value")

    def __init__(self, ev: Eval, kind: int, start: int, end: int, depth: int, value: Value = None) -> None:
        self.ev, self.kind, self.start, self.end, self.depth, self.value = ev, kind, start, end, depth, value

    @property
    def is_constant(self) -> bool:
        return self.kind == _CONST or self.kind == _BCONST

    @property
    def is_boolean(self) -> bool:
        return self.kind == _BCONST or self.kind == _BOOL


def _number_constant(n: _Node) -> int | float | None:
    """A constant node's value when it is a number (Integer, Long or Double), else None."""
    v = n.value
    if n.kind == _CONST and not isinstance(v, bool) and isinstance(v, (int, float)):
        return v
    return None


def _const_ev(value: Value) -> Eval:
    return lambda p: value


def _prop_ev(name: str) -> Eval:
    def ev(p: Props) -> Value:
        return p.get(name)
    return ev


def _negate_ev(f: Eval) -> Eval:
    def ev(p: Props) -> Value:
        v = f(p)
        if type(v) is int:
            return v if v == _INT_MIN else -v
        if type(v) is _Long:
            return v if v == _LONG_MIN else _Long(-v)
        if type(v) is float:
            return -v
        return None  # null, or not a number
    return ev


def _not_ev(f: Eval) -> Eval:
    def ev(p: Props) -> Value:
        v = f(p)
        return None if v is None else not v
    return ev


def _boolean_cast_ev(f: Eval) -> Eval:
    def ev(p: Props) -> Value:
        v = f(p)
        if v is None:
            return None
        return v if type(v) is bool else False
    return ev


def _logic_ev(fs: list[Eval], decisive: bool) -> Eval:
    """A left-nested AND (decisive FALSE) or OR (decisive TRUE), flattened: the decisive value wins and
    stops the evaluation, else null if any operand was null, else the other value."""
    def ev(p: Props) -> Value:
        unknown = False
        for f in fs:
            v = f(p)
            if v is None:
                unknown = True
            elif v is decisive:
                return decisive
        return None if unknown else not decisive
    return ev


def _and_ev(fs: list[Eval]) -> Eval:
    return _logic_ev(fs, False)


def _or_ev(fs: list[Eval]) -> Eval:
    return _logic_ev(fs, True)


def _equal_ev(lf: Eval, rf: Eval) -> Eval:
    def ev(p: Props) -> Value:
        lv, rv = lf(p), rf(p)
        if lv is None:
            return None if rv is not None else True
        if rv is None:
            return False
        return _java_equal(lv, rv)
    return ev


def _prop_equals_string_ev(name: str, s: str) -> Eval:
    def ev(p: Props) -> Value:  # the common case, same answer as _equal_ev
        v = p.get(name)
        return None if v is None else v == s
    return ev


def _is_null_ev(f: Eval, negated: bool) -> Eval:
    """IS NULL is RocketMQ's equality with the NULL constant: TRUE when missing, else FALSE."""
    if negated:
        return lambda p: f(p) is not None
    return lambda p: f(p) is None


def _compare_ev(lf: Eval, rf: Eval, pred: Callable[[int], bool]) -> Eval:
    def ev(p: Props) -> Value:
        lv = lf(p)
        if lv is None:
            return None
        rv = rf(p)
        if rv is None:
            return None
        if type(lv) is str and type(rv) is str:  # two strings compare as doubles, or fail
            return pred(_double_compare(_java_double(lv), _java_double(rv)))
        return pred(java_compare(lv, rv))
    return ev


def _prop_number_ev(name: str, number: int | float, pred: Callable[[int], bool], number_left: bool) -> Eval:
    """A property compared with a number literal, the common case, same answer as _compare_ev: the
    property's string converts to the literal's Java type (Integer, Long or Double.valueOf)."""
    t = type(number)
    if t is float:
        def convert(s: str) -> int | float:
            return _java_double(s)
        cmp: Callable[[Any, Any], int] = _double_compare
    else:
        lo, hi = (_INT_MIN, _INT_MAX) if t is int else (_LONG_MIN, _LONG_MAX)

        def convert(s: str) -> int | float:
            return _java_int(s, lo, hi)

        def cmp(a: Any, b: Any) -> int:
            return (a > b) - (a < b)

    def ev(p: Props) -> Value:
        v = p.get(name)
        if v is None:
            return None
        n = convert(v)
        return pred(cmp(number, n) if number_left else cmp(n, number))
    return ev


_PREDICATES: Final[dict[str, Callable[[int], bool]]] = {
    ">": lambda c: c > 0, ">=": lambda c: c >= 0, "<": lambda c: c < 0, "<=": lambda c: c <= 0}


def _equals_zero(c: int) -> bool:
    return c == 0


def _string_op_ev(f: Eval, op: str, search: str, negated: bool) -> Eval:
    if not search:
        return lambda p: False  # RocketMQ: an empty search string never matches, NOT or not
    test: Callable[[str], bool] = ((lambda v: search in v) if op == "CONTAINS" else
                                   (lambda v: v.startswith(search)) if op == "STARTSWITH" else
                                   (lambda v: v.endswith(search)))

    def ev(p: Props) -> Value:
        v = f(p)
        if type(v) is not str:
            return False  # missing or not a string: FALSE, not null, for the NOT forms too
        return test(v) != negated
    return ev


def _in_ev(name: str, members: frozenset[str], negated: bool) -> Eval:
    def ev(p: Props) -> Value:
        v = p.get(name)
        if v is None:
            return None
        return (v in members) != negated
    return ev


# --- the parser ----------------------------------------------------------------------------------------

_PRIMARY_START: Final = (_STRING, _DECIMAL, _FLOAT, "TRUE", "FALSE", "NULL", _ID, "(", "+", "-", "NOT")
_AFTER_OPERAND: Final = ("AND", "OR", "=", "<>", "IS", ">", ">=", "<", "<=", "BETWEEN", "IN", "NOT",
                         "CONTAINS", "STARTSWITH", "ENDSWITH")
_STRING_OPS: Final = ("CONTAINS", "STARTSWITH", "ENDSWITH")


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.toks = _tokenize(text)
        self.i = 0
        self.nesting = 0
        self.names: set[str] = set()  # the properties the expression reads

    # tokens
    def peek(self, k: int = 0) -> _Tok:
        return self.toks[min(self.i + k, len(self.toks) - 1)]

    def take(self) -> _Tok:
        t = self.toks[self.i]
        if t.kind != _EOF:
            self.i += 1
        return t

    def expect(self, kind: str) -> _Tok:
        t = self.peek()
        if t.kind != kind:
            raise self.unexpected(t, (kind,))
        return self.take()

    def unexpected(self, t: _Tok, expected: Sequence[str]) -> FilterSyntaxError:
        return FilterSyntaxError(f"Encountered {t.shown()}", self.text, t.pos, expected)

    def refuse(self, reason: str, at: int) -> FilterSyntaxError:
        return FilterSyntaxError(reason, self.text, at)

    def src(self, n: _Node) -> str:
        return self.text[n.start:n.end].strip()

    def node(self, ev: Eval, kind: int, start: int, end: int, children: Sequence[_Node],
             value: Value = None) -> _Node:
        depth = 1 + max((c.depth for c in children), default=0)
        if depth > 4 * MAX_DEPTH:
            raise self.refuse(f"Expression nested too deeply (more than {4 * MAX_DEPTH} levels)", start)
        return _Node(ev, kind, start, end, depth, value)

    # the grammar
    def selector(self) -> _Node:
        n = self.or_expr()
        t = self.peek()
        if t.kind != _EOF:
            raise self.unexpected(t, (_EOF, *_AFTER_OPERAND))
        return self.as_boolean(n)

    def as_boolean(self, n: _Node) -> _Node:
        if n.is_boolean:
            return n
        if n.kind == _PROP:
            return self.node(_boolean_cast_ev(n.ev), _BOOL, n.start, n.end, (n,))
        raise self.refuse(f"Expression will not result in a boolean value: {self.src(n)}", n.start)

    def or_expr(self) -> _Node:
        return self.logic("OR", self.and_expr, _or_ev)

    def and_expr(self) -> _Node:
        return self.logic("AND", self.equality, _and_ev)

    def logic(self, word: str, operand: Callable[[], _Node], combine: Callable[[list[Eval]], Eval]) -> _Node:
        first = operand()
        if self.peek().kind != word:
            return first
        parts = [self.as_boolean(first)]
        while self.peek().kind == word:
            self.take()
            parts.append(self.as_boolean(operand()))
        return self.node(combine([n.ev for n in parts]), _BOOL, first.start, parts[-1].end, parts)

    def equality(self) -> _Node:
        left = self.comparison()
        while True:
            t = self.peek()
            if t.kind in ("=", "<>"):
                self.take()
                right = self.comparison()
                left = self.equal(left, right, t)
                if t.kind == "<>":
                    left = self.node(_not_ev(left.ev), _BOOL, left.start, left.end, (left,))
            elif t.kind == "IS":
                self.take()
                negated = self.peek().kind == "NOT"
                if negated:
                    self.take()
                    end = self.expect("NULL")
                else:
                    nt = self.peek()
                    if nt.kind != "NULL":
                        raise self.unexpected(nt, ("NULL", "NOT"))
                    end = self.take()
                left = self.node(_is_null_ev(left.ev, negated), _BOOL, left.start, end.pos + len(end.image),
                                 (left,))
            else:
                return left

    def equal(self, left: _Node, right: _Node, op: _Tok) -> _Node:
        for n in (left, right):  # checkEqualOperand
            if n.is_constant and n.value is None:
                raise self.refuse(f"'{self.src(n)}' cannot be compared", n.start)
        if left.is_constant and right.is_constant and left.is_boolean and not right.is_boolean:
            raise self.refuse(f"'{self.src(left)}' cannot be compared with '{self.src(right)}'", op.pos)
        if left.kind == _PROP and right.kind == _CONST and type(right.value) is str:
            ev = _prop_equals_string_ev(self.text[left.start:left.end], right.value)
        elif left.kind == _PROP and (number := _number_constant(right)) is not None:
            ev = _prop_number_ev(self.text[left.start:left.end], number, _equals_zero, False)
        else:
            ev = _equal_ev(left.ev, right.ev)
        return self.node(ev, _BOOL, left.start, right.end, (left, right))

    def check_comparable(self, n: _Node) -> None:
        """checkLessThanOperand: a constant must be a number; no boolean expression."""
        if (n.is_constant and type(n.value) not in (int, _Long, float)) or n.is_boolean:
            raise self.refuse(f"Value '{self.src(n)}' cannot be compared", n.start)

    def compare(self, left: _Node, op: str, right: _Node) -> _Node:
        self.check_comparable(left)
        self.check_comparable(right)
        pred = _PREDICATES[op]
        if left.kind == _PROP and (number := _number_constant(right)) is not None:
            ev = _prop_number_ev(self.text[left.start:left.end], number, pred, False)
        elif right.kind == _PROP and (number := _number_constant(left)) is not None:
            ev = _prop_number_ev(self.text[right.start:right.end], number, pred, True)
        else:
            ev = _compare_ev(left.ev, right.ev, pred)
        return self.node(ev, _BOOL, left.start, right.end, (left, right))

    def comparison(self) -> _Node:
        left = self.unary()
        while True:
            t = self.peek()
            kind = t.kind
            negated = False
            if kind == "NOT" and self.peek(1).kind in ("BETWEEN", "IN", *_STRING_OPS):
                self.take()
                negated, t = True, self.peek()
                kind = t.kind
            if kind in _PREDICATES:
                self.take()
                left = self.compare(left, kind, self.unary())
            elif kind in _STRING_OPS:
                self.take()
                s = self.expect(_STRING)
                left = self.node(_string_op_ev(left.ev, kind, _string_value(s.image), negated), _BOOL,
                                 left.start, s.pos + len(s.image), (left,))
            elif kind == "BETWEEN":
                self.take()
                low = self.unary()
                self.expect("AND")
                high = self.unary()
                left = self.between(left, low, high, negated, t)
            elif kind == "IN":
                self.take()
                if left.kind != _PROP:
                    raise self.refuse(f"Expected a property for In expression, got: {self.src(left)}",
                                      left.start)
                self.expect("(")
                members = [_string_value(self.expect(_STRING).image)]
                while self.peek().kind == ",":
                    self.take()
                    members.append(_string_value(self.expect(_STRING).image))
                close = self.peek()
                if close.kind != ")":
                    raise self.unexpected(close, (",", ")"))
                self.take()
                left = self.node(_in_ev(self.text[left.start:left.end], frozenset(members), negated), _BOOL,
                                 left.start, close.pos + 1, (left,))
            else:
                return left

    def between(self, value: _Node, low: _Node, high: _Node, negated: bool, op: _Tok) -> _Node:
        if negated:  # NOT BETWEEN: value < low OR value > high (no check of the bounds' order)
            parts = [self.compare(value, "<", low), self.compare(value, ">", high)]
            return self.node(_or_ev([n.ev for n in parts]), _BOOL, value.start, high.end, parts)
        if low.is_constant and high.is_constant:
            if low.value is None or high.value is None:
                raise self.refuse("Illegal values of between, values can not be null", op.pos)
            try:
                inverted = java_compare(high.value, low.value) < 0
            except FilterEvalError as e:
                raise self.refuse(f"Illegal values of between: {e}", op.pos) from None
            if inverted:
                raise self.refuse(f"Illegal values of between, left value ({self.src(low)}) must be less "
                                  f"than or equal to right value ({self.src(high)})", op.pos)
        parts = [self.compare(value, ">=", low), self.compare(value, "<=", high)]
        return self.node(_and_ev([n.ev for n in parts]), _BOOL, value.start, high.end, parts)

    def unary(self) -> _Node:
        t = self.peek()
        if t.kind in ("+", "-", "NOT"):
            self.nesting += 1
            if self.nesting > MAX_DEPTH:
                raise self.refuse(f"Expression nested too deeply (more than {MAX_DEPTH} levels)", t.pos)
            self.take()
            inner = self.unary()
            self.nesting -= 1
            if t.kind == "+":
                return inner
            if t.kind == "-":
                return self.node(_negate_ev(inner.ev), _VALUE, t.pos, inner.end, (inner,))
            inner = self.as_boolean(inner)
            return self.node(_not_ev(inner.ev), _BOOL, t.pos, inner.end, (inner,))
        return self.primary()

    def primary(self) -> _Node:
        t = self.peek()
        kind = t.kind
        end = t.pos + len(t.image)
        if kind == _STRING:
            self.take()
            v = _string_value(t.image)
            return _Node(_const_ev(v), _CONST, t.pos, end, 1, v)
        if kind == _DECIMAL:
            self.take()
            n = int(t.image.rstrip("lL"))
            if n > _LONG_MAX:
                raise self.refuse(f"Number {t.image} is out of the range of a long", t.pos)
            num: int = n if n <= _INT_MAX else _Long(n)
            return _Node(_const_ev(num), _CONST, t.pos, end, 1, num)
        if kind == _FLOAT:
            self.take()
            d = float(t.image)
            if d == math.inf:
                raise self.refuse(f"{t.image} is greater than 1.7976931348623157E308", t.pos)
            if d < 5e-324:  # RocketMQ refuses below Double.MIN_VALUE, so 0.0 too (write 0)
                raise self.refuse(f"{t.image} is less than 4.9E-324", t.pos)
            return _Node(_const_ev(d), _CONST, t.pos, end, 1, d)
        if kind in ("TRUE", "FALSE", "NULL"):
            self.take()
            b = None if kind == "NULL" else kind == "TRUE"
            return _Node(_const_ev(b), _BCONST, t.pos, end, 1, b)
        if kind == _ID:
            self.take()
            self.names.add(t.image)
            return _Node(_prop_ev(t.image), _PROP, t.pos, end, 1)
        if kind == "(":
            self.nesting += 1
            if self.nesting > MAX_DEPTH:
                raise self.refuse(f"Expression nested too deeply (more than {MAX_DEPTH} levels)", t.pos)
            self.take()
            inner = self.or_expr()
            close = self.peek()
            if close.kind != ")":
                raise self.unexpected(close, (")", *_AFTER_OPERAND))
            self.take()
            self.nesting -= 1
            return inner  # the parenthesised node itself, as RocketMQ's primaryExpr returns it
        raise self.unexpected(t, _PRIMARY_START)


def _string_value(image: str) -> str:
    return image[1:-1].replace("''", "'")


# --- the compiled selector and its cache -----------------------------------------------------------------

class Selector:
    """A compiled SQL92 expression."""

    __slots__ = ("_ev", "names", "text")

    def __init__(self, text: str, ev: Eval, names: frozenset[str] = frozenset()) -> None:
        self.text = text
        self._ev = ev
        self.names = names  # the property names it reads: a record's other properties need no decoding

    def evaluate(self, props: Props) -> bool | None:
        """TRUE, FALSE or None (unknown); raises FilterEvalError where RocketMQ's evaluation throws."""
        v = self._ev(props)
        if v is None or type(v) is bool:
            return v
        raise TypeError(f"{self.text!r} evaluated to {v!r}, not a boolean")  # the parser casts to boolean

    def matches(self, props: Props) -> bool:
        """The broker's verdict (ExpressionMessageFilter.isMatchedByCommitLog): TRUE matches; FALSE,
        unknown and an evaluation error do not. Any other failure does not match either (RocketMQ
        catches every exception there): a message the filter cannot judge must not stall its queue's
        pulls; it is logged once per expression."""
        try:
            return self._ev(props) is True
        except FilterEvalError:
            return False
        except Exception:
            if self.text not in _failed:
                _failed.add(self.text)
                log.exception("SQL92 filter %r failed on a message's properties; it does not match",
                              self.text)
            return False

    def __repr__(self) -> str:
        return f"Selector({self.text!r})"


_failed: set[str] = set()  # expressions whose evaluation failed unexpectedly (logged once each)
_cache: dict[str, Selector | FilterSyntaxError] = {}  # refusals cached too, as RocketMQ's PARSE_CACHE


def compile_sql92(text: str) -> Selector:
    """The compiled selector for ``text`` (cached by text, refusals too); raises FilterSyntaxError."""
    hit = _cache.get(text)
    if hit is None:
        try:
            parser = _Parser(text)
            node = parser.selector()
            hit = Selector(text, node.ev, frozenset(parser.names))
        except FilterSyntaxError as e:
            hit = e
        except RecursionError:
            hit = FilterSyntaxError("Expression nested too deeply", text, 0)
        if len(_cache) >= _CACHE_SIZE:
            _cache.clear()
        _cache[text] = hit
    if isinstance(hit, FilterSyntaxError):  # a fresh copy: a re-raised instance would grow its traceback
        raise FilterSyntaxError(hit.reason, hit.text, hit.offset, hit.expected)
    return hit
