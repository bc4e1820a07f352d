"""The gRPC server of the 5.x endpoint: grpc.aio on the broker's event loop, one generic handler that
maps /apache.rocketmq.v2.MessagingService/<Rpc> to ``MessagingService``.

Rules: an RPC chronomq does not serve answers the gRPC status UNIMPLEMENTED (grpc does it when the
handler returns None); a refused request answers its v2 status code; an unexpected error answers
INTERNAL_ERROR; nothing hangs. The port is bound without SO_REUSEPORT, so a second broker on the same
port fails to start its endpoint instead of sharing the port.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from ._proto import rocketmq_v2_pb2 as pb
from .convert import status
from .service import MessagingService, Refused

log = logging.getLogger("chronomq.grpc")

SERVICE = "apache.rocketmq.v2.MessagingService"
MAX_MESSAGE_BYTES = 130 * 1024 * 1024  # a 5.x client allows bodies up to 128 MiB before the server says no

UnaryFn = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]


def _unary(fn: UnaryFn, req_type: type, resp_type: type) -> grpc.RpcMethodHandler:
    async def call(req: Any, ctx: grpc.aio.ServicerContext) -> Any:
        try:
            return await fn(req, ctx)
        except Refused as e:
            return resp_type(status=status(e.code, str(e)))
        except Exception as e:
            log.exception("%s failed", fn.__name__)
            return resp_type(status=status(pb.INTERNAL_ERROR, f"{type(e).__name__}: {e}"))

    return grpc.unary_unary_rpc_method_handler(
        call, request_deserializer=req_type.FromString, response_serializer=resp_type.SerializeToString
    )


class _Handler(grpc.GenericRpcHandler):
    def __init__(self, svc: MessagingService) -> None:
        unary = {
            "QueryRoute": (svc.query_route, pb.QueryRouteRequest, pb.QueryRouteResponse),
            "Heartbeat": (svc.heartbeat, pb.HeartbeatRequest, pb.HeartbeatResponse),
            "SendMessage": (svc.send_message, pb.SendMessageRequest, pb.SendMessageResponse),
            "QueryAssignment": (svc.query_assignment, pb.QueryAssignmentRequest, pb.QueryAssignmentResponse),
            "AckMessage": (svc.ack_message, pb.AckMessageRequest, pb.AckMessageResponse),
            "ForwardMessageToDeadLetterQueue": (
                svc.forward_message_to_dead_letter_queue,
                pb.ForwardMessageToDeadLetterQueueRequest,
                pb.ForwardMessageToDeadLetterQueueResponse,
            ),
            "EndTransaction": (svc.end_transaction, pb.EndTransactionRequest, pb.EndTransactionResponse),
            "NotifyClientTermination": (
                svc.notify_client_termination,
                pb.NotifyClientTerminationRequest,
                pb.NotifyClientTerminationResponse,
            ),
            "ChangeInvisibleDuration": (
                svc.change_invisible_duration,
                pb.ChangeInvisibleDurationRequest,
                pb.ChangeInvisibleDurationResponse,
            ),
            "RecallMessage": (svc.recall_message, pb.RecallMessageRequest, pb.RecallMessageResponse),
        }
        self.methods: dict[str, grpc.RpcMethodHandler] = {
            f"/{SERVICE}/{name}": _unary(*spec) for name, spec in unary.items()
        }
        self.methods[f"/{SERVICE}/ReceiveMessage"] = grpc.unary_stream_rpc_method_handler(
            svc.receive_message,
            request_deserializer=pb.ReceiveMessageRequest.FromString,
            response_serializer=pb.ReceiveMessageResponse.SerializeToString,
        )
        self.methods[f"/{SERVICE}/Telemetry"] = grpc.stream_stream_rpc_method_handler(
            svc.telemetry,
            request_deserializer=pb.TelemetryCommand.FromString,
            response_serializer=pb.TelemetryCommand.SerializeToString,
        )

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        return self.methods.get(handler_call_details.method)  # None: UNIMPLEMENTED


class GrpcServer:
    """``await start()`` binds ``host:port`` (0: any free port; ``port`` is the bound one afterwards);
    ``await stop()``."""

    def __init__(self, svc: MessagingService, host: str, port: int) -> None:
        self.svc = svc
        self.host = host
        self.port = port
        self._server: grpc.aio.Server | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        server = grpc.aio.server(
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ]
        )
        server.add_generic_rpc_handlers((_Handler(self.svc),))
        try:
            bound = server.add_insecure_port(f"{self.host}:{self.port}")
        except RuntimeError as e:
            raise OSError(f"cannot listen on {self.host}:{self.port}: {e}") from None
        if not bound:
            raise OSError(f"cannot listen on {self.host}:{self.port}")
        self.port = bound
        await server.start()
        self._server = server

    async def stop(self, grace: float = 1.0) -> None:
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace)
        self.svc.close()
