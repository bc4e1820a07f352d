"""The RocketMQ 5.x endpoint: the apache.rocketmq.v2 MessagingService over gRPC, translating to the same
broker services the 4.x processors use (docs/grpc.md). Needs the optional extra ``grpc`` (grpcio,
protobuf).
"""
