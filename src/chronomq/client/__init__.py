"""chronomq.client: a pure-Python asyncio client for chronomq and any RocketMQ 4.x-protocol broker.

Asyncio at the core (``async with Producer(...) as p: await p.send(...)``), with a blocking facade for
scripts and Spark executors (``with Producer(...) as p: p.send(...)``). See docs/client.md.
"""

from .admin import Admin, PendingMessage, PendingPage, QueueProgress, TimerOpResult, TimerOutcome
from .consumer import LATER, SUCCESS, ConsumeResult, PushConsumer, allocate_average
from .errors import (
    BrokerBusy,
    BrokerError,
    ClientClosed,
    ClientError,
    ConnectFailed,
    InvalidMessage,
    MessageTooLarge,
    NoRouteError,
    NotPermitted,
    NotSupported,
    RequestTimeout,
    SendFailed,
    TopicNotFound,
)
from .model import Message, MessageQueue, ReceivedMessage, SendResult, SendStatus, TopicRoute
from .ops import PullResult, PullStatus
from .producer import Producer, encode_rows, select_by_key
from .simple import SimpleConsumer
from .transaction import LocalTransactionState, TransactionProducer, TransactionSendResult

__all__ = [
    "LATER",
    "SUCCESS",
    "Admin",
    "BrokerBusy",
    "BrokerError",
    "ClientClosed",
    "ClientError",
    "ConnectFailed",
    "ConsumeResult",
    "InvalidMessage",
    "LocalTransactionState",
    "Message",
    "MessageQueue",
    "MessageTooLarge",
    "NoRouteError",
    "NotPermitted",
    "NotSupported",
    "PendingMessage",
    "PendingPage",
    "Producer",
    "PullResult",
    "PullStatus",
    "PushConsumer",
    "QueueProgress",
    "ReceivedMessage",
    "RequestTimeout",
    "SendFailed",
    "SendResult",
    "SendStatus",
    "SimpleConsumer",
    "TimerOpResult",
    "TimerOutcome",
    "TopicNotFound",
    "TopicRoute",
    "TransactionProducer",
    "TransactionSendResult",
    "allocate_average",
    "encode_rows",
    "select_by_key",
]
