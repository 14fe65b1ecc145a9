"""Reading a class's submissions safely: which files are the learners' notebooks, and each one's contents.

Only regular files count. A symbolic link (to a classmate's notebook, to `/dev/zero`, to a secret file), a FIFO
or a device is not followed and not opened: it is graded as "unreadable", with the reason and nothing of what it
points to. A notebook is opened with `O_NOFOLLOW | O_NONBLOCK` (a FIFO swapped in after the listing cannot hang
the grader), checked again with `fstat`, and read up to `MAX_NOTEBOOK` bytes. Error messages name the file and
the kind of problem, never its contents. Learner and notebook names come from file and folder names, with control
characters and other unprintable ones replaced; names that collide once cleaned get a suffix and a note.
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import nbformat

from .limits import GradeError, format_size

MAX_NOTEBOOK = 100 * 2 ** 20  # bytes of .ipynb the grader reads
_MAX_NAME = 80


class Unreadable(Exception):
    """A submission the grader does not read: the message says why, without its contents."""


def learner_name(raw: str) -> str:
    """A learner's name as the report shows it: printable characters only, at most 80."""
    name = "".join(ch if ch.isprintable() else "?" for ch in raw).strip() or "?"
    return name if len(name) <= _MAX_NAME else name[:_MAX_NAME - 1] + "…"


def notebook_name(raw: str) -> str:
    """A notebook's name (`part2.ipynb`, `bob/part2.ipynb`) as the report shows it: unprintable characters (a byte
    that is not UTF-8 in the file name, a control character) replaced, like a learner's name."""
    return "".join(ch if ch.isprintable() else "?" for ch in raw) or "?"


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _notebooks_in(folder: Path) -> list[Path]:
    """Every *.ipynb under `folder`, symbolic links included as entries (to be refused), never followed."""
    found = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        found += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".ipynb") and not f.startswith(".")]
        # a symbolic link to a folder is listed among dirnames and not walked: report it if it looks like a notebook
        found += [Path(dirpath) / d for d in dirnames if d.endswith(".ipynb")]
    return found


class Submissions(dict):
    """{learner: [notebook paths]}; `notes[learner]`: why the learner's name is not the file's (a collision)."""

    def __init__(self):
        super().__init__()
        self.notes: dict[str, list[str]] = {}


def find_submissions(root) -> Submissions:
    """{learner: [notebook paths]}: a notebook per learner (name = file stem) or a folder per learner.

    Names that are the same once cleaned (`alice.ipynb` and `alice .ipynb`, `alice` and `alice.ipynb`, control
    characters, names cut at 80 characters) never stop the class: each entry is graded under a name of its own
    ("alice", "alice (2)", ...: an entry whose name needed no cleaning first, then in the folder's order), with a
    note that names the colliding entries."""
    root = Path(root)
    if not root.exists():
        raise GradeError(f"{root}: no such folder")
    if not root.is_dir():
        raise GradeError(f"{root} is a file; give the folder that holds the learners' notebooks "
                         "(one .ipynb per learner, or one folder per learner)")
    entries: dict[str, list[tuple[str, Path, list[Path]]]] = {}  # {cleaned name: [(raw name, entry, notebooks)]}
    for path in sorted(root.iterdir()):
        if path.name.startswith("."):
            continue
        mode = path.lstat().st_mode
        if path.suffix == ".ipynb" and not stat.S_ISDIR(mode):
            raw, notebooks = path.stem, [path]  # a symbolic link or a FIFO too: refused when read
        elif stat.S_ISDIR(mode):
            raw, notebooks = path.name, _notebooks_in(path)
        else:
            continue
        entries.setdefault(learner_name(raw), []).append((raw, path, notebooks))
    learners = Submissions()
    for name, group in entries.items():
        group.sort(key=lambda entry: entry[0] != name)  # stable: the folder's order otherwise
        for i, (raw, path, notebooks) in enumerate(group):
            key, n = name, i + 1
            while key in learners or (n > 1 and key in entries):
                key, n = f"{name} ({n})", n + 1
            learners[key] = notebooks
            if len(group) > 1:
                others = ", ".join(repr(p.name) for _, p, _ in group if p != path)  # repr: no control character
                learners.notes[key] = [f"name collision: {path.name!r} and {others} give the same "
                                       f"learner name {name!r}; graded as {key!r}"]
    if not any(learners.values()):
        raise GradeError(f"{root} holds no .ipynb files: expected one notebook per learner (alice.ipynb) or one "
                         "folder of notebooks per learner (alice/01_callables.ipynb)")
    return learners


def read_notebook(path) -> nbformat.NotebookNode:
    """The notebook at `path`, read safely; Unreadable (with the reason only) if it is not a regular file of at most
    MAX_NOTEBOOK bytes holding a notebook."""
    mode = os.lstat(path).st_mode
    if not stat.S_ISREG(mode):
        raise Unreadable(f"{_kind(mode)}, not a notebook file: not followed")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:  # swapped for a link since the listing (ELOOP), or no permission
        raise Unreadable(f"cannot be opened ({os.strerror(exc.errno)})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise Unreadable(f"{_kind(st.st_mode)}, not a notebook file")
        if st.st_size > MAX_NOTEBOOK:
            raise Unreadable(f"{format_size(st.st_size)}, more than the {format_size(MAX_NOTEBOOK)} a notebook may have")
        data = f.read(MAX_NOTEBOOK + 1)
    if len(data) > MAX_NOTEBOOK:
        raise Unreadable(f"more than the {format_size(MAX_NOTEBOOK)} a notebook may have")
    try:
        content = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise Unreadable("not a notebook: not UTF-8 text") from None
    except json.JSONDecodeError as exc:  # its message gives a position, not the text
        raise Unreadable(f"not a notebook: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(content, dict) or "cells" not in content:
        raise Unreadable("not a notebook: JSON without notebook cells")
    try:
        return nbformat.reads(json.dumps(content), as_version=4)
    except Exception as exc:  # nbformat's own errors may quote the file: name the kind only
        raise Unreadable(f"not a notebook nbformat can read ({type(exc).__name__})") from None
