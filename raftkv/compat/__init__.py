"""Compatibility layers: run programs written for other libraries on raftkv.

- ``raftkv.compat.pysyncobj``: a drop-in for PySyncObj 0.3.x's public API (``SyncObj``,
  ``SyncObjConf``, ``@replicated``, ``SyncObjConsumer`` and the batteries). A PySyncObj
  program changes only its imports. See that package's docstring and
  ``docs/migrating-from-pysyncobj.md``.
"""
