"""Generated protobuf messages of the 5.x protocol (see README.md here)."""
