"""The node layer: drives Raft groups over storage and transport."""
