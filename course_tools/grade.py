"""`python -m course_tools.grade SUBMISSIONS/ --report report.html --csv report.csv`: grade a class (see grader)."""
from course_tools.grader.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
