"""The official Go client's scenarios (test_go_client.py) against chronomq and the reference Apache RocketMQ
(5.3.3, and 4.9.7 where it runs) in the same run: the observations that do not depend on the broker must
be equal (``broker_specific`` holds ids, queues, timestamps and lateness, and is left out)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.compat.conftest import DIFFERENTIAL_CONF, FAST_DELAY_LEVELS
from tests.compat.golang import go_driver
from tests.compat.harness import ChronomqProcess
from tests.compat.observe import assert_same, each
from tests.compat.reference import RocketMQProcess
from tests.compat.test_go_client import scenario_delay, scenario_push_consume, scenario_retry, scenario_send

pytestmark = pytest.mark.compat

SCENARIOS: dict[str, Callable[[str, Path], dict[str, Any]]] = {
    "send": scenario_send,
    "push consume": scenario_push_consume,
    # levels 1 and 3 (1 s and 3 s): the order of their receipts holds with 2 s to spare on a loaded machine
    "delay levels": lambda addr, tmp: scenario_delay(addr, tmp, FAST_DELAY_LEVELS, (1, 3)),
    "retry": lambda addr, tmp: scenario_retry(addr, tmp, FAST_DELAY_LEVELS),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_go_client_observes_the_same_on_both_brokers(
        name: str, chronomq_factory: Callable[..., ChronomqProcess], rocketmq5: RocketMQProcess,
        request: pytest.FixtureRequest, tmp_path: Path) -> None:
    go_driver()  # skipped, with the reason, without go or the module proxy
    chronomq = chronomq_factory(dict(DIFFERENTIAL_CONF))
    brokers = [("chronomq", chronomq.namesrv_addr), ("rocketmq5", rocketmq5.namesrv_addr)]
    try:
        brokers.append(("rocketmq4", request.getfixturevalue("rocketmq4").namesrv_addr))
    except pytest.skip.Exception as e:
        print(f"rocketmq4 reference not run: {e}")

    def scenario(broker: str, addr: str) -> dict[str, Any]:
        (tmp_path / broker).mkdir()
        obs = SCENARIOS[name](addr, tmp_path / broker)
        print(f"{broker} broker specific: {obs.pop('broker_specific', None)}")
        return obs

    assert_same(each(dict(brokers), scenario), name)
