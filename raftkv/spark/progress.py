"""A progress line for long Spark jobs, read from Spark's status tracker."""

from __future__ import annotations

import threading
import time
from typing import Any, Self


class Progress:
    """Prints, every ``every`` seconds while a job runs, how many of its tasks are done
    (Spark's status tracker). Spark's own bar shows the same live on a terminal, but the
    two interleave: turn the bar off when using this (``session(progress_bar=False)``)."""

    def __init__(self, sc: Any, what: str, out: Any, every: float = 5.0) -> None:
        self.sc, self.what, self.out, self.every = sc, what, out, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="raftkv-progress")

    def __enter__(self) -> Self:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        tracker = self.sc.statusTracker()
        while not self._stop.wait(self.every):
            parts = []
            for sid in tracker.getActiveStageIds():
                st = tracker.getStageInfo(sid)
                if st is not None:
                    parts.append(f"stage {sid}: {st.numCompletedTasks}/{st.numTasks} tasks")
            if parts:
                print(f"[raftkv] {self.what}: {', '.join(parts)} "
                      f"({time.monotonic() - self._t0:.0f} s)", file=self.out, flush=True)
