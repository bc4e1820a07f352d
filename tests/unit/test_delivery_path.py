"""The delivery path both the level service and the timer store use (chronomq.delay.delivery): one put
per real queue, isolation of a group refused for good, stop after a transient failure, puts that raise,
and a store that only takes one message at a time."""

from __future__ import annotations

from typing import Any

from chronomq.delay.delivery import StorePuts, put_groups
from chronomq.message import MessageExt
from chronomq.store.types import PutResult, PutStatus

OK = PutResult(PutStatus.PUT_OK)


def _m(name: str, topic: str = "A") -> MessageExt:
    return MessageExt(topic=topic, body=name.encode(), properties={"UNIQ_KEY": name})


class Puts:
    """Records every call; ``answers`` maps a message name to the status of a put that contains it."""

    def __init__(self, answers: dict[str, PutStatus] | None = None, raises: str | None = None) -> None:
        self.calls: list[tuple[str, list[str]]] = []
        self.answers = answers or {}
        self.raises = raises

    def _answer(self, kind: str, names: list[str]) -> PutResult:
        self.calls.append((kind, names))
        if self.raises in names:
            raise RuntimeError("injected")
        for n in names:
            if n in self.answers:
                return PutResult(self.answers[n], error="refused by the test")
        return OK

    def put(self, m: MessageExt) -> PutResult:
        return self._answer("one", [m.body.decode()])

    def put_many(self, ms: list[MessageExt]) -> PutResult:
        return self._answer("many", [m.body.decode() for m in ms])

    def put_raw(self, topic: str, qid: int, entries: list[Any]) -> PutResult:
        return self._answer(f"raw {topic}/{qid}", [e[3]["UNIQ_KEY"] for e in entries])


def _run(groups: dict[tuple[str, int], list[tuple[int, Any]]], puts: StorePuts
         ) -> tuple[bool, dict[int, str]]:
    out: dict[int, str] = {}

    def mark(what: str) -> Any:
        def f(members: Any, _res: PutResult) -> None:
            for i, _ in (members if isinstance(members, list) else [members]):
                out[i] = what
        return f

    stopped = put_groups(groups, puts, mark("written"), mark("refused"), mark("busy"))
    return stopped, out


def _groups(*spec: tuple[str, list[str]]) -> dict[tuple[str, int], list[tuple[int, Any]]]:
    groups: dict[tuple[str, int], list[tuple[int, Any]]] = {}
    i = 0
    for topic, names in spec:
        groups[(topic, 0)] = [(i + k, _m(n, topic)) for k, n in enumerate(names)]
        i += len(names)
    return groups


def test_one_put_per_group_in_order() -> None:
    p = Puts()
    stopped, out = _run(_groups(("A", ["a0", "a1"]), ("B", ["b0"])), StorePuts(p.put, p.put_many))
    assert not stopped and out == {0: "written", 1: "written", 2: "written"}
    assert p.calls == [("many", ["a0", "a1"]), ("one", ["b0"])]


def test_put_raw_wins_and_gets_the_queue() -> None:
    p = Puts()
    groups = {("A", 3): [(0, (b"", 0, 0, {"UNIQ_KEY": "r0"})), (1, (b"", 0, 0, {"UNIQ_KEY": "r1"}))]}
    stopped, out = _run(groups, StorePuts(p.put, p.put_many, p.put_raw))
    assert not stopped and out == {0: "written", 1: "written"}
    assert p.calls == [("raw A/3", ["r0", "r1"])]


def test_group_refused_for_good_is_isolated() -> None:
    p = Puts({"a1": PutStatus.MESSAGE_ILLEGAL})
    stopped, out = _run(_groups(("A", ["a0", "a1", "a2"]), ("B", ["b0"])), StorePuts(p.put, p.put_many))
    assert not stopped and out == {0: "written", 1: "refused", 2: "written", 3: "written"}
    assert p.calls == [("many", ["a0", "a1", "a2"]), ("one", ["a0"]), ("one", ["a1"]), ("one", ["a2"]),
                       ("one", ["b0"])]


def test_a_single_refused_message_is_put_once() -> None:
    p = Puts({"a0": PutStatus.PROPERTIES_SIZE_EXCEEDED})
    stopped, out = _run(_groups(("A", ["a0"])), StorePuts(p.put, p.put_many))
    assert not stopped and out == {0: "refused"} and len(p.calls) == 1


def test_transient_failure_stops_everything_after_it() -> None:
    p = Puts({"b0": PutStatus.OS_PAGECACHE_BUSY})
    stopped, out = _run(_groups(("A", ["a0"]), ("B", ["b0", "b1"]), ("C", ["c0"])),
                        StorePuts(p.put, p.put_many))
    assert stopped and out == {0: "written", 1: "busy", 2: "busy"}  # C: never tried, no outcome
    assert [c[1] for c in p.calls] == [["a0"], ["b0", "b1"]]


def test_transient_failure_while_isolating_stops_there() -> None:
    p = Puts({"a0": PutStatus.MESSAGE_ILLEGAL, "a1": PutStatus.SERVICE_NOT_AVAILABLE})
    stopped, out = _run(_groups(("A", ["a0", "a1", "a2"]), ("B", ["b0"])), StorePuts(p.put, p.put_many))
    assert stopped and out == {0: "refused", 1: "busy"}  # a2 and B: not tried


def test_a_put_that_raises_is_a_transient_failure() -> None:
    p = Puts(raises="a0")
    stopped, out = _run(_groups(("A", ["a0"]), ("B", ["b0"])), StorePuts(p.put, p.put_many))
    assert stopped and out == {0: "busy"}


def test_a_store_without_batch_puts_takes_every_message_of_a_group() -> None:
    p = Puts()
    stopped, out = _run(_groups(("A", ["a0", "a1", "a2"])), StorePuts(p.put))
    assert not stopped and out == {0: "written", 1: "written", 2: "written"}
    assert p.calls == [("one", ["a0"]), ("one", ["a1"]), ("one", ["a2"])]


def test_flush_timeout_counts_as_written() -> None:
    p = Puts({"a0": PutStatus.FLUSH_DISK_TIMEOUT})
    assert _run(_groups(("A", ["a0", "a1"])), StorePuts(p.put, p.put_many)) == (
        False, {0: "written", 1: "written"})


class _OnlyPutMessage:
    def put_message(self, m: MessageExt) -> PutResult:
        return OK


def test_store_puts_of_a_store() -> None:
    s = StorePuts.of(_OnlyPutMessage())
    assert s.put_many is None and s.put_raw is None and not s.batches


class _ParkedStore:
    """read_record over a few parked records; put_message raises for topic B, else appends."""

    def __init__(self, records: dict[int, bytes]) -> None:
        self.records = records
        self.put: list[MessageExt] = []

    def read_record(self, phy: int) -> bytes | None:
        return self.records.get(phy)

    def put_message(self, m: MessageExt) -> PutResult:
        if m.topic == "B":
            raise RuntimeError("injected")
        self.put.append(m)
        return OK


def test_delivery_path_outcomes_per_item() -> None:
    from chronomq.clock import VirtualClock
    from chronomq.delay.delivery import PROPERTY_DELAY_SOURCE, DeliveryPath
    from chronomq.message import SCHEDULE_TOPIC, encode_record

    def parked(real: str) -> bytes:
        props = {"REAL_TOPIC": real, "REAL_QID": "2", "DELAY": "2"}
        return bytes(encode_record(MessageExt(topic=SCHEDULE_TOPIC, body=real.encode(), queue_id=1,
                                              properties=props)))

    store = _ParkedStore({0: parked("A"), 100: parked("B"), 200: parked("bad topic!")})
    clock = VirtualClock(5_000)
    out = DeliveryPath(store, clock).deliver_many([(0, "2:0:0"), (200, None), (300, None), (100, None)])  # type: ignore[arg-type]
    assert (out[0].written, out[0].store_timestamp) == (True, 5_000)  # no append reported: the clock's time
    assert [(d.written, d.retry) for d in out[1:]] == [(False, False), (False, False), (False, True)]
    assert "not found" in (out[2].error or "") and "REAL_TOPIC" in (out[1].error or "")
    (m,) = store.put
    assert (m.topic, m.queue_id, m.body) == ("A", 2, b"A")
    assert m.properties["DELAY"] == "2" and m.properties[PROPERTY_DELAY_SOURCE] == "2:0:0"
