"""Unit tests of chronomq.client against an in-process fake name server + broker written with the
sans-IO codec (FakeBroker below). The fake implements just the docs/protocol.md behaviour the client needs,
so these tests pin the client's side of each request."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import zlib
from collections import defaultdict
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.conftest import async_wait_for, free_port

from chronomq import message as m
from chronomq.client import (
    LATER,
    Admin,
    BrokerError,
    ClientClosed,
    ConnectFailed,
    InvalidMessage,
    Message,
    MessageQueue,
    MessageTooLarge,
    NoRouteError,
    NotPermitted,
    NotSupported,
    PendingPage,
    Producer,
    PullStatus,
    PushConsumer,
    RequestTimeout,
    SendFailed,
    SimpleConsumer,
    TimerOpResult,
    TimerOutcome,
    allocate_average,
)
from chronomq.client.model import ReceivedMessage, TopicRoute, decode_received, deliver_time_ms
from chronomq.clock import VirtualClock
from chronomq.remoting.client import RemotingClient, RemotingConnectError, RemotingTimeoutError
from chronomq.remoting.codec import (
    FrameDecoder,
    FrameError,
    RemotingCommand,
    decode_batch_body,
    encode,
)
from chronomq.remoting.codes import PULL_EXT_BULK_READ, SEND_V2_FIELDS, RequestCode, ResponseCode


class FakeBroker:
    """Name server and broker on one port. Messages live in memory as encoded V1 records."""

    def __init__(self, broker_name: str = "broker-a", queue_nums: int = 4) -> None:
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.broker_name = broker_name
        self.queue_nums = queue_nums
        self.topics: dict[str, int] = {m.DEFAULT_TOPIC: 8}
        self.perms: dict[str, int] = {}
        self.log: list[bytes] = []  # commit log: records in order
        self.phys: dict[int, int] = {}  # commit-log offset -> index in log
        self.next_phys = 0
        self.queues: dict[tuple[str, int], list[int]] = defaultdict(list)  # -> commit-log offsets
        self.offsets: dict[tuple[str, str, int], int] = {}
        self.groups: dict[str, dict[str, Any]] = defaultdict(dict)  # group -> clientID -> writer
        self.requests: list[RemotingCommand] = []
        self.silent_codes: set[int] = set()  # never answer these
        self.busy_codes: dict[int, int] = {}  # code -> number of SYSTEM_BUSY answers left
        self.locks: dict[tuple[str, MessageQueue], str] = {}
        self.server: asyncio.AbstractServer | None = None
        self.writers: set[asyncio.StreamWriter] = set()
        self.arrival = asyncio.Event()
        self.peers: dict[str, str] = {}  # other brokers this name server reports (GET_BROKER_CLUSTER_INFO)
        # a minimal model of chronomq's timer store: uniq key -> parked message and its state
        self.timer: dict[str, dict[str, Any]] = {}

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", self.port)

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for w in list(self.writers):
            w.close()
        await self.server.wait_closed()

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.add(writer)
        dec = FrameDecoder()
        try:
            while data := await reader.read(65536):
                for cmd in dec.feed(data):
                    assert not isinstance(cmd, FrameError)
                    if cmd.is_response:
                        continue
                    asyncio.get_running_loop().create_task(self._answer(cmd, writer))
        except (ConnectionError, OSError):
            pass
        finally:
            self.writers.discard(writer)
            for clients in self.groups.values():
                for cid in [c for c, w in clients.items() if w is writer]:
                    del clients[cid]

    async def _answer(self, cmd: RemotingCommand, writer: asyncio.StreamWriter) -> None:
        self.requests.append(cmd)
        if cmd.code in self.silent_codes:
            return
        if self.busy_codes.get(cmd.code, 0) > 0:
            self.busy_codes[cmd.code] -= 1
            resp = cmd.response(ResponseCode.SYSTEM_BUSY, remark="busy, try later")
        else:
            handler = getattr(self, f"_h{cmd.code}", None)
            if handler is None:
                resp = cmd.response(ResponseCode.REQUEST_CODE_NOT_SUPPORTED, remark="nope")
            else:
                resp = handler(cmd, writer)
                if asyncio.iscoroutine(resp):
                    resp = await resp
        if not cmd.is_oneway and not writer.is_closing():
            writer.write(encode(resp))

    # --- helpers -----------------------------------------------------------------------------------
    def route_body(self, topic: str) -> bytes:
        n = self.topics[topic]
        return json.dumps({"orderTopicConf": None,
                           "queueDatas": [{"brokerName": self.broker_name, "readQueueNums": n,
                                           "writeQueueNums": n, "perm": self.perms.get(topic, 6),
                                           "topicSysFlag": 0}],
                           "brokerDatas": [{"cluster": "c", "brokerName": self.broker_name,
                                            "brokerAddrs": {"0": self.addr}}],
                           "filterServerTable": {}}).encode()

    def put(self, ext: m.MessageExt) -> m.MessageExt:
        q = self.queues[(ext.topic, ext.queue_id)]
        ext.queue_offset = len(q)
        ext.commit_log_offset = self.next_phys
        ext.store_timestamp = int(time.time() * 1000)
        ext.store_host = ("127.0.0.1", self.port)
        rec = bytes(m.encode_record(ext))
        self.phys[self.next_phys] = len(self.log)
        self.log.append(rec)
        q.append(self.next_phys)
        self.next_phys += len(rec)
        self.arrival.set()
        return ext

    def messages(self, topic: str, qid: int | None = None) -> list[m.MessageExt]:
        out = []
        for (t, q), offs in sorted(self.queues.items()):
            if t == topic and (qid is None or q == qid):
                out += [m.decode_record(self.log[self.phys[o]]) for o in offs]
        return out

    # --- name server ---------------------------------------------------------------------------------
    def _h105(self, cmd: RemotingCommand, w: Any) -> RemotingCommand:
        topic = cmd.ext_str("topic") or ""
        if topic not in self.topics:
            return cmd.response(ResponseCode.TOPIC_NOT_EXIST, remark=f"No topic route info for {topic}")
        return cmd.response(body=self.route_body(topic))

    def _h106(self, cmd: RemotingCommand, w: Any) -> RemotingCommand:
        brokers = {self.broker_name: self.addr, **self.peers}
        table = {name: {"cluster": "c", "brokerName": name, "brokerAddrs": {"0": addr}}
                 for name, addr in brokers.items()}
        return cmd.response(body=json.dumps({"brokerAddrTable": table,
                                             "clusterAddrTable": {"c": sorted(brokers)}}).encode())

    def _h206(self, cmd: RemotingCommand, w: Any) -> RemotingCommand:
        return cmd.response(body=json.dumps({"topicList": sorted(self.topics)}).encode())

    # --- broker --------------------------------------------------------------------------------------
    def _h17(self, cmd: RemotingCommand, w: Any) -> RemotingCommand:
        self.topics[cmd.require_str("topic")] = cmd.ext_int("writeQueueNums")
        return cmd.response()

    def _send(self, cmd: RemotingCommand, batch: bool) -> RemotingCommand:
        ext = {SEND_V2_FIELDS.get(k, k): v for k, v in cmd.ext_fields.items()}
        c = RemotingCommand(code=cmd.code, ext_fields=ext)
        topic = c.require_str("topic")
        if self.perms.get(topic, 6) & 2 == 0:
            return cmd.response(ResponseCode.NO_PERMISSION, remark=f"topic {topic} is not writable")
        if topic not in self.topics:
            self.topics[topic] = min(c.ext_int("defaultTopicQueueNums"), self.queue_nums)
        qid = c.ext_int("queueId")
        items = decode_batch_body(cmd.body) if batch else None
        base = dict(sys_flag=c.ext_int("sysFlag"), born_timestamp=c.ext_int("bornTimestamp"), queue_id=qid,
                    born_host=("127.0.0.1", 1))
        if items is None and m.PROPERTY_TIMER_DELIVER_MS in (props := m.decode_properties(
                c.ext_str("properties", ""))):
            uniq = props[m.PROPERTY_UNIQ_KEY]
            deliver_ms = int(props[m.PROPERTY_TIMER_DELIVER_MS])
            self.timer[uniq] = {"ext": m.MessageExt(topic=topic, body=cmd.body, properties=props, **base),
                                "deliver_ms": deliver_ms, "state": "PENDING",
                                "created_ms": int(time.time() * 1000)}
            return cmd.response(ext_fields={"msgId": f"{len(self.timer):032X}", "queueId": str(qid),
                                            "queueOffset": "0", "uniqKey": uniq,
                                            "deliverMs": str(deliver_ms)})
        if items is not None and all(m.PROPERTY_TIMER_DELIVER_MS in it.properties for it in items):
            for it in items:
                self.timer[it.properties[m.PROPERTY_UNIQ_KEY]] = {
                    "ext": m.MessageExt(topic=topic, body=it.body, properties=it.properties, **base),
                    "deliver_ms": int(it.properties[m.PROPERTY_TIMER_DELIVER_MS]), "state": "PENDING",
                    "created_ms": int(time.time() * 1000)}
            return cmd.response(ext_fields={
                "msgId": ",".join("H" + it.properties[m.PROPERTY_UNIQ_KEY] for it in items),
                "queueId": str(qid),
                "queueOffset": "0", "uniqKey": ",".join(it.properties[m.PROPERTY_UNIQ_KEY] for it in items),
                "deliverMs": ",".join(it.properties[m.PROPERTY_TIMER_DELIVER_MS] for it in items)})
        if items is None:
            exts = [self.put(m.MessageExt(topic=topic, body=cmd.body, flag=c.ext_int("flag"),
                                          properties=m.decode_properties(c.ext_str("properties", "")),
                                          **base))]
        else:
            exts = [self.put(m.MessageExt(topic=topic, body=it.body, flag=it.flag, properties=it.properties,
                                          **base)) for it in items]
        return cmd.response(ext_fields={"msgId": ",".join(x.msg_id for x in exts), "queueId": qid,
                                        "queueOffset": exts[0].queue_offset})

    def _h10(self, cmd: RemotingCommand, w: Any) -> RemotingCommand:
        return self._send(cmd, cmd.ext_str("batch") in ("1", "true"))

    def _h310(self, cmd: RemotingCommand, w: Any) -> RemotingCommand:
        return self._send(cmd, False)

    def _h320(self, cmd: RemotingCommand, w: Any) -> RemotingCommand:
        return self._send(cmd, True)

    async def _h11(self, cmd: RemotingCommand, w: Any) -> RemotingCommand:
        topic, qid, off = cmd.require_str("topic"), cmd.ext_int("queueId"), cmd.ext_int("queueOffset")
        q = self.queues[(topic, qid)]
        if off == len(q) and cmd.ext_int("sysFlag") & 2:
            deadline = time.monotonic() + min(cmd.ext_int("suspendTimeoutMillis") / 1000, 1.0)
            while len(q) == off and time.monotonic() < deadline:
                self.arrival.clear()
                try:
                    await asyncio.wait_for(self.arrival.wait(), deadline - time.monotonic())
                except TimeoutError:
                    break
        ext = {"minOffset": 0, "maxOffset": len(q), "suggestWhichBrokerId": 0}
        if off > len(q):
            return cmd.response(ResponseCode.PULL_OFFSET_MOVED, {**ext, "nextBeginOffset": len(q)})
        if off == len(q):
            return cmd.response(ResponseCode.PULL_NOT_FOUND, {**ext, "nextBeginOffset": off})
        sel = q[off: off + cmd.ext_int("maxMsgNums")]
        body = b"".join(self.log[self.phys[o]] for o in sel)
        return cmd.response(ResponseCode.SUCCESS, {**ext, "nextBeginOffset": off + len(sel)}, body)

    def _h14(self, cmd: RemotingCommand, w: Any) -> RemotingCommand:
        key = (cmd.require_str("consumerGroup"), cmd.require_str("topic"), cmd.ext_int("queueId"))
        if key in self.offsets:
            return cmd.response(ext_fields={"offset": self.offsets[key]})
        return cmd.response(ResponseCode.QUERY_NOT_FOUND)

    def _h15(self, cmd: RemotingCommand, w: Any) -> RemotingCommand:
        key = (cmd.require_str("consumerGroup"), cmd.require_str("topic"), cmd.ext_int("queueId"))
        self.offsets[key] = cmd.ext_int("commitOffset")
        return cmd.response()

    def _h30(self, cmd: RemotingCommand, w: Any) -> RemotingCommand:
        return cmd.response(ext_fields={"offset": len(self.queues[(cmd.require_str("topic"),
                                                                   cmd.ext_int("queueId"))])})

    def _h31(self, cmd: RemotingCommand, w: Any) -> RemotingCommand:
        return cmd.response(ext_fields={"offset": 0})

    def _h29(self, cmd: RemotingCommand, w: Any) -> RemotingCommand:
        ts = cmd.ext_int("timestamp")
        msgs = self.messages(cmd.require_str("topic"), cmd.ext_int("queueId"))
        off = next((x.queue_offset for x in msgs if x.store_timestamp >= ts), len(msgs))
        return cmd.response(ext_fields={"offset": off})

    def _h33(self, cmd: RemotingCommand, w: Any) -> RemotingCommand:
        idx = self.phys.get(cmd.ext_int("offset"))
        if idx is None:
            return cmd.response(ResponseCode.SYSTEM_ERROR, remark="no message at that offset")
        return cmd.response(body=self.log[idx])

    def _h12(self, cmd: RemotingCommand, w: Any) -> RemotingCommand:
        key, topic = cmd.require_str("key"), cmd.require_str("topic")
        hits = [x for x in self.messages(topic) if key in x.keys or x.uniq_key == key]
        if not hits:
            return cmd.response(ResponseCode.QUERY_NOT_FOUND)
        return cmd.response(body=b"".join(self.log[self.phys[x.commit_log_offset]] for x in hits))

    def _h34(self, cmd: RemotingCommand, w: Any) -> RemotingCommand:
        data = json.loads(cmd.body)
        for c in data.get("consumerDataSet") or []:
            self.groups[c["groupName"]][data["clientID"]] = w
            for s in c["subscriptionDataSet"]:
                if s["topic"].startswith(m.RETRY_GROUP_TOPIC_PREFIX):
                    self.topics.setdefault(s["topic"], 1)
        return cmd.response()

    def _h35(self, cmd: RemotingCommand, w: Any) -> RemotingCommand:
        self.groups[cmd.ext_str("consumerGroup", "") or ""].pop(cmd.ext_str("clientID", "") or "", None)
        return cmd.response()

    def _h38(self, cmd: RemotingCommand, w: Any) -> RemotingCommand:
        ids = sorted(self.groups.get(cmd.require_str("consumerGroup"), {}))
        return cmd.response(body=json.dumps({"consumerIdList": ids}).encode())

    def _h36(self, cmd: RemotingCommand, w: Any) -> RemotingCommand:
        group = cmd.require_str("group")
        old = m.decode_record(self.log[self.phys[cmd.ext_int("offset")]])
        props = dict(old.properties)
        props.setdefault(m.PROPERTY_RETRY_TOPIC, old.topic)
        dead = old.reconsume_times >= cmd.ext_int("maxReconsumeTimes", 16)
        topic = (m.DLQ_GROUP_TOPIC_PREFIX if dead else m.RETRY_GROUP_TOPIC_PREFIX) + group
        self.topics.setdefault(topic, 1)
        self.put(m.MessageExt(topic=topic, body=old.body, properties=props, sys_flag=old.sys_flag,
                              reconsume_times=old.reconsume_times + 1, born_timestamp=old.born_timestamp))
        return cmd.response()

    def _h41(self, cmd: RemotingCommand, w: Any) -> RemotingCommand:
        data = json.loads(cmd.body)
        ok = []
        for q in data["mqSet"]:
            mq = MessageQueue(q["topic"], q["brokerName"], q["queueId"])
            owner = self.locks.setdefault((data["consumerGroup"], mq), data["clientId"])
            if owner == data["clientId"]:
                ok.append(q)
        return cmd.response(body=json.dumps({"lockOKMQSet": ok}).encode())

    def _h42(self, cmd: RemotingCommand, w: Any) -> RemotingCommand:
        data = json.loads(cmd.body)
        for q in data["mqSet"]:
            mq = MessageQueue(q["topic"], q["brokerName"], q["queueId"])
            if self.locks.get((data["consumerGroup"], mq)) == data["clientId"]:
                del self.locks[(data["consumerGroup"], mq)]
        return cmd.response()

    def _h9001(self, cmd: RemotingCommand, w: Any) -> RemotingCommand:
        return cmd.response(body=json.dumps({"levels": [], "early_deliveries": 0}).encode())

    # --- chronomq timer store (9002-9004) ------------------------------------------------------------
    def timer_deliver(self, uniq: str) -> None:
        """Deliver a parked message now (as the broker does when it falls due)."""
        t = self.timer[uniq]
        self.put(t["ext"])
        t["state"], t["done_ms"] = "DELIVERED", int(time.time() * 1000)

    def _timer_matches(self, cmd: RemotingCommand) -> list[str]:
        ident = cmd.require_str("id")
        if cmd.require_str("byKey") == "true":
            return [u for u, t in self.timer.items() if ident in t["ext"].keys]
        return [ident] if ident in self.timer else []

    def _timer_answer(self, cmd: RemotingCommand, results: list[dict[str, Any]]) -> RemotingCommand:
        if not results:
            results = [{"outcome": "UNKNOWN", "msg_id": cmd.require_str("id"), "deliver_ms": None,
                        "topic": None}]
        return cmd.response(body=json.dumps({"results": results}).encode())

    def _h9002(self, cmd: RemotingCommand, w: Any) -> RemotingCommand:
        out = []
        for u in self._timer_matches(cmd):
            t = self.timer[u]
            if t["state"] == "PENDING":
                t["state"], t["done_ms"] = "CANCELLED", int(time.time() * 1000)
                outcome, when = "CANCELLED", t["deliver_ms"]
            else:
                outcome, when = "ALREADY_" + t["state"], t["done_ms"]
            out.append({"outcome": outcome, "msg_id": u, "deliver_ms": when, "topic": t["ext"].topic})
        return self._timer_answer(cmd, out)

    def _h9003(self, cmd: RemotingCommand, w: Any) -> RemotingCommand:
        new = cmd.ext_int("deliverMs")
        out = []
        for u in self._timer_matches(cmd):
            t = self.timer[u]
            if t["state"] == "PENDING":
                t["deliver_ms"] = new
                out.append({"outcome": "RESCHEDULED", "msg_id": u, "deliver_ms": new,
                            "topic": t["ext"].topic})
            else:
                out.append({"outcome": "ALREADY_" + t["state"], "msg_id": u, "deliver_ms": t["done_ms"],
                            "topic": t["ext"].topic})
        return self._timer_answer(cmd, out)

    def _h9004(self, cmd: RemotingCommand, w: Any) -> RemotingCommand:
        topic, key, tag = cmd.ext_str("topic"), cmd.ext_str("key"), cmd.ext_str("tag")
        lo, hi = cmd.ext_int("startMs", 0), cmd.ext_int("endMs", 1 << 62)
        rows = sorted(((t["deliver_ms"], u, t) for u, t in self.timer.items() if t["state"] == "PENDING"
                       and (topic is None or t["ext"].topic == topic)
                       and (key is None or key in t["ext"].keys or key == u)
                       and (tag is None or t["ext"].tags == tag) and lo <= t["deliver_ms"] <= hi),
                      key=lambda r: (r[0], r[1]))
        if cmd.ext_str("countOnly") == "true":
            body = {"items": [], "next_cursor": None, "count": len(rows)}
            return cmd.response(body=json.dumps(body).encode())
        start, limit = int(cmd.ext_str("cursor") or 0), cmd.ext_int("limit", 100)
        page = rows[start: start + limit]
        items = [{"msg_id": u, "offset_msg_id": "H" + u, "topic": t["ext"].topic,
                  "queue_id": t["ext"].queue_id, "tags": t["ext"].tags, "keys": t["ext"].keys,
                  "deliver_ms": d, "created_ms": t["created_ms"], "body_size": len(t["ext"].body)}
                 for d, u, t in page]
        nxt = str(start + limit) if start + limit < len(rows) else None
        return cmd.response(body=json.dumps({"items": items, "next_cursor": nxt}).encode())


@pytest.fixture
async def broker():
    b = FakeBroker()
    await b.start()
    yield b
    await b.stop()


def codes(b: FakeBroker) -> list[int]:
    return [c.code for c in b.requests]


# --- remoting transport -------------------------------------------------------------------------------
async def test_remoting_multiplexes_out_of_order_and_recovers_after_timeout():
    port = free_port()
    conns = []

    async def serve(reader, writer):
        conns.append(writer)
        dec = FrameDecoder()
        while data := await reader.read(65536):
            cmds = dec.feed(data)
            for cmd in reversed(cmds):  # answer in reverse order
                if cmd.code == 999:
                    continue  # never answered
                writer.write(encode(cmd.response(ext_fields={"echo": cmd.ext_str("n")})))

    server = await asyncio.start_server(serve, "127.0.0.1", port)
    client = RemotingClient()
    addr = f"127.0.0.1:{port}"
    try:
        results = await asyncio.gather(*(client.invoke(addr, RemotingCommand.request(1, {"n": i}), 2.0)
                                         for i in range(50)))
        assert [r.ext_str("echo") for r in results] == [str(i) for i in range(50)]
        assert len(conns) == 1  # one connection per address
        with pytest.raises(RemotingTimeoutError):
            await client.invoke(addr, RemotingCommand.request(999), 0.2)
        r = await client.invoke(addr, RemotingCommand.request(1, {"n": "x"}), 2.0)
        assert r.ext_str("echo") == "x"
        assert len(conns) == 2  # the timed-out connection was replaced
    finally:
        await client.close()
        server.close()
        await server.wait_closed()
    with pytest.raises(RemotingConnectError):
        await RemotingClient().invoke(f"127.0.0.1:{free_port()}", RemotingCommand.request(1), 1.0)


async def test_remoting_coalesces_small_frames_and_writes_big_ones_at_once():
    """Small frames written in one loop turn leave in one send(); a frame of WRITE_NOW_BYTES or more goes
    at once (the broker starts on it while the next is built), after any kept before it, in order."""
    from chronomq.remoting import client as rc

    port = free_port()
    got = bytearray()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1 << 20):  # never answers
            got.extend(data)

    server = await asyncio.start_server(serve, "127.0.0.1", port)
    client = RemotingClient()
    addr = f"127.0.0.1:{port}"
    tasks: list[asyncio.Task] = []
    try:
        conn = await client._get(addr)
        writes: list[bytes] = []
        real_write = conn._writer.write

        def recording(data: bytes) -> None:
            writes.append(bytes(data))
            real_write(data)

        conn._writer.write = recording  # type: ignore[method-assign]

        def frames(*bodies: bytes) -> list[bytes]:
            cmds = [RemotingCommand.request(1, {"n": i}, b) for i, b in enumerate(bodies)]
            for cmd in cmds:
                tasks.append(asyncio.ensure_future(conn.request(cmd, 30.0)))
            return [encode(c) for c in cmds]

        async def turns() -> None:
            for _ in range(5):
                await asyncio.sleep(0)

        small = frames(b"a", b"b", b"c")
        await turns()  # the first goes alone (nothing in flight yet), the other two together
        assert writes == [small[0], small[1] + small[2]]
        writes.clear()
        big = b"x" * rc.WRITE_NOW_BYTES
        mixed = frames(b"d", big, big, b"e")
        await turns()  # "d" is kept, the big one behind it flushes both; the next big goes alone
        assert writes == [mixed[0] + mixed[1], mixed[2], mixed[3]]
        await async_wait_for(lambda: len(got) == sum(map(len, small + mixed)), 5)
        assert bytes(got) == b"".join(small + mixed)  # nothing lost or reordered
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()
        server.close()
        await server.wait_closed()


async def test_remoting_dispatches_server_requests_to_handler():
    port = free_port()
    got: list[RemotingCommand] = []
    answered = asyncio.Event()
    answer: list[RemotingCommand] = []

    async def serve(reader, writer):
        writer.write(encode(RemotingCommand.request(RequestCode.NOTIFY_CONSUMER_IDS_CHANGED,
                                                    {"consumerGroup": "g"})))
        dec = FrameDecoder()
        while data := await reader.read(65536):
            for cmd in dec.feed(data):
                if cmd.is_response:
                    answer.append(cmd)
                    answered.set()
                else:
                    writer.write(encode(cmd.response()))

    async def handler(addr, cmd):
        got.append(cmd)
        return cmd.response(ResponseCode.SUCCESS)

    server = await asyncio.start_server(serve, "127.0.0.1", port)
    client = RemotingClient(handler)
    try:
        await client.invoke(f"127.0.0.1:{port}", RemotingCommand.request(1), 2.0)
        await asyncio.wait_for(answered.wait(), 5)
        assert got[0].code == RequestCode.NOTIFY_CONSUMER_IDS_CHANGED
        assert answer[0].opaque == got[0].opaque and answer[0].is_response
    finally:
        await client.close()
        server.close()
        await server.wait_closed()


# --- model ---------------------------------------------------------------------------------------------
def test_allocate_average_matches_rocketmq():
    mqs = [MessageQueue("T", "b", i) for i in range(5)]
    got = {c: allocate_average(mqs, ["c1", "c2"], c) for c in ("c1", "c2")}
    assert [q.queue_id for q in got["c1"]] == [0, 1, 2]
    assert [q.queue_id for q in got["c2"]] == [3, 4]
    three = [allocate_average(mqs[:2], ["a", "b", "c"], c) for c in "abc"]
    assert [len(x) for x in three] == [1, 1, 0]
    assert allocate_average(mqs, ["a"], "zzz") == []


def test_route_parse_numeric_keys_and_perms():
    body = json.dumps({"queueDatas": [{"brokerName": "b", "readQueueNums": 2, "writeQueueNums": 3,
                                       "perm": 4}],
                       "brokerDatas": [{"brokerName": "b", "brokerAddrs": {0: "h:1", "1": "h:2"}}]})
    r = TopicRoute.parse("T", body.encode())
    assert r.master_addr("b") == "h:1"
    assert r.write_queues() == []  # read-only topic
    assert [q.queue_id for q in r.read_queues()] == [0, 1]


def test_message_validation():
    with pytest.raises(InvalidMessage):
        Message("bad topic!", b"x").validate()
    with pytest.raises(InvalidMessage):
        Message("T", b"").validate()
    with pytest.raises(InvalidMessage):
        Message("T", b"x", properties={"UNIQ_KEY": "x"}).wire_properties()
    p = Message("T", "x", keys=["k1", "k2"], tags="A", delay_level=2, properties={"u": "v"}).wire_properties()
    assert p == {"u": "v", "KEYS": "k1 k2", "TAGS": "A", "DELAY": "2"}


# --- producer ------------------------------------------------------------------------------------------
async def test_producer_send_autocreates_and_round_robins(broker):
    async with Producer("pg", broker.addr) as p:
        results = [await p.send(Message("NewTopic", f"m{i}".encode(), keys="k", tags="t",
                                        properties={"a": "b"})) for i in range(8)]
    assert {r.queue_id for r in results} == {0, 1, 2, 3}
    assert all(r.queue_offset == 1 for r in results[4:])
    stored = broker.messages("NewTopic")
    assert len(stored) == 8
    x = stored[0]
    assert x.properties["KEYS"] == "k" and x.properties["TAGS"] == "t" and x.properties["a"] == "b"
    assert x.properties["UNIQ_KEY"] in {r.msg_id for r in results}
    assert results[0].offset_msg_id == m.create_offset_msg_id(("127.0.0.1", broker.port), 0)
    c = codes(broker)
    assert c[:2] == [105, 105]  # topic unknown, then TBW102
    assert RequestCode.UNREGISTER_CLIENT in c


async def test_producer_compresses_large_bodies_and_refuses_too_large(broker):
    broker.topics["T"] = 1
    body = b"abc" * 5000
    async with Producer("pg", broker.addr, max_message_size=100_000) as p:
        await p.send(Message("T", body))
        x = broker.messages("T")[0]
        assert x.sys_flag & m.SYSFLAG_COMPRESSED and zlib.decompress(x.body) == body
        with pytest.raises(MessageTooLarge):
            await p.send(Message("T", os.urandom(200_000)))


async def test_producer_retries_busy_broker_and_reports_failures(broker):
    broker.topics["T"] = 2
    broker.busy_codes[RequestCode.SEND_MESSAGE_V2] = 1
    async with Producer("pg", broker.addr, retries=2) as p:
        r = await p.send(Message("T", b"x"))
        assert r.queue_offset == 0
        broker.busy_codes[RequestCode.SEND_MESSAGE_V2] = 10
        with pytest.raises(SendFailed) as ei:
            await p.send(Message("T", b"x"))
        assert len(ei.value.attempts) == 3 and "SYSTEM_BUSY" in str(ei.value)
        broker.perms["T"] = 4  # read only: no writable queue
        p._instance.routes.clear()
        with pytest.raises(NoRouteError):
            await p.send(Message("T", b"x"))


async def test_producer_timeout_is_typed(broker):
    broker.topics["T"] = 1
    broker.silent_codes.add(RequestCode.SEND_MESSAGE_V2)
    async with Producer("pg", broker.addr, send_timeout=0.3, retries=0) as p:
        with pytest.raises(RequestTimeout):
            await p.send(Message("T", b"x"))


async def test_producer_no_permission_from_broker(broker):
    broker.topics["T"] = 1
    async with Producer("pg", broker.addr, retries=0) as p:
        await p.send(Message("T", b"x"))  # route cached as writable
        broker.perms["T"] = 4
        with pytest.raises(NotPermitted):
            await p.send(Message("T", b"x"))


async def test_producer_batch_oneway_ordered_and_concurrent(broker):
    broker.topics["T"] = 4
    async with Producer("pg", broker.addr) as p:
        r = await p.send_batch([Message("T", f"b{i}", keys=f"k{i}", tags="B") for i in range(5)])
        assert len(r.msg_ids) == 5 and len(r.offset_msg_id.split(",")) == 5
        got = broker.messages("T", r.queue_id)
        assert [x.body for x in got] == [f"b{i}".encode() for i in range(5)]
        assert [x.uniq_key for x in got] == list(r.msg_ids)
        with pytest.raises(InvalidMessage):
            await p.send_batch([Message("T", b"x"), Message("U", b"y")])
        await p.send_oneway(Message("T", b"one"))
        await async_wait_for(lambda: any(x.body == b"one" for x in broker.messages("T")))
        ordered = [await p.send_ordered(Message("T", f"o{i}"), key="order-1") for i in range(6)]
        assert len({r.queue_id for r in ordered}) == 1
        many = await asyncio.gather(*(p.send(Message("T", f"c{i}")) for i in range(200)))
        assert len({r.msg_id for r in many}) == 200
    with pytest.raises(ClientClosed):
        await p.send(Message("T", b"x"))


async def test_producer_unreachable_name_server_is_typed():
    async with Producer("pg", f"127.0.0.1:{free_port()}", retries=0) as p:
        with pytest.raises(ConnectFailed):
            await p.send(Message("T", b"x"))


# --- simple consumer / admin ---------------------------------------------------------------------------
async def test_simple_consumer_pull_and_offsets(broker):
    broker.topics["T"] = 1
    async with Producer("pg", broker.addr) as p:
        for i in range(5):
            await p.send(Message("T", f"m{i}", tags="A" if i % 2 else "B"))
    async with SimpleConsumer("sg", broker.addr) as c:
        (q,) = await c.queues("T")
        res = await c.pull(q, 0, 3)
        assert res.status == PullStatus.FOUND and [x.body for x in res.messages] == [b"m0", b"m1", b"m2"]
        assert res.next_offset == 3 and res.max_offset == 5
        res = await c.pull(q, 0, 32, expression="A")
        assert [x.body for x in res.messages] == [b"m1", b"m3"]
        res = await c.pull(q, 5, 32)
        assert res.status == PullStatus.NO_NEW_MSG
        res = await c.pull(q, 9, 32)
        assert res.status == PullStatus.OFFSET_ILLEGAL and res.next_offset == 5
        assert await c.max_offset(q) == 5 and await c.min_offset(q) == 0
        assert await c.offset_for_timestamp(q, 0) == 0
        assert await c.committed_offset(q) is None
        await c.commit_offset(q, 4)
        assert await c.committed_offset(q) == 4
        t0 = time.monotonic()
        waiter = asyncio.ensure_future(c.pull(q, 5, 32, timeout=5))
        await asyncio.sleep(0.05)
        broker.put(m.MessageExt(topic="T", body=b"late", queue_id=0))
        res = await waiter
        assert [x.body for x in res.messages] == [b"late"] and time.monotonic() - t0 < 4
        with pytest.raises(NoRouteError):
            await c.queues("Missing")


async def test_admin_topics_progress_lookup_reset_dlq_and_stats(broker):
    async with Admin(broker.addr) as a:
        assert await a.create_topic("AdminT", 2) == ["broker-a"]
        assert "AdminT" in await a.list_topics()
        assert len(await a.queues("AdminT")) == 2
        async with Producer("pg", broker.addr) as p:
            rs = [await p.send(Message("AdminT", f"m{i}", keys=f"key{i} common")) for i in range(6)]
        got = await a.get_message(rs[0].offset_msg_id)
        assert got.body == b"m0" and got.id == rs[0].msg_id
        by_client_id = await a.get_message(rs[1].msg_id, topic="AdminT")
        assert by_client_id.body == b"m1"
        common = await a.query_messages("AdminT", "common")
        assert {x.body for x in common} == {f"m{i}".encode() for i in range(6)}
        assert [x.body for x in await a.query_messages("AdminT", "key3")] == [b"m3"]
        prog = await a.group_progress("G", "AdminT")
        assert sum(r.lag for r in prog) == 6 and all(r.consumer_offset == -1 for r in prog)
        reset = await a.reset_offsets("G", "AdminT", 0)
        assert set(reset.values()) == {0}
        prog = await a.group_progress("G", "AdminT")
        assert all(r.consumer_offset == 0 for r in prog)
        # DLQ redrive: park two messages in %DLQ%G, move them back once
        broker.topics["%DLQ%G"] = 1
        for i in range(2):
            broker.put(m.MessageExt(topic="%DLQ%G", body=f"dead{i}".encode(),
                                    properties={"RETRY_TOPIC": "AdminT", "TAGS": "x", "u": "1"}))
        assert await a.redrive_dlq("G") == 2
        assert await a.redrive_dlq("G") == 0
        back = [x for x in broker.messages("AdminT") if x.body.startswith(b"dead")]
        assert len(back) == 2 and back[0].properties["u"] == "1" and back[0].tags == "x"
        assert "RETRY_TOPIC" not in back[0].properties
        assert await a.delay_stats() == {"broker-a": {"levels": [], "early_deliveries": 0}}


# --- push consumer -------------------------------------------------------------------------------------
async def test_push_consumer_consumes_retries_and_commits(broker):
    broker.topics["T"] = 2
    got: list[tuple[str, int]] = []
    fails = {"m1"}

    async def listener(msg):
        body = msg.body.decode()
        got.append((body, msg.reconsume_times))
        if body in fails and msg.reconsume_times == 0:
            return LATER
        return None

    async with Producer("pg", broker.addr) as p:
        for i in range(4):
            await p.send(Message("T", f"m{i}", tags="A"))
    c = PushConsumer("G", {"T": "A"}, listener, broker.addr, consume_from="first",
                     rebalance_interval=0.2, offset_commit_interval=0.2, long_poll_timeout=0.5)
    async with c:
        await async_wait_for(lambda: len(got) >= 5, message="4 deliveries + 1 retry")
        assert ("m1", 1) in got  # redelivered from %RETRY%G with the original topic
        assert len(c.assigned_queues()) == 3  # 2 queues of T + the retry queue
        await async_wait_for(lambda: broker.offsets.get(("G", "T", 0)) == 2
                             and broker.offsets.get(("G", "T", 1)) == 2, message="offsets committed")
    hb = [json.loads(x.body) for x in broker.requests if x.code == RequestCode.HEART_BEAT]
    subs = {s["topic"] for s in hb[0]["consumerDataSet"][0]["subscriptionDataSet"]}
    assert subs == {"T", "%RETRY%G"}
    # the consumer unregisters on close; its offset-commit loop may still finish a pass in that round trip
    codes = [x.code for x in broker.requests]
    assert RequestCode.UNREGISTER_CLIENT in codes
    after = codes[len(codes) - 1 - codes[::-1].index(RequestCode.UNREGISTER_CLIENT) + 1:]
    assert set(after) <= {RequestCode.UPDATE_CONSUMER_OFFSET}, after


async def test_push_consumers_split_queues_and_take_over(broker):
    broker.topics["T"] = 4
    seen: dict[str, list[bytes]] = {"a": [], "b": []}

    def make(name):
        return PushConsumer("G2", "T", lambda msg: seen[name].append(msg.body), broker.addr,
                            rebalance_interval=0.2, long_poll_timeout=0.3, offset_commit_interval=0.2)

    a, b = make("a"), make("b")
    await a.start()
    await b.start()
    try:
        await async_wait_for(lambda: len([q for q in a.assigned_queues() if q.topic == "T"]) == 2
                             and len([q for q in b.assigned_queues() if q.topic == "T"]) == 2,
                             message="2+2 split")
        await b.close()
        await async_wait_for(lambda: len([q for q in a.assigned_queues() if q.topic == "T"]) == 4,
                             message="takeover")
        async with Producer("pg", broker.addr) as p:
            for i in range(8):
                await p.send(Message("T", f"x{i}"))
        await async_wait_for(lambda: len(seen["a"]) == 8)
    finally:
        await a.close()
        await b.close()


async def test_push_consumer_flow_control_and_orderly(broker):
    broker.topics["T"] = 1
    async with Producer("pg", broker.addr) as p:
        for i in range(30):
            await p.send(Message("T", f"{i}"))
    gate = asyncio.Event()
    order: list[int] = []
    fail_once = {5}

    async def listener(msg):
        await gate.wait()
        n = int(msg.body)
        if n in fail_once:
            fail_once.discard(n)
            return "later"
        order.append(n)

    c = PushConsumer("G3", "T", listener, broker.addr, consume_from="first", orderly=True,
                     max_inflight_per_queue=4, pull_batch_size=2, orderly_retry_delay=0.05,
                     rebalance_interval=0.2, long_poll_timeout=0.3)
    async with c:
        await async_wait_for(lambda: c._pqs and len(next(iter(c._pqs.values())).msgs) >= 4)
        pq = next(q for q in c._pqs.values() if q.mq.topic == "T")
        assert len(pq.msgs) <= 4 + 1  # capped (one pull batch may straddle the cap)
        gate.set()
        await async_wait_for(lambda: len(order) == 30)
    assert order == list(range(30))  # in order, the failed one re-consumed locally before the next
    assert broker.locks == {}  # unlocked on close
    assert RequestCode.CONSUMER_SEND_MSG_BACK not in codes(broker)


async def test_push_consumer_broadcasting_gets_everything(broker):
    broker.topics["T"] = 2
    seen: dict[str, list[bytes]] = {"a": [], "b": []}
    def collector(name):
        return lambda msg: seen[name].append(msg.body)

    cs = [PushConsumer("GB", "T", collector(n), broker.addr, broadcasting=True, long_poll_timeout=0.3,
                       rebalance_interval=0.2) for n in "ab"]
    for c in cs:
        await c.start()
    try:
        async with Producer("pg", broker.addr) as p:
            for i in range(6):
                await p.send(Message("T", f"x{i}"))
        await async_wait_for(lambda: len(seen["a"]) == 6 and len(seen["b"]) == 6)
        assert all(len(c.assigned_queues()) == 2 for c in cs)  # no retry topic in broadcasting
    finally:
        for c in cs:
            await c.close()


async def test_push_consumer_notify_triggers_rebalance(broker):
    broker.topics["T"] = 2
    a = PushConsumer("GN", "T", lambda msg: None, broker.addr, rebalance_interval=60, long_poll_timeout=0.3)
    b = PushConsumer("GN", "T", lambda msg: None, broker.addr, rebalance_interval=60, long_poll_timeout=0.3)
    await a.start()
    try:
        assert len([q for q in a.assigned_queues() if q.topic == "T"]) == 2
        await b.start()
        for w in list(broker.groups["GN"].values()):
            w.write(encode(RemotingCommand.request(RequestCode.NOTIFY_CONSUMER_IDS_CHANGED,
                                                   {"consumerGroup": "GN"})))
        await async_wait_for(lambda: len([q for q in a.assigned_queues() if q.topic == "T"]) == 1,
                             timeout=5, message="rebalance on notify, not on the 60 s timer")
    finally:
        await b.close()
        await a.close()


async def test_an_offset_reset_and_a_rebalance_pass_never_interleave(broker):
    """A rebalance pass run while the broker's offset reset had stopped a queue (and was storing its new
    offset) took the queue too; the reset's own take then replaced it in the table, and the pass's pull
    task ran on unseen: two pull tasks on one queue, every later message handed on twice."""
    broker.topics["T"] = 1
    c = PushConsumer("GR", "T", lambda msg: None, broker.addr, rebalance_interval=60, long_poll_timeout=0.3)
    await c.start()
    try:
        [mq] = [q for q in c.assigned_queues() if q.topic == "T"]
        store, entered, gate = c._offset_commit.store, asyncio.Event(), asyncio.Event()

        async def held_store(q, offset):
            entered.set()
            await gate.wait()
            return await store(q, offset)

        c._offset_commit.store = held_store
        reset = asyncio.create_task(c.reset_offsets("T", {mq: 0}))
        await asyncio.wait_for(entered.wait(), 10)
        rebalance = asyncio.create_task(c._rebalancer.rebalance())
        await asyncio.wait({rebalance}, timeout=1.0)  # as far as the pass gets while the reset holds
        gate.set()
        assert await asyncio.wait_for(reset, 10) == [mq]
        await asyncio.wait_for(rebalance, 10)
        pullers = [t for t in asyncio.all_tasks() if t.get_name() == f"chronomq-pull-{mq}" and not t.done()]
        assert len(pullers) == 1, "one pull task per queue"
        assert c.offsets()[mq] == 0
    finally:
        await c.close()


# --- blocking facade -----------------------------------------------------------------------------------
def test_blocking_facade_and_no_leaked_threads():
    before = {t.name for t in threading.enumerate()}
    loop = asyncio.new_event_loop()
    b = FakeBroker()
    ready = threading.Event()

    def serve():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(b.start())
        ready.set()
        loop.run_forever()

    t = threading.Thread(target=serve)
    t.start()
    ready.wait(5)
    try:
        got: list[bytes] = []
        with Producer("pg", b.addr) as p:
            r = p.send(Message("BT", b"hello"))
            assert r.queue_offset == 0
            p.send_batch([Message("BT", b"a"), Message("BT", b"b")])
            with PushConsumer("BG", "BT", lambda msg: got.append(msg.body), b.addr, consume_from="first",
                              long_poll_timeout=0.3) as c:
                wait_until = time.monotonic() + 10
                while len(got) < 3 and time.monotonic() < wait_until:
                    time.sleep(0.01)
                assert sorted(got) == [b"a", b"b", b"hello"]
                assert c.assigned_queues()
        with SimpleConsumer("sg", b.addr) as s, Admin(b.addr) as a:
            qs = s.queues("BT")
            assert sum(s.max_offset(q) for q in qs) == 3
            assert "BT" in a.list_topics()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        t.join(5)
    leaked = {t.name for t in threading.enumerate()} - before
    assert not [n for n in leaked if n.startswith("chronomq")], leaked


async def test_close_does_not_hang_on_a_stuck_listener(broker):
    broker.topics["T"] = 1
    release = threading.Event()
    entered = threading.Event()

    def stuck(msg):
        entered.set()
        release.wait(30)

    async with Producer("pg", broker.addr) as p:
        await p.send(Message("T", b"x"))
    c = PushConsumer("GS", "T", stuck, broker.addr, consume_from="first", shutdown_timeout=0.3,
                     long_poll_timeout=0.3)
    await c.start()
    try:
        await async_wait_for(entered.is_set)
        t0 = time.monotonic()
        await asyncio.wait_for(c.close(), 10)
        assert time.monotonic() - t0 < 5
        # the unconsumed message was not committed: the next consumer gets it again
        assert broker.offsets.get(("GS", "T", 0), 0) == 0
    finally:
        release.set()


async def test_a_listener_that_finishes_during_close_is_committed(broker):
    broker.topics["T"] = 1
    entered = asyncio.Event()
    release = asyncio.Event()

    async def slow(msg):
        entered.set()
        await release.wait()

    async with Producer("pg", broker.addr) as p:
        await p.send(Message("T", b"x"))
    c = PushConsumer("GF", "T", slow, broker.addr, consume_from="first", shutdown_timeout=10,
                     long_poll_timeout=0.3, offset_commit_interval=60)
    await c.start()
    await asyncio.wait_for(entered.wait(), 10)
    closing = asyncio.ensure_future(c.close())  # graceful: waits for the running listener
    await asyncio.sleep(0)
    release.set()  # the listener finishes while the consumer is closing
    await asyncio.wait_for(closing, 10)
    assert broker.offsets.get(("GF", "T", 0)) == 1  # committed by the final commit: not delivered again


async def test_listener_result_validation_and_bad_subscriptions(broker):
    with pytest.raises(ValueError):
        PushConsumer("G", {"bad topic!": "*"}, print, broker.addr)
    with pytest.raises(ValueError):
        PushConsumer("G", "T", print, broker.addr, consume_from="timestamp")
    with pytest.raises(ValueError):
        PushConsumer("", "T", print, broker.addr)
    with pytest.raises(ValueError):
        Producer("pg", "no-port")
    broker.topics["T"] = 1
    results = []

    def odd(msg):
        results.append(msg.reconsume_times)
        return 42 if msg.reconsume_times == 0 else None  # not a valid result: treated as a failure

    async with Producer("pg", broker.addr) as p:
        await p.send(Message("T", b"x"))
    async with PushConsumer("GV", "T", odd, broker.addr, consume_from="first", long_poll_timeout=0.3,
                            rebalance_interval=0.2):
        await async_wait_for(lambda: results == [0, 1], message="redelivered after the invalid result")


def test_blocking_call_from_the_loop_thread_is_refused():
    from chronomq.client.blocking import LoopThread

    lt = LoopThread.acquire()
    try:
        async def inner():
            coro = asyncio.sleep(0)
            with pytest.raises(RuntimeError, match="own event loop"):
                lt.run(coro)

        lt.run(inner())
    finally:
        lt.release()


async def test_name_server_failover_and_connection_reuse(broker):
    dead = f"127.0.0.1:{free_port()}"
    broker.topics["T"] = 1
    async with Producer("pg", [dead, broker.addr], retries=0) as p:
        r = await p.send(Message("T", b"x"))
        assert r.queue_offset == 0
        assert p._instance.namesrv_addrs[p._instance._ns_index] == broker.addr  # sticks to the live one
        await p.send(Message("T", b"y"))
        # one connection to the broker/name server (same address here) served every request
        assert len(broker.writers) == 1


async def test_no_task_left_after_close(broker):
    broker.topics["T"] = 2
    got = []
    async with Producer("pg", broker.addr) as p, \
            PushConsumer("GT", "T", got.append, broker.addr, consume_from="first", long_poll_timeout=0.3,
                         orderly=True), \
            SimpleConsumer("st", broker.addr) as s, Admin(broker.addr) as a:
        await p.send(Message("T", b"x"))
        await async_wait_for(lambda: got)
        await s.queues("T")
        await a.list_topics()
        assert [t for t in asyncio.all_tasks() if t.get_name().startswith("chronomq")]
    await asyncio.sleep(0)
    left = [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("chronomq")]
    assert left == []


# --- deliver times, caller-chosen ids, timer admin -------------------------------------------------------
def test_deliver_time_properties_and_validation():
    at = datetime(2030, 1, 2, 3, 4, 5, 678000, tzinfo=UTC)
    at_ms = 1_893_553_445_678
    assert deliver_time_ms(at, None) == at_ms
    # another zone, same instant
    assert deliver_time_ms(at.astimezone(timezone(timedelta(hours=-5))), None) == at_ms
    assert Message("T", b"x", deliver_at=at).wire_properties() == {"TIMER_DELIVER_MS": str(at_ms)}
    assert Message("T", b"x", deliver_at=at_ms).wire_properties() == {"TIMER_DELIVER_MS": str(at_ms)}
    # delays count from now, rounded up to the ms (never earlier than asked)
    assert deliver_time_ms(None, 1.5, now_ms=1000) == 2500
    assert deliver_time_ms(None, 0.0001, now_ms=1000) == 1001
    assert deliver_time_ms(None, timedelta(minutes=2), now_ms=0) == 120_000
    assert deliver_time_ms(None, 0, now_ms=7) == 7
    before = int(time.time() * 1000)
    got = int(Message("T", b"x", delay=timedelta(seconds=3)).wire_properties()["TIMER_DELIVER_MS"])
    assert before + 3000 <= got <= int(time.time() * 1000) + 3000
    assert Message("T", b"x", delay=2).deliver_ms(now_ms=10) == 2010
    assert Message("T", b"x").deliver_ms() is None
    bad = [
        (dict(deliver_at=datetime(2030, 1, 1)), "timezone-aware"),          # naive: ambiguous
        (dict(deliver_at=at, delay=1), "not both"),
        (dict(delay=-0.5), ">= 0"),
        (dict(delay=timedelta(seconds=-1)), ">= 0"),
        (dict(delay=float("nan")), "finite"),
        (dict(delay=float("inf")), "finite"),
        (dict(delay="5"), "timedelta or seconds"),
        (dict(delay=True), "timedelta or seconds"),
        (dict(deliver_at=1_700_000_000), "epoch seconds"),                    # seconds, not ms
        (dict(deliver_at=-1), "epoch"),
        (dict(deliver_at=1.5e12), "datetime or epoch ms"),
        (dict(deliver_at=True), "datetime or epoch ms"),
        (dict(deliver_at=datetime(1960, 1, 1, tzinfo=UTC)), "before 1970"),
        (dict(delay=5, delay_level=3), "delay_level"),
        (dict(delay=5, properties={"TIMER_DELAY_SEC": "9"}), "not both"),
        (dict(deliver_at=at_ms, properties={"__STARTDELIVERTIME": "9"}), "not both"),
    ]
    for kwargs, match in bad:
        with pytest.raises(InvalidMessage, match=match):
            Message("T", b"x", **kwargs).wire_properties()  # type: ignore[arg-type]
    # the ecosystem properties themselves stay usable without deliver_at/delay
    raw = Message("T", b"x", properties={"TIMER_DELAY_SEC": "9"}).wire_properties()
    assert raw == {"TIMER_DELAY_SEC": "9"}


def test_generated_ids_never_look_like_a_timer_handle():
    from chronomq.client.producer import _UniqIdGen

    for _ in range(200):
        uid = _UniqIdGen("10.1.2.3").next()
        assert len(uid) == 32 and uid.startswith("0A010203")
        # read as an offset msgId, bits 63..62 of the offset (chronomq's timer-handle flag) are clear
        _host, off = m.decode_offset_msg_id(uid)
        assert 0 <= off < 1 << 62


def test_uniq_key_validation():
    Message("T", b"x", uniq_key="a" * 128).validate()
    Message("T", b"x", uniq_key="q1-b7-p3-r42 with space").validate()
    for bad, match in (("", "empty"), ("a" * 129, "more than 128"), ("a\x01b", "x01"), ("a\x02", "x01"),
                       (17, "must be a str")):
        with pytest.raises(InvalidMessage, match=match):
            Message("T", b"x", uniq_key=bad).validate()  # type: ignore[arg-type]


async def test_producer_uses_caller_uniq_keys_single_and_batch(broker):
    broker.topics["T"] = 2
    async with Producer("pg", broker.addr) as p:
        r = await p.send(Message("T", b"one", uniq_key="job-1/row-0"))
        assert r.msg_id == r.uniq_key == "job-1/row-0" and r.msg_ids == ("job-1/row-0",)
        assert r.deliver_ms is None and not r.scheduled
        plain = await p.send(Message("T", b"gen"))
        assert plain.uniq_key == plain.msg_id and len(plain.msg_id) == 32 and plain.msg_id != "job-1/row-0"
        ids = [f"job-1/row-{i}" for i in range(1, 4)]
        b = await p.send_batch([Message("T", f"b{i}", uniq_key=u) for i, u in enumerate(ids)]
                               + [Message("T", b"generated")])
        assert list(b.msg_ids[:3]) == ids and len(b.msg_ids[3]) == 32
        stored = {x.body: x.uniq_key for x in broker.messages("T")}
        assert stored[b"one"] == "job-1/row-0" and stored[b"b2"] == "job-1/row-3"
        assert stored[b"generated"] == b.msg_ids[3]
        # a re-send with the same key carries the same id (the point of caller-chosen ids)
        again = await p.send(Message("T", b"one", uniq_key="job-1/row-0"))
        assert again.msg_id == "job-1/row-0"
        with pytest.raises(InvalidMessage, match="uniq_key"):
            await p.send_batch([Message("T", b"x", uniq_key="")])
    assert sum(1 for x in broker.messages("T") if x.uniq_key == "job-1/row-0") == 2


async def test_encode_rows_is_send_batch_from_columns(broker):
    """encode_rows + send_encoded_batch: the bytes and the checks of send_batch for the same messages,
    without a Message per row (the Spark sink's path)."""
    from chronomq.client import encode_rows
    from chronomq.remoting.codec import BatchItem, encode_batch_body

    broker.topics["T"] = 1
    msgs = [Message("T", b"a", uniq_key="u0", dedup=True),
            Message("T", b"b", keys=["k1", "k2"], tags="tg", properties={"x": "1", "y": "2"}, uniq_key="u1",
                    dedup=True)]
    items = []
    for msg in msgs:
        props = msg.wire_properties()
        props[m.PROPERTY_UNIQ_KEY] = msg.uniq_key
        props[m.PROPERTY_WAIT_STORE_MSG_OK] = "true"
        items.append(BatchItem(body=msg.body_bytes(), properties=props))
    data = encode_rows([b"a", b"b"], ["u0", "u1"], keys=[None, "k1 k2"], tags=[None, "tg"],
                       properties=[None, [("x", "1"), ("y", "2"), ("z", None)]], dedup=True)
    assert data == encode_batch_body(items)
    async with Producer("pg", broker.addr) as p:
        r = await p.send_encoded_batch("T", data, ["u0", "u1"])
        assert r.msg_ids == ("u0", "u1")
        got = broker.messages("T")
        assert [(x.body, x.uniq_key, x.tags, x.keys) for x in got] == [(b"a", "u0", None, []),
                                                                       (b"b", "u1", "tg", ["k1", "k2"])]
        with pytest.raises(InvalidMessage, match="system topic"):
            await p.send_encoded_batch(m.SCHEDULE_TOPIC, data, ["u0", "u1"])
    for bad, match in (({"bodies": [b""]}, "row 0: the message body is empty"),
                       ({"tags": ["a\x01b"]}, "row 0: invalid tags"),
                       ({"properties": [[("UNIQ_KEY", "v")]]}, "row 0: property 'UNIQ_KEY' is reserved"),
                       ({"properties": [[("k", "a\x02")]]}, "row 0: property"),
                       ({"uniq_keys": [""]}, "row 0: uniq_key must not be empty")):
        args = {"bodies": [b"x"], "uniq_keys": ["u"], **bad}
        with pytest.raises(InvalidMessage, match=match):
            encode_rows(args.pop("bodies"), args.pop("uniq_keys"), **args)
    with pytest.raises(MessageTooLarge):
        encode_rows([b"x"], ["u"], properties=[[("k", "v" * 40_000)]])


_message_fields = st.fixed_dictionaries({}, optional={
    "keys": st.one_of(st.text("ab ", max_size=6),
                      st.lists(st.text("xy", min_size=1, max_size=3), max_size=3)),
    "tags": st.text("tg", min_size=1, max_size=4),
    "properties": st.dictionaries(st.one_of(st.text("pq", min_size=1, max_size=3), st.just("WAIT")),
                                  st.text("vw", max_size=3), max_size=3),
    "uniq_key": st.text("U0", min_size=1, max_size=8),
    "dedup": st.booleans(),
    "flag": st.integers(0, 7),
})


@settings(max_examples=60, deadline=None)
@given(fields=st.lists(_message_fields, min_size=1, max_size=6),
       timing=st.sampled_from(["none", "at", "delay"]),
       bodies=st.lists(st.binary(min_size=1, max_size=40), min_size=6, max_size=6))
def test_encode_batch_is_the_reference_encoding(fields, timing, bodies):
    """send_batch's encoding (no dict per message, ids taken at once) gives the bytes of the reference
    path: each message's wire_properties plus UNIQ_KEY and WAIT, through encode_batch_body."""
    from chronomq.clock import VirtualClock
    from chronomq.remoting.codec import BatchItem, encode_batch_body

    clock = VirtualClock()
    p = Producer("pg", "127.0.0.1:1", clock=clock)
    timed = {"none": {}, "at": {"deliver_at": clock.now_ms() + 5_000}, "delay": {"delay": 2.5}}[timing]
    msgs = [Message("T", bodies[i], **f, **timed) for i, f in enumerate(fields)]
    topic, data, ids = p.encode_batch(msgs)
    assert topic == "T" and len(ids) == len(msgs)
    generated = [u for msg, u in zip(msgs, ids, strict=True) if msg.uniq_key is None]
    assert len(set(generated)) == len(generated)
    assert all(len(u) == 32 and u[:20] == p._ids._prefix and int(u, 16) >= 0 for u in generated)
    items = []
    for msg, uniq in zip(msgs, ids, strict=True):
        if msg.uniq_key is not None:
            assert uniq == msg.uniq_key
        props = msg.wire_properties(clock.now_ms())
        props[m.PROPERTY_UNIQ_KEY] = uniq
        props[m.PROPERTY_WAIT_STORE_MSG_OK] = "true"
        items.append(BatchItem(body=msg.body_bytes(), properties=props, flag=msg.flag))
    assert data == encode_batch_body(items)


def test_uniq_ids_taken_at_once_never_repeat_past_the_16_bit_counter():
    from chronomq.client.producer import _UniqIdGen

    gen = _UniqIdGen("10.0.0.1")
    ids = gen.take(70_000) + gen.take(3) + [gen.next()]
    assert len(set(ids)) == len(ids) == 70_004


def test_encode_batch_refuses_what_send_batch_refuses():
    p = Producer("pg", "127.0.0.1:1")
    for msgs, err, match in (
            ([], InvalidMessage, "at least one"),
            ([Message("bad topic!", b"x")], InvalidMessage, "invalid topic"),
            ([Message("T", b"x"), "not a message"], InvalidMessage, "expected chronomq.client.Message"),
            ([Message("T", b"x"), Message("U", b"y")], InvalidMessage, "one topic"),
            ([Message("T", b"")], InvalidMessage, "body is empty"),
            ([Message("T", b"x", tags="a\x01")], InvalidMessage, "invalid tags"),
            ([Message("T", b"x", deliver_at=5)], InvalidMessage, "epoch"),
            ([Message("T", b"x", delay=1, deliver_at=2_000_000_000_000)], InvalidMessage, "not both"),
            ([Message("T", b"x", properties={"UNIQ_KEY": "u"})], InvalidMessage, "reserved"),
            ([Message("T", b"x", properties={"k": "v" * 40_000})], MessageTooLarge, "32767")):
        with pytest.raises(err, match=match):
            p.encode_batch(msgs)


async def test_producer_deliver_time_send_result(broker):
    broker.topics["T"] = 1
    async with Producer("pg", broker.addr) as p:
        t0 = int(time.time() * 1000)
        r = await p.send(Message("T", b"later", keys="order-9", delay=1.5))
        t1 = int(time.time() * 1000)
        parked = broker.timer[r.msg_id]
        assert t0 + 1500 <= parked["deliver_ms"] <= t1 + 1500
        assert r.scheduled and r.deliver_ms == parked["deliver_ms"] and r.uniq_key == r.msg_id
        assert r.queue_offset == 0 and r.offset_msg_id
        assert "DELAY" not in parked["ext"].properties and broker.messages("T") == []
        at = datetime.now(UTC) + timedelta(days=3)
        r2 = await p.send(Message("T", b"at", deliver_at=at, uniq_key="my-handle"))
        assert r2.uniq_key == "my-handle" and r2.deliver_ms == int(at.timestamp() * 1000)
        # a timed batch: every item scheduled, one deliver time each
        tb = await p.send_batch([Message("T", b"b0", delay=60, uniq_key="id,with,commas"),
                                 Message("T", b"b1", deliver_at=at)])
        assert tb.msg_ids[0] == "id,with,commas" and tb.uniq_key == tb.msg_id
        first_ms = broker.timer["id,with,commas"]["deliver_ms"]
        assert tb.deliver_times_ms == (first_ms, int(at.timestamp() * 1000))
        assert tb.deliver_ms == tb.deliver_times_ms[0] and tb.scheduled
        plain = await p.send_batch([Message("T", b"p0"), Message("T", b"p1")])
        assert plain.deliver_times_ms == () and plain.deliver_ms is None and not plain.scheduled
        with pytest.raises(InvalidMessage, match="all timed"):
            await p.send_batch([Message("T", b"x", delay=1), Message("T", b"y")])
        with pytest.raises(InvalidMessage, match="all timed"):
            await p.send_batch([Message("T", b"y"), Message("T", b"x", delay=1)])
        with pytest.raises(InvalidMessage, match="delay_level"):
            await p.send_batch([Message("T", b"x", delay_level=1)])
        with pytest.raises(InvalidMessage, match="delay_level"):
            await p.send(Message("T", b"x", delay=1, delay_level=2))


async def test_admin_cancel_reschedule_pending(broker):
    broker.topics["T"] = 1
    async with Producer("pg", broker.addr) as p, Admin(broker.addr) as a:
        base = int(time.time() * 1000) + 3_600_000
        rs = [await p.send(Message("T", f"m{i}", keys=f"k{i} shared", tags="A" if i % 2 else "B",
                                   deliver_at=base + i * 1000)) for i in range(6)]
        # cancel by id
        [c] = await a.cancel(rs[0].uniq_key)
        assert isinstance(c, TimerOpResult) and c.outcome == TimerOutcome.CANCELLED
        assert (c.msg_id, c.deliver_ms, c.topic, c.broker) == (rs[0].msg_id, base, "T", "broker-a")
        assert c.deliver_at == datetime.fromtimestamp(base / 1000, UTC)
        req = broker.requests[-1]
        assert req.code == RequestCode.CHRONOMQ_CANCEL_SCHEDULED
        assert req.ext_fields == {"id": rs[0].msg_id, "byKey": "false"}
        [again] = await a.cancel(rs[0].uniq_key)
        assert again.outcome == TimerOutcome.ALREADY_CANCELLED
        [unknown] = await a.cancel("no-such-id")
        assert unknown.outcome == TimerOutcome.UNKNOWN and unknown.msg_id == "no-such-id"
        # reschedule by id, to a datetime and by a delay
        new_at = datetime.fromtimestamp((base + 99_000) / 1000, UTC)
        [r] = await a.reschedule(rs[1].msg_id, new_at)
        assert r.outcome == TimerOutcome.RESCHEDULED and r.deliver_ms == base + 99_000
        assert broker.requests[-1].ext_fields == {"id": rs[1].msg_id, "byKey": "false",
                                                  "deliverMs": str(base + 99_000)}
        t0 = int(time.time() * 1000)
        [r] = await a.reschedule(rs[1].msg_id, delay=timedelta(hours=2))
        assert t0 + 7_200_000 <= r.deliver_ms <= int(time.time() * 1000) + 7_200_000
        # already delivered
        broker.timer_deliver(rs[2].msg_id)
        [d] = await a.reschedule(rs[2].msg_id, base)
        assert d.outcome == TimerOutcome.ALREADY_DELIVERED and d.deliver_ms is not None
        # by key: one result per matching message
        res = await a.cancel("shared", by_key=True)
        assert broker.requests[-1].ext_fields == {"id": "shared", "byKey": "true"}
        assert sorted(x.outcome.value for x in res) == ["ALREADY_CANCELLED", "ALREADY_DELIVERED", "CANCELLED",
                                                        "CANCELLED", "CANCELLED", "CANCELLED"]
        # pending: send a few more, page through them
        more = [await p.send(Message("T", f"n{i}", keys="page", tags="P", deliver_at=base + 10_000 + i))
                for i in range(5)]
        assert await a.pending_count() == 5
        assert await a.pending_count(tag="P", start=base + 10_001, end=base + 10_003) == 3
        assert broker.requests[-1].ext_fields == {"tag": "P", "startMs": str(base + 10_001),
                                                  "endMs": str(base + 10_003), "countOnly": "true"}
        page = await a.pending(topic="T", key="page", limit=2)
        assert isinstance(page, PendingPage)
        assert [x.msg_id for x in page.items] == [r.msg_id for r in more[:2]]
        assert broker.requests[-1].ext_fields == {"topic": "T", "key": "page", "limit": "2"}
        seen = [x.msg_id for x in page.items]
        while page.next_cursor is not None:
            page = await a.pending(topic="T", key="page", limit=2, cursor=page.next_cursor)
            seen += [x.msg_id for x in page.items]
        assert seen == [r.msg_id for r in more]
        item = (await a.pending(start=datetime.fromtimestamp((base + 10_004) / 1000, UTC))).items
        assert len(item) == 1 and item[0].deliver_ms == base + 10_004 and item[0].tags == "P"
        assert item[0].keys == ["page"] and item[0].topic == "T" and item[0].body_size == 2
        assert item[0].deliver_at == datetime.fromtimestamp((base + 10_004) / 1000, UTC)
        assert item[0].broker == "broker-a"
        # bad arguments are refused before anything is sent
        n = len(broker.requests)
        for call in (lambda: a.pending(limit=0), lambda: a.pending(limit=1001),
                     lambda: a.pending(cursor="zz!"),
                     lambda: a.pending(start=datetime(2030, 1, 1)), lambda: a.pending(start=5, end=4),
                     lambda: a.pending(topic=""), lambda: a.cancel(""), lambda: a.reschedule("x"),
                     lambda: a.reschedule("x", base, delay=1)):
            with pytest.raises(ValueError):
                await call()
        with pytest.raises(InvalidMessage):
            await a.reschedule("x", delay=-1)
        assert len(broker.requests) == n


async def test_admin_timer_ops_span_brokers(broker):
    other = FakeBroker("broker-b")
    await other.start()
    broker.peers["broker-b"] = other.addr
    try:
        base = int(time.time() * 1000) + 600_000
        for b, name in ((broker, "a"), (other, "b")):
            b.topics["T"] = 1
            async with Producer("pg", b.addr) as p:  # each fake is its own name server: one broker each
                for i in range(3):
                    await p.send(Message("T", f"{name}{i}", keys="k", uniq_key=f"{name}{i}",
                                         deliver_at=base + i))
        async with Admin(broker.addr) as a:
            assert await a.pending_count(key="k") == 6
            seen, cursor, pages = [], None, 0
            while True:
                page = await a.pending(key="k", limit=2, cursor=cursor)
                seen += [(x.broker, x.msg_id) for x in page.items]
                pages += 1
                if page.next_cursor is None:
                    break
                cursor = page.next_cursor
            assert seen == [("broker-a", "a0"), ("broker-a", "a1"), ("broker-a", "a2"),
                            ("broker-b", "b0"), ("broker-b", "b1"), ("broker-b", "b2")]
            assert pages <= 4
            big = await a.pending(limit=1000)
            assert len(big.items) == 6 and big.next_cursor is None
            # an id lives on one broker: the other's UNKNOWN is dropped
            [r] = await a.cancel("b1")
            assert (r.outcome, r.broker) == (TimerOutcome.CANCELLED, "broker-b")
            res = await a.reschedule("k", base + 5, by_key=True)
            assert sorted((x.broker, x.msg_id, x.outcome.value) for x in res) == [
                ("broker-a", "a0", "RESCHEDULED"), ("broker-a", "a1", "RESCHEDULED"),
                ("broker-a", "a2", "RESCHEDULED"), ("broker-b", "b0", "RESCHEDULED"),
                ("broker-b", "b1", "ALREADY_CANCELLED"), ("broker-b", "b2", "RESCHEDULED")]
            [u] = await a.cancel("nothing")
            assert u.outcome == TimerOutcome.UNKNOWN
            # a timer handle names one broker's timer store: only that broker is asked
            handle = m.create_offset_msg_id(("127.0.0.1", other.port), (1 << 62) | 77)
            [h] = await a.cancel(handle)
            assert h.broker == "broker-b"

            def asked(b: FakeBroker) -> bool:
                return any(c.code == RequestCode.CHRONOMQ_CANCEL_SCHEDULED and c.ext_str("id") == handle
                           for c in b.requests)

            assert asked(other) and not asked(broker)
            # by key, or an id that only looks like a handle of no broker here: every broker is asked
            stray = m.create_offset_msg_id(("10.9.9.9", 1), (1 << 62) | 77)
            await a.cancel(stray)
            await a.cancel(handle, by_key=True)
            for ident in (stray, handle):
                assert sum(c.ext_str("id") == ident for c in broker.requests + other.requests
                           if c.code == RequestCode.CHRONOMQ_CANCEL_SCHEDULED) >= 2
            assert any(c.ext_str("id") == handle for c in broker.requests)
            gone = _encode_cursor_for_test("broker-z")
            with pytest.raises(ValueError, match="broker-z"):
                await a.pending(cursor=gone)
    finally:
        await other.stop()


def _encode_cursor_for_test(broker_name: str) -> str:
    from chronomq.client.admin import _encode_cursor
    return _encode_cursor(broker_name, None)


async def test_admin_timer_errors_are_typed(broker):
    async with Admin(broker.addr) as a:
        broker._h9002 = lambda cmd, w: cmd.response(ResponseCode.MESSAGE_ILLEGAL, remark="id too long")  # type: ignore[method-assign]
        with pytest.raises(BrokerError, match="id too long"):
            await a.cancel("x")
        broker._h9003 = lambda cmd, w: cmd.response(body=b"not json")  # type: ignore[method-assign]
        with pytest.raises(BrokerError, match="not JSON"):
            await a.reschedule("x", 10**12 * 2)
        broker._h9004 = lambda cmd, w: cmd.response(body=b'{"items": [{"msg_id": "x"}]}')  # type: ignore[method-assign]
        with pytest.raises(BrokerError, match="malformed"):
            await a.pending()
        with pytest.raises(BrokerError, match="no count"):
            await a.pending_count()
        broker._h9002 = lambda cmd, w: cmd.response(body=json.dumps({"results": [  # type: ignore[method-assign]
            {"outcome": "SOMETHING_NEW", "msg_id": "x", "deliver_ms": None, "topic": None}]}).encode())
        [r] = await a.cancel("x")
        assert r.outcome == "SOMETHING_NEW"  # an outcome this client does not know is passed through
        broker._h9002 = None  # type: ignore[assignment]  # the fake answers REQUEST_CODE_NOT_SUPPORTED
        with pytest.raises(NotSupported):  # a broker without the timer store (e.g. Apache RocketMQ)
            await a.cancel("x")


def test_blocking_admin_timer_ops():
    loop = asyncio.new_event_loop()
    b = FakeBroker()
    ready = threading.Event()

    def serve():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(b.start())
        ready.set()
        loop.run_forever()

    t = threading.Thread(target=serve)
    t.start()
    assert ready.wait(5)
    try:
        b.topics["T"] = 1
        with Producer("pg", b.addr) as p, Admin(b.addr) as a:
            r = p.send(Message("T", b"x", keys="bk", delay=timedelta(hours=1)))
            assert r.scheduled
            assert a.pending_count(topic="T") == 1
            assert [x.msg_id for x in a.pending(key="bk").items] == [r.msg_id]
            [res] = a.reschedule(r.msg_id, r.deliver_ms + 1)
            assert res.outcome == TimerOutcome.RESCHEDULED and res.deliver_ms == r.deliver_ms + 1
            [res] = a.cancel("bk", by_key=True)
            assert res.outcome == TimerOutcome.CANCELLED
            assert a.pending_count() == 0
    finally:
        loop.call_soon_threadsafe(loop.stop)
        t.join(5)
        loop.close()


def _record(topic: str, body: bytes, props: dict[str, str], *, qid: int = 0, qoff: int = 0, phys: int = 0,
            sys_flag: int = 0, reconsume: int = 0) -> bytes:
    ext = m.MessageExt(topic=topic, body=body, properties=props, queue_id=qid, sys_flag=sys_flag,
                       born_timestamp=1_700_000_000_000, born_host=("10.1.2.3", 4567),
                       store_timestamp=1_700_000_000_123, store_host=("127.0.0.1", 10911),
                       reconsume_times=reconsume, queue_offset=qoff, commit_log_offset=phys)
    return bytes(m.encode_record(ext))


def test_decode_received_matches_the_message_ext_path():
    big = os.urandom(64) * 100
    recs = [
        _record("T", b"plain", {m.PROPERTY_UNIQ_KEY: "U1", m.PROPERTY_TAGS: "A", "u": "1"}, qoff=7, phys=0),
        _record("T", zlib.compress(big), {m.PROPERTY_TAGS: "B"}, qid=1, qoff=8, phys=200,
                sys_flag=m.SYSFLAG_COMPRESSED | 0x4),  # no UNIQ_KEY: the offset msg id
        _record("%RETRY%G", b"again", {m.PROPERTY_RETRY_TOPIC: "T", m.PROPERTY_UNIQ_KEY: "U3"}, qoff=0,
                phys=5000, reconsume=2),
        _record("T", b"no props", {}, qoff=9, phys=6000),
    ]
    buf = b"".join(recs)
    want = [ReceivedMessage.from_ext(x, "bk") for x in m.decode_records(buf)]
    got = decode_received(buf, "bk")
    assert got == want
    assert got[1].body == big and got[1].sys_flag == 0x4 and got[2].topic == "T"
    pair = decode_received(recs[0] + recs[3], "bk")
    assert pair[0].queue is pair[1].queue  # one MessageQueue per queue in a batch
    assert decode_received(b"", "bk") == []
    for bad in (buf[:-1], buf[:50], b"\x00" * 4 + buf[4:]):
        with pytest.raises(m.MessageFormatError):
            decode_received(bad, "bk")


async def test_push_consumer_pulls_bulk_reads_within_the_inflight_limit(broker):
    broker.topics["T"] = 1
    async with Producer("pg", broker.addr) as p:
        await p.send_batch([Message("T", f"{i}") for i in range(300)])
    got: list[int] = []
    c = PushConsumer("GB", "T", lambda msg: got.append(int(msg.body)), broker.addr, consume_from="first",
                     pull_batch_size=8, max_inflight_per_queue=100, rebalance_interval=0.2,
                     long_poll_timeout=0.3)
    async with c:
        await async_wait_for(lambda: len(got) == 300)
    reqs = [x for x in broker.requests
            if x.code == RequestCode.PULL_MESSAGE and x.require_str("topic") == "T"]
    pulls = [x.ext_int("maxMsgNums") for x in reqs]
    assert pulls[0] == 100  # more than pull_batch_size: up to the in-flight limit ...
    assert max(pulls) <= 100 and min(pulls) >= 8  # ... never past it, never under pull_batch_size
    assert all(x.ext_str(PULL_EXT_BULK_READ, "") == "true" for x in reqs)  # as bulk reads
    assert sorted(got) == list(range(300))


async def test_push_consumer_runs_concurrency_listeners_from_one_pulled_batch(broker):
    broker.topics["T"] = 1
    async with Producer("pg", broker.addr) as p:
        await p.send_batch([Message("T", f"{i}") for i in range(20)])
    gate = asyncio.Event()
    running = 0
    peak = 0
    done: list[int] = []

    async def listener(msg):
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await gate.wait()
        running -= 1
        done.append(int(msg.body))

    c = PushConsumer("GC", "T", listener, broker.addr, consume_from="first", concurrency=8,
                     pull_batch_size=32, rebalance_interval=0.2, long_poll_timeout=0.3)
    async with c:
        await async_wait_for(lambda: running == 8, message="8 listeners at once from one batch of 20")
        assert peak == 8
        gate.set()
        await async_wait_for(lambda: len(done) == 20)
    assert peak == 8 and sorted(done) == list(range(20))


def test_push_consumer_commit_offset_is_the_oldest_message_in_flight():
    from chronomq.client.consumer import ProcessQueue

    c = PushConsumer("GO", "T", lambda msg: None, "127.0.0.1:1", max_inflight_per_queue=3)
    msgs = decode_received(b"".join(_record("T", b"x", {}, qoff=i, phys=i * 100) for i in range(5)), "bk")
    mq = msgs[0].queue
    pq = ProcessQueue(mq=mq, expression="*", next_offset=0, high=5)
    c._pqs[mq] = pq
    c._offsets[mq] = 0  # as _apply sets it when the queue is taken
    for x in msgs:
        pq.add(x)
    seen = []
    for i in (2, 0, 1, 4, 3):
        c._done(pq, msgs[i])
        seen.append((c._offsets.get(mq), pq.space.is_set()))
    assert seen == [(0, False), (1, False), (3, True), (3, True), (5, True)]
    assert pq.consumed == 5 and not pq.msgs


# --- the client's clock: a virtual clock drives bornTimestamp, deliver times and subscription versions ---
CLOCK_START_MS = 1_800_000_000_000


async def test_producer_dates_and_times_messages_by_its_clock(broker: FakeBroker) -> None:
    broker.topics["T"] = 1
    clock = VirtualClock(CLOCK_START_MS)
    async with Producer("pg", broker.addr, clock=clock) as p:
        await p.send(Message("T", b"now"))
        (stored,) = broker.messages("T")
        assert stored.born_timestamp == CLOCK_START_MS
        r = await p.send(Message("T", b"later", delay=1.5))
        assert r.deliver_ms == CLOCK_START_MS + 1500 == broker.timer[r.msg_id]["deliver_ms"]
        await clock.advance(60_000)
        b = await p.send_batch([Message("T", b"b0", delay=2), Message("T", b"b1", delay=3)])
        assert b.deliver_times_ms == (CLOCK_START_MS + 62_000, CLOCK_START_MS + 63_000)


async def test_admin_reschedule_delay_counts_from_its_clock(broker: FakeBroker) -> None:
    broker.topics["T"] = 1
    clock = VirtualClock(CLOCK_START_MS)
    async with Producer("pg", broker.addr, clock=clock) as p, Admin(broker.addr, clock=clock) as a:
        r = await p.send(Message("T", b"x", delay=3600))
        await clock.advance(10_000)
        [res] = await a.reschedule(r.msg_id, delay=5)
        assert res.outcome == TimerOutcome.RESCHEDULED and res.deliver_ms == CLOCK_START_MS + 15_000


def test_push_consumer_subscription_version_is_its_clock() -> None:
    clock = VirtualClock(CLOCK_START_MS)
    c = PushConsumer("g", "T", lambda msg: None, namesrv="127.0.0.1:9876", clock=clock)
    subs = c._heartbeat_body()["consumerDataSet"][0]["subscriptionDataSet"]
    assert {s["subVersion"] for s in subs} == {CLOCK_START_MS}
