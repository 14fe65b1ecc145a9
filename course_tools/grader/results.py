"""What a grading run finds: the outcome of each exercise (`Outcome`) and of each notebook (`NotebookRun`).

The statuses are the checkers' own (course_utils.exercises.core) and NOT_RUN, the grader's: the notebook stopped
before the exercise was checked.
"""
from __future__ import annotations

from course_utils.exercises.core import CORRECT, INCORRECT, INTERFERED, NOT_ATTEMPTED  # noqa: F401

NOT_RUN = "not run"
RANK = {CORRECT: 0, INCORRECT: 1, NOT_ATTEMPTED: 2, NOT_RUN: 3}  # the best first, where a learner has several


class Outcome:
    def __init__(self, status: str, message: str, notebook: str = "", flags: list[str] | None = None):
        self.status, self.message, self.notebook, self.flags = status, message, notebook, list(flags or [])


class NotebookRun:
    """One notebook's grading: how the run ended, the outcome of each exercise it checks, notes."""

    def __init__(self, learner: str, path, name: str):
        self.learner, self.path, self.name = learner, path, name
        self.status, self.detail, self.seconds = "completed", "", 0.0
        self.counted = 0.0             # the seconds counted against the time limit (all but the kernel's start)
        self.outcomes: dict[str, Outcome] = {}
        self.notes: list[str] = []
        self.alerts: list[str] = []    # tampering with files outside the working directory
        self.sandbox: dict = {}


def exercise_order(ex_id: str):
    major, _, minor = ex_id.partition(".")
    return (int(major), int(minor)) if major.isdigit() and minor.isdigit() else (999, 0)
