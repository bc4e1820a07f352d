"""chronomq.delay: delay levels, the level schedule service, retry/DLQ send-back (see
../shared/ARCHITECTURE.md). The broker uses ``DelayService``."""

from chronomq.delay.delivery import PROPERTY_DELAY_SOURCE, DeliveryPath, restore_real
from chronomq.delay.histogram import Histogram
from chronomq.delay.levels import DelayLevels
from chronomq.delay.service import DelayService

__all__ = ["PROPERTY_DELAY_SOURCE", "DelayLevels", "DelayService", "DeliveryPath", "Histogram",
           "restore_real"]
