"""The broker's request dispatcher (protocol.md section 2): ``BrokerProcessor`` maps each request code to
its handler; the handlers live in ``broker/processors/``, one module per kind of request, as mixins of
this class (send.py, reply.py, pull.py, client_manage.py, consumer_manage.py, admin.py, groups.py,
broker_config.py, query.py, transaction.py), and the timer codes 9001-9004 in ``broker/timer_processor.py``.

Most requests are answered inline (``handle_sync``: no task, no await). Two need to wait:
- a PULL with the suspend flag and nothing to return: ``handle_sync`` returns None and the async
  ``handle`` holds it (long polling);
- a SEND under SYNC_FLUSH: the put returns a flush future; the response is written from that future's
  callback (``DEFERRED``), so the event loop never blocks on fsync.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from chronomq.acl import AclValidator, refusal
from chronomq.remoting.codec import RemotingCommand
from chronomq.remoting.codes import RequestCode
from chronomq.remoting.server import Connection, UnsupportedCode

from .processors.admin import AdminProcessor
from .processors.base import Handler
from .processors.broker_config import BrokerConfigProcessor
from .processors.client_manage import ClientManageProcessor
from .processors.consumer_manage import ConsumerManageProcessor
from .processors.groups import GroupProcessor
from .processors.pull import PullProcessor
from .processors.query import QueryMessageProcessor
from .processors.reply import ReplyProcessor
from .processors.send import SendProcessor
from .processors.transaction import TransactionProcessor
from .subgroups import SubscriptionGroupManager

if TYPE_CHECKING:
    from .services import BrokerServices
    from .timer_processor import TimerProcessor


class BrokerProcessor(
    ReplyProcessor,
    SendProcessor,
    PullProcessor,
    ClientManageProcessor,
    ConsumerManageProcessor,
    QueryMessageProcessor,
    AdminProcessor,
    GroupProcessor,
    BrokerConfigProcessor,
    TransactionProcessor,
):
    """The 4.x request codes, answered from the broker's services; the timer codes and the parking of
    timed messages are ``timers``' (broker/timer_processor.py)."""

    def __init__(self, services: BrokerServices, timers: TimerProcessor) -> None:
        self.services = services
        self.store = services.store
        self.config = services.config
        self.clock = services.clock
        self.topics = services.topics
        self.delay = services.delay
        self.timers = timers
        self.acl: AclValidator | None = None  # set when aclEnable (the controller loads the accounts)
        if services.subgroups is None:
            services.subgroups = SubscriptionGroupManager(
                Path(self.config.storePathRootDir) / "config", self.clock.now_ms,
                lambda: self.config.autoCreateSubscriptionGroup)
        self._sync: dict[int, Handler] = {}
        self._sync.update(self._init_send())
        self._sync.update(self._init_reply())  # after the send's: it reads its stamps
        self._sync.update(self._init_pull())
        self._sync.update(self._init_client_manage())
        self._sync.update(self._init_consumer_manage())
        self._sync.update(self._init_query())
        self._sync.update(self._init_admin())
        self._sync.update(self._init_groups())
        self._sync.update(self._init_broker_config())
        self._sync.update(self._init_transaction())
        self._sync.update(timers.handlers())  # 9001-9004: broker/timer_processor.py

    def handle_sync(self, req: RemotingCommand, conn: Connection) -> RemotingCommand | None:
        if self.acl is not None:
            refused = refusal(self.acl, req, conn.remote_addr)
            if refused is not None:
                return refused
        fn = self._sync.get(req.code)
        if fn is None:
            raise UnsupportedCode(req.code)
        return fn(req, conn)

    async def handle(self, req: RemotingCommand, conn: Connection) -> RemotingCommand | None:
        if req.code == RequestCode.PULL_MESSAGE:
            return await self.pull_message_held(req, conn)
        return self.handle_sync(req, conn)
