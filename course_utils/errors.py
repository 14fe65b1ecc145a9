"""How course code words a problem for the learner: the first line of an error, and a warning shown at the
learner's own line.

- `first_line(exc)`: "TypeName: first line of the message", for errors quoted inside a course message (the
  rest of a long PyTorch error is noise there); `message_line(exc)` without the type.
- `learner_stacklevel()`: the `stacklevel` that makes `warnings.warn` point at the first caller outside this
  package (the learner's `trainer(3)` in a notebook cell), not at a line of course code.

A leaf module: it imports nothing of the package.
"""
from __future__ import annotations

import os
import sys

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def message_line(exc: BaseException) -> str:
    """The first line of `exc`'s message ("" for an empty one)."""
    text = str(exc).strip().splitlines()
    return text[0] if text else ""


def first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {message_line(exc)}"


def learner_stacklevel() -> int:
    """The `stacklevel` for a `warnings.warn` made by the caller of this function, so that the warning is shown
    at the first frame outside course_utils."""
    frame, level = sys._getframe(2), 2  # for the caller's warnings.warn: 1 is the caller itself, 2 its caller
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level
