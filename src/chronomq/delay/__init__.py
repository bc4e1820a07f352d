"""chronomq.delay (see ../shared/ARCHITECTURE.md)."""
