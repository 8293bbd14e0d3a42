"""The thread shape the server's workers share: a daemon thread woken through a condition on one lock."""

from __future__ import annotations

import threading
from typing import ClassVar


class ServiceThread:
    """A daemon thread serving queued work (`_run`, in subclasses). Its lock guards the subclass's queues
    and the `_draining` / `_stopping` flags; `_wake` is notified when there is something to do."""

    #: the thread's name (shows in stack dumps)
    thread_name: ClassVar[str] = "superslm-worker"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._draining = self._stopping = False  # guarded by _lock
        self._thread: threading.Thread | None = None
        #: what killed the thread, if anything did
        self.error: BaseException | None = None

    def start(self) -> None:
        """Start the thread (once)."""
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """True while the thread runs and has not failed."""
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def drain(self) -> None:
        """Refuse new work from now on; what was accepted goes on."""
        with self._lock:
            self._draining = True

    def stop(self, timeout: float | None = 10.0) -> None:
        """Tell the thread to stop (what `_run` does with work in flight is the subclass's), wait for it."""
        with self._lock:
            self._draining = self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        raise NotImplementedError
