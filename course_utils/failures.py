"""What failures cost a long run, and how often to checkpoint (notebook 08, "When a process dies").

A job trains `every` steps of `step_s` seconds, then saves a checkpoint in `save_s` seconds; failures come at random,
a mean time between failures `mtbf_s` apart (exponentially distributed: they have no memory); after a failure
the job restarts in `restart_s` seconds (a failure during a restart starts it again) and redoes everything since
the last save. Two answers to "what fraction of the time is lost to saving and redoing":

- `lost_fraction(...)`: exact for that model (Daly 2006): a segment of length L = every x step_s + save_s takes
  M e^(R/M) (e^(L/M) - 1) seconds on average, with M the MTBF and R the restart time;
- `simulated_lost_fraction(...)`: runs the job against random failure times, sharing no code with the formula.

Young (1974) minimised the first-order version, save_s / tau + tau / (2 M), at tau = sqrt(2 save_s M) seconds of
training between saves; exercise 08.5 turns that into a number of steps.
"""
from __future__ import annotations

import math
import random

from .i18n import _


def _check(step_s, save_s, mtbf_s, restart_s):
    if not (step_s > 0 and save_s >= 0 and mtbf_s > 0 and restart_s >= 0):
        raise ValueError(_("need step_s > 0, save_s >= 0, mtbf_s > 0, restart_s >= 0; got {step_s}, {save_s}, "
                           "{mtbf_s}, {restart_s}").format(step_s=step_s, save_s=save_s, mtbf_s=mtbf_s,
                                                           restart_s=restart_s))


def _segment_seconds(length_s: float, mtbf_s: float, restart_s: float) -> float:
    """The mean time to get through `length_s` seconds of work (training and its save) without a failure."""
    return mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1(length_s / mtbf_s)


def lost_fraction(every: int, step_s: float, save_s: float, mtbf_s: float, restart_s: float = 0.0,
                  work_steps: int | None = None) -> float:
    """The expected time lost (saves, work redone, restarts) as a fraction of the training time itself, with a
    checkpoint every `every` steps; for a job of `work_steps` steps (saving after the last one too), or in the
    long run (None)."""
    _check(step_s, save_s, mtbf_s, restart_s)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(_("every must be a positive int, got {every!r}").format(every=every))
    if work_steps is None:
        return _segment_seconds(every * step_s + save_s, mtbf_s, restart_s) / (every * step_s) - 1
    full, rest = divmod(work_steps, every)
    total = full * _segment_seconds(every * step_s + save_s, mtbf_s, restart_s)
    if rest:
        total += _segment_seconds(rest * step_s + save_s, mtbf_s, restart_s)
    return total / (work_steps * step_s) - 1


def best_interval(step_s: float, save_s: float, mtbf_s: float, restart_s: float = 0.0) -> int:
    """The whole number of steps between saves with the least `lost_fraction` in the long run (a scan)."""
    young = math.sqrt(2 * save_s * mtbf_s) / step_s
    candidates = range(1, int(4 * young) + 16)
    return min(candidates, key=lambda k: lost_fraction(k, step_s, save_s, mtbf_s, restart_s))


def simulated_lost_fraction(every: int, step_s: float, save_s: float, mtbf_s: float, work_steps: int,
                            restart_s: float = 0.0, runs: int = 200, seed: int = 0) -> float:
    """`lost_fraction` measured instead of computed: `runs` jobs of `work_steps` steps, each against its own random
    failure times (a Poisson process with mean gap `mtbf_s`, the same times for every `every` with the same seed)."""
    _check(step_s, save_s, mtbf_s, restart_s)
    rng = random.Random(seed)
    lost = 0.0
    for _run in range(runs):
        failures = random.Random(rng.getrandbits(64))
        next_failure = failures.expovariate(1 / mtbf_s)
        clock, done = 0.0, 0
        while done < work_steps:
            steps = min(every, work_steps - done)
            finish = clock + steps * step_s + save_s
            if finish <= next_failure:  # trained and saved: this segment is safe
                clock, done = finish, done + steps
                continue
            clock = next_failure + restart_s  # lost since the last save; restart (again, if one hits the restart)
            next_failure += failures.expovariate(1 / mtbf_s)
            while next_failure < clock:
                clock = next_failure + restart_s
                next_failure += failures.expovariate(1 / mtbf_s)
        lost += clock / (work_steps * step_s) - 1
    return lost / runs
