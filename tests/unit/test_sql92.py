"""The SQL92 selector engine (chronomq.filter.sql92) against RocketMQ's grammar and evaluation: each
construct, precedence, three-valued logic with missing properties, Java's number conversions, and the
refusals with where they happen."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chronomq.filter import sql92
from chronomq.filter.sql92 import FilterEvalError, FilterSyntaxError, compile_sql92, java_compare


def ev(expr: str, **props: str) -> bool | None:
    return compile_sql92(expr).evaluate(props)


def matches(expr: str, **props: str) -> bool:
    return compile_sql92(expr).matches(props)


def refusal(expr: str) -> FilterSyntaxError:
    with pytest.raises(FilterSyntaxError) as info:
        compile_sql92(expr)
    return info.value


# --- comparisons -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("expr,props,want", [
    ("a = 'x'", {"a": "x"}, True),
    ("a = 'x'", {"a": "y"}, False),
    ("a = 'x'", {}, None),
    ("a <> 'x'", {"a": "y"}, True),
    ("a <> 'x'", {}, None),
    ("'x' = a", {}, False),           # RocketMQ: a null right side is FALSE, a null left side is null
    ("'x' <> a", {}, True),
    ("a = b", {}, True),              # both null: equal
    ("a = b", {"a": "1"}, False),
    ("a = b", {"a": "1", "b": "1.0"}, False),  # two strings compare as strings for =
    ("a = 5", {"a": "5"}, True),
    ("a = 5", {"a": "+5"}, True),     # Integer.valueOf accepts a sign
    ("a = 5.0", {"a": "5"}, True),    # Double.valueOf
    ("a = 5.0", {"a": " 5d "}, True),  # Double.valueOf trims and takes a d suffix
    ("a = '5'", {"a": "5.0"}, False),
    ("a = TRUE", {"a": "true"}, True),  # Boolean.valueOf: equalsIgnoreCase("true")
    ("a = TRUE", {"a": "yes"}, False),
    ("a = FALSE", {"a": "no"}, True),
    ("1 = 1.0", {}, True),
    ("a > 5", {"a": "6"}, True),
    ("a > 5", {"a": "5"}, False),
    ("a >= 5", {"a": "5"}, True),
    ("a < 5", {"a": "-7"}, True),
    ("a <= -5", {"a": "-5"}, True),
    ("a > 2.5", {"a": "2.75"}, True),
    ("a > 2.5", {"a": "NaN"}, True),   # Double.compare: NaN is above everything
    ("a < 1E3", {"a": "999"}, True),
    ("a > b", {"a": "10", "b": "9"}, True),  # two strings by < > compare as doubles
    ("a > 5", {}, None),
    ("5 < a", {"a": "6"}, True),
    ("a > 3000000000", {"a": "3000000001"}, True),  # a long literal converts by Long.valueOf
    ("a > 10L", {"a": "11"}, True),
    ("a > +5", {"a": "6"}, True),
    ("a > --5", {"a": "6"}, True),
    ("a > -b", {"a": "6", "b": "1"}, None),  # negating a string is null
])
def test_comparisons(expr: str, props: dict[str, str], want: bool | None) -> None:
    assert compile_sql92(expr).evaluate(props) is want


@pytest.mark.parametrize("expr,props", [
    ("a > 5", {"a": "5.5"}),          # Integer.valueOf("5.5") fails
    ("a = 5", {"a": "x"}),
    ("a > 5", {"a": "3000000000"}),   # past int range against an int literal
    ("a > b", {"a": "x", "b": "1"}),
    ("TRUE = a", {"a": "true"}),      # RocketMQ casts the Boolean to String: ClassCastException
    ("NOT a = 'x'", {"a": "x"}),      # (NOT a) = 'x' is a boolean against a string
    ("a > 1.5", {"a": "Inf"}),
])
def test_evaluation_errors_never_match(expr: str, props: dict[str, str]) -> None:
    sel = compile_sql92(expr)
    with pytest.raises(FilterEvalError):
        sel.evaluate(props)
    assert sel.matches(props) is False


def test_an_error_spoils_the_whole_expression_unless_short_circuited() -> None:
    assert not matches("a = 5 OR b = 'y'", a="x", b="y")  # RocketMQ's exception reaches the top
    assert matches("b = 'y' OR a = 5", a="x", b="y")      # the left side decides first
    assert not matches("a = 'q' AND b = 5", a="z", b="bad")


# --- BETWEEN, IN, IS NULL, CONTAINS / STARTSWITH / ENDSWITH ------------------------------------------------

@pytest.mark.parametrize("expr,props,want", [
    ("a BETWEEN 1 AND 10", {"a": "1"}, True),
    ("a BETWEEN 1 AND 10", {"a": "10"}, True),
    ("a BETWEEN 1 AND 10", {"a": "11"}, False),
    ("a BETWEEN 1 AND 10", {}, None),
    ("a BETWEEN -1.5 AND 1.5", {"a": "0"}, True),
    ("a NOT BETWEEN 1 AND 10", {"a": "11"}, True),
    ("a NOT BETWEEN 1 AND 10", {"a": "5"}, False),
    ("a NOT BETWEEN 1 AND 10", {}, None),
    ("a NOT BETWEEN 10 AND 1", {"a": "5"}, True),  # no order check for NOT BETWEEN
    ("a IN ('x', 'y')", {"a": "y"}, True),
    ("a IN ('x', 'y')", {"a": "z"}, False),
    ("a IN ('x')", {}, None),
    ("a NOT IN ('x', 'y')", {"a": "z"}, True),
    ("a NOT IN ('x', 'y')", {}, None),
    ("a IN ('1','2','3','4','5','6')", {"a": "6"}, True),
    ("a IS NULL", {}, True),
    ("a IS NULL", {"a": ""}, False),
    ("a IS NOT NULL", {"a": ""}, True),
    ("a IS NOT NULL", {}, False),
    ("a CONTAINS 'bc'", {"a": "abcd"}, True),
    ("a CONTAINS 'bc'", {}, False),     # FALSE, not null
    ("a NOT CONTAINS 'bc'", {"a": "ad"}, True),
    ("a NOT CONTAINS 'bc'", {}, False),  # the NOT forms are FALSE on a missing property too
    ("a CONTAINS ''", {"a": "x"}, False),  # an empty search never matches
    ("a NOT CONTAINS ''", {"a": "x"}, False),
    ("a STARTSWITH 'ab'", {"a": "abc"}, True),
    ("a NOT STARTSWITH 'ab'", {"a": "cab"}, True),
    ("a ENDSWITH 'bc'", {"a": "abc"}, True),
    ("a NOT ENDSWITH 'bc'", {"a": "abc"}, False),
    ("NOT (a CONTAINS 'z')", {}, True),
    ("(a = 'x') CONTAINS 'x'", {"a": "x"}, False),  # a boolean is not a string
])
def test_predicates(expr: str, props: dict[str, str], want: bool | None) -> None:
    assert compile_sql92(expr).evaluate(props) is want


# --- logic and precedence --------------------------------------------------------------------------------

def test_and_binds_tighter_than_or() -> None:
    assert ev("a = '1' OR b = '1' AND c = '1'", a="1", b="0", c="0") is True
    assert ev("(a = '1' OR b = '1') AND c = '1'", a="1", b="0", c="0") is False


def test_not_binds_tighter_than_comparisons() -> None:
    # RocketMQ's unaryExpr takes NOT: NOT a IS NULL is (NOT a) IS NULL, which is a IS NULL
    assert ev("NOT a IS NULL") is True
    assert ev("NOT a IS NULL", a="x") is False
    assert ev("NOT (a IS NULL)", a="x") is True
    assert "cannot be compared" in str(refusal("NOT a > 1"))


@pytest.mark.parametrize("left", [True, False, None])
@pytest.mark.parametrize("right", [True, False, None])
def test_three_valued_logic(left: bool | None, right: bool | None) -> None:
    def term(v: bool | None, name: str) -> tuple[str, dict[str, str]]:
        return (f"{name} = 'y'", {} if v is None else {name: "y" if v else "n"})
    lt, lp = term(left, "a")
    rt, rp = term(right, "b")
    props = {**lp, **rp}
    want_and = False if False in (left, right) else None if None in (left, right) else True
    want_or = True if True in (left, right) else None if None in (left, right) else False
    assert compile_sql92(f"{lt} AND {rt}").evaluate(props) is want_and
    assert compile_sql92(f"{lt} OR {rt}").evaluate(props) is want_or
    assert compile_sql92(f"NOT ({lt})").evaluate(props) is (None if left is None else not left)


def test_constants_and_boolean_casts() -> None:
    assert ev("TRUE") is True
    assert ev("FALSE") is False
    assert ev("NULL") is None
    assert ev("NULL IS NULL") is True
    assert ev("a") is None and ev("a", a="true") is False  # a property as a boolean: never TRUE
    assert ev("NOT a", a="x") is True
    assert ev("TRUE AND a = 'x'", a="x") is True
    assert ev("(a = 'x') = (b = 'y')", a="x", b="y") is True
    assert ev("1 = TRUE") is False  # an Integer against a Boolean compares as -1


def test_keywords_are_case_insensitive_and_identifiers_are_not() -> None:
    assert ev("a between 1 and 3 AnD b iS nOt NuLl", a="2", b="") is True
    assert ev("Tags = 'x'", TAGS="x") is None
    assert ev("TAGS = 'x'", TAGS="x") is True


def test_identifiers_literals_and_comments() -> None:
    assert ev("$a_1 = 'it''s'", **{"$a_1": "it's"}) is True
    assert ev("a = '' ", a="") is True
    assert ev("a = 'line\nbreak'", a="line\nbreak") is True
    assert ev("/* c */ a = 1 -- trailing\n", a="1") is True
    assert ev("a\t=\r\n1", a="1") is True
    assert ev("a > .5", a="0.75") is True and ev("a > 5.", a="6") is True and ev("a < 5E1", a="49") is True


# --- refusals, with where ----------------------------------------------------------------------------------

@pytest.mark.parametrize("expr,column,words", [
    ("a =", 4, "Was expecting one of: <STRING_LITERAL>"),
    ("a = 'x' b = 'y'", 9, 'Encountered "b"'),   # RocketMQ ignores the tail; chronomq refuses it
    ("a > 'x'", 5, "cannot be compared"),
    ("a > TRUE", 5, "cannot be compared"),
    ("a = NULL", 5, "'NULL' cannot be compared"),
    ("TRUE = 'x'", 6, "cannot be compared with"),
    ("1", 1, "will not result in a boolean value"),
    ("'x' AND a = 1", 1, "will not result in a boolean value"),
    ("NOT 1", 5, "will not result in a boolean value"),
    ("a BETWEEN 10 AND 1", 3, "Illegal values of between"),
    ("a BETWEEN NULL AND 1", 3, "can not be null"),
    ("1 IN ('x')", 1, "Expected a property for In expression"),
    ("a IN (1)", 7, "Was expecting <STRING_LITERAL>"),
    ("a IN ('x' 'y')", 11, "Was expecting one of: ,, )"),
    ("a CONTAINS b", 12, "Was expecting <STRING_LITERAL>"),
    ("a IS 5", 6, "NULL, NOT"),
    ("(a = 1", 7, "Encountered end of expression"),
    ("a.b = 1", 2, "Lexical error"),
    ("a != 1", 3, "Lexical error"),
    ("'open", 1, "unterminated string"),
    ("/* open", 1, "unterminated comment"),
    ("a = 99999999999999999999", 5, "out of the range of a long"),
    ("a > 0.0", 5, "less than 4.9E-324"),       # RocketMQ's createFloat refuses below Double.MIN_VALUE
    ("a > 1e400", 5, "greater than"),
    ("contains = 'x'", 1, 'Encountered "contains"'),  # a 5.x keyword
    ("a = 1 -- no line end", 7, 'Encountered "-"'),  # a comment needs its line end
    ("", 1, "Encountered end of expression"),
])
def test_refusals_say_where(expr: str, column: int, words: str) -> None:
    err = refusal(expr)
    assert words in str(err)
    assert (err.line, err.column) == (1, column)
    assert str(err).startswith("Invalid MessageSelector.")


def test_refusal_positions_count_lines() -> None:
    err = refusal("a = 1 AND\n  b >")
    assert (err.line, err.column) == (2, 6)
    assert err.offset == len("a = 1 AND\n  b >")


def test_nesting_is_bounded_with_a_clear_refusal() -> None:
    deep = "(" * (sql92.MAX_DEPTH + 1) + "a = 1" + ")" * (sql92.MAX_DEPTH + 1)
    assert "nested too deeply" in str(refusal(deep))
    assert "nested too deeply" in str(refusal("NOT " * (sql92.MAX_DEPTH + 1) + "a"))
    ok = "(" * sql92.MAX_DEPTH + "a = 1" + ")" * sql92.MAX_DEPTH
    assert ev(ok, a="1") is True


def test_long_and_or_chains_evaluate_without_recursion() -> None:
    expr = " AND ".join(f"p{i} = '{i}'" for i in range(3000))
    props = {f"p{i}": str(i) for i in range(3000)}
    assert compile_sql92(expr).evaluate(props) is True
    any_of = " OR ".join(f"p{i} = 'z'" for i in range(3000)) + " OR p0 = '0'"
    assert compile_sql92(any_of).evaluate(props) is True


# --- compiled once ---------------------------------------------------------------------------------------

def test_compiled_once_per_text_and_refusals_cached() -> None:
    assert compile_sql92("cache_probe = 'x'") is compile_sql92("cache_probe = 'x'")
    first, second = refusal("cache_probe ="), refusal("cache_probe =")
    assert first is not second and str(first) == str(second)


# --- Java conversions --------------------------------------------------------------------------------------

def test_java_compare_conversions() -> None:
    assert java_compare(1, 1.0) == 0
    assert java_compare("2", 1) == 1
    assert java_compare(1.0, "1e0") == 0
    assert java_compare(-0.0, 0.0) == -1                      # Double.compare
    assert java_compare(math.nan, math.nan) == 0
    assert java_compare(1, True) == -1 and java_compare(True, 1) == -1  # not converted: -1
    assert java_compare("true", True) == 0
    assert java_compare("\U0001F600", "\uffff") == -1         # UTF-16 code units, as String.compareTo
    for bad in (("0x10", 1), ("1_000", 1), (" 1", 1), ("1.5", 1), ("inf", 1.0), ("1e", 1.0)):
        with pytest.raises(FilterEvalError):
            java_compare(*bad)
    assert java_compare("0x1p3", 8.0) == 0 and java_compare("-Infinity", -1e308) == -1


# --- properties ------------------------------------------------------------------------------------------

_value = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12)


@given(_value)
def test_any_string_literal_round_trips(s: str) -> None:
    literal = "'" + s.replace("'", "''") + "'"
    assert compile_sql92(f"p = {literal}").evaluate({"p": s}) is True
    assert compile_sql92(f"p IN ('zz', {literal})").evaluate({"p": s}) is True


@given(st.integers(-(2**31), 2**31 - 1), st.integers(0, 2**31 - 1),
       st.sampled_from(["<", "<=", ">", ">=", "="]))
def test_integer_comparisons_agree_with_arithmetic(value: int, literal: int, op: str) -> None:
    want = {"<": value < literal, "<=": value <= literal, ">": value > literal, ">=": value >= literal,
            "=": value == literal}[op]
    assert compile_sql92(f"n {op} {literal}").evaluate({"n": str(value)}) is want
    assert compile_sql92(f"n {op} -{literal}").evaluate({"n": str(value)}) is {
        "<": value < -literal, "<=": value <= -literal, ">": value > -literal, ">=": value >= -literal,
        "=": value == -literal}[op]


@given(st.text(alphabet="ab()=<>'-.0123 NOTANDISNULLINBETWEENx,", max_size=30),
       st.dictionaries(st.sampled_from(["a", "b", "x"]), _value, max_size=3))
def test_any_text_compiles_or_is_refused_and_evaluation_only_fails_cleanly(text: str,
                                                                           props: dict[str, str]) -> None:
    try:
        sel = compile_sql92(text)
    except FilterSyntaxError as e:
        assert 0 <= e.offset <= len(text)
        return
    try:
        assert sel.evaluate(props) in (True, False, None)
    except FilterEvalError:
        assert sel.matches(props) is False


# --- stored records --------------------------------------------------------------------------------------

def _record(props: dict[str, str]) -> bytes:
    from chronomq.message import MessageExt, encode_record

    return bytes(encode_record(MessageExt(topic="T", body=b"body \x01\x02 a\x01", properties=props)))


_names = st.sampled_from(["a", "ab", "b", "TAGS", "xa"])


@given(st.dictionaries(_names, st.text(alphabet=st.characters(blacklist_characters="\x01\x02",
                                                               blacklist_categories=("Cs",)), max_size=6),
                       max_size=5))
def test_only_the_named_properties_are_read_and_they_equal_a_full_decode(props: dict[str, str]) -> None:
    from chronomq.filter.records import named_properties, properties_span, record_properties

    rec = _record(props)
    full = record_properties(rec)
    assert full == props
    span = properties_span(rec)
    assert span is not None
    wanted = [(n, n.encode() + b"\x01", b"\x02" + n.encode() + b"\x01") for n in ("a", "b", "TAGS")]
    assert named_properties(rec, *span, wanted) == {k: v for k, v in props.items() if k in ("a", "b", "TAGS")}


def test_record_filter_matches_stored_records_and_refuses_broken_ones() -> None:
    from chronomq.filter.records import record_filter

    match = record_filter(compile_sql92("a = 'x' AND TAGS IN ('t1', 't2')"))
    assert compile_sql92("a = 'x' AND TAGS IN ('t1', 't2')").names == {"a", "TAGS"}
    assert match(_record({"xa": "y", "a": "x", "TAGS": "t2"}))
    assert not match(_record({"xa": "x", "TAGS": "t2"}))  # "xa" is not "a"
    assert not match(_record({"a": "x"}))
    rec = _record({"a": "x", "TAGS": "t1"})
    assert match(rec) and not match(rec[:-1]) and not match(rec[:40])
    assert record_filter(compile_sql92("TRUE"))(rec)


_numberish = st.one_of(st.sampled_from(["5", "+5", "-5", "5.0", " 5", "5d", "NaN", "-Infinity", "abc", "",
                                        "3000000000", "9223372036854775808", "0x1p2", "\u0665"]),
                       st.integers(-(2**40), 2**40).map(str), st.floats(allow_nan=True).map(repr))


@given(_numberish, st.sampled_from([("5", 5), ("3000000000", sql92._Long(3000000000)), ("2.5", 2.5)]),
       st.sampled_from(["<", "<=", ">", ">=", "="]))
def test_property_against_a_number_is_java_compare(value: str, literal: tuple[str, object], op: str) -> None:
    text, number = literal
    pred = {"<": lambda c: c < 0, "<=": lambda c: c <= 0, ">": lambda c: c > 0, ">=": lambda c: c >= 0,
            "=": lambda c: c == 0}[op]

    def outcome(expr: str, lv: object, rv: object) -> object:
        try:
            want: object = pred(java_compare(lv, rv))  # type: ignore[arg-type]
        except FilterEvalError:
            want = "error"
        try:
            got: object = compile_sql92(expr).evaluate({"a": value})
        except FilterEvalError:
            got = "error"
        return want, got

    want, got = outcome(f"a {op} {text}", value, number)
    assert got == want
    if op != "=":
        want, got = outcome(f"{text} {op} a", number, value)
        assert got == want


def test_an_unexpected_failure_in_evaluation_is_no_match_logged_once(
        caplog: pytest.LogCaptureFixture) -> None:
    """RocketMQ catches every exception in the broker's filter: a message it cannot judge must not stall
    the pulls of its queue (the exception would escape the store's read and fail every retry)."""

    class Broken(dict):  # a property map whose reads fail in an unforeseen way
        def get(self, *a: object, **k: object) -> str:
            raise RuntimeError("unforeseen")

        def __getitem__(self, key: str) -> str:
            raise RuntimeError("unforeseen")

        def __contains__(self, key: object) -> bool:
            raise RuntimeError("unforeseen")

    sel = compile_sql92("a = 'x' AND b > 3")
    with caplog.at_level("ERROR", logger="chronomq.filter.sql92"):
        assert sel.matches(Broken()) is False
        assert sel.matches(Broken()) is False
    assert sum("failed on a message's properties" in r.getMessage() for r in caplog.records) == 1
    assert sel.matches({"a": "x", "b": "4"}) is True
