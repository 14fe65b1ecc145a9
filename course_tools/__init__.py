"""The course's own tool chain, for whoever maintains or teaches it, not for learners: nothing a learner imports
imports this package.

- `python -m course_tools.translate update|check|build|messages`: the Chinese edition from gettext catalogs.
- `python -m course_tools.slides notebooks/`: the slide layout of every notebook (RISE).
- `python -m course_tools.solve notebooks/ solved/`: the answer key (`--list`: every exercise).
- `python -m course_tools.grade SUBMISSIONS/ --report report.html --csv report.csv`: grade a class
  (`course_tools.grader`).
"""
