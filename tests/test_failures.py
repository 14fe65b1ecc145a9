"""The expected time lost to failures (course_utils.failures, Daly's formula) against a simulation of failing
jobs that shares no code with it; and the best interval it gives against Young's approximation."""
import math

import pytest

from course_utils.failures import best_interval, lost_fraction, simulated_lost_fraction

# (every, step_s, save_s, mtbf_s, restart_s, work_steps, relative tolerance): the tolerance is many standard errors
# of the 300-run simulation, and smaller than the gap to Young's first-order model (1.8 % in the first case)
CASES = [(50, 1.0, 30, 3600, 0, 20000, 0.01), (7, 1.0, 2, 20, 5, 300, 0.05), (569, 2.0, 60, 10800, 120, 60000, 0.05),
         (3, 1.0, 0.5, 4, 1, 50, 0.05), (40, 1.0, 1, 200, 0, 1010, 0.05)]  # the last: a partial last segment


@pytest.mark.parametrize("every,step_s,save_s,mtbf_s,restart_s,work_steps,tolerance", CASES)
def test_the_expected_loss_is_what_a_simulation_of_failing_jobs_loses(every, step_s, save_s, mtbf_s, restart_s,
                                                                      work_steps, tolerance):
    exact = lost_fraction(every, step_s, save_s, mtbf_s, restart_s, work_steps=work_steps)
    simulated = simulated_lost_fraction(every, step_s, save_s, mtbf_s, work_steps, restart_s, runs=300, seed=1)
    assert simulated == pytest.approx(exact, rel=tolerance)
    first_order = save_s / (every * step_s) + every * step_s / (2 * mtbf_s)
    assert abs(first_order - exact) > tolerance * exact  # the check tells the two apart


def test_the_best_interval_is_near_youngs_and_where_the_loss_is_least():
    for step_s, save_s, mtbf_s in [(0.25, 2.0, 10800), (2.0, 60, 10800), (1, 30, 86400)]:
        best = best_interval(step_s, save_s, mtbf_s)
        young = math.sqrt(2 * save_s * mtbf_s) / step_s
        assert 0.9 * young < best <= young  # the exact optimum sits a little below Young's (Daly: about - save_s)
        loss = lambda k: lost_fraction(k, step_s, save_s, mtbf_s)  # noqa: E731
        assert loss(best) <= min(loss(best - 1), loss(best + 1), loss(round(young)))
        assert loss(round(young / 2)) > 1.1 * loss(best) and loss(round(2 * young)) > 1.1 * loss(best)
    assert best_interval(2.0, 0.01, 60) == 1  # a save cheaper than a step: every step


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="positive int"):
        lost_fraction(0, 1.0, 1.0, 10.0)
    with pytest.raises(ValueError, match="mtbf_s > 0"):
        lost_fraction(5, 1.0, 1.0, 0.0)


@pytest.mark.parametrize("code", [
    "    return max(1, round((math.sqrt(2 * save_s * mtbf_s) - save_s) / step_s))\n",  # Daly's first order
    "    return max(1, math.ceil(math.sqrt(2 * save_s * mtbf_s) / step_s))\n",
    "    import numpy as np\n    return np.int64(max(1, round(math.sqrt(2 * save_s * mtbf_s) / step_s)))\n",
    "    import torch\n    return torch.tensor(max(1, round(math.sqrt(2 * save_s * mtbf_s) / step_s)))\n",
])
def test_exercise_08_5_accepts_every_right_way_to_write_it(code):
    from course_utils.exercises import CORRECT, evaluate

    ns = {}
    exec("import math\ndef steps_between_checkpoints(step_s, save_s, mtbf_s):\n" + code, ns)
    result = evaluate("08.5", ns["steps_between_checkpoints"])
    assert result.status == CORRECT, result.message


@pytest.mark.parametrize("code", [
    "    return 10 ** 400\n",                                         # overflowed the expected-loss formula
    "    return max(1, round(2 * save_s * mtbf_s * 1000 / step_s))\n",
    "    import torch\n    return torch.tensor(831, device='meta')\n",  # a tensor with no value to read
    "    calls.append(1)\n    return 831 if len(calls) < 3 else 'oops'\n",
    "    calls.append(1)\n    return 831 if len(calls) < 3 else 0\n",  # 0 once the check had moved on: a hang before
    "    import numpy as np\n    return np.asarray(max(1, round(math.sqrt(2 * save_s * mtbf_s) / step_s)))\n",
])
def test_exercise_08_5_gives_feedback_and_never_crashes_or_hangs_on_hostile_answers(code):
    """Answers found by a review: each is judged (the last one is right) without a checker crash."""
    import time

    from course_utils.exercises import CORRECT, INCORRECT, evaluate

    ns = {"calls": []}
    exec("import math\ndef steps_between_checkpoints(step_s, save_s, mtbf_s):\n" + code, ns)
    start = time.perf_counter()
    result = evaluate("08.5", ns["steps_between_checkpoints"])
    assert not result.crashed and time.perf_counter() - start < 5, result.message
    assert result.status == (CORRECT if "np.asarray" in code else INCORRECT), result.message
