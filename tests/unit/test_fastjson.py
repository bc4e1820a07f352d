"""chronomq.remoting.fastjson: bodies as RocketMQ's Java servers write them."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chronomq.client.model import TopicRoute
from chronomq.remoting import fastjson

# what a RocketMQ 5.3 name server answered for GET_ROUTEINFO_BY_TOPIC (captured, spaces as sent)
ROUTE = (b'{"brokerDatas":[{"brokerAddrs":{0:"127.0.0.1:20911"},"brokerName":"broker-a",'
         b'"cluster":"DefaultCluster","enableActingMaster":false}],"filterServerTable":{},'
         b'"queueDatas":[{"brokerName":"broker-a","perm":7,"readQueueNums":16,"topicSysFlag":0,'
         b'"writeQueueNums":16}]}')


def test_a_rocketmq_route_with_bare_number_keys_is_read() -> None:
    route = TopicRoute.parse("DefaultCluster", ROUTE)
    assert route.broker_addrs == {"broker-a": {0: "127.0.0.1:20911"}}
    assert route.master_addr("broker-a") == "127.0.0.1:20911"
    assert [q.write_queue_nums for q in route.queue_datas] == [16]


def test_object_keys_become_canonical_json_text() -> None:
    body = ' {"offsetTable":{{"topic":"T","brokerName":"b","queueId":0}:{"brokerOffset":5}, -1 : 2}} '
    data = fastjson.loads(body)
    key = fastjson.canonical_key({"brokerName": "b", "queueId": 0, "topic": "T"})
    assert data == {"offsetTable": {key: {"brokerOffset": 5}, "-1": 2}}
    assert json.loads(key) == {"brokerName": "b", "queueId": 0, "topic": "T"}


def test_literals_numbers_strings_and_nesting() -> None:
    assert fastjson.loads('{1:[true,false,null,-2.5e3,"a\\"b\\u00e9"],x:{}}') == {
        "1": [True, False, None, -2500.0, 'a"b\u00e9'], "x": {}}


@pytest.mark.parametrize("bad", ["", "{", '{"a":}', "{1:2,}", "[1 2]", "{1:2} x", "nul", "{[1]:}", "{:1}"])
def test_what_is_not_json_either_way_raises_value_error(bad: str) -> None:
    with pytest.raises(ValueError):
        fastjson.loads(bad)


def test_deep_nesting_is_a_value_error_not_a_crash() -> None:
    with pytest.raises(ValueError):
        fastjson.loads("{1:" * 100_000)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4), max_leaves=20)


@given(json_values)
def test_standard_json_reads_as_json_loads_reads_it(value: object) -> None:
    text = json.dumps(value)
    assert fastjson.loads(text) == json.loads(text)
    assert fastjson.loads(text.encode()) == json.loads(text)


@given(st.dictionaries(st.integers(), st.text(), max_size=5))
def test_bare_integer_keys_read_as_their_quoted_form(table: dict[int, str]) -> None:
    bare = "{" + ",".join(f"{k}:{json.dumps(v)}" for k, v in table.items()) + "}"
    assert fastjson.loads(bare) == json.loads(json.dumps(table))
