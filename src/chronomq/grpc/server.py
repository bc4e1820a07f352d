"""The gRPC server of the 5.x endpoint: grpc.aio on the broker's event loop, one generic handler that
maps /apache.rocketmq.v2.MessagingService/<Rpc> to ``MessagingService``.

Rules: an RPC chronomq does not serve answers the gRPC status UNIMPLEMENTED (grpc does it when the
handler returns None); a refused request answers its v2 status code; an unexpected error answers
INTERNAL_ERROR; nothing hangs.

TLS (docs/grpc.md, "TLS"): grpc listens on 127.0.0.1 only, on a plaintext port unless the mode is
enforcing and on a TLS port (grpc's own TLS) unless it is disabled; the public port is ``front.PortFront``,
which sends each connection to the internal port of its kind or closes it. The TLS port's credentials
reload the certificate files when they change (``tls.Certificates``). Every port is bound without
SO_REUSEPORT, so a second broker on the same port fails to start its endpoint instead of sharing the port.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from . import tls as tls_settings
from ._proto import rocketmq_v2_pb2 as pb
from .convert import status
from .front import PortFront
from .service import MessagingService, Refused
from .tls import Certificates, TlsSettings

log = logging.getLogger("chronomq.grpc")

SERVICE = "apache.rocketmq.v2.MessagingService"
MAX_MESSAGE_BYTES = 130 * 1024 * 1024  # a 5.x client allows bodies up to 128 MiB before the server says no

UnaryFn = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]


def _unary(
    svc: MessagingService, rpc: str, fn: UnaryFn, req_type: Any, resp_type: Any
) -> grpc.RpcMethodHandler:
    """``fn`` served for requests of the generated message class ``req_type`` (the generated classes read
    as Any), answering ``resp_type``, once the accounts' check (``svc.refused``) lets the call through."""
    async def call(req: Any, ctx: grpc.aio.ServicerContext) -> Any:
        refused = svc.refused(rpc, req, ctx)
        if refused is not None:
            return resp_type(status=refused)
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
            f"/{SERVICE}/{name}": _unary(svc, name, *spec) for name, spec in unary.items()
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
    ``await stop()``. ``tls``: the TLS settings (default: read from the service's broker configuration,
    see ``tls.load``)."""

    def __init__(self, svc: MessagingService, host: str, port: int, tls: TlsSettings | None = None) -> None:
        self.svc = svc
        self.host = host
        self.port = port
        self.tls = tls
        self.front: PortFront | None = None
        self.certificates: Certificates | None = None  # the files the TLS port serves, unless disabled
        self._server: grpc.aio.Server | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        config = self.svc.config
        tls = self.tls if self.tls is not None else tls_settings.load(config)
        self.tls = tls
        server = grpc.aio.server(
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ]
        )
        server.add_generic_rpc_handlers((_Handler(self.svc),))
        plaintext_port = tls_port = None
        try:
            if tls.serves_plaintext:
                plaintext_port = server.add_insecure_port("127.0.0.1:0")
            if tls.serves_tls:
                self.certificates = Certificates(tls)
                tls_port = server.add_secure_port("127.0.0.1:0", self.certificates.credentials())
        except RuntimeError as e:
            raise OSError(f"cannot listen on an internal port of 127.0.0.1: {e}") from None
        if plaintext_port == 0 or tls_port == 0:
            raise OSError("cannot listen on an internal port of 127.0.0.1")
        await server.start()
        front = PortFront(
            self.host, self.port, tls.mode, plaintext_port=plaintext_port, tls_port=tls_port,
            max_connections=getattr(config, "serverMaxConnections", 0),
            max_connections_per_ip=getattr(config, "serverMaxConnectionsPerIp", 0),
            first_bytes_timeout=getattr(config, "serverFrameReadTimeoutMillis", 30_000) / 1000,
            clock=self.svc.clock,
        )
        try:
            await front.start()
        except OSError as e:
            await server.stop(0)
            raise OSError(f"cannot listen on {self.host}:{self.port}: {e.strerror or e}") from None
        self.port = front.port
        self.front = front
        self._server = server
        self.svc.peer_of = front.client_of
        log.info("gRPC endpoint: TLS %s on %s%s", tls.mode, self.address,
                 f", certificate {tls.cert_path}" if tls.cert_path is not None else "")

    async def stop(self, grace: float = 1.0) -> None:
        front, self.front = self.front, None
        if front is not None:
            await front.stop()
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace)
        self.svc.close()
