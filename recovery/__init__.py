"""Recovery: replay from the state store's checkpoint, and compaction after checkpoints."""
