"""The broker's request dispatcher (docs/protocol.md#request-codes): ``BrokerProcessor`` joins the tables
``{request code: handler}`` of the processors in ``broker/processors/`` (send.py, reply.py, pull.py,
client_manage.py, consumer_manage.py, admin.py, groups.py, broker_config.py, query.py, transaction.py,
auth.py) and of the timer codes 9001-9004 (``broker/timer_processor.py``) into one dispatch table; a
code two of them register is refused when it is built.

Most requests are answered inline (``handle_sync``: no task, no await). Two need to wait:
- a PULL with the suspend flag and nothing to return: ``handle_sync`` returns None and the async
  ``handle`` holds it (long polling);
- a SEND under SYNC_FLUSH: the put returns a flush future; the response is written from that future's
  callback (``DEFERRED``), so the event loop never blocks on fsync.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from chronomq.remoting.codec import RemotingCommand
from chronomq.remoting.codes import RequestCode
from chronomq.remoting.server import UnsupportedCode

from .processors.admin import AdminProcessor
from .processors.auth import AuthProcessor
from .processors.base import Handler, RequestConnection, join_tables
from .processors.broker_config import BrokerConfigProcessor
from .processors.client_manage import ClientManageProcessor
from .processors.consumer_manage import ConsumerManageProcessor
from .processors.groups import GroupProcessor
from .processors.pull import PullProcessor
from .processors.query import QueryMessageProcessor
from .processors.reply import ReplyProcessor
from .processors.send import SendProcessor
from .processors.transaction import TransactionProcessor

if TYPE_CHECKING:
    from chronomq.acl.validator import Checker

    from .services import BrokerServices
    from .timer_processor import TimerProcessor


class BrokerProcessor:
    """The 4.x request codes, answered from the broker's services by the processors it builds; the timer
    codes and the parking of timed messages are ``timers``' (broker/timer_processor.py)."""

    def __init__(self, services: BrokerServices, timers: TimerProcessor) -> None:
        self.services = services
        self.timers = timers
        self.acl: Checker | None = None  # set when aclEnable or ACL 2.0 (the controller loads the accounts)
        self.send = SendProcessor(services, timers)
        self.reply = ReplyProcessor(services, self.send)
        self.pull = PullProcessor(services)
        self.client_manage = ClientManageProcessor(services)
        self.consumer_manage = ConsumerManageProcessor(services)
        self.query = QueryMessageProcessor(services)
        self.admin = AdminProcessor(services)
        self.groups = GroupProcessor(services)
        self.broker_config = BrokerConfigProcessor(services)
        self.transaction = TransactionProcessor(services)
        self.auth = AuthProcessor(services)  # ACL 2.0 users and ACLs
        self._sync: dict[int, Handler] = join_tables([
            self.send, self.reply, self.pull, self.client_manage, self.consumer_manage, self.query,
            self.admin, self.groups, self.broker_config, self.transaction, self.auth, timers])

    def handler(self, code: int) -> Handler | None:
        """The handler of a request code, or None when no processor serves it."""
        return self._sync.get(code)

    def handle_sync(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand | None:
        if self.acl is not None:
            from chronomq.acl.validator import refusal  # the accounts' code loads only when they are on

            refused = refusal(self.acl, req, conn.remote_addr)
            if refused is not None:
                return refused
        fn = self._sync.get(req.code)
        if fn is None:
            raise UnsupportedCode(req.code)
        return fn(req, conn)

    async def handle(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand | None:
        if req.code == RequestCode.PULL_MESSAGE:
            return await self.pull.pull_message_held(req, conn)
        return self.handle_sync(req, conn)
