"""MessageStore dispatch on the caller's side (the broker's event loop): the hook replaces the thread
wake-up, dispatch_now keeps commit-log order, a busy dispatcher thread or a closed loop hands the work
back to the thread, and nothing is lost or dispatched twice."""

from __future__ import annotations

import threading

from test_store_basic import make_config, msg

from chronomq.clock import VirtualClock
from chronomq.store import GetStatus, MessageStore
from chronomq.store.checkpoint import Checkpoint
from chronomq.store.reput import INDEX_MAX_WAIT_S


def _started(tmp_path, **kw) -> MessageStore:
    s = MessageStore(make_config(tmp_path, **kw), VirtualClock())
    s.start()
    return s


def test_hook_is_called_per_put_and_dispatch_now_writes_the_entries_on_this_thread(tmp_path) -> None:
    s = MessageStore(make_config(tmp_path), VirtualClock())
    # the dispatcher thread also wakes every 50 ms to take what is queued (its fallback): here it wakes
    # only when set, so that it cannot take the puts before dispatch_now does
    wake = s._wake
    wake.wait = lambda timeout=None: threading.Event.wait(wake)
    s.start()
    calls: list[int] = []
    arrivals: list[tuple[str, int, int, int]] = []
    s.set_dispatch_hook(lambda: calls.append(threading.get_ident()))
    s.add_arrival_listener(lambda t, q, mx, ts: arrivals.append((t, q, mx, threading.get_ident())))
    try:
        for i in range(3):
            assert s.put_message(msg(body=b"m%d" % i)).ok
        assert s.put_messages([msg(body=b"b1"), msg(body=b"b2")]).ok
        assert calls == [threading.get_ident()] * 4
        s.dispatch_now()
        assert arrivals == [("TopicA", 0, 5, threading.get_ident())]  # one batch, on this thread
        g = s.get_message("TopicA", 0, 0, 32)
        assert g.status is GetStatus.FOUND and len(g.messages) == 5 and g.max_offset == 5
        s.dispatch_now()  # nothing queued: no second arrival
        assert len(arrivals) == 1
    finally:
        s.shutdown()


def test_entries_stay_in_commit_log_order_when_the_thread_and_the_hook_both_dispatch(tmp_path) -> None:
    s = _started(tmp_path, mappedFileSizeConsumeQueue=20 * 4096)
    s.set_dispatch_hook(s.dispatch_now)  # dispatch inline on every put, racing the thread's wake-ups
    stop = threading.Event()

    def nudge() -> None:  # the dispatcher thread wakes too, as wait_dispatched would make it
        while not stop.is_set():
            s._wake.set()

    t = threading.Thread(target=nudge)
    t.start()
    try:
        for i in range(600):
            assert s.put_message(msg(body=b"%d" % i, qid=i % 2)).ok
    finally:
        stop.set()
        t.join()
    try:
        assert s.wait_dispatched(s.max_phy_offset - 1, 5)
        for q in (0, 1):
            g = s.get_message("TopicA", q, 0, 400)
            assert g.status is GetStatus.FOUND and g.max_offset == 300
            units = s.get_cq_units("TopicA", q, 0, 300)
            offsets = [u.commit_log_offset for u in units]
            assert offsets == sorted(offsets) and len(set(offsets)) == 300
    finally:
        s.shutdown()


def test_a_busy_dispatcher_or_a_closed_loop_hands_the_work_to_the_thread(tmp_path) -> None:
    s = _started(tmp_path)
    try:
        with s._dispatch_lock:  # the thread is in the middle of a batch
            assert s.put_message(msg(body=b"first")).ok
            s.dispatch_now()  # does not block: wakes the thread instead
            assert s.get_max_offset_in_queue("TopicA", 0) == 0
        assert s.wait_dispatched(0, 5) and s.get_max_offset_in_queue("TopicA", 0) == 1

        def closed() -> None:
            raise RuntimeError("Event loop is closed")

        s.set_dispatch_hook(closed)
        assert s.put_message(msg(body=b"second")).ok  # the put still succeeds ...
        assert s._dispatch_hook is None  # ... and the store is back to thread-only dispatch
        assert s.wait_dispatched(s.max_phy_offset - 1, 5)
        assert s.get_max_offset_in_queue("TopicA", 0) == 2
    finally:
        s.shutdown()


def _keys_found(s: MessageStore, key: str) -> list[bytes]:
    return [m.body for m in s.query_message("TopicA", key, 10, 0, 2**62)]


def _deferring(tmp_path) -> tuple[MessageStore, list]:
    """A store dispatching on this thread, with its index entries deferred to jobs the test runs."""
    s = _started(tmp_path)
    jobs: list = []
    s.set_dispatch_hook(s.dispatch_now)
    s.set_index_later(jobs.append)
    return s, jobs


def test_deferred_index_entries_are_seen_by_a_key_query_and_written_at_shutdown(tmp_path) -> None:
    s, jobs = _deferring(tmp_path)
    try:
        assert s.put_message(msg(body=b"a", KEYS="ka")).ok
        assert s.put_message(msg(body=b"b", KEYS="kb")).ok
        assert len(jobs) == 1  # one job for the backlog, however many batches wait in it
        assert s.get_message("TopicA", 0, 0, 32).status is GetStatus.FOUND  # queue units: at once
        assert s._reput.recover_point() < s._reput.dispatched  # the checkpoint would refill the index
        assert _keys_found(s, "kb") == [b"b"]  # a key query writes the backlog first
        assert s._reput.recover_point() == s._reput.dispatched
        assert s.put_message(msg(body=b"c", KEYS="kc")).ok
        jobs[-1]()
        assert s._reput.recover_point() == s._reput.dispatched
        assert s.put_message(msg(body=b"d", KEYS="kd")).ok  # left in the backlog at shutdown
    finally:
        s.shutdown()
    ckpt = Checkpoint.load(s._checkpoint_path)
    assert ckpt is not None and ckpt.recover_from == ckpt.commit_log_end  # nothing left to refill
    s2 = _started(tmp_path)
    try:
        assert [_keys_found(s2, k) for k in ("ka", "kb", "kc", "kd")] == [[b"a"], [b"b"], [b"c"], [b"d"]]
        assert not s2.recovered_abnormally
    finally:
        s2.shutdown()


def test_a_crash_with_index_entries_never_written_refills_them_at_recovery(tmp_path) -> None:
    s, jobs = _deferring(tmp_path)
    assert s.put_message(msg(body=b"a", KEYS="ka")).ok
    jobs.pop()()
    real_put = s._index.put_batch

    def full_disk(items: list) -> None:
        raise OSError(28, "No space left on device")

    s._index.put_batch = full_disk  # type: ignore[method-assign]
    assert s.put_message(msg(body=b"b", KEYS="kb")).ok
    jobs.pop()()  # fails: the batch stays in the backlog for the dispatcher thread's retry
    assert s._reput.recover_point() < s._reput.dispatched
    s.flush()  # the checkpoint: recover from before the batch without index entries
    s._halt()  # the process dies before a retry succeeds
    s._index.put_batch = real_put  # type: ignore[method-assign]
    s2 = _started(tmp_path)
    try:
        assert s2.recovered_abnormally
        assert _keys_found(s2, "ka") == [b"a"] and _keys_found(s2, "kb") == [b"b"]
    finally:
        s2.shutdown()


def test_index_entries_are_written_at_once_when_the_deferral_is_gone(tmp_path) -> None:
    s = _started(tmp_path)

    def closed_loop(job) -> None:
        raise RuntimeError("Event loop is closed")

    s.set_dispatch_hook(s.dispatch_now)
    s.set_index_later(closed_loop)
    try:
        assert s.put_message(msg(body=b"a", KEYS="ka")).ok
        assert not s._reput._index_backlog and s._reput.recover_point() == s._reput.dispatched
        assert _keys_found(s, "ka") == [b"a"]
    finally:
        s.shutdown()


def test_turning_the_deferral_off_writes_what_waits_first(tmp_path) -> None:
    s, _jobs = _deferring(tmp_path)
    try:
        assert s.put_message(msg(body=b"a", KEYS="ka")).ok
        s.set_index_later(None)
        assert s._reput.recover_point() == s._reput.dispatched
        assert s.put_message(msg(body=b"b", KEYS="kb")).ok
        assert s._reput.recover_point() == s._reput.dispatched  # written with its batch
        assert _keys_found(s, "ka") == [b"a"] and _keys_found(s, "kb") == [b"b"]
    finally:
        s.shutdown()


def test_a_burst_being_handed_over_keeps_the_index_entries_waiting_within_a_bound(tmp_path) -> None:
    """While ``busy`` says a burst is being handed over, the index job defers itself again (nothing
    written, the checkpoint would refill them), at most INDEX_MAX_WAIT_S after the oldest waiting batch;
    a key query still finds them meanwhile, and once the burst is over the next run writes them."""
    s = _started(tmp_path)
    clock = s.clock
    assert isinstance(clock, VirtualClock)
    jobs: list = []
    busy = [True]
    s.set_dispatch_hook(s.dispatch_now)
    s.set_index_later(jobs.append, busy=lambda: busy[0])
    try:
        assert s.put_message(msg(body=b"a", KEYS="ka")).ok
        clock.advance_sync(int(INDEX_MAX_WAIT_S * 1000) // 2)
        assert s.put_message(msg(body=b"b", KEYS="kb")).ok
        assert len(jobs) == 1
        jobs.pop()()
        assert len(jobs) == 1  # deferred again: the burst goes on and the oldest batch is young
        assert s._reput.recover_point() < s._reput.dispatched
        clock.advance_sync(int(INDEX_MAX_WAIT_S * 1000) // 2 + 1)
        jobs.pop()()  # the oldest waited its bound: written though the burst goes on
        assert not jobs and s._reput.recover_point() == s._reput.dispatched
        assert s.put_message(msg(body=b"c", KEYS="kc")).ok
        jobs.pop()()
        assert len(jobs) == 1 and _keys_found(s, "kc") == [b"c"]  # a query writes what waits
        assert s.put_message(msg(body=b"d", KEYS="kd")).ok
        busy[0] = False
        jobs.pop()()  # the burst is over: written at once
        assert not jobs and s._reput.recover_point() == s._reput.dispatched
        assert [_keys_found(s, k) for k in ("ka", "kb", "kd")] == [[b"a"], [b"b"], [b"d"]]
    finally:
        s.shutdown()
