"""Stop requests from outside, deferred to a step boundary: Ctrl-C (SIGINT, also Jupyter's "interrupt
kernel") and SIGTERM (what a cluster scheduler sends before it preempts a job, and torchrun to its workers).

    with DeferredStop() as stop:
        for batch in loader:
            step(batch)              # never cut in half by the first Ctrl-C
            if stop.requested:       # read between steps
                break

`PREEMPTED_EXIT` is the exit status of a process stopped by SIGTERM that saved its state first.
"""
from __future__ import annotations

import signal
import threading
from typing import NoReturn

PREEMPTED_EXIT = 128 + signal.SIGTERM  # the status of a process ended by SIGTERM: "stopped from outside, saved"
# What a process wishes after a step (`DeferredStop.wish`); in a distributed run the largest over ranks wins
GO_ON, STOP, INTERRUPT, TERMINATE = 0, 1, 2, 3  # STOP: a callback's StopTraining; INTERRUPT: Ctrl-C; SIGTERM


class DeferredStop:
    """While active, a first Ctrl-C (SIGINT, also Jupyter's "interrupt kernel") only sets a flag that the
    loop reads between steps, so a step is never cut in half; a second Ctrl-C interrupts at once. SIGTERM (what
    a cluster scheduler sends before it preempts a job, and torchrun to its workers) is deferred the same way.
    `wish` is the largest stop asked for so far, as one int a loop reads at every step: GO_ON, STOP (`stop()`,
    e.g. a callback's StopTraining), INTERRUPT (Ctrl-C) or TERMINATE (SIGTERM)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.wish = GO_ON
        self._previous: dict = {}

    @property
    def requested(self) -> bool:
        """A Ctrl-C or a SIGTERM arrived."""
        return self.wish >= INTERRUPT

    @property
    def terminated(self) -> bool:
        """A SIGTERM arrived."""
        return self.wish == TERMINATE

    def stop(self) -> None:
        """A stop asked for from inside the loop (not a signal): STOP, unless a signal asked for more."""
        if self.wish < STOP:  # no call between the test and the store: a signal cannot land in between
            self.wish = STOP

    def _handler(self, signum, frame):
        if signum == signal.SIGTERM:
            self.wish = TERMINATE
            return
        if self.wish == INTERRUPT:  # second Ctrl-C: the learner really wants out now
            signal.signal(signal.SIGINT, self._previous.pop(signal.SIGINT))
            raise KeyboardInterrupt
        if self.wish < INTERRUPT:
            self.wish = INTERRUPT

    def __enter__(self):
        self.wish = GO_ON
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handler) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._previous = {}
        return False


def exit_preempted(quietly: bool) -> NoReturn:
    """Leave with `PREEMPTED_EXIT` (SystemExit). `quietly`: ignore further SIGTERMs on the way out, as a rank of a
    torchrun job should: once one rank has left, torchrun sends SIGTERM to the others, which may still be leaving;
    the default action would turn their 143 into "killed by SIGTERM" (-15), though their state is saved."""
    if quietly and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(PREEMPTED_EXIT)
