"""PullHoldService on a virtual clock: arrivals wake the right waiters, deadlines fire in order (also when
an earlier one is added later), arrivals from another thread are coalesced, memory stays bounded."""

from __future__ import annotations

import asyncio
import threading

from tests.conftest import async_wait_for

from chronomq.broker.longpoll import PullHoldService
from chronomq.clock import VirtualClock


async def test_arrival_wakes_only_waiters_below_the_new_max() -> None:
    clock = VirtualClock()
    hold = PullHoldService(clock)
    hold.bind(asyncio.get_running_loop())
    end = clock.now_ms() + 15_000
    a = asyncio.ensure_future(hold.wait("T", 0, 3, end, lambda: 3))
    b = asyncio.ensure_future(hold.wait("T", 0, 5, end, lambda: 3))
    c = asyncio.ensure_future(hold.wait("T", 1, 3, end, lambda: 3))
    await async_wait_for(lambda: hold.held == 3, message="3 held")
    hold.notify("T", 0, 4)
    assert await asyncio.wait_for(a, 5) is True
    await asyncio.sleep(0)
    assert not b.done() and not c.done()
    await clock.advance(15_000)
    assert await asyncio.wait_for(b, 5) is False and await asyncio.wait_for(c, 5) is False
    assert hold.held == 0 and hold.timeouts == 2 and hold.wakeups == 1


async def test_already_arrived_returns_at_once() -> None:
    hold = PullHoldService(VirtualClock())
    assert await asyncio.wait_for(hold.wait("T", 0, 3, 0, lambda: 4), 5) is True
    assert hold.held == 0


async def test_deadlines_fire_in_order_even_when_an_earlier_one_comes_later() -> None:
    clock = VirtualClock()
    hold = PullHoldService(clock)
    t0 = clock.now_ms()
    late = asyncio.ensure_future(hold.wait("T", 0, 0, t0 + 20_000, lambda: 0))
    await async_wait_for(lambda: hold.held == 1, message="held")
    early = asyncio.ensure_future(hold.wait("T", 1, 0, t0 + 1_000, lambda: 0))
    await async_wait_for(lambda: hold.held == 2, message="held")
    await clock.advance(1_000)
    assert await asyncio.wait_for(early, 5) is False
    assert not late.done()
    await clock.advance(19_000)
    assert await asyncio.wait_for(late, 5) is False


async def test_arrivals_from_the_dispatcher_thread_are_coalesced() -> None:
    clock = VirtualClock()
    hold = PullHoldService(clock)
    loop = asyncio.get_running_loop()
    hold.bind(loop)
    waiters = [
        asyncio.ensure_future(hold.wait("T", q, 0, clock.now_ms() + 15_000, lambda: 0)) for q in range(4)
    ]
    await async_wait_for(lambda: hold.held == 4, message="held")
    calls = 0
    real = loop.call_soon_threadsafe

    def counting(*a, **k):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        return real(*a, **k)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    try:
        t = threading.Thread(target=lambda: [hold.on_arrival("T", q % 4, 1, 0) for q in range(400)])
        t.start()
        t.join()
        assert all(await asyncio.wait_for(asyncio.gather(*waiters), 5))
    finally:
        loop.call_soon_threadsafe = real  # type: ignore[method-assign]
    assert 1 <= calls < 400
    hold.on_arrival("Other", 0, 1, 0)  # nobody waits there: nothing is scheduled


async def test_answered_waiters_do_not_accumulate() -> None:
    clock = VirtualClock()
    hold = PullHoldService(clock)
    hold.bind(asyncio.get_running_loop())
    end = clock.now_ms() + 15_000
    for i in range(6000):
        w = asyncio.ensure_future(hold.wait("T", 0, i, end, lambda: 0))
        await asyncio.sleep(0)
        hold.notify("T", 0, i + 1)
        assert await w is True
    assert len(hold._deadlines) <= 4097 + 1
    hold.wake_all()


async def test_arrival_on_the_loop_thread_wakes_at_once_without_a_thread_hop() -> None:
    clock = VirtualClock()
    hold = PullHoldService(clock)
    loop = asyncio.get_running_loop()
    hold.bind(loop)
    w = asyncio.ensure_future(hold.wait("T", 0, 0, clock.now_ms() + 15_000, lambda: 0))
    await async_wait_for(lambda: hold.held == 1, message="held")
    real = loop.call_soon_threadsafe

    def refuse(*a, **k):  # type: ignore[no-untyped-def]
        raise AssertionError("the loop thread must not hop through call_soon_threadsafe")

    loop.call_soon_threadsafe = refuse  # type: ignore[method-assign]
    try:
        hold.on_arrival("T", 0, 1, 0)  # the store dispatching on the loop (the broker's mode)
    finally:
        loop.call_soon_threadsafe = real  # type: ignore[method-assign]
    await asyncio.sleep(0)  # one turn: the waiter's future was resolved inside on_arrival
    assert w.done() and w.result() is True
