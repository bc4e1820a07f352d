"""The loop of a periodic store service thread (flush, consume-queue flush, clean): an action every
interval of the store's clock until the store stops. Rule: an OSError or ValueError from the action is
logged and the loop goes on; anything else ends the thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chronomq.store.message_store import MessageStore

log = logging.getLogger("chronomq.store")


def run_every(store: MessageStore, interval_ms: int, action: Callable[[], object], what: str) -> None:
    """Call ``action()`` every ``interval_ms`` (clock time) until the store's stop event is set; a
    failure is logged as "<what> failed: <error>"."""
    stop = store._stop
    clock = store.clock
    while not stop.is_set():
        if clock.wait_until_ms(stop, clock.now_ms() + interval_ms):
            break
        try:
            action()
        except (OSError, ValueError) as e:
            log.error("%s failed: %s", what, e)
