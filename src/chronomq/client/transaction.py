"""TransactionProducer: RocketMQ 4.x transactional sends (docs/transactions.md).

``send_in_transaction(message, local)`` sends a half message (TRAN_MSG, PGROUP, the prepared sysFlag
bit), runs ``local`` (the local transaction; sync or async) only when the broker stored it with SEND_OK,
then tells the broker its answer with END_TRANSACTION (oneway, as the Java client): COMMIT makes the
message visible, ROLLBACK drops it, UNKNOWN leaves it to the broker's check, which calls ``checker`` on
this producer (CHECK_TRANSACTION_STATE) and sends its answer the same way. A send not stored with SEND_OK
is rolled back; a local transaction that raises counts as UNKNOWN. Unlike RocketMQ's client this one
keeps a delay level or a deliver time: chronomq parks the committed message until due.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from chronomq import message as m
from chronomq.remoting.codec import RemotingCommand
from chronomq.remoting.codes import RequestCode

from .model import Message, ReceivedMessage, SendResult, SendStatus, decode_received
from .producer import Producer

log = logging.getLogger("chronomq.client")

PROPERTY_PRODUCER_GROUP = "PGROUP"


class LocalTransactionState(StrEnum):
    COMMIT = "COMMIT_MESSAGE"
    ROLLBACK = "ROLLBACK_MESSAGE"
    UNKNOWN = "UNKNOW"  # RocketMQ's spelling


_DECISION = {LocalTransactionState.COMMIT: m.SYSFLAG_TRANSACTION_COMMIT_TYPE,
             LocalTransactionState.ROLLBACK: m.SYSFLAG_TRANSACTION_ROLLBACK_TYPE,
             LocalTransactionState.UNKNOWN: m.SYSFLAG_TRANSACTION_NOT_TYPE}

LocalTransaction = Callable[[Message, SendResult], "LocalTransactionState | Awaitable[LocalTransactionState]"]
Checker = Callable[[ReceivedMessage], "LocalTransactionState | Awaitable[LocalTransactionState]"]


@dataclass(frozen=True, slots=True)
class TransactionSendResult:
    """The half message's SendResult and the answer given for it (``error``: why the local transaction
    counted as UNKNOWN, when it raised)."""

    send: SendResult
    state: LocalTransactionState
    error: str | None = None


async def _answer(fn: Callable[..., Any], *args: Any) -> tuple[LocalTransactionState, str | None]:
    try:
        state = fn(*args)
        if inspect.isawaitable(state):
            state = await state
    except Exception as e:
        return LocalTransactionState.UNKNOWN, f"{type(e).__name__}: {e}"
    if state is None:
        return LocalTransactionState.UNKNOWN, None
    return LocalTransactionState(state), None


class TransactionProducer(Producer):
    """A Producer that also sends transactional messages; ``checker`` answers the broker's checks of
    messages whose transaction was left UNKNOWN (or whose answer was lost)."""

    def __init__(self, group: str, namesrv: str | Sequence[str] = "127.0.0.1:9876", *, checker: Checker,
                 **kw: Any) -> None:
        super().__init__(group, namesrv, **kw)
        self.checker = checker
        self._announced: set[str] = set()  # brokers told this producer's group (where checks come from)

    async def start(self) -> None:
        """Start, then tell every broker the default topic's route lists about this producer's group,
        as RocketMQ's producer does within a second of starting: a check of a transaction left open
        before a restart must find a producer of the group."""
        await super().start()
        try:
            route = await self._instance.get_route(self.default_topic)
        except Exception as e:
            log.debug("%s: no route for %s yet (%s); brokers learn this group at its first send", self.group,
                      self.default_topic, e)
            return
        self._announced.update(route.broker_addrs)
        await self._instance.send_heartbeat()

    async def send_in_transaction(self, message: Message, local: LocalTransaction, *,
                                  timeout: float | None = None) -> TransactionSendResult:
        body, props, sys_flag, uniq = self._prepare(message)
        props[m.PROPERTY_TRANSACTION_PREPARED] = "true"
        props[PROPERTY_PRODUCER_GROUP] = self.group
        sys_flag |= m.SYSFLAG_TRANSACTION_PREPARED_TYPE
        topic = message.topic

        def make(_broker: str, qid: int) -> RemotingCommand:
            return self._command(topic, qid, sys_flag, props, message.flag, body, batch=False)

        what = f"transactional send to {topic!r}"
        mq, resp = await self._send_with_retries(topic, make, timeout, what, None)
        result = self._result(mq, resp, [uniq])
        if mq.broker_name not in self._announced:  # so that its checks can find this producer at once
            self._announced.add(mq.broker_name)
            await self._instance.send_heartbeat()
        error: str | None
        if result.status != SendStatus.OK:
            state, error = LocalTransactionState.ROLLBACK, f"the half message was answered {result.status}"
        else:
            state, error = await _answer(local, message, result)
        _, offset = m.decode_offset_msg_id(result.offset_msg_id)
        addr = await self._instance.broker_addr(mq.broker_name)
        await self._end(addr, result.queue_offset, offset, uniq, state, False, error)
        return TransactionSendResult(result, state, error)

    async def _end(self, addr: str, queue_offset: int, commit_log_offset: int, msg_id: str,
                   state: LocalTransactionState, from_check: bool, remark: str | None = None) -> None:
        """END_TRANSACTION (oneway) to the broker at ``addr`` for the half message at those offsets."""
        ext = {"producerGroup": self.group, "tranStateTableOffset": str(queue_offset),
               "commitLogOffset": str(commit_log_offset), "commitOrRollback": str(_DECISION[state]),
               "fromTransactionCheck": "true" if from_check else "false", "msgId": msg_id}
        cmd = self._instance.request(RequestCode.END_TRANSACTION, ext, oneway=True)
        cmd.remark = remark
        await self._instance.invoke_oneway(addr, cmd, "end transaction")

    async def _on_server_request(self, addr: str, cmd: RemotingCommand) -> RemotingCommand | None:
        if cmd.code != RequestCode.CHECK_TRANSACTION_STATE:
            return await super()._on_server_request(addr, cmd)
        try:
            msg = decode_received(cmd.body, "")[0]
            queue_offset = cmd.ext_int("tranStateTableOffset")
            offset = cmd.ext_int("commitLogOffset")
        except (m.MessageFormatError, IndexError, ValueError) as e:
            log.error("%s: a transaction check from %s could not be read: %s", self.group, addr, e)
            return None
        msg_id = cmd.ext_str("msgId") or msg.id
        state, error = await _answer(self.checker, msg)
        if error:
            log.warning("%s: the transaction checker raised for %s: %s", self.group, msg_id, error)
        try:
            await self._end(addr, queue_offset, offset, msg_id, state, True)
        except Exception as e:
            log.warning("%s: the answer to a transaction check could not be sent to %s: %s", self.group, addr,
                        e)
        return None  # the check is oneway: no response


__all__ = ["LocalTransactionState", "TransactionProducer", "TransactionSendResult"]
