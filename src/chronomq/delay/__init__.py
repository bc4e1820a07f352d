"""chronomq.delay: delayed delivery. ``DelayService`` is the broker's facade: ``admit`` /
``admit_batch`` are the one way in for sent messages (TIMER_* over DELAY), the level schedule service
delivers the levels (18 by default), ``build_send_back`` builds retry and DLQ copies; the ``timer``
subpackage parks messages for any deliver time. Both deliver through one path (``delivery.put_groups``).
Never delivers early. Design and guarantees: docs/delay.md.
"""

from chronomq.delay.delivery import PROPERTY_DELAY_SOURCE, DeliveryPath, restore_real
from chronomq.delay.histogram import Histogram
from chronomq.delay.levels import DelayLevels
from chronomq.delay.service import DelayService

__all__ = ["PROPERTY_DELAY_SOURCE", "DelayLevels", "DelayService", "DeliveryPath", "Histogram",
           "restore_real"]
