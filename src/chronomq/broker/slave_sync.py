"""A slave's copy of its master's metadata (RocketMQ's SlaveSynchronize): topic config, consumer offsets
and delay-level offsets, pulled over the remoting protocol with GET_ALL_TOPIC_CONFIG,
GET_ALL_CONSUMER_OFFSET and GET_ALL_DELAY_OFFSET, first 3 s after start, then every 10 s, as RocketMQ
does. Rules: the topic table is replaced whole when the master's dataVersion differs from the slave's;
consumer offsets are taken key by key (a topic@group the master has overwrites the slave's, others
stay); the delay offsets go to the slave's delayOffset.json, for the schedule service of a slave that
becomes master. Each part is pulled on its own: a failure is retried on the next round, logged when its
reason changes (the same reason again at DEBUG), and its end logged too. The connection is the broker's
(TLS with tlsEnable); a master that cannot be reached or refuses it fails the round, never the loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from chronomq.delay.offsets import OffsetFile, OffsetSnapshot
from chronomq.remoting.client import RemotingError
from chronomq.remoting.codec import RemotingCommand
from chronomq.remoting.codes import RequestCode, ResponseCode

from .offsets import ConsumerOffsetManager
from .topics import TopicConfig, TopicConfigManager

log = logging.getLogger(__name__)

FIRST_SYNC_S = 3.0
SYNC_INTERVAL_S = 10.0
REQUEST_TIMEOUT_S = 3.0

Invoke = Callable[[str, RemotingCommand, float], Awaitable[RemotingCommand]]


class SyncError(Exception):
    """The master's answer to one metadata request could not be used."""


@dataclass
class SyncResult:
    """What one round changed, and what failed (part -> reason)."""

    topics_replaced: bool = False
    offsets_taken: int = 0
    delay_offsets_saved: bool = False
    errors: dict[str, str] = field(default_factory=dict)


class SlaveSynchronize:
    def __init__(self, topics: TopicConfigManager, offsets: ConsumerOffsetManager, store_root: str,
                 invoke: Invoke) -> None:
        self.topics = topics
        self.offsets = offsets
        self.delay_file = OffsetFile(store_root)
        self._invoke = invoke
        self.master_addr = ""  # the master's remoting address, from the name server's register answer
        self.rounds = 0
        self.last: SyncResult | None = None
        self._failing: dict[str, str] = {}  # part -> the reason last logged

    async def _fetch(self, code: int, what: str) -> Any:
        resp = await self._invoke(self.master_addr, RemotingCommand.request(code), REQUEST_TIMEOUT_S)
        if resp.code != ResponseCode.SUCCESS:
            raise SyncError(f"the master answered {what} with code {resp.code}: {resp.remark or ''}")
        try:
            body = json.loads(resp.body) if resp.body else None
        except (ValueError, UnicodeDecodeError) as e:
            raise SyncError(f"the master's {what} is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise SyncError(f"the master's {what} is not a JSON object")
        return body

    async def sync_all(self) -> SyncResult:
        """One round; a no-op (empty result) while the master's address is unknown."""
        res = SyncResult()
        if not self.master_addr:
            return res
        for part, step in (("topics", self._sync_topics), ("consumer offsets", self._sync_offsets),
                           ("delay offsets", self._sync_delay_offsets)):
            try:
                await step(res)
            except (SyncError, RemotingError, OSError, ValueError, TypeError, KeyError) as e:
                why = res.errors[part] = str(e) or type(e).__name__
                if self._failing.get(part) != why:
                    self._failing[part] = why
                    log.warning("slave sync: %s from master %s failed: %s", part, self.master_addr, why)
                else:
                    log.debug("slave sync: %s from master %s failed again: %s", part, self.master_addr, why)
            else:
                if self._failing.pop(part, None) is not None:
                    log.info("slave sync: %s from master %s read again", part, self.master_addr)
        self.rounds += 1
        self.last = res
        return res

    async def _sync_topics(self, res: SyncResult) -> None:
        body = await self._fetch(RequestCode.GET_ALL_TOPIC_CONFIG, "topic config")
        version = body.get("dataVersion")
        table = body.get("topicConfigTable")
        if not isinstance(version, dict) or not isinstance(table, dict):
            raise SyncError("the master's topic config lacks dataVersion or topicConfigTable")
        version = {"timestamp": int(version.get("timestamp", 0)), "counter": int(version.get("counter", 0))}
        if version == self.topics.data_version:
            return
        configs = {str(name): TopicConfig.from_json(d) for name, d in table.items()}
        self.topics.replace_all(configs, version)
        await asyncio.to_thread(self.topics.persist)
        res.topics_replaced = True

    async def _sync_offsets(self, res: SyncResult) -> None:
        body = await self._fetch(RequestCode.GET_ALL_CONSUMER_OFFSET, "consumer offsets")
        table = body.get("offsetTable")
        if not isinstance(table, dict):
            raise SyncError("the master's consumer offsets lack offsetTable")
        parsed = {str(k): {int(q): int(o) for q, o in v.items()} for k, v in table.items()
                  if isinstance(v, dict)}
        res.offsets_taken = self.offsets.take(parsed)
        if res.offsets_taken:
            await asyncio.to_thread(self.offsets.persist)

    async def _sync_delay_offsets(self, res: SyncResult) -> None:
        body = await self._fetch(RequestCode.GET_ALL_DELAY_OFFSET, "delay offsets")
        snap = OffsetSnapshot.from_json(json.dumps(body))  # checked like the file itself
        await asyncio.to_thread(self.delay_file.save, snap)
        res.delay_offsets_saved = True

    async def run(self, sleep: Callable[[float], Awaitable[None]]) -> None:
        await sleep(FIRST_SYNC_S)
        while True:
            await self.sync_all()
            await sleep(SYNC_INTERVAL_S)
