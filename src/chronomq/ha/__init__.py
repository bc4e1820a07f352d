"""Master-slave high availability: the commit-log link (RocketMQ's HAService and HAClient) and the
SYNC_MASTER wait. ``HAService`` runs on a master, ``HAClient`` on a slave; see docs/ha.md."""

from chronomq.ha.client import HAClient
from chronomq.ha.service import HAService, SlaveWait

__all__ = ["HAClient", "HAService", "SlaveWait"]
