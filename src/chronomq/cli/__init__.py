"""chronomq.cli (see ../shared/ARCHITECTURE.md)."""
