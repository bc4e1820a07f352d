"""The Spark sink's batches (encode_rows, de-duplication on) through a real broker in process: the batch
encoded in one pass is stored once however often it is sent, its answers repeat the first ones, a key twice
in one request is stored once, and the records hold the properties sent plus the broker's stamps."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import async_wait_for, free_port

from chronomq.broker.controller import BrokerController
from chronomq.client import Producer, encode_rows
from chronomq.clock import SystemClock
from chronomq.config import BrokerConfig
from chronomq.message import decode_record
from chronomq.namesrv.server import NameServer


async def test_a_retried_batch_is_stored_once_with_its_properties_and_the_stamps(tmp_path: Path) -> None:
    ns = NameServer("127.0.0.1", free_port(), SystemClock())
    await ns.start()
    values = {"storePathRootDir": str(tmp_path), "listenPort": str(free_port()),
              "haListenPort": str(free_port()), "namesrvAddr": ns.address, "metricsPort": "-1"}
    config, _ = BrokerConfig.load(None, values)
    b = BrokerController(config, SystemClock())
    await b.start()
    encoded = []
    encode = b.store.encode_batch

    def counting(*args: object) -> object:
        out = encode(*args)  # type: ignore[arg-type]
        encoded.append(out is not None)
        return out

    b.store.encode_batch = counting  # type: ignore[method-assign]
    try:
        async with Producer("PG_batch_put", ns.address) as p:
            ids = ["U1", "U2", "U3"]
            data = encode_rows([b"one", b"two", b"three"], ids, keys=["k1", None, "k3 k4"],
                               tags=["t", None, None], properties=[[("p", "1")], None, None], dedup=True)
            first = await p.send_encoded_batch("Bp", data, ids)
            q = first.queue
            again = await p.send_encoded_batch("Bp", data, ids, queue=q)  # Spark retried the task
            assert again.offset_msg_id == first.offset_msg_id and again.queue_offset == first.queue_offset
            # a key stored before, a key twice in one request, a new key
            data2 = encode_rows([b"three", b"four", b"four"], ["U3", "U4", "U4"], dedup=True)
            r = await p.send_encoded_batch("Bp", data2, ["U3", "U4", "U4"], queue=q)
            got = r.offset_msg_id.split(",")
            assert got[0] == first.offset_msg_id.split(",")[2] and got[1] == got[2]
            assert got[1] not in first.offset_msg_id
        assert encoded == [True, True, True]  # each went the one-pass way
        store = b.store
        await async_wait_for(lambda: store.dispatched_offset >= store.max_phy_offset, 10,
                             message="the consume queue to catch up")
        assert store.get_max_offset_in_queue("Bp", q.queue_id) == 4  # U1..U4, once each
        res = store.get_message("Bp", q.queue_id, 0, 32)
        msgs = [decode_record(r) for r in res.messages]
        assert [m.body for m in msgs] == [b"one", b"two", b"three", b"four"]
        assert [m.uniq_key for m in msgs] == ["U1", "U2", "U3", "U4"]
        assert msgs[0].properties["p"] == "1" and msgs[0].tags == "t" and msgs[2].keys == ["k3", "k4"]
        for m in msgs:
            assert (m.properties["CLUSTER"], m.properties["TRACE_ON"]) == (config.brokerClusterName, "true")
            assert m.properties["CHRONOMQ_DEDUP"] == "true" and m.born_host[0] == "127.0.0.1"
        assert b.services.dedup is not None and b.services.dedup.replays == 5
        assert len(store.query_message("Bp", "k3", 4, 0, 1 << 62)) == 1  # KEYS indexed
    finally:
        await b.shutdown()
        await ns.stop()
