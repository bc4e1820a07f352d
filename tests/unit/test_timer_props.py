"""The four timer property forms (docs/protocol.md#timer-properties) and their pitfalls."""

from __future__ import annotations

import pytest

from chronomq.delay.timer import TimerPropertyError, deliver_ms_from_properties, has_timer_property

NOW = 1_700_000_000_000


def test_absent_is_none() -> None:
    assert deliver_ms_from_properties({"TAGS": "a"}, NOW) is None
    assert not has_timer_property({"TAGS": "a", "DELAY": "3"})


@pytest.mark.parametrize(
    ("props", "expected"),
    [
        ({"TIMER_DELIVER_MS": str(NOW + 1234)}, NOW + 1234),
        ({"TIMER_DELAY_SEC": "5"}, NOW + 5000),
        ({"TIMER_DELAY_MS": "250"}, NOW + 250),
        ({"__STARTDELIVERTIME": str(NOW + 60_000)}, NOW + 60_000),
        # seconds where milliseconds belong (the 6.7 pitfall): read as epoch seconds
        ({"TIMER_DELIVER_MS": str(NOW // 1000 + 30)}, NOW + 30_000),
        ({"__STARTDELIVERTIME": str(NOW // 1000 + 7)}, NOW + 7000),
        # past and zero: returned as is (delivered at once by the caller)
        ({"TIMER_DELIVER_MS": str(NOW - 5)}, NOW - 5),
        ({"TIMER_DELAY_MS": "0"}, NOW),
        ({"TIMER_DELIVER_MS": " 1700000000500 "}, NOW + 500),
    ],
)
def test_forms(props: dict[str, str], expected: int) -> None:
    assert has_timer_property(props)
    assert deliver_ms_from_properties(props, NOW) == expected


def test_precedence_matches_rocketmq_5() -> None:
    props = {"TIMER_DELIVER_MS": str(NOW + 9000), "TIMER_DELAY_MS": "700", "TIMER_DELAY_SEC": "2",
             "__STARTDELIVERTIME": str(NOW + 1)}
    assert deliver_ms_from_properties(props, NOW) == NOW + 2000
    del props["TIMER_DELAY_SEC"]
    assert deliver_ms_from_properties(props, NOW) == NOW + 700
    del props["TIMER_DELAY_MS"]
    assert deliver_ms_from_properties(props, NOW) == NOW + 9000
    del props["TIMER_DELIVER_MS"]
    assert deliver_ms_from_properties(props, NOW) == NOW + 1


@pytest.mark.parametrize("bad", ["", "abc", "-5", "1e400", "nan", "12x"])
def test_bad_values_raise_clear_errors(bad: str) -> None:
    with pytest.raises(TimerPropertyError, match="TIMER_DELAY_MS"):
        deliver_ms_from_properties({"TIMER_DELAY_MS": bad}, NOW)


def test_float_text_is_accepted() -> None:
    assert deliver_ms_from_properties({"TIMER_DELAY_SEC": "1.5"}, NOW) == NOW + 1000
