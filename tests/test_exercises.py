"""Proofs for every exercise of every notebook.

1. The committed (learner) notebook contains each exercise's blank exactly once, in the cell that checks it.
2. The blank, run as written, is reported "not attempted".
3. The reference solution passes.
4. Every exercise lists at least three common mistakes (wrong answers as a learner writes them), and each is
   rejected with feedback that names the mistake.
5. Fuzz: whatever the answer (None, wrong types, raising or slow callables), a checker gives feedback
   and never raises or hangs.
6. Judged from the record: every verdict above is the same when the checker runs once with the answer, recording
   what the learner's code produced (`record`, as in the grader's sandboxed kernel), and once more without it,
   judging from that record alone (`judge`, as in the grader's own process).
"""
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from course_tools.solve import exercise_cells, solve_notebook
from course_utils.exercises import CORRECT, INCORRECT, NOT_ATTEMPTED, evaluate, judge, load_all
from course_utils.exercises.core import describe, recorded
from course_utils.i18n import N_, _, speaking

import nbformat

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
REGISTRY = load_all()
IDS = sorted(REGISTRY)
SEED = 20261203  # the grader's seed for cases drawn afresh at each check (a new one per check in the grader)


def run(ex, code: str):
    """Run an exercise's setup then `code` (blank, solution or mistake) and return the answer object."""
    ns = {"__name__": f"exercise_{ex.id.replace('.', '_')}"}
    exec(compile(ex.setup, f"<setup {ex.id}>", "exec"), ns)
    exec(compile(code, f"<answer {ex.id}>", "exec"), ns)
    assert ex.answer in ns, f"{ex.id}: running the code did not define {ex.answer!r}"
    return ns[ex.answer]


def test_every_notebook_exercise_is_registered_and_every_exercise_is_in_a_notebook():
    in_notebooks = {}
    for path in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        for i, ex_id in exercise_cells(nb):
            assert ex_id not in in_notebooks, f"{ex_id} is checked in two cells"
            in_notebooks[ex_id] = (path.name, nb.cells[i].source)
    assert set(in_notebooks) == set(REGISTRY), (
        f"only in notebooks: {set(in_notebooks) - set(REGISTRY)}; only registered: {set(REGISTRY) - set(in_notebooks)}")
    for ex_id, (name, source) in in_notebooks.items():
        ex = REGISTRY[ex_id]
        assert ex_id.startswith(name[:2] + "."), f"{ex_id} lives in {name}"
        assert source.count(ex.blank) == 1, f"{name}: blank of {ex_id} not found exactly once"
        assert f"check(\"{ex_id}\", {ex.answer})" in source, f"{name}: cell must call check(\"{ex_id}\", {ex.answer})"


def test_solving_replaces_every_blank():
    for path in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        solved = solve_notebook(nb)
        for i, ex_id in exercise_cells(solved):
            assert REGISTRY[ex_id].solution in solved.cells[i].source


def verdict(ex, code: str, plain_too: bool = False):
    """The Result of `code`, after proving that the record of the same run, judged where the answer does not exist
    (the grader's split), gives the very same Result (and, with `plain_too`, that a plain check() run agrees)."""
    direct, data = recorded(ex.id, run(ex, code), seed=SEED)
    judged = judge(ex.id, data, seed=SEED)
    assert (judged.status, judged.message, judged.crashed) == (direct.status, direct.message, direct.crashed), (
        ex.id, code, direct, judged)
    if plain_too:
        assert evaluate(ex.id, run(ex, code)).status == direct.status, (ex.id, code)
    return direct


@pytest.mark.parametrize("ex_id", IDS)
def test_blank_is_not_attempted(ex_id):
    ex = REGISTRY[ex_id]
    result = verdict(ex, ex.blank, plain_too=True)
    assert result.status == NOT_ATTEMPTED, result


@pytest.mark.parametrize("ex_id", IDS)
def test_solution_passes(ex_id):
    ex = REGISTRY[ex_id]
    result = verdict(ex, ex.solution, plain_too=True)
    assert result.status == CORRECT, result


@pytest.mark.parametrize("ex_id", IDS)
def test_common_mistakes_get_their_feedback(ex_id):
    ex = REGISTRY[ex_id]
    assert len(ex.mistakes) >= 3, f"{ex_id} lists {len(ex.mistakes)} common mistakes; every exercise needs three"
    assert ex.hints, f"{ex_id} has no hints"
    for mistake in ex.mistakes:
        result = verdict(ex, mistake.code)
        assert result.status == INCORRECT, (mistake.code, result)
        assert mistake.feedback in result.message, (mistake.code, result.message)


CJK = __import__("re").compile(r"[\u4e00-\u9fff]")


@pytest.mark.parametrize("ex_id", IDS)
def test_feedback_hints_and_title_are_translated(ex_id):
    """In Chinese the same answers get the same verdicts, told in Chinese: every mistake, the solution's remark,
    the not-attempted message, each hint and the title."""
    ex = REGISTRY[ex_id]
    with speaking("zh-CN"):
        assert CJK.search(_(ex.title)), f"{ex_id}: title {ex.title!r} has no Chinese translation"
        for h in ex.hints:
            assert CJK.search(_(h)), f"{ex_id}: hint {h[:60]!r} has no Chinese translation"
        for code, expected in [(m.code, INCORRECT) for m in ex.mistakes] + [(ex.solution, CORRECT),
                                                                              (ex.blank, NOT_ATTEMPTED)]:
            answer = run(ex, code)
            zh = evaluate(ex_id, answer)
            assert zh.status == expected, (code, zh)
            assert CJK.search(zh.message), f"{ex_id}: feedback not translated: {zh.message!r}"
    english = evaluate(ex_id, run(ex, ex.mistakes[0].code))
    assert not CJK.search(english.message), "the language must go back to English after the block"


def test_translation_keeps_placeholders_and_falls_back_to_english():
    with speaking("zh-CN"):
        assert _(N_("well done")) == "做得好"
        assert _("a message no catalog has") == "a message no catalog has"
    assert _("well done") == "well done"


def _raiser(exc):
    def fn(*args, **kwargs):
        raise exc
    return fn


def _slow(*args, **kwargs):
    while True:
        pass


answers = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=20),
    st.lists(st.integers(), max_size=5), st.dictionaries(st.text(max_size=3), st.integers(), max_size=3),
    st.just(object()), st.just(print), st.just(len), st.just(lambda *a, **k: None),
    st.just(_raiser(ValueError("boom"))), st.just(_raiser(TypeError("bad"))), st.just(_raiser(ZeroDivisionError())),
    st.just(type("Weird", (), {"__eq__": _raiser(RuntimeError("no eq"))})()),
    st.builds(lambda n: __import__("torch").randn(n), st.integers(0, 4)),
)


@pytest.mark.parametrize("ex_id", IDS)
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(answer=answers)
def test_fuzz_checkers_never_crash(ex_id, answer):
    """Any odd answer gets feedback from the checker itself: an exception that escapes the checker from its own
    code (not from the learner's answer) is a checker bug, even though `evaluate` still turns it into a line."""
    result = evaluate(ex_id, answer, timeout=3)
    assert result.status in (CORRECT, INCORRECT, NOT_ATTEMPTED)
    assert isinstance(result.message, str) and result.message
    assert not result.crashed, (ex_id, describe(answer), result.message)
    kernel, data = recorded(ex_id, answer, timeout=3, seed=SEED)
    judged = judge(ex_id, data, seed=SEED)
    assert (judged.status, judged.message, judged.crashed) == (kernel.status, kernel.message, False), (
        ex_id, describe(answer), kernel, judged)


@pytest.mark.parametrize("ex_id", IDS)
def test_a_hanging_answer_is_stopped(ex_id):
    result = evaluate(ex_id, _slow, timeout=0.5)
    assert result.status == INCORRECT


def test_a_checker_crash_is_told_apart_from_an_answer_that_raises():
    """What makes the fuzz above able to fail: an exception from the checker's own code is `crashed`; one raised
    inside the learner's answer is feedback."""
    from course_utils.exercises.core import REGISTRY, Exercise

    import course_utils.exercises.core as core
    scope = {}  # a checker compiled as course code (its file is in the package), like every real one
    exec(compile("def checker(answer):\n    return answer().shape  # assumes the answer returns a tensor\n",
                 core.__file__, "exec"), scope)
    checker = scope["checker"]
    REGISTRY["99.1"] = Exercise("99.1", "probe", "...", "...", "f", checker)
    try:
        assert evaluate("99.1", lambda: 3).crashed  # int has no .shape: the checker's own line failed
        assert not evaluate("99.1", _raiser(ValueError("boom"))).crashed  # the answer raised
        assert evaluate("99.1", _raiser(ValueError("boom"))).status == INCORRECT
    finally:
        del REGISTRY["99.1"]


@pytest.mark.parametrize("edition", ["", "zh-CN"])
def test_exercises_are_numbered_in_the_order_they_appear(edition):
    """In every notebook (both editions) the exercises' check() calls come in the order 1, 2, 3, ... of its own
    number, and together they are exactly the registry's exercises of that notebook."""
    import re

    registry = load_all()
    for path in sorted((NOTEBOOKS / edition).glob("[0-9][0-9]_*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        checked = [m for cell in nb.cells if cell.cell_type == "code"
                   for m in re.findall(r'check\("(\d\d)\.(\d+)"', cell.source)]
        number = path.name[:2]
        assert all(n == number for n, _k in checked), (path.name, checked)
        order = [int(k) for _n, k in checked]
        assert order == list(range(1, len(order) + 1)), (path.name, order)
        assert {f"{number}.{k}" for k in order} == {i for i in registry if i.startswith(number + ".")}, path.name


@pytest.mark.parametrize("ex_id", IDS)
def test_numbers_at_the_edge_of_float_get_feedback_not_a_crash(ex_id):
    """An answer that returns an int beyond float's range, NaN or -0.0 (an outside attack found the first one
    crashing a checker): feedback, from the checker itself, and the same judged from the record."""
    for value in (10 ** 400, float("nan"), -0.0):
        kernel, data = recorded(ex_id, lambda *args, _v=value, **kwargs: _v, timeout=3, seed=SEED)
        assert not kernel.crashed, (ex_id, value, kernel.message)
        assert judge(ex_id, data, seed=SEED).status == kernel.status


@pytest.mark.parametrize("ex_id", IDS)
def test_zero_dimensional_tensors_of_odd_kinds_get_feedback_not_a_crash(ex_id):
    """A complex or a meta 0-d tensor returned where a number is asked (found by an outside attack on 01.2)."""
    import torch

    for value in (torch.tensor(1 + 2j), torch.empty((), device="meta")):
        kernel, data = recorded(ex_id, lambda *args, _v=value, **kwargs: _v, timeout=3, seed=SEED)
        judged = judge(ex_id, data, seed=SEED)  # what the grader reports
        assert not judged.crashed and judged.status == kernel.status, (ex_id, value, judged.message)
