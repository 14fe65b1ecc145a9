"""Judging records where a record cannot harm the grader: in a worker process of its own.

A record comes from the learner's kernel, so its bytes are the learner's to choose. `torch.load(weights_only=True)`
builds nothing but plain data from them, but plain data can still cost without bound: a tuple nested a million deep
crashes the interpreter that hashes it, a tree of shared tuples takes hours to hash, a small compressed entry
inflates to gigabytes. So the grader never reads a record itself: a `Judge` hands it to a worker
(`python -m course_tools.grader.judging`, one per grading thread, started once and reused), under an address-space
limit, and waits for the verdict at most the exercise's own time plus a margin. A worker that crashes, runs out of
memory or time is stopped and replaced, and that record gets no result (interference), never a pass.
"""
from __future__ import annotations

import base64
import json
import os
import select
import subprocess
import sys
import time

READY_SECONDS = 180  # importing torch and the checkers on a busy machine


class JudgeFailed(Exception):
    """The worker did not give a verdict (it died, or took too long): the record is not to be trusted."""


class Judge:
    """Verdicts on records, from a worker process of this Judge's own (started on first use)."""

    def __init__(self, memory: int | None = None):
        self.memory, self.process, self.buffer = memory, None, b""

    def _start(self) -> None:
        memory = self.memory

        def limit():  # in the worker, before it runs anything
            if memory and os.name == "posix":
                import resource
                resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

        self.process = subprocess.Popen([sys.executable, "-m", "course_tools.grader.judging"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                        preexec_fn=limit if os.name == "posix" else None)
        self.buffer = b""
        if self._line(READY_SECONDS) != {"ready": True}:
            self.close()
            raise JudgeFailed("the grader's judging process did not start")

    def _line(self, seconds: float):
        deadline = time.monotonic() + seconds
        fd = self.process.stdout.fileno()
        while b"\n" not in self.buffer:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            return None

    def __call__(self, exercise_id: str, data: bytes, seed: int, seconds: float) -> dict:
        """{"status", "message", "crashed"} of `judge(exercise_id, data, seed=seed)`; JudgeFailed when the worker
        gives none within `seconds` (it is then stopped, and the next call starts another)."""
        if self.process is None or self.process.poll() is not None:
            self._start()
        request = json.dumps({"id": exercise_id, "seed": seed, "record": base64.b64encode(data).decode("ascii")})
        try:
            self.process.stdin.write(request.encode("ascii") + b"\n")
            self.process.stdin.flush()
        except OSError:
            self.close()
            raise JudgeFailed("the grader's judging process stopped") from None
        reply = self._line(seconds)
        if not isinstance(reply, dict) or not {"status", "message", "crashed"} <= set(reply):
            try:
                died = self.process.wait(timeout=1)  # a worker that crashed is reaped before its status is read
            except subprocess.TimeoutExpired:
                died = None
            self.close()
            if died is None:
                raise JudgeFailed(f"judging the record took longer than {seconds:g} s")
            raise JudgeFailed(f"judging the record stopped the grader's judging process (exit status {died})")
        return reply

    def close(self) -> None:
        if self.process is not None:
            try:
                self.process.kill()
                self.process.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
            for stream in (self.process.stdin, self.process.stdout):
                try:
                    stream.close()
                except OSError:
                    pass
            self.process = None


def main() -> None:
    """The worker: one JSON request per line on stdin, one verdict per line on stdout."""
    import course_utils.exercises as exercises

    out = os.fdopen(os.dup(1), "wb")  # the verdicts' own channel: anything else printed goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    exercises.load_all()
    out.write(b'{"ready": true}\n')
    out.flush()
    for line in sys.stdin.buffer:
        try:
            request = json.loads(line)
            data = base64.b64decode(request["record"], validate=True)
            result = exercises.judge(str(request["id"]), data, seed=int(request["seed"]))
            reply = {"status": result.status, "message": result.message, "crashed": bool(result.crashed)}
        except Exception as exc:  # the judgement itself must never stop the worker: no verdict for this record
            reply = {"status": exercises.INTERFERED, "message": f"the record could not be judged ({type(exc).__name__})",
                     "crashed": False}
        out.write(json.dumps(reply).encode("utf-8", "replace") + b"\n")
        out.flush()


if __name__ == "__main__":
    main()
