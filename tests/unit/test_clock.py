from __future__ import annotations

import asyncio
import threading

import pytest
from tests.conftest import async_wait_for

from chronomq.clock import SystemClock, VirtualClock


async def test_virtual_clock_wakes_in_deadline_order() -> None:
    clock = VirtualClock(start_ms=1000)
    woke: list[tuple[str, int]] = []

    async def sleeper(name: str, at: int) -> None:
        await clock.sleep_until_ms(at)
        woke.append((name, clock.now_ms()))

    tasks = [asyncio.create_task(sleeper("b", 3000)), asyncio.create_task(sleeper("a", 2000)),
             asyncio.create_task(sleeper("c", 10_000))]
    await asyncio.sleep(0)
    await clock.advance(1500)
    assert woke == [("a", 2000)]
    await clock.advance(500)
    assert woke == [("a", 2000), ("b", 3000)]
    await clock.advance_to(20_000)
    assert woke[-1] == ("c", 10_000)
    assert clock.now_ms() == 20_000
    await asyncio.gather(*tasks)


async def test_virtual_sleep_in_past_returns() -> None:
    clock = VirtualClock(start_ms=5000)
    await asyncio.wait_for(clock.sleep_until_ms(10), 1)


def test_thread_wait_until() -> None:
    clock = VirtualClock(start_ms=0)
    ev = threading.Event()
    result: list[bool] = []
    t = threading.Thread(target=lambda: result.append(clock.wait_until_ms(ev, 5000)))
    t.start()
    clock.advance_sync(5000)
    t.join(5)
    assert result == [False]
    t2 = threading.Thread(target=lambda: result.append(clock.wait_until_ms(ev, 99_999)))
    t2.start()
    ev.set()
    t2.join(5)
    assert result == [False, True]


async def test_system_clock_basics() -> None:
    c = SystemClock()
    a = c.now_ms()
    await c.sleep_until_ms(a - 5)
    assert c.now_ms() >= a
    assert not c.wait_until_ms(threading.Event(), c.now_ms() - 1)


async def test_system_clock_precise_sleeps_never_end_early_and_survive_cancellation(monkeypatch) -> None:
    """Precise sleeps end at their deadline (the waker thread, then a few loop turns), never before it,
    in deadline order; one cancelled while the waker holds its deadline leaves the others and later ones
    unharmed."""
    import time

    from chronomq import clock as clock_mod

    # A wide margin hands every sleeper to the waker at once, whatever the machine's load: with the
    # default 2 ms, a loop late by 2 ms skips the waker, and the deadline order is then up to the loop.
    default_margin = clock_mod._PRECISE_S
    monkeypatch.setattr(clock_mod, "_PRECISE_S", 1.0)
    added: list[float] = []
    real_add = clock_mod._WAKER.add

    def add(at: float, loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None]) -> None:
        added.append(at)
        real_add(at, loop, fut)

    monkeypatch.setattr(clock_mod._WAKER, "add", add)
    c = SystemClock()
    # every sleeper must be handed over before the first deadline: 400 ms ahead, a loaded machine's stall
    # between here and the waker's add cannot make one of them due already (it would then end in task order)
    base = c.now_ms() + 400
    woke: list[tuple[int, float]] = []

    async def sleeper(at: int) -> None:
        await c.sleep_until_ms(at, precise=True)
        woke.append((at, time.time()))

    cancelled = asyncio.create_task(c.sleep_until_ms(base + 100, precise=True))
    tasks = [asyncio.create_task(sleeper(base + d)) for d in (4, 0, 2, 3)]
    await async_wait_for(lambda: any(at >= (base + 100) / 1000 - 0.001 for at in added), 5)
    assert not cancelled.done()
    cancelled.cancel()  # while the waker holds its deadline
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert [at for at, _ in woke] == [base + d for d in (0, 2, 3, 4)]
    assert all(t >= at / 1000 for at, t in woke)  # never early
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    # the default path: the loop first, then the waker
    monkeypatch.setattr(clock_mod, "_PRECISE_S", default_margin)
    later = c.now_ms() + 3
    await asyncio.wait_for(c.sleep_until_ms(later, precise=True), 5)
    assert time.time() >= later / 1000


async def test_a_precise_sleep_ends_even_if_the_waker_never_fires(monkeypatch) -> None:
    """The loop's own timer is the backstop of the waker thread."""
    import time

    from chronomq import clock as clock_mod

    monkeypatch.setattr(clock_mod._WAKER, "add", lambda *a: None)  # a waker that lost the sleeper
    c = SystemClock()
    at = c.now_ms() + 3
    await asyncio.wait_for(c.sleep_until_ms(at, precise=True), 5)
    assert time.time() >= at / 1000
