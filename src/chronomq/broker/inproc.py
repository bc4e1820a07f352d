"""In-process calls into the 4.x request processors, for another endpoint of the same broker (the gRPC
service): a request built in memory runs through ``BrokerProcessor`` exactly as one read from a socket
(send checks, admission, the timer, de-duplication, transactions, flush and slave waits), and its answer
comes back as an awaitable.

Rules: no second send path: every put an endpoint makes goes through here. The ACL check of the 4.x
processors does not apply (the caller authenticates its own clients).
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from chronomq.message import (
    DEFAULT_TOPIC,
    PROPERTY_PRODUCER_GROUP,
    PROPERTY_TRANSACTION_PREPARED,
    SYSFLAG_TRANSACTION_COMMIT_TYPE,
    SYSFLAG_TRANSACTION_PREPARED_TYPE,
    SYSFLAG_TRANSACTION_ROLLBACK_TYPE,
    decode_offset_msg_id,
    encode_properties,
)
from chronomq.remoting.codec import RemotingCommand
from chronomq.remoting.codes import RequestCode, ResponseCode
from chronomq.remoting.server import DEFERRED

if TYPE_CHECKING:
    from .processor import BrokerProcessor


class LocalConnection:
    """The connection of one in-process request, as the processors use a ``Connection`` (its peer
    address, ``reply`` for a deferred answer): the caller is not a 4.x client, so commands to it go
    nowhere."""

    def __init__(self, remote: tuple[str, int], loop: asyncio.AbstractEventLoop) -> None:
        self.remote = remote
        self.remote_addr = f"{remote[0]}:{remote[1]}"
        self.addr = self.remote_addr
        self.closed = False
        self.attrs: dict[str, Any] = {}
        self.answer: asyncio.Future[RemotingCommand] = loop.create_future()

    def reply(self, req: RemotingCommand, resp: RemotingCommand) -> None:
        # called on the loop (the processors post deferred answers there)
        if not self.answer.done():
            self.answer.set_result(resp)

    def send_oneway(self, cmd: RemotingCommand) -> None:
        """Server-to-client commands have no in-process client to reach."""

    async def invoke(self, cmd: RemotingCommand, timeout: float = 3.0) -> RemotingCommand:
        """Server-to-client requests reach no in-process client either."""
        raise ConnectionError(f"{self.remote_addr} is an in-process caller: it answers no request")


class AnswerKind(enum.StrEnum):
    """How a 4.x answer reads for another protocol."""

    OK = "ok"
    FLUSH_TIMEOUT = "flush_timeout"  # stored, not yet on disk in time
    SLAVE_TIMEOUT = "slave_timeout"  # stored, not yet on a slave in time (or no slave)
    ILLEGAL = "illegal"
    TOPIC_NOT_FOUND = "topic_not_found"
    FORBIDDEN = "forbidden"
    UNAVAILABLE = "unavailable"
    BUSY = "busy"
    ERROR = "error"  # any other code


ANSWER_KINDS: dict[int, AnswerKind] = {
    ResponseCode.SUCCESS: AnswerKind.OK,
    ResponseCode.FLUSH_DISK_TIMEOUT: AnswerKind.FLUSH_TIMEOUT,
    ResponseCode.FLUSH_SLAVE_TIMEOUT: AnswerKind.SLAVE_TIMEOUT,
    ResponseCode.SLAVE_NOT_AVAILABLE: AnswerKind.SLAVE_TIMEOUT,
    ResponseCode.MESSAGE_ILLEGAL: AnswerKind.ILLEGAL,
    ResponseCode.TOPIC_NOT_EXIST: AnswerKind.TOPIC_NOT_FOUND,
    ResponseCode.NO_PERMISSION: AnswerKind.FORBIDDEN,
    ResponseCode.SERVICE_NOT_AVAILABLE: AnswerKind.UNAVAILABLE,
    ResponseCode.SYSTEM_BUSY: AnswerKind.BUSY,
}
STORED_KINDS = frozenset({AnswerKind.OK, AnswerKind.FLUSH_TIMEOUT, AnswerKind.SLAVE_TIMEOUT})


@dataclass
class Answer:
    """A 4.x answer, protocol-neutral."""

    kind: AnswerKind
    remark: str = ""
    msg_id: str = ""  # a send: the offset message id (the timer's for a timed message)
    queue_id: int = -1
    queue_offset: int = -1
    uniq_key: str = ""  # a timed send: the timer's handle (cancel by it)

    @property
    def stored(self) -> bool:
        """The message is stored (perhaps not yet on disk or on a slave)."""
        return self.kind in STORED_KINDS


def _answer(resp: RemotingCommand) -> Answer:
    ext = resp.ext_fields or {}

    def num(name: str) -> int:
        try:
            return int(str(ext.get(name, "-1")).split(",")[0])
        except ValueError:
            return -1

    return Answer(
        ANSWER_KINDS.get(resp.code, AnswerKind.ERROR),
        resp.remark or "",
        str(ext.get("msgId", "")),
        num("queueId"),
        num("queueOffset"),
        str(ext.get("uniqKey", "")),
    )


class LocalCalls:
    """``await calls.request(code, fields, body, remote)`` -> the processor's answer; ``send``,
    ``send_back`` and ``end_transaction``: the same, typed."""

    def __init__(self, processor: BrokerProcessor) -> None:
        self.processor = processor

    async def request(
        self, code: int, fields: dict[str, str], body: bytes = b"", remote: tuple[str, int] = ("127.0.0.1", 0)
    ) -> RemotingCommand:
        req = RemotingCommand.request(code, fields, body)
        conn = LocalConnection(remote, asyncio.get_running_loop())
        fn = self.processor.handler(code)
        if fn is None:
            raise ValueError(f"request code {code} has no handler")
        try:
            resp = fn(req, conn)
            if resp is None:  # a handler that waits (a held PULL)
                resp = await self.processor.handle(req, conn)
        except Exception as e:  # what the remoting server answers for a handler's error
            return req.response(ResponseCode.SYSTEM_ERROR, remark=f"{type(e).__name__}: {e}")
        if resp is DEFERRED or resp is None:
            resp = await conn.answer
        return resp

    async def send(
        self,
        topic: str,
        properties: dict[str, str],
        body: bytes,
        *,
        queue_id: int = -1,
        born_ms: int = 0,
        born_host: tuple[str, int] = ("127.0.0.1", 0),
        producer_group: str = "",
        transactional: bool = False,
    ) -> Answer:
        """SEND_MESSAGE of one message (``queue_id`` -1: the send path picks one)."""
        props = dict(properties)
        sys_flag = 0
        if transactional:
            props[PROPERTY_TRANSACTION_PREPARED] = "true"
            props[PROPERTY_PRODUCER_GROUP] = producer_group
            sys_flag |= SYSFLAG_TRANSACTION_PREPARED_TYPE
        fields = {
            "producerGroup": producer_group or "CHRONOMQ_GRPC",
            "topic": topic,
            "defaultTopic": DEFAULT_TOPIC,
            "defaultTopicQueueNums": "0",
            "queueId": str(queue_id),
            "sysFlag": str(sys_flag),
            "bornTimestamp": str(born_ms),
            "flag": "0",
            "properties": encode_properties(props),
            "reconsumeTimes": "0",
            "unitMode": "false",
            "batch": "false",
        }
        return _answer(await self.request(RequestCode.SEND_MESSAGE, fields, body, born_host))

    async def send_back(self, group: str, commit_log_offset: int, delay_level: int, max_times: int) -> Answer:
        """CONSUMER_SEND_MSG_BACK: the message at ``commit_log_offset`` to %RETRY%group, or with
        ``delay_level`` -1 (or ``max_times`` reached) to %DLQ%group."""
        fields = {
            "group": group,
            "offset": str(commit_log_offset),
            "delayLevel": str(delay_level),
            "maxReconsumeTimes": str(max_times),
            "unitMode": "false",
        }
        return _answer(await self.request(RequestCode.CONSUMER_SEND_MSG_BACK, fields))

    async def end_transaction(
        self, producer_group: str, msg_id: str, queue_offset: int, commit: bool
    ) -> Answer:
        """END_TRANSACTION of the half message stored as ``msg_id`` (its offset message id)."""
        _, commit_log_offset = decode_offset_msg_id(msg_id)
        decision = SYSFLAG_TRANSACTION_COMMIT_TYPE if commit else SYSFLAG_TRANSACTION_ROLLBACK_TYPE
        fields = {
            "producerGroup": producer_group,
            "tranStateTableOffset": str(queue_offset),
            "commitLogOffset": str(commit_log_offset),
            "commitOrRollback": str(decision),
            "fromTransactionCheck": "false",
            "msgId": msg_id,
        }
        return _answer(await self.request(RequestCode.END_TRANSACTION, fields))
