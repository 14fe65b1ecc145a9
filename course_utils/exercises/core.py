"""The exercise system: a registry of exercises and `check` / `hint` / `solution`.

An exercise cell in a notebook looks like

    def make_counter():
        raise NotImplementedError  # your code here
    check("01.2", make_counter)

`check` never raises and never hangs: whatever the learner's answer does (raise, return None, return
the wrong type, mutate its input, loop forever) becomes a line of feedback. A blank answer (`...`, or a
function that raises NotImplementedError) is reported as "not attempted yet".
"""
from __future__ import annotations

import contextlib
import copy
import importlib
import signal
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from ..i18n import N_, _
from .probe import ABSENT as ABSENT_ANSWER
from .probe import (AnswerTimeout, Incorrect, Interfered, NotAttempted, OutOfReach, decode, describe, encode, finish,
                    leftover, observe, raised_in_course_code, recording, replaying, short)

NOT_ATTEMPTED, CORRECT, INCORRECT = "not attempted", "correct", "incorrect"
INTERFERED = "interfered"  # only from `judge`: the record of the learner's code does not match the checker


@dataclass
class Mistake:
    """A common wrong answer (`code` replaces the blank) and a phrase its feedback must contain."""
    code: str
    feedback: str


@dataclass
class Exercise:
    id: str                      # "NN.k": notebook number and exercise number
    title: str
    blank: str                   # the exact text of the blank in the notebook cell
    solution: str                # reference answer; replaces `blank` in the solved notebook
    answer: str                  # the name passed to check(), e.g. "make_counter"
    checker: Callable[[Any], str | None]  # raises Incorrect(feedback); may return a success remark
    hints: list[str] = field(default_factory=list)
    mistakes: list[Mistake] = field(default_factory=list)
    setup: str = ""              # what the cell relies on from earlier cells (imports, definitions)
    timeout: float = 10.0        # seconds the learner's code may take in total
    inside: str = ""             # what the verdict takes from measurements in the learner's process (host reads)


@dataclass
class Result:
    status: str
    message: str
    crashed: bool = False  # the checker itself failed (an exception raised in course code, not in the answer)

    @property
    def passed(self) -> bool:
        return self.status == CORRECT


REGISTRY: dict[str, Exercise] = {}
_hints_shown: dict[str, int] = {}


def register(*exercises: Exercise) -> None:
    for ex in exercises:
        if ex.id in REGISTRY and REGISTRY[ex.id] is not ex:
            raise ValueError(_("exercise id {id} registered twice").format(id=ex.id))
        REGISTRY[ex.id] = ex


# --- helpers for checkers -------------------------------------------------------------------

def call(fn, *args, name: str | None = None, check_mutation: bool = True, **kwargs):
    """Call the learner's `fn`, turning what can go wrong into feedback.

    NotImplementedError means the blank is still there; any other exception becomes an Incorrect that
    names the call; changing an argument in place is reported too (the caller's data would be altered).
    """
    label = name or getattr(fn, "__name__", None) or _("your function")
    if not callable(fn):
        raise Incorrect(_("expected something callable (a function or an object with __call__), "
                          "got {value}").format(value=describe(fn)))
    before = [_snapshot(a) for a in args] if check_mutation else None
    try:
        out = fn(*args, **kwargs)
    except NotImplementedError:
        raise NotAttempted() from None
    except (AnswerTimeout, KeyboardInterrupt):
        raise
    except Exception as exc:  # the learner's code raised: say where, not a traceback
        raise Incorrect(_("calling {call} raised {error}: {message}").format(
            call=f"{label}({', '.join(_short(a) for a in args)})", error=type(exc).__name__, message=exc)) from None
    if check_mutation:
        for i, (a, b) in enumerate(zip(args, before)):
            if b is not None and not _same(a, b):
                raise Incorrect(_("{label} changed its argument {number} ({value}) in place; return a new value "
                                  "and leave the input as it was").format(label=label, number=i + 1, value=_short(b)))
    return out


_short = short


def _snapshot(value):
    try:
        return copy.deepcopy(value)
    except Exception:
        return None


def _same(a, b) -> bool:
    """Did `a` keep the value of its snapshot `b`? Unknown (no meaningful ==) counts as unchanged."""
    try:
        import torch
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
        if isinstance(a, torch.nn.Module) and isinstance(b, torch.nn.Module):
            sa, sb = a.state_dict(), b.state_dict()
            return sa.keys() == sb.keys() and all(_same(sa[k], sb[k]) for k in sa)
        if type(a).__eq__ is object.__eq__:  # == would only test identity, and b is a copy
            return True
        result = a == b
        return bool(result) if isinstance(result, bool) else True
    except Exception:
        return True


# --- running a checker safely ---------------------------------------------------------------

class _Deadline:
    """Interrupt the learner's code after `seconds` (SIGALRM on the main thread of a POSIX system;
    elsewhere the check cannot be interrupted and only reports the overrun afterwards)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.armed = False

    def _fire(self, signum, frame):
        raise AnswerTimeout()

    def __enter__(self):
        if hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGALRM, self._fire)
            signal.setitimer(signal.ITIMER_REAL, self.seconds)
            self.armed = True
        return self

    def __exit__(self, *exc):
        if self.armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous)
        return False


# One module per notebook that has exercises, in course order.
MODULES = ["nb00", "nb01", "nb02", "nb03", "nb04", "nb05", "nb06", "nb07", "nb08"]


def load_all() -> dict:
    """Import every exercise module (each registers its exercises once) and return the registry."""
    package = __name__.rsplit(".", 1)[0]
    for name in MODULES:
        try:
            importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{package}.{name}":
                raise
    return REGISTRY


def get(exercise_id: str) -> Exercise:
    load_all()
    try:
        return REGISTRY[exercise_id]
    except KeyError:
        known = ", ".join(sorted(REGISTRY)) or "none"
        raise KeyError(_("no exercise {id!r}; known exercises: {known}").format(id=exercise_id, known=known)) from None


def evaluate(exercise_id: str, answer, timeout: float | None = None) -> Result:
    """Check `answer` and return a Result; never raises for anything the answer does."""
    return _verdict(exercise_id, answer, timeout)[0]


def _verdict(exercise_id: str, answer, timeout: float | None) -> tuple[Result, bool]:
    """The Result, and whether the deadline stopped the check."""
    try:
        ex = get(str(exercise_id))
    except KeyError as exc:
        return Result(INCORRECT, str(exc.args[0])), False
    seconds = ex.timeout if timeout is None else timeout
    try:
        with _Deadline(seconds):
            if observe(lambda: answer is ...):
                return Result(NOT_ATTEMPTED, _("replace the `...` (or the `raise NotImplementedError`) with your "
                                               "answer, then run the cell again")), False
            remark = ex.checker(answer)
    except NotAttempted:
        return Result(NOT_ATTEMPTED, _("your code still raises NotImplementedError: replace that line with your "
                                       "answer, then run the cell again")), False
    except Incorrect as exc:
        return Result(INCORRECT, str(exc)), False
    except AnswerTimeout:
        return Result(INCORRECT, _("your answer took longer than {seconds:g} s, so the check stopped it; look for "
                                   "a loop that never ends or work repeated far too often").format(seconds=seconds)), True
    except RecursionError:
        return Result(INCORRECT, _("your answer recursed without end (RecursionError): does a method call itself?")), False
    except Interfered as exc:
        return Result(INTERFERED, str(exc)), False
    except Exception as exc:  # raised by the answer, or the answer broke an assumption of the checker
        frames = traceback.extract_tb(exc.__traceback__)
        line = getattr(exc, "replayed_line", None) or frames[-1].lineno
        replayed = hasattr(exc, "replayed_line")
        if isinstance(exc, OutOfReach) and not replayed:  # only in a judgement: the checker itself is wrong
            return Result(INCORRECT, str(exc), crashed=True), False
        try:
            answer_text = observe(lambda: describe(answer))
        except Interfered as interfered:
            return Result(INTERFERED, str(interfered)), False
        # A crash of the checker's own code, decided where it happened: an error replayed from a record is the
        # answer's (the record may claim anything about where it came from).
        return Result(INCORRECT, _("checking your answer failed with {error}: {message} (your answer is {answer}; "
                                   "line {line} of the checker)").format(error=type(exc).__name__, message=exc,
                                                                         answer=answer_text, line=line),
                      crashed=False if replayed else raised_in_course_code(frames)), False
    return Result(CORRECT, remark or _("well done")), False


def record(exercise_id: str, answer, timeout: float | None = None, seed: int | None = None) -> bytes:
    """Check `answer` as `evaluate` does and return the record of what the learner's code produced (run in the
    learner's kernel by the class grader; `judge` reads it). `seed`: the grader's, for cases drawn afresh."""
    return recorded(exercise_id, answer, timeout, seed)[1]


def recorded(exercise_id: str, answer, timeout: float | None = None, seed: int | None = None) -> tuple[Result, bytes]:
    """`record`, with the verdict the recording run itself reached (what the proofs compare `judge` with)."""
    with recording(seed) as log:
        result, timed_out = _verdict(exercise_id, answer, timeout)
        finish(log, "timeout" if timed_out else "done")
    return result, encode(log)


def judge(exercise_id: str, data: bytes, timeout: float | None = None, seed: int | None = None) -> Result:
    """The verdict on a record from `record`, decided here: the checker runs again with every observation read
    from the record (no learner code runs). A record that does not decode or does not match is INTERFERED. `seed`:
    the one given to `record` (cases drawn afresh are drawn again here, from it)."""
    try:
        log = decode(data)
    except Interfered as exc:
        return Result(INTERFERED, str(exc))
    with replaying(log, seed) as session:
        try:
            result = evaluate(exercise_id, ABSENT_ANSWER, timeout)
        except Exception as exc:  # whatever a record makes of the checker's own handling: no verdict from it
            return Result(INTERFERED, _("the record does not decode ({error})").format(error=type(exc).__name__))
        if result.status != INTERFERED and leftover(session):
            return Result(INTERFERED, _("the record holds more than the checker asked for"))
    return result


_ICONS = {CORRECT: N_("[correct]"), INCORRECT: N_("[not yet]"), NOT_ATTEMPTED: N_("[not attempted yet]")}


def check(exercise_id: str, answer) -> None:
    """Check your answer to an exercise and print feedback. Never raises."""
    result = evaluate(exercise_id, answer)
    print(_("Exercise {id} {status} {message}").format(id=exercise_id, status=_(_ICONS[result.status]),
                                                       message=result.message))


def hint(exercise_id: str) -> None:
    """Print the next hint for an exercise (each call reveals one more)."""
    try:
        ex = get(exercise_id)
    except KeyError as exc:
        print(exc.args[0])
        return
    if not ex.hints:
        print(_("Exercise {id}: no hints for this one; try solution({id!r}).").format(id=exercise_id))
        return
    k = _hints_shown.get(exercise_id, 0)
    shown = min(k, len(ex.hints) - 1)
    _hints_shown[exercise_id] = k + 1
    more = _(" (that was the last hint)") if shown == len(ex.hints) - 1 else ""
    print(_("Hint {number}/{total} for {id}: {hint}").format(number=shown + 1, total=len(ex.hints), id=exercise_id,
                                                              hint=_(ex.hints[shown])) + more)


def solution(exercise_id: str) -> None:
    """Print the reference solution of an exercise."""
    try:
        ex = get(exercise_id)
    except KeyError as exc:
        print(exc.args[0])
        return
    print(_("Reference solution for {id} ({title}):").format(id=exercise_id, title=_(ex.title)) + "\n\n" + _(ex.solution))


@contextlib.contextmanager
def seeded(seed: int = 0):
    """A private CPU random state: deterministic checks that do not disturb the learner's RNG."""
    import torch  # here: the registry itself needs no torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def as_float(value) -> float | None:
    """`value` as a float when it is a real number (an int or a float, not a bool) that a float can hold, NaN and
    infinities included; None otherwise (an int beyond float's range among them)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


def real_item(value):
    """A one-element tensor's Python number when it holds a real number with data (not complex, not on the meta
    device); anything else unchanged."""
    import torch

    if (isinstance(value, torch.Tensor) and value.numel() == 1 and value.device.type != "meta"
            and not value.is_complex()):
        return value.item()
    return value


def require_function(answer: Any, name: str) -> Callable:
    """`answer` if it is a function (not a class), else Incorrect naming what it is."""
    if isinstance(answer, type) or not callable(answer):
        raise Incorrect(_("{name} should be a function (written with `def {name}(...)`), got {value}").format(
            name=name, value=describe(answer)))
    return answer
