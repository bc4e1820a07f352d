"""chronomq.store (see ../shared/ARCHITECTURE.md)."""
