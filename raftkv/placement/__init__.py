"""Placement (Ignite 3 rebalance, IGNITE-16668): the metastore, tables and partitions,
rebalance, and the in-memory restart protocol. See ``../shared/DESIGN.md`` (Placement)."""
