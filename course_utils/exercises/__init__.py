"""Auto-checked exercises: `check(id, answer)`, `hint(id)`, `solution(id)`.

Each notebook's exercises live in their own module (`nb00.py`, `nb01.py`, ...), registered when first
needed. `python -m course_utils.exercises solve notebooks/ solved/` writes the solved notebooks.
"""
import importlib

from .core import (CORRECT, INCORRECT, NOT_ATTEMPTED, REGISTRY, Exercise, Incorrect, Mistake, Result, call,
                   check, describe, evaluate, get, hint, register, solution)

# One module per notebook that has exercises, in course order.
MODULES = ["nb00", "nb01", "nb02", "nb03", "nb04", "nb05", "nb06", "nb07", "nb08"]


def load_all() -> dict:
    """Import every exercise module (each registers its exercises once) and return the registry."""
    for name in MODULES:
        try:
            importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    return REGISTRY


__all__ = ["check", "hint", "solution", "evaluate", "register", "call", "describe", "get", "load_all",
           "Exercise", "Mistake", "Incorrect", "Result", "REGISTRY", "CORRECT", "INCORRECT", "NOT_ATTEMPTED"]
