"""The class grader (`python -m course_tools.grade`), on hostile submissions.

tests/grader_submissions/ holds one small notebook per case (learner name = file stem, plus `frank/`, a learner
with a folder of two notebooks): correct, incorrect and not attempted answers to exercises 01.1 and 01.4, and
each hostile case: an endless loop, a memory bomb, deleting the grader's folders, killing the kernel, printing
without end, redefining check(), outputs edited to read "[correct]", replacing the course's checkers,
running the reference solution, and reaching a server on the grader's machine; IPython hooks that stall the
grader's cells (buys_time), a forged private checker (forges_private), and a notebook that looks for its classmates'
work, the grader's folders, other kernels' connection files and the host's sockets, forks without end and leaves
files in /tmp and /dev/shm (snoops); an error message with a lone surrogate (surrogate), a link in place of the
kernel's log and malformed output messages (forges_log), SysV shared memory and message queues left behind
(leaves_ipc), the unwrapped solution() (unwraps_solution), a hook disguised as matplotlib's (disguises_hook),
hooks dressed as the course's thread follower (dresses_as_follower) and a hook table that hides entries (hides_hooks);
verdicts forged in the kernel: torch's comparisons patched (patches_torch), a framed "correct" line printed from the
answer in place of the grader's own (forges_result), a record that is a pickle running a command (forges_record);
names that collide (`alice.ipynb`, `alice .ipynb`) and a file name that is not UTF-8 are added by _prepare. One
grading run of the whole folder (the real command, in a subprocess) is
shared by the tests that read its report cells; a second run without namespaces (--unsafe-no-sandbox) checks the
audit hook alone; a third grades the real solved notebook 01.
"""
import csv
import hashlib
import html.parser
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from course_tools import grader
from course_tools.grader.cli import main as cli
from course_tools.grader.run import _answer_name, _solution_calls
from course_tools.solve import solve_notebook

ROOT = Path(__file__).resolve().parents[1]
SUBMISSIONS = Path(__file__).resolve().parent / "grader_submissions"
# 10 s: a kernel start and `import torch` can take 5 s on a loaded 2-core machine, and the endless-output submission
# must still reach the output cap before the time limit (with 6 s it once did not)
LIMITS = ["--timeout", "10", "--output", "2M", "--file-size", "1M", "--memory", "5G", "--processes", "100"]
SANDBOXED = grader.Sandbox.probe().complete  # else the grader refuses without --unsafe-no-sandbox
LEAK = "course-grader-leak"  # what snoops.ipynb writes in /tmp and /dev/shm
SHM_KEY, MSG_KEY = 0x43475231, 0x43475232  # the SysV objects leaves_ipc.ipynb creates


SECRET = "the instructor's secret line"


def _snapshot(folder: Path) -> dict:
    def digest(p):
        if p.is_symlink() or not (p.is_file() or p.is_dir()):
            return "special"
        return hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
    return {str(p.relative_to(folder)): digest(p) for p in sorted(folder.rglob("*"))}


def _prepare(base: Path, shell: bool, port: int = 9, sockets: tuple[str, str] = ("", "")) -> tuple[Path, Path]:
    """A copy of the submissions (plus an unreadable notebook) and a grader working directory, each with a
    sentinel file; the deleting notebook aims at both, the network one at `port` on this machine, the snooping one
    at both and at `sockets` (a unix socket's path, an abstract socket's name)."""
    subs, cwd = base / "submissions", base / "grader_cwd"
    shutil.copytree(SUBMISSIONS, subs, ignore=shutil.ignore_patterns("conftest.py", "__pycache__"))
    cwd.mkdir()
    for folder in (subs, cwd):
        (folder / "sentinel.txt").write_text("must survive\n")
    (subs / "broken.ipynb").write_text('{"cells": [ this is not json\n')
    # Hostile files (safe input): a FIFO, links to a classmate, to /dev/zero and to a secret, a formula as a name.
    os.mkfifo(subs / "fifo.ipynb")
    (subs / "copycat.ipynb").symlink_to(subs / "correct.ipynb")
    (subs / "zero.ipynb").symlink_to("/dev/zero")
    (base / "secret.txt").write_text(SECRET + "\n")
    (subs / "peek.ipynb").symlink_to(base / "secret.txt")
    shutil.copy(subs / "incorrect.ipynb", subs / "=2+3.ipynb")
    # Names that collide once cleaned (a trailing space), and a file name that is not UTF-8 (byte \xff).
    shutil.copy(subs / "correct.ipynb", subs / "alice.ipynb")
    shutil.copy(subs / "not_attempted.ipynb", subs / "alice .ipynb")
    shutil.copy(bytes(subs / "correct.ipynb"), bytes(subs) + b"/mallory\xff.ipynb")
    path = subs / "forges_log.ipynb"
    nb = nbformat.read(path, as_version=4)
    nb.cells[2].source = nb.cells[2].source.replace('SECRET_FILE = ""', f"SECRET_FILE = {str(base / 'secret.txt')!r}")
    nbformat.write(nb, path)
    path = subs / "deletes_files.ipynb"
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        cell.source = cell.source.replace("TARGETS = []", f"TARGETS = [{str(cwd)!r}, {str(subs)!r}]")
        cell.source = cell.source.replace("SHELL = True", f"SHELL = {shell}")
    nbformat.write(nb, path)
    path = subs / "uses_network.ipynb"
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        cell.source = cell.source.replace("PORT = 9 ", f"PORT = {port} ")
    nbformat.write(nb, path)
    path = subs / "snoops.ipynb"
    nb = nbformat.read(path, as_version=4)
    for name, value in (("SUBMISSIONS", subs), ("GRADER_CWD", cwd), ("HOST_SOCKET", sockets[0]),
                        ("ABSTRACT_SOCKET", sockets[1])):
        nb.cells[1].source = nb.cells[1].source.replace(f'{name} = ""', f"{name} = {str(value)!r}")
    nbformat.write(nb, path)
    return subs, cwd


class _Cells(html.parser.HTMLParser):
    """{(learner, exercise): status} from the report's table cells."""

    def __init__(self):
        super().__init__()
        self.cells = {}

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "td" and "data-exercise" in attrs:
            self.cells[attrs["data-learner"], attrs["data-exercise"]] = attrs["data-status"]


def _sysv_left(remove: bool = False) -> list[str]:
    """Which of leaves_ipc's SysV objects exist in this IPC namespace (removed if `remove`)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    left = []
    for kind, get, ctl, key in (("shared memory", libc.shmget, libc.shmctl, SHM_KEY),
                                ("message queue", libc.msgget, libc.msgctl, MSG_KEY)):
        found = get(key, 0, 0) if kind == "shared memory" else get(key, 0)
        if found != -1:
            left.append(kind)
            if remove:
                ctl(found, 0, None)  # IPC_RMID
    return left


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    base = tmp_path_factory.mktemp("grade")
    listener = socket.create_server(("127.0.0.1", 0))  # what the network notebook tries to reach
    unix = socket.socket(socket.AF_UNIX)  # and the snooping one: a unix socket in a folder, an abstract one
    unix.bind(str(base / "host.sock"))
    abstract = socket.socket(socket.AF_UNIX)
    abstract_name = f"course-grader-test-{os.getpid()}"
    abstract.bind("\0" + abstract_name)
    for s in (unix, abstract):
        s.listen()
    for leak in (Path("/tmp", LEAK), Path("/dev/shm", LEAK), Path("/tmp/course-grader-pwned")):
        leak.unlink(missing_ok=True)
    _sysv_left(remove=True)
    # Shell commands (rm -rf) escape the audit hook: only try them where the OS makes the file system read-only.
    subs, cwd = _prepare(base, shell=grader.Sandbox.probe().mounts, port=listener.getsockname()[1],
                         sockets=(str(base / "host.sock"), abstract_name))
    before = {"subs": _snapshot(subs), "cwd": _snapshot(cwd)}
    try:
        run = subprocess.run([sys.executable, "-m", "course_tools.grade", str(subs), "--report",
                              str(base / "report.html"), "--csv", str(base / "report.csv"), "--jobs", "2", *LIMITS,
                              *([] if SANDBOXED else ["--unsafe-no-sandbox"])],
                             cwd=cwd, capture_output=True, text=True, timeout=300)
    finally:
        for s in (listener, unix, abstract):
            s.close()
    leaks = [str(p) for p in (Path("/tmp", LEAK), Path("/dev/shm", LEAK)) if p.exists()]
    for leak in leaks:
        Path(leak).unlink()
    ipc_left = _sysv_left(remove=True)
    assert run.returncode == 0, run.stdout + run.stderr
    with open(base / "report.csv", newline="") as f:
        rows = {(r["learner"], r["exercise"]): r for r in csv.DictReader(f)}
    page = (base / "report.html").read_text()
    parser = _Cells()
    parser.feed(page)
    return {"run": run, "rows": rows, "html": page, "cells": parser.cells, "before": before, "subs": subs,
            "cwd": cwd, "leaks": leaks, "ipc_left": ipc_left}


def _status(graded, learner, ex_id):
    row = graded["rows"][learner, ex_id]
    assert graded["cells"][learner, ex_id] == row["status"], "the HTML and the CSV disagree"
    return row["status"], row["feedback"], row["flags"], row["notebook_status"]


def _runs_cell(graded, learner) -> str:
    """The text of a learner's "notebooks" cell in the HTML report."""
    start = graded["html"].index(f'<td class="runs" data-learner="{learner}">')
    return graded["html"][start:graded["html"].index("</td>", start)]


def test_every_learner_and_exercise_is_in_the_table(graded):
    learners = {k[0] for k in graded["rows"]}
    hostile = {"fifo", "copycat", "zero", "peek", "=2+3", "alice", "alice (2)", "mallory?"}
    expected = {p.stem for p in SUBMISSIONS.glob("*.ipynb")} | {"frank", "broken"} | hostile
    assert learners == (expected - {"=2+3"}) | {"'=2+3"}  # the CSV escapes what a spreadsheet would evaluate
    assert {k[1] for k in graded["rows"]} == {"01.1", "01.4"}
    assert {(k[0].lstrip("'"), k[1]) for k in graded["cells"]} == {(k[0].lstrip("'"), k[1]) for k in graded["rows"]}


def test_correct_incorrect_and_not_attempted(graded):
    assert _status(graded, "correct", "01.1")[0] == "correct"
    assert _status(graded, "correct", "01.4")[0] == "correct"
    status, feedback, _, _ = _status(graded, "incorrect", "01.1")
    assert status == "incorrect" and "factor is ignored" in feedback
    status, feedback, _, _ = _status(graded, "incorrect", "01.4")
    assert status == "incorrect" and "positional arguments to partial fill" in feedback
    for ex_id in ("01.1", "01.4"):
        status, feedback, _, _ = _status(graded, "not_attempted", ex_id)
        assert status == "not attempted" and "then run the cell again" in feedback


def test_a_learner_with_a_folder_of_notebooks(graded):
    assert _status(graded, "frank", "01.1")[0] == "correct"
    status, feedback, _, _ = _status(graded, "frank", "01.4")
    assert status == "incorrect" and "without calling it" in feedback
    assert graded["rows"]["frank", "01.4"]["notebook"] == "part2.ipynb"


def test_an_endless_loop_hits_the_time_limit_and_the_rest_is_not_run(graded):
    assert _status(graded, "infinite_loop", "01.1")[0] == "correct"
    status, feedback, _, notebook = _status(graded, "infinite_loop", "01.4")
    assert status == "not run" and "time limit of 10 s" in feedback
    assert notebook.startswith("time limit")
    # out of time beside another notebook (--jobs 2): graded again alone, so that a classmate who keeps the CPUs
    # busy cannot make it run out of time
    again = "ran out of time or could not start beside other notebooks (--jobs 2): graded again alone"
    assert again in _runs_cell(graded, "infinite_loop")


def test_a_memory_bomb_gets_a_memory_error_and_the_notebook_goes_on(graded):
    assert _status(graded, "memory_bomb", "01.1")[0] == "correct"
    assert "raised MemoryError" in _runs_cell(graded, "memory_bomb")


def test_deleting_files_leaves_the_grader_and_the_submissions_untouched(graded):
    assert _snapshot(graded["subs"]) == graded["before"]["subs"]
    assert _snapshot(graded["cwd"]) == graded["before"]["cwd"]
    assert _status(graded, "deletes_files", "01.1")[0] == "correct"
    assert "changed while it ran" not in graded["html"]


def test_a_kernel_that_kills_itself_is_reported_and_the_others_are_graded(graded):
    assert _status(graded, "kills_kernel", "01.1")[0] == "correct"
    status, feedback, _, notebook = _status(graded, "kills_kernel", "01.4")
    assert status == "not run" and "killed" in feedback
    assert notebook.startswith("kernel died")


def test_endless_output_hits_the_output_cap(graded):
    assert _status(graded, "prints_gigabytes", "01.1")[0] == "correct"
    status, feedback, _, notebook = _status(graded, "prints_gigabytes", "01.4")
    assert status == "not run" and "more than 2 MiB of output" in feedback
    assert notebook.startswith("output cap")
    assert "File too large" in _runs_cell(graded, "prints_gigabytes")  # os.write to fd 1: RLIMIT_FSIZE
    assert len(graded["html"]) < 200_000  # none of it reached the report


def test_redefining_check_or_editing_outputs_or_the_checkers_changes_nothing(graded):
    for ex_id in ("01.1", "01.4"):
        status, _, flags, _ = _status(graded, "redefines_check", ex_id)
        assert status == "not attempted"
        assert "redefines check(): the grader does not use the notebook's check(): no effect" in flags
    status, feedback, _, _ = _status(graded, "edited_outputs", "01.1")
    assert status == "incorrect" and "factor is ignored" in feedback
    status, feedback, _, _ = _status(graded, "patches_checker", "01.1")
    assert status == "incorrect" and "factor is ignored" in feedback
    flags = _status(graded, "patches_checker", "01.1")[2]
    assert "replaced the checker of 01.1" in flags and "replaced course_utils.exercises.check or evaluate" in flags
    assert "(ignored)" not in graded["html"]


def test_using_the_reference_solution_is_flagged(graded):
    status, _, flags, _ = _status(graded, "uses_solution", "01.1")
    assert status == "correct"
    assert "calls solution('01.1') in cell 3" in flags
    assert "ran the reference solution's text through exec/compile" in flags
    assert _status(graded, "correct", "01.1")[2] == ""  # a learner's own answer is not flagged


def test_the_network_is_out_of_reach_where_the_os_allows_it(graded):
    # uses_network answers 01.1 correctly only if it could not connect to a port this machine listens on
    isolated = "net" in grader.Sandbox.probe().namespaces
    assert _status(graded, "uses_network", "01.1")[0] == ("correct" if isolated else "incorrect")


def test_an_unreadable_notebook_is_reported(graded):
    assert _status(graded, "broken", "01.1")[0] == "not attempted"
    assert "not valid JSON" in _runs_cell(graded, "broken")


@pytest.mark.parametrize("learner, why", [("fifo", "a FIFO"), ("copycat", "a symbolic link"),
                                          ("zero", "a symbolic link"), ("peek", "a symbolic link")])
def test_a_link_or_a_fifo_is_not_followed_and_is_reported(graded, learner, why):
    # the grader finished (a FIFO would hang a plain open(), /dev/zero would read forever), and a link to a
    # classmate's notebook does not earn the classmate's result
    assert _status(graded, learner, "01.1")[0] == "not attempted"
    assert why in _runs_cell(graded, learner) and "not graded" in _runs_cell(graded, learner)
    assert _status(graded, "correct", "01.1")[0] == "correct"


def test_no_file_contents_and_no_formula_reach_the_report(graded, tmp_path):
    csv_text = "\n".join(",".join(r.values()) for r in graded["rows"].values())
    assert SECRET not in graded["html"] and SECRET not in csv_text
    assert graded["rows"]["'=2+3", "01.1"]["status"] == graded["cells"]["=2+3", "01.1"] == "incorrect"
    from course_tools.grader.report import csv_cell
    assert [csv_cell(v) for v in ("=1+1", "+1", "-1", "@SUM(A1)", "\tx", "alice", "3")] == \
        ["'=1+1", "'+1", "'-1", "'@SUM(A1)", "'\tx", "alice", "3"]


def test_the_summary_counts_the_common_mistakes_and_the_report_lists_the_containment(graded):
    page = graded["html"]
    start = page.index('<tr data-exercise="01.1">')
    row = page[start:page.index("</tr>", start)]
    # incorrect, =2+3 (a copy of it), edited_outputs, patches_checker: the same listed mistake of 01.1
    assert "4 \u00d7 known mistake: \u201cfactor is ignored\u201d" in row
    assert "Time limit: 10 s" in page and "Memory limit: 5 GiB of address space (RLIMIT_AS)" in page
    sandbox = grader.Sandbox.probe()
    network = page[page.index("No network") - 60:page.index("No network")]
    assert ("NOT applied" in network) != ("net" in sandbox.namespaces)
    assert "correct: 2/2 correct" in graded["run"].stdout


def test_hooks_that_stall_the_graders_cells_buy_no_time(graded):
    # buys_time's IPython hooks sleep 20 s whenever the grader's turn comes (and then make its answer wrong): the
    # grader's checks run none of them, they are removed and flagged, and the notebook's time stays within the limit
    for ex_id in ("01.1", "01.4"):
        status, _, flags, notebook = _status(graded, "buys_time", ex_id)
        assert status == "correct" and notebook == "completed"
        assert "installed IPython hooks (pre_execute, pre_run_cell, post_execute, post_run_cell, " \
               "input_transformers_cleanup, input_transformers_post)" in flags and "no effect on the results" in flags
    line = next(text for text in graded["run"].stdout.splitlines() if text.startswith("buys_time / "))
    assert float(line.split(" in ")[1].split(" s ")[0]) <= 10, line
    assert _status(graded, "correct", "01.1")[2] == ""  # an honest notebook is not flagged


def test_a_verdict_cannot_be_forged_in_the_kernel(graded):
    """The verdict is decided in the grader's process from the record of what the answer produced: what the kernel
    patches, prints or sends decides nothing (each of these was a pass when the kernel decided)."""
    status, feedback, _, _ = _status(graded, "patches_torch", "01.1")  # torch.equal and == patched to say "equal"
    assert status == "incorrect" and "should be tensor([3., -6.])" in feedback, feedback
    status, feedback, flags, _ = _status(graded, "forges_result", "01.1")  # "correct" in place of the real line
    assert status == "not run" and "interfered with the grader's check" in flags, (status, flags)
    status, feedback, flags, _ = _status(graded, "forges_record", "01.1")  # a pickle that would run a command
    assert status == "not run" and "does not match the checker" in feedback, feedback
    assert "interfered with the record" in flags
    assert not os.path.exists("/tmp/course-grader-pwned")  # read with weights_only: nothing of it ran here


def test_a_forged_private_checker_gives_no_result(graded):
    status, feedback, flags, _ = _status(graded, "forges_private", "01.1")
    assert status == "not run" and "changed the grader's private copy of the checkers" in feedback
    assert "changed the grader's private checker: no result" in flags


@pytest.mark.skipif(not SANDBOXED, reason="needs mount, network and PID namespaces")
def test_a_kernel_sees_nothing_of_its_classmates_the_grader_or_the_host(graded):
    # snoops answers 01.1 right only if it reached none of: the class's notebooks, the grader's working directory,
    # another kernel's connection file (--jobs 2), a unix socket of the host (a file, an abstract name), more than
    # --processes processes; and what it wrote in /tmp and /dev/shm is gone after its run
    assert "reached" not in _runs_cell(graded, "snoops")
    assert _status(graded, "snoops", "01.1")[0] == "correct"
    assert graded["leaks"] == []
    page = graded["html"]
    for item in ("Private /tmp, /var/tmp and /dev/shm", "Processes and threads per kernel: 100 (RLIMIT_NPROC)"):
        assert page[:page.index(item)].rsplit("<li>", 1)[1].startswith('<span class="ok">applied'), item


def test_names_that_collide_are_each_graded_with_a_note(graded):
    # alice.ipynb and "alice .ipynb" (a trailing space) are both "alice" once cleaned: neither stops the class
    assert _status(graded, "alice", "01.1")[0] == "correct"  # the name that needed no cleaning keeps it
    assert _status(graded, "alice (2)", "01.1")[0] == "not attempted"
    for learner in ("alice", "alice (2)"):
        assert "name collision: " in _runs_cell(graded, learner)
    assert "name collision: 'alice.ipynb' and 'alice .ipynb' give the same learner name 'alice'; graded as " \
           "'alice'" in _status(graded, "alice", "01.1")[2]
    assert _status(graded, "correct", "01.1")[0] == "correct" and _status(graded, "correct", "01.1")[2] == ""


def test_text_that_utf8_cannot_encode_still_gives_a_report(graded):
    # an answer's error holds a lone surrogate; a notebook's file name holds the byte \xff: the HTML and the CSV are
    # written (the fixture reads both), with "?" in their place
    status, feedback, _, _ = _status(graded, "surrogate", "01.1")
    assert status == "incorrect" and feedback.endswith("raised ValueError: bad ?")
    assert _status(graded, "mallory?", "01.1")[0] == "correct"
    assert graded["rows"]["mallory?", "01.1"]["notebook"] == "mallory?.ipynb"
    assert "mallory?.ipynb: completed" in _runs_cell(graded, "mallory?")


def test_a_link_in_place_of_the_kernel_log_and_malformed_messages(graded):
    # forges_log links the kernel's log to a file only the grader can read, then sends output messages of the wrong
    # shape: they are the notebook's problem (noted), the grader goes on and reads nothing through the link
    assert _status(graded, "forges_log", "01.1")[0] == "correct"
    assert "malformed output: the kernel sent 2 message(s)" in _runs_cell(graded, "forges_log")
    assert SECRET not in graded["html"] and SECRET not in str(graded["rows"])


def test_the_kernel_log_is_read_only_as_a_plain_file(tmp_path):
    from course_tools.grader.run import _Grading
    (tmp_path / "secret.txt").write_text(SECRET + "\n")
    grading = _Grading.__new__(_Grading)
    grading.ipc = str(tmp_path)
    (tmp_path / "kernel.log").symlink_to(tmp_path / "secret.txt")
    assert grading._log_tail() == ""
    (tmp_path / "kernel.log").unlink()
    (tmp_path / "kernel.log").write_text("noise\n" * 1000 + "Traceback\nOSError: boom\n")  # its last lines only
    assert grading._log_tail() == "noise / Traceback / OSError: boom"


@pytest.mark.skipif("ipc" not in grader.Sandbox.probe().namespaces, reason="needs an IPC namespace")
def test_sysv_ipc_objects_of_a_kernel_are_gone_after_its_run(graded):
    assert _status(graded, "leaves_ipc", "01.1")[0] == "correct"
    assert graded["ipc_left"] == []
    page = graded["html"]
    assert page[:page.index("Own IPC namespace")].rsplit("<li>", 1)[1].startswith('<span class="ok">applied')


def test_the_unwrapped_solution_is_out_of_reach(graded):
    # unwraps_solution answers right only if solution.__wrapped__ (which the grader's record would not see) failed
    status, _, flags, _ = _status(graded, "unwraps_solution", "01.1")
    assert status == "correct" or "called solution('01.1')" in flags


def test_a_hook_disguised_as_matplotlibs_is_flagged(graded):
    # disguises_hook uses inline figures (matplotlib's own post_execute hook: kept) and the course's thread follower
    # (removed, not reported), and registers a post_run_cell hook whose __module__ claims matplotlib_inline and a
    # pre_run_cell hook of a subclass of the follower
    status, _, flags, _ = _status(graded, "disguises_hook", "01.1")
    assert status == "correct"
    assert "installed IPython hooks (pre_run_cell, post_run_cell): removed before each" in flags


def test_the_reference_solution_pasted_in_another_cell_is_flagged(tmp_path):
    from course_tools.grader.run import _Grading
    import course_utils.exercises as exercises
    registry = dict(exercises.load_all())
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("from course_utils.exercises import check"),
                nbformat.v4.new_code_cell(registry["01.5"].solution),
                nbformat.v4.new_code_cell('check("01.5", WarmupCosine)')]
    nbformat.write(nb, tmp_path / "paste.ipynb")
    grading = _Grading("paste", tmp_path / "paste.ipynb", "paste.ipynb", registry, grader.Limits(),
                       grader.Sandbox([], [], "not used"))
    grading.work = str(tmp_path)
    grading._prepare()
    assert grading.flags["01.5"] == ["cell 2 contains the reference solution verbatim"]


def test_without_namespaces_the_grader_refuses_unless_told(tmp_path, monkeypatch, capsys):
    (tmp_path / "subs").mkdir()
    shutil.copy(SUBMISSIONS / "correct.ipynb", tmp_path / "subs")
    none = grader.Sandbox([], [], "disabled by the test")
    monkeypatch.setattr(grader.Sandbox, "probe", classmethod(lambda cls: none))
    with pytest.raises(grader.GradeError, match="--unsafe-no-sandbox"):
        grader.grade(tmp_path / "subs")
    assert cli([str(tmp_path / "subs")]) == 2
    assert "cannot keep the learners' kernels apart" in capsys.readouterr().err


def test_without_namespaces_the_audit_hook_still_protects_the_files(tmp_path, monkeypatch):
    subs, cwd = _prepare(tmp_path, shell=False)
    for path in subs.iterdir():
        if path.name not in ("deletes_files.ipynb", "sentinel.txt", "correct.ipynb"):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    before = {"subs": _snapshot(subs), "cwd": _snapshot(cwd)}
    monkeypatch.chdir(cwd)
    none = grader.Sandbox([], [], "disabled by the test")
    monkeypatch.setattr(grader.Sandbox, "probe", classmethod(lambda cls: none))
    report = grader.grade(subs, grader.Limits(timeout=20, memory=5 * grader.GiB), jobs=2, unsafe_no_sandbox=True)
    assert _snapshot(subs) == before["subs"] and _snapshot(cwd) == before["cwd"]
    assert report.table["deletes_files"]["01.1"].status == "correct"
    assert report.table["correct"]["01.4"].status == "correct"
    applied = {what.split(" (")[0]: (ok, detail) for ok, what, detail in report.containment()}
    assert applied["No network"] == (False, "not isolated: disabled by the test")


def test_the_real_solved_notebook_passes(tmp_path):
    teacher = tmp_path / "subs" / "teacher"
    teacher.mkdir(parents=True)
    nbformat.write(solve_notebook(nbformat.read(ROOT / "notebooks" / "01_callables.ipynb", as_version=4)),
                   teacher / "01_callables.ipynb")
    report = grader.grade(tmp_path / "subs", grader.Limits(timeout=120), unsafe_no_sandbox=not SANDBOXED)
    row = report.table["teacher"]
    assert row and all(o.status == "correct" for o in row.values()), {k: (o.status, o.message) for k, o in row.items()}
    # The solved notebook is the reference solution: pasting it is flagged where it is long enough to tell.
    flags = {f for o in row.values() for f in o.flags}
    assert flags == {"the cell contains the reference solution verbatim"}


# --- bad input, and the small pieces ------------------------------------------------------------------------

def test_bad_input_gets_a_clear_message(tmp_path, capsys):
    assert cli([str(tmp_path / "nowhere")]) == 2
    assert "grade: error: " in (err := capsys.readouterr().err) and "no such folder" in err
    with pytest.raises(grader.GradeError, match="holds no .ipynb files"):
        grader.find_submissions(tmp_path)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(grader.GradeError, match="is a file"):
        grader.find_submissions(tmp_path / "notes.txt")
    # Names that are the same once cleaned: a notebook and a folder, control characters, names cut at 80: each is
    # graded under a name of its own, with a note
    (tmp_path / "ann.ipynb").write_text("{}")
    (tmp_path / "ann").mkdir()
    (tmp_path / "ann" / "01.ipynb").write_text("{}")
    for name in ("bo\x01.ipynb", "bo\x02.ipynb", "c" * 90 + "1.ipynb", "c" * 90 + "2.ipynb", "d (2).ipynb", "d.ipynb",
                 "d .ipynb"):
        (tmp_path / name).write_text("{}")
    found = grader.find_submissions(tmp_path)
    assert found["ann"] == [tmp_path / "ann" / "01.ipynb"] and found["ann (2)"] == [tmp_path / "ann.ipynb"]
    assert found["bo?"] == [tmp_path / "bo\x01.ipynb"] and found["bo? (2)"] == [tmp_path / "bo\x02.ipynb"]
    assert found["c" * 79 + "…"] == [tmp_path / ("c" * 90 + "1.ipynb")] and "c" * 79 + "… (2)" in found
    assert (found["d"], found["d (2)"], found["d (3)"]) == ([tmp_path / "d.ipynb"], [tmp_path / "d (2).ipynb"],
                                                             [tmp_path / "d .ipynb"])
    assert found.notes["ann (2)"] == ["name collision: 'ann.ipynb' and 'ann' give the same learner name 'ann'; "
                                      "graded as 'ann (2)'"]
    assert found.notes["bo?"] == ["name collision: 'bo\\x01.ipynb' and 'bo\\x02.ipynb' give the same learner name "
                                  "'bo?'; graded as 'bo?'"]
    assert "d (2)" not in found.notes and set(found.notes) == set(found) - {"d (2)"}
    with pytest.raises(SystemExit) as exit:
        cli([str(tmp_path), "--memory", "lots"])
    assert exit.value.code == 2 and "expected a size such as 8G" in capsys.readouterr().err
    assert cli([str(tmp_path), "--report", str(tmp_path / "no" / "r.html")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_sizes_and_solution_calls():
    assert grader.parse_size("8G") == 8 * 2 ** 30 and grader.parse_size("512MiB") == 512 * 2 ** 20
    assert grader.parse_size("1.5k") == 1536 and grader.parse_size("100") == 100
    with pytest.raises(ValueError):
        grader.parse_size("-1G")
    assert _solution_calls('solution("01.1")\nx.solution(k)\n# solution("02.1")') == ["01.1", "?"]
    assert _solution_calls('%time solution("01.2")') == ["01.2"]  # not Python: read as text
    # The answer is the name the cell hands to check(), as the learner's own check saw it.
    assert _answer_name('class MyScale: ...\ncheck("01.1", MyScale)\n', "01.1", "Scale") == "MyScale"
    assert _answer_name('check("01.2", RunningMean)', "01.1", "Scale") == "Scale"


def test_every_part_of_a_kernel_message_counts_against_the_output_cap():
    """A second outside attack sent gigabytes in message headers and metadata, which the cap did not count."""
    from course_tools.grader.run import _message_size

    for part in ("header", "parent_header", "metadata", "content"):
        assert _message_size({part: {"pad": "x" * 10_000}}) >= 10_000, part
    assert _message_size({"buffers": [b"x" * 10_000]}) >= 10_000


def test_hooks_dressed_as_the_course_follower_are_flagged(graded):
    # dresses_as_follower registers a real LoadFollower whose update() is its own, and the follower's method bound
    # in post_run_cell; the course's own follower (started in solved notebooks) is the only one not reported
    status, _, flags, _ = _status(graded, "dresses_as_follower", "01.1")
    assert status == "correct"
    assert "installed IPython hooks (pre_run_cell, post_run_cell): removed before each" in flags


def test_a_hook_table_that_hides_entries_is_flagged(graded):
    status, _, flags, _ = _status(graded, "hides_hooks", "01.1")
    assert status == "correct"
    # the table is put back as it was before the learner's first cell, its hidden pre_run_cell hook gone with it
    assert "installed IPython hooks (IPython's event manager): removed before each" in flags
