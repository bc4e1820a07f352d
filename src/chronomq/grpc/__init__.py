"""The RocketMQ 5.x endpoint: the apache.rocketmq.v2 MessagingService over gRPC, translating to the same
broker services the 4.x processors use (docs/grpc.md). Runs on grpcio and protobuf (dependencies of
chronomq); the broker starts it when grpcListenPort >= 0.
"""

from .server import GrpcServer
from .service import MessagingService

__all__ = ["GrpcServer", "MessagingService"]
