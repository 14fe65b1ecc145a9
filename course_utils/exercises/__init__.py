"""Auto-checked exercises: `check(id, answer)`, `hint(id)`, `solution(id)`.

Each notebook's exercises live in their own module (`nb00.py`, `nb01.py`, ...), registered when first
needed. The answer key (solved notebooks) and the class grader are instructor tools, outside this package.
"""
from .core import (CORRECT, INCORRECT, MODULES, NOT_ATTEMPTED, REGISTRY, Exercise, Incorrect, Mistake, Result,
                   call, check, describe, evaluate, get, hint, load_all, register, solution)

__all__ = ["check", "hint", "solution", "evaluate", "register", "call", "describe", "get", "load_all",
           "Exercise", "Mistake", "Incorrect", "Result", "REGISTRY", "MODULES", "CORRECT", "INCORRECT", "NOT_ATTEMPTED"]
