"""``bulk_load`` ``on_batch`` hooks for tests. They run in Spark's Python workers, which
import them by module name, so they live here rather than in a test module."""

from __future__ import annotations

import os
from pathlib import Path


class FailOnce:
    """Fails the first attempt of the task writing ``partition`` when it reaches batch
    ``after`` (so that attempt wrote ``after`` batches): Spark then retries the task."""

    def __init__(self, partition: int, after: int) -> None:
        self.partition, self.after = partition, after

    def __call__(self, partition: int, number: int, attempt: int) -> None:
        if partition == self.partition and number == self.after and attempt == 0:
            raise RuntimeError("injected task failure after part of its batches")


class TouchAt:
    """Creates the file ``path`` when partition ``at[0]`` reaches batch ``at[1]``: a signal
    from a Spark worker process to the test (``wait`` blocks until then)."""

    def __init__(self, path: str, at: tuple[int, int]) -> None:
        self.path, self.at = path, at
        if os.path.exists(path):
            os.unlink(path)

    def __call__(self, partition: int, number: int, attempt: int) -> None:
        if (partition, number) == self.at:
            Path(self.path).touch()

    def reached(self) -> bool:
        return os.path.exists(self.path)
