"""chronomq.client (see ../shared/ARCHITECTURE.md)."""
