from __future__ import annotations

import asyncio
import threading

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
