"""The course's own tool chain, for whoever maintains or teaches it, not for learners: nothing a learner imports
imports this package.

- `python -m course_tools.translate update|check|build|messages`: the Chinese edition from gettext catalogs.
- `python -m course_tools.slides notebooks/`: the slide layout of every notebook (RISE).

The answer key and the class grader are still `python -m course_utils.exercises solve|grade` (they move here with
the grader's redesign).
"""
