"""Transactional messages, as RocketMQ 4.x keeps them (docs/transactions.md).

A send carrying TRAN_MSG=true is stored as a half message under ``HALF_TOPIC`` queue 0 (real topic and
queue in REAL_TOPIC / REAL_QID, transaction bits cleared), which no consumer subscribes to.
END_TRANSACTION commits it (the real message is put, or parked when it carries a delay level or a deliver
time) or rolls it back; either way an op record under ``OP_TOPIC`` (body: the half message's queue offset,
tag "d") marks it decided, so a restart loses no decision. Every ``transactionCheckInterval`` the check
scans the half queue from its saved offset: a half message undecided for ``transactionTimeOut`` is put
again at the end of the half queue with TRANSACTION_CHECK_TIMES + 1 (its old place marked decided) and a
live producer of its group is asked with CHECK_TRANSACTION_STATE; past ``transactionCheckMax`` checks it
goes to ``CHECK_MAX_TOPIC`` instead. The scan's offsets are consumer offsets of ``CHECK_GROUP``.
"""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING, Any

from chronomq.message import (
    PROPERTY_REAL_QUEUE_ID,
    PROPERTY_REAL_TOPIC,
    PROPERTY_TAGS,
    PROPERTY_TRANSACTION_PREPARED,
    PROPERTY_UNIQ_KEY,
    SYSFLAG_TRANSACTION_COMMIT_TYPE,
    SYSFLAG_TRANSACTION_NOT_TYPE,
    SYSFLAG_TRANSACTION_PREPARED_TYPE,
    SYSFLAG_TRANSACTION_ROLLBACK_TYPE,
    MessageExt,
    MessageFormatError,
    create_offset_msg_id,
    decode_record,
    encode_record,
    transaction_type,
)
from chronomq.remoting.codec import RemotingCommand
from chronomq.remoting.codes import RequestCode, ResponseCode
from chronomq.store.types import PutResult, PutStatus

if TYPE_CHECKING:
    from chronomq.clock import Clock
    from chronomq.config import BrokerConfig
    from chronomq.delay import DelayService
    from chronomq.delay.timer import TimerService
    from chronomq.store import MessageStore

    from .clients import ProducerManager
    from .offsets import ConsumerOffsetManager

log = logging.getLogger("chronomq.broker.transaction")

HALF_TOPIC = "RMQ_SYS_TRANS_HALF_TOPIC"
OP_TOPIC = "RMQ_SYS_TRANS_OP_HALF_TOPIC"
CHECK_MAX_TOPIC = "TRANS_CHECK_MAX_TIME_TOPIC"
CHECK_GROUP = "CID_RMQ_SYS_TRANS"
REMOVE_TAG = "d"
PROPERTY_PRODUCER_GROUP = "PGROUP"
PROPERTY_CHECK_TIMES = "TRANSACTION_CHECK_TIMES"
PROPERTY_CHECK_IMMUNITY = "CHECK_IMMUNITY_TIME_IN_SECONDS"
_TX_MASK = SYSFLAG_TRANSACTION_ROLLBACK_TYPE  # the two transaction bits
_WRITTEN = (PutStatus.PUT_OK, PutStatus.FLUSH_DISK_TIMEOUT)
# the sysFlag transaction bits of a send that may be a half message (send.py refuses them without TRAN_MSG)
_HALF_BITS = (SYSFLAG_TRANSACTION_PREPARED_TYPE, SYSFLAG_TRANSACTION_ROLLBACK_TYPE)


def is_transactional(props: dict[str, str]) -> bool:
    """The TRAN_MSG property says true: a transactional producer's send, or a committed message (which
    keeps it, as RocketMQ's does)."""
    return props.get(PROPERTY_TRANSACTION_PREPARED, "").lower() == "true"


def is_half_send(props: dict[str, str], sys_flag: int) -> bool:
    """What makes a send a half message: TRAN_MSG=true and the prepared sysFlag bit, which every
    transactional producer sets together (RocketMQ's Java and Go clients, chronomq's, the gRPC endpoint).
    A committed message carries TRAN_MSG=true too; a client that sends such a message again with its
    properties (the console's dead-letter re-drive, a consumer forwarding it) sends an ordinary
    message, not a half message nobody would ever commit. (RocketMQ's broker reads the property alone;
    its Java consumer clears TRAN_MSG before it re-sends.)"""
    return transaction_type(sys_flag) in _HALF_BITS and is_transactional(props)


class TransactionError(Exception):
    """An END_TRANSACTION that cannot be applied; ``code`` is the response code, the text its remark."""

    def __init__(self, code: int, text: str) -> None:
        super().__init__(text)
        self.code = code


class TransactionService:
    def __init__(self, config: BrokerConfig, clock: Clock, store: MessageStore, delay: DelayService,
                 timer: TimerService, offsets: ConsumerOffsetManager, producers: ProducerManager,
                 store_host: tuple[str, int]) -> None:
        self.config = config
        self.clock = clock
        self.store = store
        self.delay = delay
        self.timer = timer
        self.offsets = offsets
        self.producers = producers
        self.store_host = store_host
        self._decided: set[int] = set()  # half-queue offsets with an op record, at or past the scan offset
        self._deciding: set[int] = set()  # half-queue offsets whose commit is being stored (the check skips)
        self._ops_read = -1  # op-queue offset read up to (-1: not read yet)
        self.committed = self.rolled_back = self.checks_sent = self.given_up = 0

    # --- the half message -----------------------------------------------------------------------------
    @staticmethod
    def half(msg: MessageExt) -> MessageExt:
        """``msg`` as its half message: under HALF_TOPIC queue 0, real topic and queue kept in
        REAL_TOPIC / REAL_QID, transaction bits cleared (it is stored like any message)."""
        msg.properties[PROPERTY_REAL_TOPIC] = msg.topic
        msg.properties[PROPERTY_REAL_QUEUE_ID] = str(msg.queue_id)
        msg.topic, msg.queue_id = HALF_TOPIC, 0
        msg.sys_flag = (msg.sys_flag & ~_TX_MASK) | SYSFLAG_TRANSACTION_NOT_TYPE
        return msg

    def _half_at(self, commit_log_offset: int) -> MessageExt | None:
        m = self.store.look_message_by_offset(commit_log_offset)
        return m if m is not None and m.topic == HALF_TOPIC else None

    # --- END_TRANSACTION -----------------------------------------------------------------------------
    async def end(self, group: str, queue_offset: int, commit_log_offset: int, decision: int) -> str:
        """Apply a producer's decision (SYSFLAG_TRANSACTION_COMMIT_TYPE or _ROLLBACK_TYPE) on the half
        message at ``commit_log_offset``. Returns what was done; raises TransactionError."""
        half = self._half_at(commit_log_offset)
        if half is None:
            raise TransactionError(ResponseCode.SYSTEM_ERROR, "Find prepared transaction message failed")
        if half.properties.get(PROPERTY_PRODUCER_GROUP) != group:
            raise TransactionError(ResponseCode.SYSTEM_ERROR, "The producer group wrong")
        if half.queue_offset != queue_offset:
            raise TransactionError(ResponseCode.SYSTEM_ERROR, "The transaction state table offset wrong")
        self._read_ops()
        if queue_offset in self._decided or queue_offset in self._deciding \
                or queue_offset < self._scan_offset():
            return "already decided"  # a second answer (a check and the producer's own, say) changes nothing
        self._deciding.add(queue_offset)
        try:
            if decision == SYSFLAG_TRANSACTION_COMMIT_TYPE:
                await self._commit(half)
                self.committed += 1
                what = "committed"
            else:
                self.rolled_back += 1
                what = "rolled back"
            self._decide(half)
        finally:
            self._deciding.discard(queue_offset)
        return what

    async def _commit(self, half: MessageExt) -> None:
        """The real message: the half's bytes and properties under its real topic and queue, commit bits
        set, the half's commit-log offset as prepared transaction offset. A delay level or a deliver time
        parks it until due (RocketMQ refuses both on transactional messages)."""
        # every property of the half stays, TRAN_MSG, PGROUP, REAL_TOPIC and REAL_QID among them:
        # RocketMQ's EndTransactionProcessor.endMessageTransaction writes the stored property string
        # before it clears them. What makes the copy a committed message, never a half one again, is its
        # sysFlag (the commit bits), as in RocketMQ's store; a send is a half message only with the
        # prepared bit (is_half_send)
        props = dict(half.properties)
        topic = props.get(PROPERTY_REAL_TOPIC)
        qid = props.get(PROPERTY_REAL_QUEUE_ID)
        if topic is None or qid is None:
            raise TransactionError(ResponseCode.SYSTEM_ERROR, "the half message lacks REAL_TOPIC/REAL_QID")
        real = MessageExt(topic, half.body, props, half.flag, int(qid),
                          (half.sys_flag & ~_TX_MASK) | SYSFLAG_TRANSACTION_COMMIT_TYPE, half.born_timestamp,
                          half.born_host, 0, self.store_host, half.reconsume_times, half.commit_log_offset)
        admitted = self.delay.admit(real)
        if admitted.refused is not None:
            raise TransactionError(ResponseCode.MESSAGE_ILLEGAL, admitted.refused)
        if admitted.timed:
            try:
                await self.timer.schedule_batch_async(admitted.timed)
            except Exception as e:
                raise TransactionError(ResponseCode.SYSTEM_ERROR, f"cannot park the message: {e}") from e
            return
        self._put(admitted.put[0], "the committed message")

    def _put(self, msg: MessageExt, what: str) -> PutResult:
        res = self.store.put_message(msg)
        if res.status not in _WRITTEN:
            code = (ResponseCode.MESSAGE_ILLEGAL if res.status in (PutStatus.MESSAGE_ILLEGAL,
                                                                   PutStatus.PROPERTIES_SIZE_EXCEEDED)
                    else ResponseCode.SERVICE_NOT_AVAILABLE)
            raise TransactionError(code, f"{what} could not be stored: {res.error or res.status.value}")
        return res

    def _decide(self, half: MessageExt) -> None:
        """The op record marking the half message at its queue offset decided."""
        op = MessageExt(OP_TOPIC, str(half.queue_offset).encode(), {PROPERTY_TAGS: REMOVE_TAG}, 0, 0, 0,
                        self.clock.now_ms(), self.store_host, 0, self.store_host)
        self._put(op, "the op record")
        self._decided.add(half.queue_offset)

    # --- the check ------------------------------------------------------------------------------------
    def _scan_offset(self) -> int:
        off = self.offsets.query(CHECK_GROUP, HALF_TOPIC, 0)
        return off if off >= 0 else self.store.get_min_offset_in_queue(HALF_TOPIC, 0)

    def _read_ops(self) -> None:
        """Every op record not read yet: their half offsets are decided."""
        if self._ops_read < 0:
            off = self.offsets.query(CHECK_GROUP, OP_TOPIC, 0)
            self._ops_read = off if off >= 0 else self.store.get_min_offset_in_queue(OP_TOPIC, 0)
        while True:
            res = self.store.get_message(OP_TOPIC, 0, self._ops_read, 256)
            for raw in res.messages:
                try:
                    op = decode_record(raw)
                    if op.properties.get(PROPERTY_TAGS) == REMOVE_TAG:
                        self._decided.add(int(op.body.decode()))
                except (MessageFormatError, ValueError, UnicodeDecodeError):
                    log.error("transactions: an unreadable op record was skipped")
            if res.next_begin_offset <= self._ops_read:
                break
            self._ops_read = res.next_begin_offset
            if not res.messages and res.next_begin_offset >= res.max_offset:
                break

    def check_once(self) -> dict[str, int]:
        """One check round (see the module docs). Returns counts: checked, given_up, skipped."""
        start = self.clock.now_ms()
        self._read_ops()
        i = self._scan_offset()
        end = self.store.get_max_offset_in_queue(HALF_TOPIC, 0)
        timeout = self.config.transactionTimeOut
        counts = {"checked": 0, "given_up": 0}
        while i < end:
            if i in self._decided:
                i += 1
                continue
            if i in self._deciding:
                break  # its commit is being stored: decided in a moment, checked next round if not
            res = self.store.get_message(HALF_TOPIC, 0, i, 1)
            if not res.messages:
                if res.next_begin_offset > i:  # cleaned away: nothing to check there
                    i = res.next_begin_offset
                    continue
                break
            try:
                half = decode_record(res.messages[0])
            except MessageFormatError:
                log.error("transactions: the half message at queue offset %d is unreadable; skipped", i)
                i += 1
                continue
            if half.store_timestamp >= start:
                break  # put again during this round, or newer
            immunity = timeout
            raw = half.properties.get(PROPERTY_CHECK_IMMUNITY)
            if raw:
                try:
                    immunity = int(raw) * 1000
                except ValueError:
                    immunity = timeout
            if start - half.store_timestamp < immunity:
                break  # the rest are newer still
            times = int(half.properties.get(PROPERTY_CHECK_TIMES, "0") or 0)
            if times >= self.config.transactionCheckMax:
                self._give_up(half)
                counts["given_up"] += 1
            else:
                self._check(half, times + 1)
                counts["checked"] += 1
            self._decide(half)
            i += 1
        # the scan resumes at the first offset still undecided; what lies below it is forgotten
        scan = self._scan_offset()
        while scan in self._decided:
            self._decided.discard(scan)
            scan += 1
        self._decided = {d for d in self._decided if d >= scan}
        self.offsets.commit(CHECK_GROUP, HALF_TOPIC, 0, scan)
        self.offsets.commit(CHECK_GROUP, OP_TOPIC, 0, max(self._ops_read, 0))
        return counts

    def _give_up(self, half: MessageExt) -> None:
        """Checked transactionCheckMax times without an answer: kept under CHECK_MAX_TOPIC for an operator."""
        copy = self._copy(half, CHECK_MAX_TOPIC)
        self._put(copy, "a transaction given up")
        self.given_up += 1
        log.warning("transactions: message %s of group %s was checked %s times without a decision; "
                    "moved to %s",
                    half.properties.get(PROPERTY_UNIQ_KEY), half.properties.get(PROPERTY_PRODUCER_GROUP),
                    half.properties.get(PROPERTY_CHECK_TIMES), CHECK_MAX_TOPIC)

    def _copy(self, half: MessageExt, topic: str, **props: str) -> MessageExt:
        return MessageExt(topic, half.body, {**half.properties, **props}, half.flag, 0, half.sys_flag,
                          half.born_timestamp, half.born_host, 0, self.store_host, half.reconsume_times)

    def _check(self, half: MessageExt, times: int) -> None:
        """Put the half message again at the end of the half queue, then ask a producer of its group."""
        res = self._put(self._copy(half, HALF_TOPIC, **{PROPERTY_CHECK_TIMES: str(times)}), "a half message")
        a = res.append
        assert a is not None
        group = half.properties.get(PROPERTY_PRODUCER_GROUP, "")
        online = [c.conn for c in (self.producers.groups.get(group) or {}).values() if c.conn is not None]
        if not online:
            log.info("transactions: no producer of group %s is online to check message %s (check %d)", group,
                     half.properties.get(PROPERTY_UNIQ_KEY), times)
            return
        conn = random.choice(online)
        uniq = half.properties.get(PROPERTY_UNIQ_KEY, "")
        real = self._copy(half, half.properties.get(PROPERTY_REAL_TOPIC, half.topic),
                          **{PROPERTY_CHECK_TIMES: str(times)})
        real.queue_id = int(half.properties.get(PROPERTY_REAL_QUEUE_ID, "0") or 0)
        real.queue_offset, real.commit_log_offset = a.queue_offset, a.wrote_offset
        real.store_timestamp = a.store_timestamp
        try:
            body = bytes(encode_record(real))
        except MessageFormatError as e:
            log.error("transactions: message %s cannot be encoded for a check: %s", uniq, e)
            return
        cmd = RemotingCommand.request(RequestCode.CHECK_TRANSACTION_STATE, {
            "tranStateTableOffset": str(a.queue_offset), "commitLogOffset": str(a.wrote_offset),
            "msgId": uniq, "transactionId": uniq,
            "offsetMsgId": create_offset_msg_id(self.store_host, a.wrote_offset)}, body, oneway=True)
        cmd.language = "JAVA"
        conn.send_oneway(cmd)
        self.checks_sent += 1

    def stats(self) -> dict[str, Any]:
        return {"committed": self.committed, "rolledBack": self.rolled_back, "checksSent": self.checks_sent,
                "givenUp": self.given_up,
                "halfQueue": self.store.get_max_offset_in_queue(HALF_TOPIC, 0) - self._scan_offset()}
