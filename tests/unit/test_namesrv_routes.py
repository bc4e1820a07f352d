"""Name server: registration of several brokers (names, master + slave), route lookups, expiry after
120 s of silence (virtual clock), unregistration, and the admin listings, over loopback TCP."""

from __future__ import annotations

import json

import pytest
from tests.conftest import async_wait_for, free_port
from tests.integration.rawclient import AsyncRawClient

from chronomq.clock import VirtualClock
from chronomq.namesrv import NameServer, RouteInfoManager
from chronomq.remoting.codes import RequestCode, ResponseCode


def _tc(name: str, n: int = 4, perm: int = 6) -> dict:
    return {"topicName": name, "readQueueNums": n, "writeQueueNums": n, "perm": perm, "topicSysFlag": 0}


def _register_body(topics: dict[str, dict], counter: int = 1) -> bytes:
    return json.dumps(
        {
            "topicConfigSerializeWrapper": {
                "topicConfigTable": topics,
                "dataVersion": {"timestamp": 1, "counter": counter},
            },
            "filterServerList": [],
        }
    ).encode()


def _reg_ext(name: str, addr: str, bid: int = 0, cluster: str = "C1") -> dict:
    return {
        "brokerName": name,
        "brokerAddr": addr,
        "clusterName": cluster,
        "brokerId": bid,
        "haServerAddr": addr.replace(":1", ":2"),
    }


def test_route_table_master_slave_and_several_brokers() -> None:
    r = RouteInfoManager()
    r.register_broker("C1", "a", "h:1", 0, "h:2", {"T": _tc("T", 4)}, {"counter": 1}, now_ms=0)
    res = r.register_broker("C1", "a", "h:3", 1, "h:4", {"T": _tc("T", 4)}, {"counter": 1}, now_ms=0)
    assert res["masterAddr"] == "h:1" and res["haServerAddr"] == "h:2"
    r.register_broker("C1", "b", "g:1", 0, "g:2", {"T": _tc("T", 2), "U": _tc("U")}, {"counter": 1}, now_ms=0)
    route = r.topic_route("T")
    assert route is not None
    assert {q["brokerName"]: q["writeQueueNums"] for q in route["queueDatas"]} == {"a": 4, "b": 2}
    addrs = {b["brokerName"]: b["brokerAddrs"] for b in route["brokerDatas"]}
    assert addrs == {"a": {"0": "h:1", "1": "h:3"}, "b": {"0": "g:1"}}
    assert r.topic_route("U")["queueDatas"][0]["brokerName"] == "b"  # type: ignore[index]
    assert r.topic_route("nope") is None
    assert r.cluster_info()["clusterAddrTable"] == {"C1": ["a", "b"]}
    # a master's new data version replaces its topic set; a slave never changes queues
    r.register_broker("C1", "b", "g:1", 0, "g:2", {"U": _tc("U")}, {"counter": 2}, now_ms=1)
    assert [q["brokerName"] for q in r.topic_route("T")["queueDatas"]] == ["a"]  # type: ignore[index]
    r.register_broker("C1", "a", "h:3", 1, "h:4", {}, {"counter": 9}, now_ms=1)
    assert r.topic_route("T") is not None


def test_expiry_and_unregister() -> None:
    r = RouteInfoManager(expire_ms=120_000)
    r.register_broker("C1", "a", "h:1", 0, "", {"T": _tc("T")}, {}, now_ms=0)
    r.register_broker("C1", "b", "g:1", 0, "", {"T": _tc("T")}, {}, now_ms=100_000)
    assert r.expire(120_000) == []
    assert r.expire(120_001) == ["h:1"]
    route = r.topic_route("T")
    assert route is not None and [b["brokerName"] for b in route["brokerDatas"]] == ["b"]
    r.unregister_broker("C1", "b", "g:1", 0)
    assert r.topic_route("T") is None and r.cluster_info()["brokerAddrTable"] == {}


@pytest.fixture
async def ns():
    clock = VirtualClock()
    srv = NameServer("127.0.0.1", free_port(), clock)
    await srv.start()
    yield srv
    await srv.stop()


async def test_namesrv_over_tcp(ns: NameServer) -> None:
    c = await AsyncRawClient.connect(ns.address)
    resp = await c.request(RequestCode.GET_ROUTEINFO_BY_TOPIC, {"topic": "T"})
    assert resp.code == ResponseCode.TOPIC_NOT_EXIST and "T" in resp.remark
    resp = await c.request(
        RequestCode.REGISTER_BROKER,
        _reg_ext("a", "127.0.0.1:1001"),
        _register_body({"T": _tc("T"), "TBW102": _tc("TBW102", 8, 7)}),
    )
    assert resp.code == 0
    slave = await AsyncRawClient.connect(ns.address)
    resp = await slave.request(
        RequestCode.REGISTER_BROKER, _reg_ext("a", "127.0.0.1:1003", bid=1), _register_body({"T": _tc("T")})
    )
    assert resp.code == 0 and resp.ext_fields["masterAddr"] == "127.0.0.1:1001"
    resp = await c.request(RequestCode.GET_ROUTEINFO_BY_TOPIC, {"topic": "T"})
    route = json.loads(resp.body)
    assert resp.code == 0 and route["queueDatas"][0]["perm"] == 6
    assert route["brokerDatas"][0]["brokerAddrs"] == {"0": "127.0.0.1:1001", "1": "127.0.0.1:1003"}
    resp = await c.request(RequestCode.GET_ALL_TOPIC_LIST_FROM_NAMESERVER)
    assert json.loads(resp.body)["topicList"] == ["T", "TBW102"]
    resp = await c.request(RequestCode.GET_BROKER_CLUSTER_INFO)
    assert json.loads(resp.body)["clusterAddrTable"] == {"C1": ["a"]}
    # the slave's connection closes: it leaves the route, the master stays
    await slave.close()
    await async_wait_for(
        lambda: "1" not in ns.routes.brokers["a"].to_json()["brokerAddrs"], message="slave dropped on close"
    )
    # bad input is answered, not fatal
    resp = await c.request(RequestCode.REGISTER_BROKER, _reg_ext("a", "x:1"), b"{bad")
    assert resp.code == ResponseCode.SYSTEM_ERROR and "JSON" in resp.remark
    resp = await c.request(RequestCode.GET_ROUTEINFO_BY_TOPIC, {})
    assert resp.code == ResponseCode.SYSTEM_ERROR and "topic" in resp.remark
    resp = await c.request(RequestCode.SEND_MESSAGE, {})
    assert resp.code == ResponseCode.REQUEST_CODE_NOT_SUPPORTED
    resp = await c.request(RequestCode.UNREGISTER_BROKER, _reg_ext("a", "127.0.0.1:1001"))
    assert resp.code == 0
    resp = await c.request(RequestCode.GET_ROUTEINFO_BY_TOPIC, {"topic": "T"})
    assert resp.code == ResponseCode.TOPIC_NOT_EXIST
    await c.close()


async def test_silent_broker_expires_after_120s(ns: NameServer) -> None:
    c = await AsyncRawClient.connect(ns.address)
    await c.request(
        RequestCode.REGISTER_BROKER, _reg_ext("a", "127.0.0.1:1001"), _register_body({"T": _tc("T")})
    )
    clock = ns.clock
    assert isinstance(clock, VirtualClock)
    await clock.advance(110_000)
    assert ns.routes.topic_route("T") is not None
    # re-registration refreshes it
    await c.request(
        RequestCode.REGISTER_BROKER, _reg_ext("a", "127.0.0.1:1001"), _register_body({"T": _tc("T")})
    )
    await clock.advance(110_000)
    assert ns.routes.topic_route("T") is not None
    await clock.advance(20_000)
    assert ns.routes.topic_route("T") is None
    resp = await c.request(RequestCode.GET_ROUTEINFO_BY_TOPIC, {"topic": "T"})
    assert resp.code == ResponseCode.TOPIC_NOT_EXIST
    await c.close()
