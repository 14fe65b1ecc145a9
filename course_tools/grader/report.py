"""The class report: the table of learners and exercises, the containment that was applied, HTML and CSV."""
from __future__ import annotations

import csv
import os
import re
import sys
import time
from collections import Counter
from html import escape

from .limits import Limits, format_size
from .results import CORRECT, INCORRECT, NOT_ATTEMPTED, NOT_RUN, RANK, Outcome, exercise_order
from .sandbox import Sandbox


class ClassReport:
    """The class's results: a row per learner, a column per exercise (the best outcome of the learner's notebooks)."""

    def __init__(self, root, learners: dict, runs: dict, registry: dict, limits: Limits, sandbox: Sandbox):
        self.root, self.registry, self.limits, self.sandbox = root, registry, limits, sandbox
        self.runs = runs                      # {learner: [NotebookRun]}
        self.learners = list(learners)
        found = {e for rs in runs.values() for r in rs for e in r.outcomes}
        self.exercises = sorted(found, key=exercise_order)
        self.table: dict[str, dict[str, Outcome]] = {}
        for learner in self.learners:
            row = {}
            for ex_id in self.exercises:
                candidates = [r.outcomes[ex_id] for r in runs[learner] if ex_id in r.outcomes]
                if not candidates:
                    row[ex_id] = Outcome(NOT_ATTEMPTED, "no notebook of this learner checks this exercise")
                    continue
                best = min(candidates, key=lambda o: RANK[o.status])
                if len(candidates) > 1:
                    others = [o.notebook for o in candidates if o is not best]
                    best.flags.append(f"also checked in {', '.join(others)}")
                row[ex_id] = best
            self.table[learner] = row
        self.generated = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        self.guarded: list[str] = []  # the folders checked for changes after each notebook

    def score(self, learner: str) -> int:
        return sum(o.status == CORRECT for o in self.table[learner].values())

    def containment(self) -> list[tuple[bool, str, str]]:
        """(applied, what, detail) for each protection, from what the kernels reported."""
        statuses = [r.sandbox for rs in self.runs.values() for r in rs if r.sandbox]
        limits, sb = self.limits, self.sandbox

        def rlimit(name):
            if os.name != "posix":
                return False, f"resource limits are POSIX-only (this is {sys.platform})"
            if not statuses:
                return False, "no kernel reported its limits"
            missing = [m[1] for s in statuses for m in s.get("missing", []) if m[0] == "RLIMIT_" + name]
            if missing:
                return False, f"could not be applied: {missing[0]}"
            if any("RLIMIT_" + name not in s.get("applied", []) for s in statuses):
                return False, "not applied in every kernel"
            return True, ""

        items = [(True, "Own kernel process per notebook, empty temporary working directory (also HOME and TMPDIR)",
                  "each notebook runs in a fresh kernel"),
                 (True, f"Time limit: {limits.timeout:g} s of wall-clock time per notebook",
                  "the grader stops the kernel when it is reached"),
                 (True, f"Output cap: {format_size(limits.output)} of output per notebook",
                  "the grader stops the kernel when it is reached; outputs are not kept")]
        if limits.memory:
            ok, why = rlimit("AS")
            items.append((ok, f"Memory limit: {format_size(limits.memory)} of address space (RLIMIT_AS)", why))
        else:
            items.append((False, "Memory limit (RLIMIT_AS)",
                          "not applied with --gpu: CUDA reserves more address space than any useful limit"
                          if limits.gpu else "not applied: --memory 0"))
        ok, why = rlimit("CPU")
        items.append((ok, f"CPU time limit: {limits.cpu} s (RLIMIT_CPU)", why))
        ok, why = rlimit("FSIZE")
        items.append((ok, f"Largest file a notebook may write: {format_size(limits.file_size)} (RLIMIT_FSIZE)", why))
        items.append(("net" in sb.namespaces, "No network (a new network namespace, `unshare --net`)",
                      "" if "net" in sb.namespaces else f"not isolated: {sb.why_not}"))
        items.append(("pid" in sb.namespaces, "Own PID namespace: cannot see or signal the grader or the other "
                                              "kernels; all its processes stop with it",
                      "" if "pid" in sb.namespaces else f"not applied: {sb.why_not}; a notebook can signal the "
                                                         "grader and the other kernels"))
        items.append(("ipc" in sb.namespaces, "Own IPC namespace: SysV shared memory and message queues and POSIX "
                                              "message queues of its own, gone after the run (no channel to another "
                                              "kernel)", "" if "ipc" in sb.namespaces else "not applied: `unshare "
                                                                                         "--ipc` failed"))

        def applied(name):
            why = [m[1] for s in statuses for m in s.get("missing", []) if m[0] == name]
            if why or not statuses or any(name not in s.get("applied", []) for s in statuses):
                return False, "not applied: " + (why[0] if why else sb.why_not or "no mount namespace")
            partly = [m[1] for s in statuses for m in s.get("missing", []) if m[0] == name + " (partly)"]
            return True, f"partly: {partly[0]} (it holds Python or the course)" if partly else ""

        ok, why = applied("private folders")
        items.append((ok, f"Private /tmp, /var/tmp and /dev/shm (one {format_size(limits.disk)} tmpfs that holds the "
                          "working directory, gone after the run); the submissions, the grader's working directory "
                          "and temporary folder and the host's sockets in /run hidden", why))
        ok, why = applied("own uid")
        nproc_ok, nproc_why = rlimit("NPROC")
        if nproc_ok and not all(s.get("nproc_binds") for s in statuses):
            nproc_ok, nproc_why = False, "it does not bind a kernel that runs as root (no uid of its own)"
        items.append((ok, "A uid of its own per kernel (as root): cannot signal, read or write what belongs to "
                          "another", why))
        items.append((nproc_ok, f"Processes and threads per kernel: {limits.processes} (RLIMIT_NPROC)", nproc_why))
        fs_missing = [m[1] for s in statuses for m in s.get("missing", []) if m[0] == "filesystem"]
        fs_ok = sb.mounts and bool(statuses) and not fs_missing
        items.append((fs_ok, "Read-only file system except the kernel's own /tmp, /var/tmp and /dev/shm, kernel "
                             "without capabilities",
                      "" if fs_ok else "not applied: " + (fs_missing[0] if fs_missing else sb.why_not or
                                                         "no mount namespace") +
                      "; only the audit hook refuses Python-level writes outside the working directory"))
        items.append((True, "Audit hook in the kernel: Python-level writes, deletions and renames by path outside "
                            "the working directory and /dev are refused",
                      "not covered by it: writes through a file descriptor (os.fchmod(fd)), sqlite3.connect, "
                      "socket.bind, processes it starts, ctypes"))
        items.append((True, "Checked for changes after each notebook: " + ", ".join(self.guarded),
                      "" if len(self.guarded) > 1 else "the grader's working directory is a shared folder (temporary "
                                                  "folder, home or /), which other programs change: not checked"))
        items.append((not limits.gpu, "GPU hidden from the notebooks (CUDA_VISIBLE_DEVICES='', COURSE_DEVICE=cpu)",
                      "" if not limits.gpu else "--gpu: the notebooks may use the GPU"))
        return items

    def summary(self) -> list[dict]:
        """Per exercise: counts of each status and the most common mistakes."""
        rows = []
        for ex_id in self.exercises:
            ex = self.registry.get(ex_id)
            outcomes = [self.table[learner][ex_id] for learner in self.learners]
            counts = Counter(o.status for o in outcomes)
            mistakes = Counter()
            for o in outcomes:
                if o.status != INCORRECT:
                    continue
                known = next((m.feedback for m in (ex.mistakes if ex else []) if m.feedback in o.message), None)
                key = f"known mistake: \u201c{known}\u201d" if known else re.sub(r"\d+(\.\d+)?", "#", o.message)[:160]
                mistakes[key] += 1
            rows.append({"id": ex_id, "title": ex.title if ex else "", "counts": counts,
                         "mistakes": mistakes.most_common(5)})
        return rows

    # --- output ------------------------------------------------------------------------------------------------

    def write_csv(self, path) -> None:
        """One row per learner and exercise. A cell that a spreadsheet would read as a formula (starting with =, +,
        -, @, a tab or a carriage return: a learner named "=2+3", feedback quoting "-1") is written with a leading
        apostrophe, as OWASP recommends against CSV injection. Text UTF-8 cannot encode (a lone surrogate) is "?"."""
        with open(path, "w", newline="", encoding="utf-8", errors="replace") as f:  # a lone surrogate: "?"
            writer = _SafeWriter(csv.writer(f))
            writer.writerow(["learner", "exercise", "status", "feedback", "flags", "notebook", "notebook_status"])
            for learner in self.learners:
                by_name = {r.name: r for r in self.runs[learner]}
                for ex_id in self.exercises:
                    o = self.table[learner][ex_id]
                    run = by_name.get(o.notebook)
                    writer.writerow([learner, ex_id, o.status, o.message, "; ".join(o.flags), o.notebook,
                                     f"{run.status}: {run.detail}" if run and run.detail else (run.status if run else "")])

    def write_html(self, path) -> None:
        icons = {CORRECT: "\u2713 correct", INCORRECT: "\u2717 incorrect", NOT_ATTEMPTED: "\u2013 not attempted",
                 NOT_RUN: "\u26a0 not run"}
        parts = [f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Grades: {escape(str(self.root))}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
th, td {{ border: 1px solid #ccc; padding: 4px 6px; vertical-align: top; text-align: left; }}
td.correct {{ background: #e3f5e1; }} td.incorrect {{ background: #fde2e1; }}
td.not-attempted {{ background: #f0f0f0; color: #666; }} td.not-run {{ background: #fff3cd; }}
td .fb {{ font-size: 0.8em; max-width: 22em; }} .flag {{ font-size: 0.8em; color: #8a4b00; }}
.ok {{ color: #1a7f37; }} .no {{ color: #b42318; font-weight: bold; }} .alert {{ color: #b42318; font-weight: bold; }}
</style></head><body>
<h1>Grades: {escape(str(self.root))}</h1>
<p>{len(self.learners)} learners, {len(self.exercises)} exercises; graded {escape(self.generated)} with
<code>python -m course_tools.grade</code>. Every result comes from the course's own checker: after the
learner's cell, the grader's kernel-side code records what the learner's code produces for the checker's cases, and
the verdict is decided from that record in the grader's own process, where no learner code runs; the notebooks'
saved outputs are ignored. Flags (⚑) say what the grader noticed and what it means for the result; INSTRUCTORS.md
lists what it cannot prevent.</p>
<h2>Containment</h2><ul>"""]
        for ok, what, detail in self.containment():
            mark = '<span class="ok">applied</span>' if ok else '<span class="no">NOT applied</span>'
            parts.append(f"<li>{mark}: {escape(what)}{': ' + escape(detail) if detail else ''}</li>")
        parts.append("</ul><h2>Results</h2><table><thead><tr><th>learner</th><th>score</th>")
        for ex_id in self.exercises:
            title = self.registry[ex_id].title if ex_id in self.registry else ""
            parts.append(f'<th title="{escape(title)}">{escape(ex_id)}</th>')
        parts.append("<th>notebooks</th></tr></thead><tbody>")
        for learner in self.learners:
            parts.append(f"<tr><th>{escape(learner)}</th><td>{self.score(learner)}/{len(self.exercises)}</td>")
            for ex_id in self.exercises:
                o = self.table[learner][ex_id]
                css = o.status.replace(" ", "-")
                flags = "".join(f'<div class="flag">\u2691 {escape(f)}</div>' for f in o.flags)
                fb = "" if o.status == CORRECT and not o.flags else f'<div class="fb">{escape(o.message)}</div>'
                parts.append(f'<td class="{css}" data-learner="{escape(learner)}" data-exercise="{escape(ex_id)}" '
                             f'data-status="{escape(o.status)}">{icons[o.status]}{fb}{flags}</td>')
            cells = []
            for r in self.runs[learner]:
                text = f"{escape(r.name)}: {escape(r.status)}" + (f" ({escape(r.detail)})" if r.detail else "")
                text += f", {r.counted:.1f} s ({r.seconds:.1f} s with the kernel's start)"
                text += "".join(f'<div class="alert">\u26a0 {escape(a)}</div>' for a in r.alerts)
                text += "".join(f'<div class="flag">{escape(n)}</div>' for n in r.notes)
                cells.append(f"<div>{text}</div>")
            parts.append(f'<td class="runs" data-learner="{escape(learner)}">'
                         f'{"".join(cells) or "no notebooks"}</td></tr>')
        parts.append("</tbody></table><h2>Per exercise</h2><table><thead><tr><th>exercise</th><th>correct</th>"
                     "<th>incorrect</th><th>not attempted</th><th>not run</th><th>most common mistakes</th></tr>"
                     "</thead><tbody>")
        for row in self.summary():
            c = row["counts"]
            mistakes = "".join(f"<div>{n} \u00d7 {escape(text)}</div>" for text, n in row["mistakes"]) or "\u2013"
            parts.append(f'<tr data-exercise="{escape(row["id"])}"><th>{escape(row["id"])} {escape(row["title"])}'
                         f"</th><td>{c[CORRECT]}</td><td>{c[INCORRECT]}</td><td>{c[NOT_ATTEMPTED]}</td>"
                         f"<td>{c[NOT_RUN]}</td><td>{mistakes}</td></tr>")
        parts.append("</tbody></table></body></html>\n")
        with open(path, "w", encoding="utf-8", errors="replace") as f:  # a lone surrogate (an answer's error): "?"
            f.write("".join(parts))


_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def csv_cell(value) -> str:
    """`value` as a CSV cell that no spreadsheet evaluates."""
    text = str(value)
    return "'" + text if text.startswith(_FORMULA_START) else text


class _SafeWriter:
    def __init__(self, writer):
        self.writer = writer

    def writerow(self, row) -> None:
        self.writer.writerow([csv_cell(v) for v in row])
