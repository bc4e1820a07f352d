"""chronomq.namesrv (see ../shared/ARCHITECTURE.md)."""
