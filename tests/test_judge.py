"""The verdict decided from a record (`course_utils.exercises.record` in the learner's kernel, `judge` in the
grader's process): whatever the record holds, it is read as plain data and only what matches the checker's own
questions can pass.

tests/test_exercises.py proves that every blank, solution, listed mistake and fuzzed answer gets the same verdict
judged from its record. Here: records that the learner's kernel could send instead (every way of changing one:
bytes that do not decode, a pickle that runs code, entries dropped, added, reordered or relabelled, malformed
values, random states and exceptions), which must give INTERFERED and never CORRECT, and the exceptions and random
state that travel with a record.
"""
import io
import os
import pickle

import pytest
import torch

from course_utils.exercises import CORRECT, INCORRECT, INTERFERED, NOT_ATTEMPTED, evaluate, judge, load_all, record
from course_utils.exercises import probe

REGISTRY = load_all()


def _answer(ex_id: str, code: str):
    ex = REGISTRY[ex_id]
    ns = {"__name__": "answer"}
    exec(compile(ex.setup, "<setup>", "exec"), ns)
    exec(compile(code, "<answer>", "exec"), ns)
    return ns[ex.answer]


def _solved(ex_id: str = "01.1") -> list:
    return probe.decode(record(ex_id, _answer(ex_id, REGISTRY[ex_id].solution)))


def _wrong(ex_id: str = "01.1") -> list:
    return probe.decode(record(ex_id, _answer(ex_id, REGISTRY[ex_id].mistakes[1].code)))


def test_a_solved_record_passes_and_a_wrong_one_does_not():
    assert judge("01.1", probe.encode(_solved())).status == CORRECT
    assert judge("01.1", probe.encode(_wrong())).status == INCORRECT


@pytest.mark.parametrize("data", [b"", b"not a record", b"PK\x03\x04" + b"\0" * 40, pickle.dumps([("end", "done")])])
def test_bytes_that_do_not_decode_are_interference(data):
    assert judge("01.1", data).status == INTERFERED


class _Runs:
    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


MARKER = f"/tmp/course-judge-test-{os.getpid()}"


def test_a_pickle_that_would_run_a_command_is_refused_unread():
    for data in (pickle.dumps([_Runs()]), pickle.dumps([("value", "x", _Runs(), None)])):
        buffer = io.BytesIO()
        torch.save([("value", "_check_scale:1", _Runs(), None)], buffer)  # torch's own format, same payload
        for payload in (data, buffer.getvalue()):
            assert judge("01.1", payload).status == INTERFERED
    assert not os.path.exists(MARKER)


def _variants(log: list):
    """Every record one change away from `log`: each entry dropped, duplicated, moved to the end, relabelled; the
    end marker dropped; an entry added; the whole record reversed."""
    for i in range(len(log)):
        yield f"drop {i}", log[:i] + log[i + 1:]
        yield f"duplicate {i}", log[:i + 1] + log[i:]
        yield f"move {i} to the end", log[:i] + log[i + 1:] + [log[i]]
        if len(log[i]) > 1:
            yield f"relabel {i}", log[:i] + [(log[i][0], "elsewhere:0", *log[i][2:])] + log[i + 1:]
            yield f"retag {i}", log[:i] + [("held", *log[i][1:2])] + log[i + 1:]
    yield "append", log + [("value", "_check_scale:0", 6, None)]
    yield "reversed", list(reversed(log))


@pytest.mark.parametrize("ex_id", ["01.1", "01.3", "02.2"])
def test_a_record_changed_in_any_one_way_never_passes_by_that_change(ex_id):
    """The changes that keep a solved record passing are exactly those that leave what the checker reads as it was
    (a duplicate of the end marker, for example); none of them makes a wrong record pass."""
    solved, wrong = _solved(ex_id), _wrong(ex_id)
    for name, log in _variants(wrong):
        result = judge(ex_id, probe.encode(log))
        assert result.status != CORRECT, (name, result)
    for name, log in _variants(solved):
        result = judge(ex_id, probe.encode(log))
        assert result.status in (CORRECT, INTERFERED, INCORRECT), (name, result)
        if result.status == CORRECT:  # only a change the checker cannot see: the values it reads are the same
            kept = [e for e in log if e[0] != "end"]
            assert kept == [e for e in solved if e[0] != "end"], name


def test_malformed_values_states_and_errors_are_interference():
    solved = _solved()
    first = next(i for i, e in enumerate(solved) if e[0] == "value")
    label = solved[first][1]
    for entry in [("value", label, {"\x00opaque": ["a", 1, "c"]}, None),  # a malformed opaque value
                  ("value", label, solved[first][2], torch.zeros(3)),  # a random state that is not one
                  ("value", label, solved[first][2], torch.zeros(3, dtype=torch.uint8)),
                  ("error", label, "builtins", "ValueError", "boom"),  # an exception without its line and origin
                  ("incorrect", label, 3),  # feedback that is not text
                  ("value", label),  # no value
                  ("unknown", label, 1)]:
        log = solved[:first] + [entry] + solved[first + 1:]
        assert judge("01.1", probe.encode(log)).status == INTERFERED, entry


def test_a_recorded_exception_is_the_same_class_in_the_judgement():
    seen = []

    def checker(answer):
        try:
            probe.observe(lambda: answer())
        except torch.OutOfMemoryError as exc:
            seen.append((type(exc).__name__, str(exc)))
            raise probe.Incorrect(f"caught {type(exc).__name__}: {exc}") from None
        except ValueError as exc:
            seen.append((type(exc).__name__, str(exc)))
            raise probe.Incorrect("caught ValueError") from None

    REGISTRY["99.2"] = REGISTRY["01.1"].__class__("99.2", "t", "...", "...", "f", checker)
    try:
        for error in (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"), ValueError("bad")):
            def raiser():
                raise error
            direct = evaluate("99.2", raiser)
            judged = judge("99.2", record("99.2", raiser))
            assert (judged.status, judged.message) == (direct.status, direct.message) == (INCORRECT, direct.message)
        assert len(set(seen[:3])) == 1 and len(set(seen[3:])) == 1, seen  # direct, recorded, judged
    finally:
        del REGISTRY["99.2"]


def test_the_random_state_the_answer_moved_is_the_judgement_s_too():
    """A checker that draws after the learner's code drew gets the same numbers in the judgement."""
    def checker(answer):
        torch.manual_seed(0)
        out = probe.observe(lambda: answer())
        case = torch.rand(3)  # drawn after the answer moved the generator
        if not torch.equal(out, case):
            raise probe.Incorrect("different")

    REGISTRY["99.3"] = REGISTRY["01.1"].__class__("99.3", "t", "...", "...", "f", checker)

    def answer():
        torch.rand(5)
        gen_state = torch.get_rng_state()
        value = torch.rand(3)
        torch.set_rng_state(gen_state)
        return value

    try:
        assert evaluate("99.3", answer).status == CORRECT
        assert judge("99.3", record("99.3", answer)).status == CORRECT
    finally:
        del REGISTRY["99.3"]


def test_a_timeout_in_the_kernel_is_a_timeout_in_the_judgement():
    class slow:  # noqa: N801 (an answer to 01.1 whose call never ends)
        def __init__(self, factor):
            pass

        def __call__(self, x):
            while True:
                pass
    direct = evaluate("01.1", slow, timeout=0.3)
    judged = judge("01.1", record("01.1", slow, timeout=0.3), timeout=0.3)
    assert (judged.status, judged.message) == (direct.status, direct.message)
    assert "took longer than" in judged.message


def test_the_blank_and_a_missing_answer_are_not_attempted_in_the_judgement():
    assert judge("01.1", record("01.1", ...)).status == NOT_ATTEMPTED
    blank = _answer("01.1", REGISTRY["01.1"].blank)
    assert judge("01.1", record("01.1", blank)).status == NOT_ATTEMPTED


def test_a_checker_that_touches_the_answer_outside_observe_is_a_crash_not_a_verdict():
    def careless(answer):
        if answer(2) != 4:  # the learner's code used directly: in the judgement there is no answer
            raise probe.Incorrect("wrong")

    REGISTRY["99.4"] = REGISTRY["01.1"].__class__("99.4", "t", "...", "...", "f", careless)
    try:
        assert evaluate("99.4", lambda x: 2 * x).status == CORRECT
        judged = judge("99.4", record("99.4", lambda x: 2 * x))
        assert judged.crashed and judged.status != CORRECT
    finally:
        del REGISTRY["99.4"]


def test_a_record_that_would_keep_the_grader_busy_is_refused():
    """An expanded view (one stored number standing for 10^12), a sparse tensor, nesting without end: not what
    `plain` writes, refused before any checker reads them."""
    solved = _solved()
    first = next(i for i, e in enumerate(solved) if e[0] == "value")
    label = solved[first][1]
    deep = []
    for _ in range(40):  # deeper than plain() ever writes
        deep = [deep]
    for value in (torch.zeros(1).expand(10 ** 6, 10 ** 6), torch.eye(3).to_sparse(), deep,
                  [torch.zeros(10 ** 7)] * 6):
        log = solved[:first] + [("value", label, value, None)] + solved[first + 1:]
        assert judge("01.1", probe.encode(log)).status == INTERFERED


def test_instructors_md_lists_exactly_the_verdicts_that_rest_on_measurements_in_the_learner_s_process():
    from pathlib import Path
    import re

    text = (Path(__file__).resolve().parents[1] / "INSTRUCTORS.md").read_text()
    listed = set(re.findall(r"^\* (\d\d\.\d+) \(", text, re.M))
    assert listed == {k for k, e in REGISTRY.items() if e.inside}
    for k, e in REGISTRY.items():
        if e.inside:
            assert f"* {k} ({e.title}): {e.inside}" in text, k


# --- from an outside attack on the grader -------------------------------------------------------------------------

def _with_first_value(value, ex_id="01.1"):
    solved = _solved(ex_id)
    first = next(i for i, e in enumerate(solved) if e[0] == "value")
    return solved[:first] + [("value", solved[first][1], value, None)] + solved[first + 1:]


def test_values_plain_never_writes_are_refused():
    """A tensor carrying attributes (`t.float = torch.Tensor` makes `out.float()` an empty tensor, which allclose
    takes for any loss), a storage far larger than its tensor (a zip bomb's payload), an OrderedDict or Counter
    (whose methods attributes could replace), a class object: not plain data."""
    import collections

    shadowed = torch.tensor(4870.2)
    shadowed.float = torch.Tensor
    oversized = torch.zeros(10 ** 6)[:1]
    for value in (shadowed, oversized, collections.OrderedDict(a=1), collections.Counter(a=1), torch.Tensor):
        assert judge("01.1", probe.encode(_with_first_value(value))).status == INTERFERED, value


def test_a_record_cannot_claim_that_the_course_s_checker_crashed():
    """An error entry chosen by the kernel, saying it came from course code: the answer's error, not a crash."""
    wrong = _wrong()
    first = next(i for i, e in enumerate(wrong) if e[0] == "value")
    forged = wrong[:first] + [("error", wrong[first][1], "builtins", "ValueError", "internal error", 1, True),
                              ("end", "done")]
    result = judge("01.1", probe.encode(forged))
    assert result.status in (INCORRECT, INTERFERED) and not result.crashed, result


def test_a_replayed_exception_class_is_looked_up_without_importing_anything():
    import sys

    before = set(sys.modules)
    wrong = _wrong()
    first = next(i for i, e in enumerate(wrong) if e[0] == "value")
    forged = wrong[:first] + [("error", wrong[first][1], "torch", "_dynamo.exc.Unsupported", "x", 1, False),
                              ("end", "done")]
    assert judge("01.1", probe.encode(forged)).status in (INCORRECT, INTERFERED)
    assert set(sys.modules) - before == set()


def test_a_record_that_crashes_or_hangs_its_reader_costs_the_grader_one_judging_process():
    """The grader judges in a worker process under a time limit: a record that overflows the C stack (a tuple a
    million deep) or hashes for hours (shared tuples) gives JudgeFailed quickly, and the next record is judged by a
    fresh worker."""
    import time

    from course_tools.grader.judging import Judge, JudgeFailed
    import hostile_records

    judge_ = Judge(memory=6 * 2 ** 30)
    try:
        for data in (hostile_records.deep(), hostile_records.shared()):
            start = time.monotonic()
            with pytest.raises(JudgeFailed):
                judge_("01.1", data, 1, 8)
            assert time.monotonic() - start < 30
        solved = record("01.1", _answer("01.1", REGISTRY["01.1"].solution), seed=1)
        assert judge_("01.1", solved, 1, 30)["status"] == CORRECT
    finally:
        judge_.close()


@pytest.mark.parametrize("module, qualname", [("course_utils.exercises.probe", "OutOfReach"),
                                              ("course_utils.exercises.probe", "Interfered"),
                                              ("builtins", "ExceptionGroup"), ("builtins", "UnicodeDecodeError"),
                                              ("builtins", "BaseExceptionGroup")])
def test_a_replayed_exception_of_any_class_is_the_answer_s_error(module, qualname):
    """Classes that mean something to the judgement itself (a checker bug, interference) or that cannot be built
    from one text: the answer's error all the same, never "the course's checker failed"."""
    wrong = _wrong()
    first = next(i for i, e in enumerate(wrong) if e[0] == "value")
    forged = wrong[:first] + [("error", wrong[first][1], module, qualname, "x", 1, False), ("end", "done")]
    result = judge("01.1", probe.encode(forged))
    assert result.status in (INCORRECT, INTERFERED) and not result.crashed, result
