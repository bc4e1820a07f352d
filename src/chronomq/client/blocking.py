"""The blocking facade: one background event-loop thread shared by every blocking client in the
process (reference counted: it stops when the last blocking client closes, so nothing is leaked), and
a proxy that turns the async methods of a client into plain blocking calls."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def _new_loop() -> asyncio.AbstractEventLoop:
    """uvloop when it is installed (the `fast` extra) and not disabled with CHRONOMQ_CLIENT_UVLOOP=0."""
    if os.environ.get("CHRONOMQ_CLIENT_UVLOOP", "1") != "0":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


class LoopThread:
    _lock = threading.Lock()
    _shared: LoopThread | None = None

    def __init__(self) -> None:
        self.loop = _new_loop()
        self._users = 0
        self._thread = threading.Thread(target=self._run, name="chronomq-client-loop", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
        # drain whatever is left, then close
        pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.run_until_complete(self.loop.shutdown_default_executor())
        self.loop.close()

    @classmethod
    def acquire(cls) -> LoopThread:
        with cls._lock:
            if cls._shared is None or not cls._shared._thread.is_alive():
                cls._shared = LoopThread()
            cls._shared._users += 1
            return cls._shared

    def release(self) -> None:
        with LoopThread._lock:
            self._users -= 1
            if self._users > 0:
                return
            if LoopThread._shared is self:
                LoopThread._shared = None
        self.loop.call_soon_threadsafe(self.loop.stop)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a blocking chronomq client method was called from its own event loop "
                               "thread (e.g. inside an async listener); use the async API there")
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)


class BlockingProxy:
    """Wraps an async client: coroutine methods become blocking, everything else passes through.
    ``close()`` closes the client and releases the loop thread."""

    _CLOSE = "close"

    def __init__(self, target: Any, loop_thread: LoopThread) -> None:
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_lt", loop_thread)
        object.__setattr__(self, "_released", False)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if inspect.iscoroutinefunction(attr):
            @functools.wraps(attr)
            def call(*args: Any, **kwargs: Any) -> Any:
                return self._lt.run(attr(*args, **kwargs))
            return call
        if inspect.ismethod(attr):
            # plain methods also run on the loop thread: they read state that only it mutates
            @functools.wraps(attr)
            def call_sync(*args: Any, **kwargs: Any) -> Any:
                async def on_loop() -> Any:
                    return attr(*args, **kwargs)
                return self._lt.run(on_loop())
            return call_sync
        return attr

    @property
    def async_client(self) -> Any:
        """The underlying asyncio client (its methods must run on ``loop``)."""
        return self._target

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._lt.loop

    def submit(self, method: str, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        """Start an async method without waiting: returns a concurrent.futures.Future."""
        return self._lt.submit(getattr(self._target, method)(*args, **kwargs))

    def close(self) -> None:
        if self._released:
            return
        object.__setattr__(self, "_released", True)
        try:
            self._lt.run(self._target.close())
        finally:
            self._lt.release()

    def __enter__(self) -> BlockingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_blocking(client: Any) -> BlockingProxy:
    lt = LoopThread.acquire()
    try:
        lt.run(client.start())
    except BaseException:
        try:
            lt.run(client.close())
        finally:
            lt.release()
        raise
    return BlockingProxy(client, lt)


class SyncContextMixin:
    """``with Client(...) as c`` gives a blocking proxy; ``async with Client(...) as c`` the client."""

    async def start(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    async def close(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def blocking(self) -> BlockingProxy:
        """Start this client on the shared background loop and return its blocking facade."""
        return start_blocking(self)

    def __enter__(self) -> BlockingProxy:
        proxy = self.blocking()
        object.__setattr__(self, "_chronomq_proxy", proxy)
        return proxy

    def __exit__(self, *exc: object) -> None:
        proxy = getattr(self, "_chronomq_proxy", None)
        if proxy is not None:
            proxy.close()

    async def __aenter__(self) -> Any:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
