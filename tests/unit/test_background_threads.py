"""The store's background threads and the pool of file work run under SCHED_BATCH where Linux has it (so
waking them never preempts the event loop); backgroundThreadsBatch=false leaves them as they start."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
from test_store_basic import make_config

import chronomq.store.threads as threads
from chronomq.clock import VirtualClock
from chronomq.delay.background import in_background
from chronomq.store import MessageStore

BATCH = getattr(os, "SCHED_BATCH", None)
pytestmark = pytest.mark.skipif(BATCH is None or not hasattr(os, "sched_getscheduler"),
                                reason="SCHED_BATCH is Linux's; elsewhere threads keep the default policy")


@pytest.fixture(autouse=True)
def _switch_restored():
    yield
    threads.set_background_batch(True)


def _policies_of_store_threads(store: MessageStore) -> dict[str, int]:
    out = {}
    for t in threading.enumerate():
        if t.name.startswith("chronomq-store-") and t in store._threads:
            assert t.native_id is not None
            out[t.name] = os.sched_getscheduler(t.native_id)
    return out


@pytest.mark.parametrize("on", [True, False])
def test_the_store_threads_run_under_sched_batch_unless_switched_off(tmp_path, on: bool) -> None:
    cfg = make_config(tmp_path)
    cfg.backgroundThreadsBatch = on
    store = MessageStore(cfg, VirtualClock(1_000))
    store.start()
    try:
        policies = _policies_of_store_threads(store)
        assert {"chronomq-store-dispatch", "chronomq-store-allocate", "chronomq-store-flush",
                "chronomq-store-flush-cq", "chronomq-store-clean"} <= set(policies)
        want = BATCH if on else os.SCHED_OTHER
        assert set(policies.values()) == {want}, policies
        assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the caller's thread is left as it was
    finally:
        store.shutdown()


def test_file_work_for_the_loop_runs_under_sched_batch_and_the_thread_gets_its_policy_back() -> None:
    async def main() -> tuple[int, str, int]:
        loop = asyncio.get_running_loop()
        policy, joined = await in_background(lambda a, b: (os.sched_getscheduler(0), a + b), "x", "y")
        after = await loop.run_in_executor(None, os.sched_getscheduler, 0)  # the executor's (one) thread
        return policy, joined, after

    import concurrent.futures

    async def with_one_thread() -> tuple[int, str, int]:
        asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(1))
        return await main()

    policy, joined, after = asyncio.run(with_one_thread())
    assert policy == BATCH and joined == "xy"
    assert after == os.SCHED_OTHER  # the default executor serves others too: its thread is as it was


def test_a_refusal_leaves_the_thread_as_it_was(monkeypatch) -> None:
    def refuse(*_a: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(threads.os, "sched_setscheduler", refuse)
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(threads.as_background()))
    t.start()
    t.join(10)
    assert got == [False]


def test_switched_off_a_thread_is_not_touched(monkeypatch) -> None:
    calls: list[object] = []
    monkeypatch.setattr(threads.os, "sched_setscheduler", lambda *a: calls.append(a))
    threads.set_background_batch(False)
    assert threads.as_background() is False and calls == []
    threads.set_background_batch(True)
    assert threads.as_background() is True and len(calls) == 1
