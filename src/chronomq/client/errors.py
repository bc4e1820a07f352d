"""Typed exceptions of chronomq.client. Every one carries a message saying what failed and where."""

from __future__ import annotations

from chronomq.remoting.codes import ResponseCode


class ClientError(Exception):
    """Base class of every error raised by chronomq.client."""


class ClientClosed(ClientError):
    """The producer/consumer/admin was closed (or never started)."""


class InvalidMessage(ClientError, ValueError):
    """The message cannot be sent as given (bad topic, empty body, mixed batch, ...)."""


class MessageTooLarge(InvalidMessage):
    """The body (after compression) exceeds the producer's max_message_size, or the broker said so."""


class NoRouteError(ClientError):
    """The name server has no route for the topic (or no writable/readable queue)."""


class ConnectFailed(ClientError):
    """A name server or broker could not be reached (or the connection broke during a request)."""


class RequestTimeout(ClientError, TimeoutError):
    """No response within the request timeout."""


class BrokerError(ClientError):
    """The broker or name server answered with an error code."""

    def __init__(self, message: str, code: int = ResponseCode.SYSTEM_ERROR, remark: str | None = None,
                 addr: str | None = None) -> None:
        super().__init__(message)
        self.code = int(code)
        self.remark = remark
        self.addr = addr

    @property
    def code_name(self) -> str:
        """The response code's RocketMQ name (MESSAGE_ILLEGAL, QUERY_NOT_FOUND, ...), or its number."""
        try:
            return ResponseCode(self.code).name
        except ValueError:
            return str(self.code)


class BrokerBusy(BrokerError):
    """SYSTEM_BUSY / SERVICE_NOT_AVAILABLE: back-pressure, worth retrying later."""


class NotPermitted(BrokerError):
    """NO_PERMISSION: the topic is not writable/readable, or the broker refused the operation."""


class TopicNotFound(BrokerError, NoRouteError):
    """TOPIC_NOT_EXIST from the broker or the name server."""


class NotSupported(BrokerError):
    """REQUEST_CODE_NOT_SUPPORTED: the server does not implement this request."""


class SendFailed(ClientError):
    """Every send attempt failed; ``attempts`` lists (broker, queue, error) for each try."""

    def __init__(self, message: str, attempts: list[tuple[str, int, BaseException]]) -> None:
        super().__init__(message)
        self.attempts = attempts


def error_for_code(code: int, remark: str | None, what: str, addr: str | None = None) -> BrokerError:
    """Map a response code to the exception a user should see."""
    text = f"{what}: {addr or 'server'} answered code {code}"
    try:
        text += f" ({ResponseCode(code).name})"
    except ValueError:
        pass
    if remark:
        text += f": {remark}"
    if code in (ResponseCode.SYSTEM_BUSY, ResponseCode.SERVICE_NOT_AVAILABLE):
        return BrokerBusy(text, code, remark, addr)
    if code == ResponseCode.NO_PERMISSION:
        return NotPermitted(text, code, remark, addr)
    if code == ResponseCode.TOPIC_NOT_EXIST:
        return TopicNotFound(text, code, remark, addr)
    if code == ResponseCode.REQUEST_CODE_NOT_SUPPORTED:
        return NotSupported(text, code, remark, addr)
    if code == ResponseCode.MESSAGE_ILLEGAL and remark and ("size" in remark.lower() or
                                                            "large" in remark.lower()):
        return MessageTooLargeBroker(text, code, remark, addr)
    return BrokerError(text, code, remark, addr)


class MessageTooLargeBroker(BrokerError, MessageTooLarge):
    """The broker refused the message as too large."""
