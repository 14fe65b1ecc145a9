"""Auto-checked exercises: `check(id, answer)`, `hint(id)`, `solution(id)`.

Each notebook's exercises live in their own module (`nb00.py`, `nb01.py`, ...), registered when first
needed. The answer key (solved notebooks) and the class grader are instructor tools, outside this package.
"""
from .core import (CORRECT, INCORRECT, INTERFERED, MODULES, NOT_ATTEMPTED, REGISTRY, Exercise, Incorrect, Mistake,
                   Result, call, check, describe, evaluate, get, hint, judge, load_all, record, register, solution)
from .probe import hold, observe

__all__ = ["check", "hint", "solution", "evaluate", "record", "judge", "register", "call", "describe", "get",
           "load_all", "observe", "hold", "Exercise", "Mistake", "Incorrect", "Result", "REGISTRY", "MODULES",
           "CORRECT", "INCORRECT", "NOT_ATTEMPTED", "INTERFERED"]
