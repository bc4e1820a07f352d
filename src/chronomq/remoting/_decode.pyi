# The compiled decode (_decode.pyx) as mypy sees it; chronomq.remoting.decode.Kernels is the contract it
# and its pure twins (chronomq.client.model) share, and mypy checks this module against it.
from collections.abc import Callable
from typing import Any, TypeVar

C = TypeVar("C")
R = TypeVar("R")

DEF_MAGIC_V1: int
RECORD_FIXED_SIZE: int
POS_BODY: int
SYSFLAG_COMPRESSED: int
PROPERTY_UNIQ_KEY: str
PROPERTY_RETRY_TOPIC: str
RETRY_GROUP_TOPIC_PREFIX: str
RECEIVED_FIELDS: tuple[str, ...]
WANT_VALUE: int
WANT_PROPERTIES: int
WANT_KEYS: int
WANT_TAGS: int
WANT_MSG_ID: int
WANT_DELIVER: int
PROPERTY_KEYS: str
PROPERTY_TAGS: str
PROPERTY_DELIVER_MS: str
PROPERTY_TIMER_DELIVER_MS: str

def record_columns(buf: bytes, cls: Callable[..., C]) -> C: ...
def decode_received(buf: bytes, broker_name: str, received_cls: type[R],
                    queue_cls: Callable[[str, str, int], Any]) -> list[R]: ...
def parse_properties(text: str) -> dict[str, str]: ...
def record_buffers(parts: list[tuple[bytes, int, int]], want: int) -> dict[str, Any] | None: ...
