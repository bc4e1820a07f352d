"""chronomq.store: commit log, consume queues, index, dispatcher, flush, clean and recovery behind the
MessageStore facade (design: docs/store.md). No network code in this package."""

from chronomq.store.mapped import StoreConfigError
from chronomq.store.message_store import MessageStore
from chronomq.store.types import AppendResult, CQUnit, GetResult, GetStatus, PutResult, PutStatus

__all__ = ["AppendResult", "CQUnit", "GetResult", "GetStatus", "MessageStore", "PutResult", "PutStatus",
           "StoreConfigError"]
