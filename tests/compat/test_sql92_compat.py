"""SQL92 subscriptions with the official Java client (4.x API, MessageSelector.bySql) against chronomq with
enablePropertyFilter=true and against the reference Apache RocketMQ 5.3.x (which runs with it on): the
same messages, the same expressions, the same deliveries; an expression that does not compile stops
the consumer's start on both."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.compat.conftest import DIFFERENTIAL_CONF
from tests.compat.observe import assert_same, b64, each, text, uniq
from tests.compat.reference import RocketMQProcess
from tests.compat.test_java_differential import Broker, consume, produce

pytestmark = pytest.mark.compat

# property n = i; color on even messages only; tags T0 / T1 / T2
EXPRESSIONS = [
    "n >= 5 AND n < 9",
    "color = 'red' AND TAGS IN ('T1', 'T2')",
    "color IS NULL AND n BETWEEN 3 AND 8",
    "NOT (n BETWEEN 2 AND 10) OR color = 'blue'",
    "color <> 'red'",                       # missing color: unknown, not delivered
    "n > 2.5 AND n <= 4",
    "TAGS = 'T1' AND name STARTSWITH 'job-1'",   # job-1 and job-10
]


@pytest.fixture
def sql_brokers(chronomq_factory: Callable[..., Any], rocketmq5: RocketMQProcess) -> dict[str, Broker]:
    chronomq = chronomq_factory({**DIFFERENTIAL_CONF, "enablePropertyFilter": "true"})
    return {"chronomq": chronomq, "rocketmq5": rocketmq5}


def _messages(topic: str) -> list[dict[str, Any]]:
    out = []
    for i in range(12):
        props = {"n": str(i), "name": f"job-{i}"}
        if i % 2 == 0:
            props["color"] = "red" if i % 4 == 0 else "blue"
        out.append({"topic": topic, "body": b64(f"m{i}"), "tags": f"T{i % 3}", "props": props})
    return out


@pytest.mark.parametrize("expression", EXPRESSIONS)
def test_a_sql92_subscription_gets_the_same_messages(expression: str, sql_brokers: dict[str, Broker],
                                                     tmp_path: Path) -> None:
    def scenario(name: str, broker: Broker) -> dict[str, Any]:
        topic = uniq("JSql")
        results = produce("java4", broker, _messages(topic))
        assert all(r["ok"] for r in results), f"{name}: {results}"
        # every message is filtered in the pull answers of the consumer's first pulls (one per queue): once
        # deliveries began, 3 s without one means none is left, the extra one a wrong match would be included
        result, recs = consume("java4", broker, tmp_path, topic, expect=13, type="SQL92",
                               expression=expression, max_seconds=30, quietMs=3000)
        return {"started": result.get("started"), "delivered": sorted({text(r) for r in recs})}

    observed = each(sql_brokers, scenario)
    assert observed["chronomq"]["started"] is True
    assert_same(observed, f"SQL92 {expression!r}")


@pytest.mark.parametrize("expression", ["n >", "n > 'x'", "a = NULL"])
def test_an_expression_that_does_not_compile_stops_the_consumer_on_both(
        expression: str, sql_brokers: dict[str, Broker], tmp_path: Path) -> None:
    def scenario(name: str, broker: Broker) -> dict[str, Any]:
        topic = uniq("JSqlBad")
        produce("java4", broker, _messages(topic)[:1])
        result, recs = consume("java4", broker, tmp_path, topic, expect=1, type="SQL92",
                               expression=expression, max_seconds=10)
        print(f"{name}: {result}")
        return {"started": result.get("started"), "delivered": len(recs)}

    observed = each(sql_brokers, scenario)
    assert observed["chronomq"] == {"started": False, "delivered": 0}
    assert_same(observed, f"SQL92 refused {expression!r}")
