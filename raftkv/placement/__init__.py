"""Placement (Ignite 3 rebalance, IGNITE-16668): the metastore, tables and partitions,
rebalance, and the in-memory restart protocol. ``rebalance.py``'s module docstring is the
theory of operation, with one module per concern beside it (``manager_base`` lists them);
the README's "Tables" section is the user's view."""
