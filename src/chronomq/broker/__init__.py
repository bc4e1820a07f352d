"""chronomq.broker (see ../shared/ARCHITECTURE.md)."""
