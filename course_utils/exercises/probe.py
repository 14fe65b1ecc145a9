"""What the learner's code produces, as plain data: the seam between asking, answering and judging.

A checker asks (it builds the inputs and cases), lets the learner's code answer, and judges (it computes the
reference and compares). Every place where it runs the learner's code, or reads what that code made or changed,
goes through one of two calls:

    out = observe(lambda: call(fn, x))   # what came out, as plain data: numbers, strings, tensors, lists, dicts
    model = hold(lambda: call(MLP))      # the learner's object itself, to be used inside later observe() calls only

In a notebook (`check`) both simply run. The class grader runs a checker twice. In the learner's sandboxed kernel,
`record` writes each observation to a log (plain data that `torch.load(weights_only=True)` reads, and the CPU
random state where the learner's code moved it). In the grader's own process, where no learner code runs, `judge`
runs the checker again: each observation is read back from the log, `hold` gives a stand-in that refuses every use,
and the reference computation and the comparison happen for real. A log that does not match what the checker asks
for, or that does not decode, is interference: never a pass.

What is observed is whatever the learner's code could have produced itself; what the judgement trusts beyond that
is named by `Exercise.inside` (counts measured in the learner's process, such as host reads).
"""
from __future__ import annotations

import builtins
import contextvars
import io
import numbers
import os
import random
import re
import secrets
import sys
import sysconfig
import traceback
import warnings
from contextlib import contextmanager

from ..i18n import _


class Incorrect(Exception):
    """Raised by a checker with the feedback for a wrong answer."""


class NotAttempted(Exception):
    """The answer is still the blank."""


class AnswerTimeout(Exception):
    """The learner's code ran longer than the exercise allows."""


class Interfered(Exception):
    """The record of what the learner's code produced does not match what the checker asks for."""


class OutOfReach(Exception):
    """A checker used the learner's object outside observe(): a bug in the checker, not in the answer."""


class Opaque:
    """Something the learner's code produced that is not plain data: its type's name and how feedback shows it."""

    def __init__(self, type_name: str, text: str, short: str):
        self.type_name, self.text, self.short = type_name, text, short

    def __repr__(self):
        return self.short

    def __eq__(self, other):
        return isinstance(other, Opaque) and (self.type_name, self.text, self.short) == (
            other.type_name, other.text, other.short)

    __hash__ = None


class _Absent:
    """In the judgement, the learner's answer and every held object: any use is a checker bug (OutOfReach)."""
    __slots__ = ()

    def _refuse(self, *args, **kwargs):
        raise OutOfReach(_("a checker used the learner's code outside observe() or hold()"))

    __getattr__ = __call__ = __bool__ = __iter__ = __len__ = __getitem__ = __eq__ = __contains__ = _refuse
    __float__ = __int__ = __index__ = __add__ = __mul__ = __lt__ = __le__ = __gt__ = __ge__ = __ne__ = _refuse
    __hash__ = None

    def __repr__(self):
        return "<the learner's object (not in this process)>"


ABSENT = _Absent()

_OPAQUE_KEY = "\x00opaque"  # how an Opaque travels in the log (a dict with this one key)
_EXACT = (type(None), bool, int, float, complex, str, bytes)


def describe(value) -> str:
    """A short description of a value for feedback: type and a glimpse."""
    if isinstance(value, Opaque):
        return value.text
    try:
        import torch
        if isinstance(value, torch.Tensor):
            return _("a tensor of shape {shape}, dtype {dtype}, on {device}").format(
                shape=tuple(value.shape), dtype=value.dtype, device=value.device)
    except ImportError:  # pragma: no cover
        pass
    if value is None:
        return _("None (did you forget a `return`?)")
    if value is ...:
        return _("... (the blank)")
    return f"{type(value).__name__} {short(value)}"


def short(value, limit: int = 60) -> str:
    """repr(value), cut to `limit` characters (and never raising)."""
    if isinstance(value, Opaque):
        return value.short
    try:
        text = _ADDRESS.sub("", repr(value))  # "<function f at 0x7f..>": the address tells a learner nothing
    except Exception:
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_COURSE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_LIBRARY_DIRS = tuple({sysconfig.get_paths()[k] + os.sep for k in ("stdlib", "purelib", "platlib")})


def raised_in_course_code(frames: traceback.StackSummary) -> bool:
    """Whether an exception came from course code (a checker's own line) rather than from the learner's answer:
    the innermost frame that is not Python's library or an installed package (torch raising on what a checker
    passed it counts as that checker's line) decides."""
    for frame in reversed(frames):
        name = frame.filename
        if name.startswith("<frozen"):
            continue
        path = os.path.abspath(name) if not name.startswith("<") else name
        if path.startswith(_COURSE_DIR):
            return True
        if not path.startswith(_LIBRARY_DIRS):
            return False  # a notebook cell, a script: the learner's code
    return True


def plain(value, _depth: int = 0):
    """`value` as plain data, copied (later changes by the learner's code do not reach it): builtin scalars, tensors
    (detached CPU-or-device copies keeping dtype, device and requires_grad), dtypes, devices, sizes, and lists, tuples,
    dicts and sets of those. Anything else becomes an Opaque that keeps its type's name and its feedback text."""
    import torch

    if type(value) in _EXACT:
        return value
    if type(value).__module__ == "numpy" and isinstance(value, numbers.Number):  # a NumPy scalar: its Python value
        return value.item()
    if isinstance(value, torch.Tensor):
        t = value.as_subclass(torch.Tensor) if type(value) is not torch.Tensor else value
        copy = t.detach().clone()
        return copy.requires_grad_(True) if t.requires_grad and copy.is_floating_point() else copy
    if isinstance(value, (torch.dtype, torch.device)):
        return value
    if type(value) is torch.Size:
        return torch.Size(value)
    if _depth < 20:
        if type(value) in (list, tuple, set):
            return type(value)(plain(v, _depth + 1) for v in value)
        if type(value) is dict or type(value).__name__ == "OrderedDict" and isinstance(value, dict):
            return {plain(k, _depth + 1): plain(v, _depth + 1)
                    for k, v in value.items()}
    return Opaque(type(value).__name__, describe(value), short(value))


def encode(log: list) -> bytes:
    """The log as bytes that torch.load(weights_only=True) reads back."""
    import torch

    def out(v):
        if isinstance(v, Opaque):
            return {_OPAQUE_KEY: [v.type_name, v.text, v.short]}
        if type(v) in (list, tuple, set):
            return type(v)(out(x) for x in v)
        if type(v) is dict:
            return {out(k): out(x) for k, x in v.items()}
        return v

    buffer = io.BytesIO()
    torch.save([out(entry) for entry in log], buffer)
    return buffer.getvalue()


_MAX_ELEMENTS = 50_000_000  # tensor elements in one record: far above any checker's cases, below a grader's memory


def decode(data: bytes) -> list:
    """A log from `encode`, read with weights_only=True (nothing but plain data can come out); Interfered if not.
    Also refused: nesting deeper than `plain` writes, and tensors that are not what `plain` writes (a dense strided
    copy whose storage holds all its elements): an expanded view of one number could stand for 10^12 of them and
    keep the grader busy for hours."""
    import torch

    budget = [_MAX_ELEMENTS]

    def back(v, depth=0):
        if depth > 25:
            raise Interfered(_("a malformed value"))
        if type(v) is dict:
            if list(v) == [_OPAQUE_KEY]:
                parts = v[_OPAQUE_KEY]
                if type(parts) is list and len(parts) == 3 and all(type(p) is str for p in parts):
                    return Opaque(*parts)
                raise Interfered(_("a malformed value"))
            return {back(k, depth + 1): back(x, depth + 1) for k, x in v.items()}
        if type(v) in (list, tuple, set):
            return type(v)(back(x, depth + 1) for x in v)
        if type(v) is torch.Tensor:  # what plain() writes: a dense copy on the CPU (or meta), nothing attached
            budget[0] -= v.numel()
            needed = v.numel() * v.element_size()
            if (v.layout != torch.strided or v.device.type not in ("cpu", "meta") or budget[0] < 0 or vars(v)
                    or not needed <= v.untyped_storage().nbytes() <= needed + 64):
                raise Interfered(_("a malformed value"))
            return v
        if type(v) in _EXACT or type(v) in (torch.dtype, torch.device, torch.Size):
            return v
        raise Interfered(_("a malformed value"))  # a type plain() never writes (OrderedDict, a class, ...)

    try:
        with warnings.catch_warnings():  # torch's remarks on a pickle it was not written by: the learner's choice
            warnings.simplefilter("ignore")
            log = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")  # any grader reads it
    except Exception as exc:
        raise Interfered(_("the record does not decode ({error})").format(error=type(exc).__name__)) from None
    if type(log) is not list or not all(type(e) is tuple and e and type(e[0]) is str for e in log):
        raise Interfered(_("the record is not a list of entries"))
    try:
        return [back(e) for e in log]
    except Interfered:
        raise
    except Exception as exc:  # RecursionError, a key that cannot be hashed, ...
        raise Interfered(_("the record does not decode ({error})").format(error=type(exc).__name__)) from None


class _Session:
    def __init__(self, mode: str, log: list | None = None, seed: int | None = None):
        self.mode, self.log, self.position, self.seed = mode, [] if log is None else log, 0, seed


_session: contextvars.ContextVar[_Session | None] = contextvars.ContextVar("course_probe_session", default=None)


@contextmanager
def recording(seed: int | None = None):
    """Observations in this block are written to a log (the learner's kernel, under the grader): yields the log.
    `seed` is the grader's, for the cases drawn afresh at each check (`fresh_random`)."""
    token = _session.set(_Session("record", seed=seed))
    try:
        yield _session.get().log
    finally:
        _session.reset(token)


@contextmanager
def replaying(log: list, seed: int | None = None):
    """Observations in this block are read back from `log` (the grader's own process): yields the session.
    `seed`: the one the grader gave the recording (never taken from the record)."""
    token = _session.set(_Session("replay", log, seed))
    try:
        yield _session.get()
    finally:
        _session.reset(token)


def fresh_random() -> random.Random:
    """A generator for cases drawn afresh at each check, so that no table of answers can hold them: seeded from the
    operating system in a notebook, and from the grader's seed for this check under the grader (the same in the
    learner's kernel and in the judgement, and known to neither beforehand). Draw from it outside observe()."""
    session = _session.get()
    if session is None or session.seed is None:
        return random.Random(secrets.randbits(64))
    return random.Random(session.seed)


def _error_entry(label: str, exc: Exception) -> tuple:
    if isinstance(exc, Incorrect):
        return ("incorrect", label, str(exc))
    if isinstance(exc, NotAttempted):
        return ("not_attempted", label)
    if isinstance(exc, AnswerTimeout):
        return ("timeout", label)
    if isinstance(exc, RecursionError):
        return ("recursion", label)
    frames = traceback.extract_tb(exc.__traceback__)
    line, crashed = (frames[-1].lineno or 0) if frames else 0, raised_in_course_code(frames)
    cls = type(exc)
    try:
        message = str(exc)
    except Exception:
        message = f"<{cls.__name__}>"
    return ("error", label, cls.__module__, cls.__qualname__, message, line, crashed)


_REPLAYABLE = ("builtins", "torch", "course_utils", "numpy")
_GROUPS = tuple(c for c in (getattr(builtins, "BaseExceptionGroup", None),) if c is not None)  # Python 3.11+
_replayed_classes: dict = {}


def _replayed_error(module: str, qualname: str, message: str, line: int, crashed: bool) -> Exception:
    """An exception like the one the learner's code raised: the same class where it is Python's, torch's, NumPy's or
    the course's (so a checker's `except` clause sees it), with the same name, message and checker line."""
    base = Exception
    if module.split(".")[0] in _REPLAYABLE and module in sys.modules:
        found = sys.modules[module]
        for part in qualname.split("."):  # through __dict__ only: a module's __getattr__ (torch's imports) never runs
            found = vars(found).get(part) if isinstance(found, type) or hasattr(found, "__dict__") else None
        if isinstance(found, type) and issubclass(found, Exception):
            base = found
    if issubclass(base, (OutOfReach, Interfered, *_GROUPS)):
        base = Exception  # a verdict of the course's own, or a class built another way (a group): only its name
    key = (base, qualname.rsplit(".", 1)[-1])
    cls = _replayed_classes.get(key)
    if cls is None:
        try:
            cls = type(key[1], (base,), {"__init__": lambda self, text: Exception.__init__(self, text),
                                         "__str__": lambda self: str(self.args[0]) if self.args else ""})
        except TypeError:  # a class that cannot be subclassed: its name and message still come through
            cls = type(key[1], (Exception,), {"__str__": lambda self: str(self.args[0]) if self.args else ""})
        _replayed_classes[key] = cls
    try:
        error = cls(message)
    except Exception:  # a class whose construction refuses one text
        error = type(key[1], (Exception,), {"__str__": lambda self: str(self.args[0]) if self.args else ""})(message)
    error.replayed_line, error.replayed_crashed = line, crashed
    return error


def _replay(session: _Session, label: str, kind: str):
    log = session.log
    if session.position >= len(log):
        raise Interfered(_("the record ended before {label}").format(label=label))
    entry = log[session.position]
    if entry[0] == "end":
        if len(entry) == 2 and entry[1] == "timeout":
            raise AnswerTimeout()
        raise Interfered(_("the record ended before {label}").format(label=label))
    session.position += 1
    if len(entry) < 2 or entry[1] != label:
        raise Interfered(_("the record has {entry} where the checker asks for {label}").format(
            entry=short(entry[:2]), label=label))
    tag = entry[0]
    if tag == kind == "value" and len(entry) == 4:
        state = entry[3]
        if state is not None:
            import torch
            if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
                raise Interfered(_("a malformed random state"))
            try:
                torch.set_rng_state(state)
            except Exception:
                raise Interfered(_("a malformed random state")) from None
        return entry[2]
    if tag == kind == "held" and len(entry) == 2:
        return ABSENT
    if tag == "incorrect" and len(entry) == 3 and type(entry[2]) is str:
        raise Incorrect(entry[2])
    if tag == "not_attempted" and len(entry) == 2:
        raise NotAttempted()
    if tag == "timeout" and len(entry) == 2:
        raise AnswerTimeout()
    if tag == "recursion" and len(entry) == 2:
        raise RecursionError()
    if (tag == "error" and len(entry) == 7 and all(type(x) is str for x in entry[2:5])
            and type(entry[5]) is int and type(entry[6]) is bool):
        raise _replayed_error(*entry[2:])
    raise Interfered(_("the record has {entry} where the checker asks for {label}").format(entry=short(tag),
                                                                                                  label=label))


def _run(fn, kind: str):
    session = _session.get()
    if session is None:  # a notebook's check(): just run
        out = fn()
        return plain(out) if kind == "value" else out
    frame = sys._getframe(2)  # the checker's line that called observe() or hold()
    label = f"{frame.f_code.co_name}:{frame.f_lineno}"
    if session.mode == "replay":
        return _replay(session, label, kind)
    import torch
    before = torch.get_rng_state()
    try:
        out = fn()
        value = plain(out) if kind == "value" else None
    except Exception as exc:
        session.log.append(_error_entry(label, exc))
        raise
    if kind == "held":
        session.log.append(("held", label))
        return out
    after = torch.get_rng_state()
    session.log.append(("value", label, value, None if torch.equal(before, after) else after))
    return value


def observe(fn):
    """Run `fn` (no arguments; it runs the learner's code or reads what that code made) and return what it gave as
    plain data (see `plain`). Under the grader's judgement, read from the record instead: `fn` does not run."""
    return _run(fn, "value")


def hold(fn):
    """Run `fn` and return the learner's object it gives (an instance, a model), to be used inside later `observe`
    calls only. Under the grader's judgement, a stand-in that refuses every use."""
    return _run(fn, "held")


def finish(log: list, how: str) -> None:
    """End a record: how the check ended outside any observation ('done' or 'timeout')."""
    log.append(("end", how))


def leftover(session: _Session) -> int:
    """Entries of the record the judgement did not ask for (the end marker aside)."""
    rest = session.log[session.position:]
    return len([e for e in rest if e[0] != "end"])


__all__ = ["observe", "hold", "plain", "describe", "short", "Opaque", "ABSENT", "encode", "decode", "recording",
           "replaying", "fresh_random", "Incorrect", "NotAttempted", "AnswerTimeout", "Interfered", "OutOfReach", "finish",
           "leftover", "raised_in_course_code"]
