"""chronomq: a delayed-delivery message broker, wire-compatible with Apache RocketMQ 4.x."""

__version__ = "0.1.0"
