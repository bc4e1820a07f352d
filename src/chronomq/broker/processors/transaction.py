"""END_TRANSACTION (37): a producer's commit or rollback of a half message (broker/transaction.py).

Rules: RocketMQ's clients send it oneway, so an answer is written only to a request that asks for one; a
refusal is logged with its reason either way. commitOrRollback must be 0 (unknown: nothing happens, the
check asks again later), 8 (commit) or 12 (rollback); a slave answers SLAVE_NOT_AVAILABLE.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from chronomq.message import SYSFLAG_TRANSACTION_COMMIT_TYPE, SYSFLAG_TRANSACTION_ROLLBACK_TYPE
from chronomq.remoting.codec import HeaderError, RemotingCommand
from chronomq.remoting.codes import RequestCode, ResponseCode
from chronomq.remoting.server import DEFERRED

from ..transaction import TransactionError
from .base import Handler, ProcessorBase, RequestConnection

if TYPE_CHECKING:
    from ..services import BrokerServices

log = logging.getLogger("chronomq.broker.transaction")
_DECISIONS = {0: "unknown", SYSFLAG_TRANSACTION_COMMIT_TYPE: "commit",
              SYSFLAG_TRANSACTION_ROLLBACK_TYPE: "rollback"}


class TransactionProcessor(ProcessorBase):
    """END_TRANSACTION, decided by ``services.transactions``."""

    def __init__(self, services: BrokerServices) -> None:
        super().__init__(services)
        self._tx_tasks: set[asyncio.Future[None]] = set()

    def handlers(self) -> dict[int, Handler]:
        return {RequestCode.END_TRANSACTION: self.end_transaction}

    def end_transaction(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand | None:
        if self.config.is_slave:
            return req.response(ResponseCode.SLAVE_NOT_AVAILABLE, remark="this broker is a slave")
        tx = self.services.transactions
        decision = req.ext_int("commitOrRollback", -1)
        if decision not in _DECISIONS:
            raise HeaderError("commitOrRollback field wrong")
        group = req.require_str("producerGroup")
        queue_offset = req.ext_int("tranStateTableOffset", -1)
        commit_log_offset = req.ext_int("commitLogOffset", -1)
        msg_id = req.ext_str("msgId", "") or ""
        checked = req.ext_bool("fromTransactionCheck")
        if decision == 0:
            log.info("transactions: producer group %s does not know yet whether to commit message %s%s",
                     group, msg_id, " (check)" if checked else "")
            return req.response(remark="unknown: the check will ask again")

        async def run() -> None:
            try:
                what = await tx.end(group, queue_offset, commit_log_offset, decision)
                log.debug("transactions: message %s of group %s %s", msg_id, group, what)
                resp = req.response(remark=what)
            except TransactionError as e:
                log.warning("transactions: %s of message %s (group %s, from %s) refused: %s",
                            _DECISIONS[decision], msg_id, group, conn.remote_addr, e)
                resp = req.response(e.code, remark=str(e))
            conn.reply(req, resp)

        task = asyncio.ensure_future(run())
        self._tx_tasks.add(task)
        task.add_done_callback(self._tx_tasks.discard)
        return DEFERRED
