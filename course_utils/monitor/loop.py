"""A quiet background loop, and the per-kernel registry that keeps one loop of each kind.

The loop runs `tick()` about every `interval` seconds on a daemon thread. It never prints: anything
a thread writes to stdout/stderr lands in whatever notebook cell happens to be running. An exception
inside `tick()` ends the loop; it is kept in `error` and handed to `on_error` (which must not print
either; the monitors show it in their panel).

The registry: re-running a notebook cell creates a new monitor object while the old one's thread is
still running. `claim(kind, owner)` stops the previous owner of that kind first, so a kernel never
has two DeviceMonitor threads (or two TrainingProgress threads) updating at once.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Protocol

from ..i18n import _


class _Stoppable(Protocol):
    def stop(self) -> None: ...


_REGISTRY: dict[str, _Stoppable] = {}
_REGISTRY_LOCK = threading.Lock()


def claim(kind: str, owner: _Stoppable) -> None:
    """Make `owner` the one running object of `kind`, stopping the previous one (outside the lock)."""
    with _REGISTRY_LOCK:
        previous = _REGISTRY.get(kind)
        _REGISTRY[kind] = owner
    if previous is not None and previous is not owner:
        previous.stop()


def release(kind: str, owner: _Stoppable) -> None:
    """Forget `owner` if it is still the registered one."""
    with _REGISTRY_LOCK:
        if _REGISTRY.get(kind) is owner:
            del _REGISTRY[kind]


def current(kind: str) -> _Stoppable | None:
    """The running object of `kind`, if any."""
    with _REGISTRY_LOCK:
        return _REGISTRY.get(kind)


class Loop:
    """Calls `tick()` every `interval` seconds on a daemon thread until `stop()`.

    `start()` and `stop()` are idempotent; after a stop, `start()` begins a fresh thread.
    """

    def __init__(self, tick: Callable[[], None], interval: float, name: str,
                 on_error: Callable[[BaseException], None] | None = None):
        if not interval > 0:
            raise ValueError(_("interval must be a positive number of seconds, got {interval!r}").format(interval=interval))
        self._tick = tick
        self.interval = float(interval)
        self.name = name
        self._on_error = on_error
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.ticks = 0
        self.error: BaseException | None = None

    @property
    def running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def start(self) -> None:
        with self._lock:
            if self.running:
                return
            self._stop = threading.Event()
            self.error = None
            self._thread = threading.Thread(target=self._run, args=(self._stop,), name=self.name, daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the thread to end and wait for it (up to `timeout` s); safe to call from inside a tick."""
        with self._lock:
            self._stop.set()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                began = time.monotonic()
                self._tick()
                self.ticks += 1
                stop.wait(max(0.0, self.interval - (time.monotonic() - began)))
        except BaseException as exc:  # noqa: BLE001 - a thread has nobody to raise to, and must not print
            self.error = exc
            if self._on_error is not None:
                try:
                    self._on_error(exc)
                except BaseException:  # noqa: BLE001
                    pass
