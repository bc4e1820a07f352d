"""What the broker's request processors share: ``ProcessorBase`` (the services and the shortcuts every
processor reads), the ``Handler`` type, ``join_tables`` (the processors' tables as one dispatch table) and
the JSON helpers.

Rules: nothing here answers a request; a helper lives here only when more than one processor module
uses it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from chronomq.message import PROPERTY_CLUSTER, PROPERTY_MSG_REGION, PROPERTY_TRACE_SWITCH
from chronomq.remoting.codec import HeaderError, RemotingCommand

from ..clients import ClientConnection

if TYPE_CHECKING:
    from chronomq.config import BrokerConfig

    from ..services import BrokerServices


class RequestConnection(ClientConnection, Protocol):
    """The connection a request came on (a ``remoting.server.Connection``, or an in-process caller's):
    its peer's (host, port), and ``reply`` for an answer written later (after DEFERRED)."""

    @property
    def remote(self) -> tuple[str, int]: ...

    def reply(self, req: RemotingCommand, resp: RemotingCommand) -> None: ...


Handler = Callable[[RemotingCommand, RequestConnection], "RemotingCommand | None"]


class RequestProcessor(Protocol):
    """What the dispatcher takes from each processor: its table ``{request code: handler}``."""

    def handlers(self) -> dict[int, Handler]: ...


class ProcessorBase:
    """The services a processor works from, and the shortcuts every processor reads."""

    def __init__(self, services: BrokerServices) -> None:
        self.services = services
        self.store = services.store
        self.config = services.config
        self.clock = services.clock
        self.topics = services.topics
        self.delay = services.delay


def join_tables(processors: Iterable[RequestProcessor]) -> dict[int, Handler]:
    """The processors' tables as one ``{request code: handler}``; a code two of them register is refused
    (ValueError naming both), so no handler hides another."""
    table: dict[int, Handler] = {}
    owners: dict[int, RequestProcessor] = {}
    for processor in processors:
        for code, handler in processor.handlers().items():
            if code in table:
                raise ValueError(f"request code {code} is registered by both {type(owners[code]).__name__} "
                                 f"and {type(processor).__name__}")
            table[code] = handler
            owners[code] = processor
    return table


def stamped_properties(config: BrokerConfig) -> dict[str, str]:
    """What RocketMQ's broker writes into the properties of every message a producer sends: CLUSTER
    (SendMessageProcessor, the single and the batch path), MSG_REGION and TRACE_ON (5.x's
    AbstractSendMessageProcessor.buildMsgContext, on every send; 4.9's only with a send hook)."""
    return {PROPERTY_CLUSTER: config.brokerClusterName, PROPERTY_MSG_REGION: config.regionId,
            PROPERTY_TRACE_SWITCH: "true" if config.traceOn else "false"}


def send_result_fields(msg_id: str, queue_id: int, queue_offset: int, region: str = "DefaultRegion",
                       trace_on: str = "true", **extra: str) -> dict[str, str]:
    """The header fields of a SEND's answer (SendMessageResponseHeader, plus what RocketMQ's broker
    always adds: its regionId and traceOn)."""
    return {"msgId": msg_id, "queueId": str(queue_id), "queueOffset": str(queue_offset), **extra,
            PROPERTY_MSG_REGION: region, PROPERTY_TRACE_SWITCH: trace_on}


def not_available_remark(store: Any, cause: str | None) -> str:
    """The remark of a put the store refused with SERVICE_NOT_AVAILABLE: RocketMQ's words (its
    SendMessageProcessor; the disk use of the commit log, consume queues and index, which share one file
    system here), then the store's own reason."""
    try:
        ratio = f"{store.disk_usage_ratio():5.2f}"
    except (OSError, AttributeError):
        ratio = "  ?  "
    return ("service not available now. It may be caused by one of the following reasons: the broker's disk "
            f"is full [CL: {ratio} CQ: {ratio} INDEX: {ratio}], messages are put to the slave, message store "
            f"has been shut down, etc. ({cause or 'the store refused the message'})")


def is_tag_type(expression_type: str | None) -> bool:
    """RocketMQ's ExpressionType.isTagType: no type, "" or "TAG"."""
    return not expression_type or expression_type == "TAG"


def no_filter_remark(expression_type: str) -> str:
    """RocketMQ's answer to a subscription it cannot filter (enablePropertyFilter=false, which chronomq
    always is: it filters by TAG only)."""
    return f"The broker does not support consumer to filter message by {expression_type}"


def dump_json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def parse_json_body(req: RemotingCommand, what: str) -> Any:
    try:
        return json.loads(req.body) if req.body else {}
    except (ValueError, UnicodeDecodeError) as e:
        raise HeaderError(f"{what} body is not valid JSON: {e}") from None
