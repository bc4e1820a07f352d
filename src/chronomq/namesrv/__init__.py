"""chronomq.namesrv: the name server (route table, broker registration and expiry)."""

from .routeinfo import RouteInfoManager
from .server import NameServer

__all__ = ["NameServer", "RouteInfoManager"]
