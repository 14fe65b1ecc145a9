"""Command line: `python -m course_utils.exercises solve SRC OUT`, `... list` or `... grade SUBMISSIONS/`."""
import argparse
from pathlib import Path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_utils.exercises")
    sub = parser.add_subparsers(dest="command", required=True)
    p_solve = sub.add_parser("solve", help="write solved copies of the notebooks (instructor version)")
    p_solve.add_argument("src", type=Path, help="a notebook or the notebooks/ folder")
    p_solve.add_argument("out", type=Path, help="folder for the solved notebooks")
    sub.add_parser("list", help="list every exercise")
    p_grade = sub.add_parser("grade", help="grade a class: run each learner's notebook in a contained kernel and "
                                           "check every exercise (HTML and CSV report)")
    from .grade import add_arguments
    add_arguments(p_grade)
    args = parser.parse_args(argv)
    if args.command == "grade":
        from .grade import main as grade
        return grade(args)
    if args.command == "solve":
        from .solve import solve_paths
        for path in solve_paths(args.src, args.out):
            print(f"wrote {path}")
    else:
        from . import load_all
        for ex_id, ex in sorted(load_all().items()):
            print(f"{ex_id}  {ex.title}  ({len(ex.mistakes)} common mistakes, {len(ex.hints)} hints)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
