"""What the broker's request processors share: ``ProcessorBase`` (the services and the shortcuts every
mixin reads), the ``Handler`` type and the JSON helpers.

Rules: nothing here answers a request; a helper lives here only when more than one processor module
uses it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from chronomq.message import PROPERTY_CLUSTER, PROPERTY_MSG_REGION, PROPERTY_TRACE_SWITCH
from chronomq.remoting.codec import HeaderError, RemotingCommand

if TYPE_CHECKING:
    from chronomq.clock import Clock
    from chronomq.config import BrokerConfig
    from chronomq.delay import DelayService
    from chronomq.remoting.server import Connection
    from chronomq.store import MessageStore

    from ..services import BrokerServices
    from ..timer_processor import TimerProcessor
    from ..topics import TopicConfigManager

Handler = Callable[[RemotingCommand, "Connection"], "RemotingCommand | None"]


class ProcessorBase:
    """The attributes ``BrokerProcessor.__init__`` sets, which every processor mixin reads."""

    services: BrokerServices
    store: MessageStore
    config: BrokerConfig
    clock: Clock
    topics: TopicConfigManager
    delay: DelayService
    timers: TimerProcessor


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
