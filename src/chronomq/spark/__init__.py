"""chronomq.spark (see ../shared/ARCHITECTURE.md)."""
