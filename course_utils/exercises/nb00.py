"""Exercises of notebook 00, "Is my GPU working?".

00.1 a stack diagnosis from recorded facts: the torch build's CUDA against the driver's (backward and
minor-version compatibility), then the GPU's compute capability against the build's architectures. The
answer key is `course_utils.environment` (`driver_runs_build`, `build_supports_gpu`); each common mistake
is recognised by running it, as written in `mistakes`, on the same recorded machines.
"""
from __future__ import annotations

import types

from ..environment import build_supports_gpu, driver_runs_build
from ..i18n import N_, _, get_language, speaking
from .core import Exercise, Incorrect, Mistake, call, describe, register
from .probe import observe

VERDICTS = ("ok", "cpu-only build", "driver too old", "gpu too old for this build", "gpu too new for this build")

# --- recorded facts ---------------------------------------------------------------------------------------

# torch.cuda.get_arch_list() of real builds: 2.14.1+cu130 is the course's (read on this machine); the 2.10 and
# 2.11 lists are quoted in pytorch/pytorch#182250; 2.5.1+cu124 is the list tests/test_device.py records.
_BUILDS = {
    "2.14.1+cu130": ("13.0", ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]),
    "2.11.0+cu128": ("12.8", ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]),
    "2.10.0+cu128": ("12.8", ["sm_70", "sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]),
    "2.11.0+cu126": ("12.6", ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]),
    "2.5.1+cu124": ("12.4", ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]),
    "2.14.1+cpu": (None, []),
}
# Driver releases and the CUDA version each reports (nvidia-smi's "CUDA Version"; CUDA toolkit release notes).
_DRIVERS = {"470.256.02": "11.4", "525.60.13": "12.0", "535.183.01": "12.2", "550.54.14": "12.4",
            "570.86.10": "12.8", "575.57.08": "12.9", "580.65.06": "13.0", "590.44.01": "13.1"}
_GPUS = {"GeForce RTX 3060 Laptop": "8.6", "GeForce RTX 4090": "8.9", "Tesla V100": "7.0", "A100": "8.0",
         "H100": "9.0", "B200": "10.0", "GeForce GTX 1080": "6.1", "GeForce RTX 5090": "12.0", "Tesla T4": "7.5"}
_MACHINES = [  # (GPU, torch build, driver)
    ("GeForce RTX 3060 Laptop", "2.14.1+cu130", "580.65.06"),
    ("GeForce RTX 3060 Laptop", "2.14.1+cu130", "575.57.08"),  # a CUDA 13 build on a CUDA 12 driver
    ("GeForce RTX 3060 Laptop", "2.11.0+cu128", "570.86.10"),
    ("GeForce RTX 4090", "2.14.1+cu130", "590.44.01"),         # a newer driver: backward compatibility
    ("GeForce RTX 4090", "2.11.0+cu126", "550.54.14"),         # 12.6 on 12.4: minor-version compatibility
    ("H100", "2.11.0+cu128", "535.183.01"),                    # 12.8 on 12.2: minor-version compatibility
    ("A100", "2.5.1+cu124", "525.60.13"),                      # 12.4 on 12.0: minor-version compatibility
    ("A100", "2.14.1+cu130", "575.57.08"),
    ("Tesla T4", "2.11.0+cu128", "470.256.02"),                # a CUDA 12 build on a CUDA 11 driver
    ("Tesla T4", "2.14.1+cu130", "580.65.06"),
    ("Tesla V100", "2.14.1+cu130", "580.65.06"),               # Volta is gone from the CUDA 13 builds
    ("Tesla V100", "2.11.0+cu128", "570.86.10"),               # and from 2.11's CUDA 12.8 build
    ("Tesla V100", "2.10.0+cu128", "570.86.10"),               # 2.10's still has sm_70
    ("GeForce GTX 1080", "2.11.0+cu126", "550.54.14"),         # 6.1 runs the sm_60 code
    ("GeForce GTX 1080", "2.14.1+cu130", "580.65.06"),
    ("GeForce GTX 1080", "2.14.1+cu130", "470.256.02"),        # two problems: the driver is reported first
    ("B200", "2.5.1+cu124", "570.86.10"),                      # 10.0: no sm_10x code in a CUDA 12.4 build
    ("B200", "2.14.1+cu130", "580.65.06"),
    ("GeForce RTX 5090", "2.11.0+cu126", "575.57.08"),
    ("GeForce RTX 5090", "2.14.1+cu130", "590.44.01"),
    ("GeForce RTX 4090", "2.14.1+cpu", "580.65.06"),
    ("Tesla T4", "2.14.1+cpu", "470.256.02"),                  # a CPU-only build is reported first
]


def _case(gpu: str, build: str, driver: str) -> tuple[tuple[str, str, str], dict]:
    torch_cuda, arch_list = _BUILDS[build]
    facts = {"torch_cuda": torch_cuda, "driver_cuda": _DRIVERS[driver], "driver_version": driver,
             "capability": _GPUS[gpu], "arch_list": list(arch_list)}
    return (gpu, build, driver), facts


def _label(machine: tuple[str, str, str]) -> str:
    """A recorded machine in words, for feedback (in the language being spoken)."""
    gpu, build, driver = machine
    return _("{gpu} ({capability}) with torch {build} on driver {driver}").format(
        gpu=gpu, capability=_GPUS[gpu], build=build, driver=driver)


CASES = [_case(*machine) for machine in _MACHINES]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def expected_verdict(facts: dict) -> str:
    """The answer key: course_utils.environment's rules, applied in the exercise's order."""
    if facts["torch_cuda"] is None:
        return "cpu-only build"
    ok, _why = driver_runs_build(_version(facts["torch_cuda"]), _version(facts["driver_cuda"]),
                                 facts["driver_version"])
    if not ok:
        return "driver too old"
    with speaking("en"):  # `why` is read below: its English wording, whatever language is being spoken
        ok, why = build_supports_gpu(_version(facts["capability"]), facts["arch_list"])
    if ok:
        return "ok"
    return "gpu too old for this build" if "too old" in why else "gpu too new for this build"


# --- the exercise -----------------------------------------------------------------------------------------

_DOC = ('def diagnose_stack(facts):\n'
        '    """One verdict for a machine\'s recorded facts, for example\n'
        '    {"torch_cuda": "13.0", "driver_cuda": "12.9", "driver_version": "575.57.08", "capability": "8.6",\n'
        '     "arch_list": ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]} -> "driver too old"."""\n')

_PARSE = ('    def version(text):\n'
          '        return tuple(int(part) for part in text.split("."))\n\n')

_DRIVER_CHECK = ('    build, driver = version(facts["torch_cuda"]), version(facts["driver_cuda"])\n'
                 '    branch = int(facts["driver_version"].split(".")[0])\n'
                 '    minimum = {11: 450, 12: 525, 13: 580}.get(build[0])\n'
                 '    minor_compatible = driver[0] == build[0] and minimum is not None and branch >= minimum\n'
                 '    if driver < build and not minor_compatible:\n'
                 '        return "driver too old"\n')

_GPU_CHECK = ('    gpu = version(facts["capability"])\n'
              '    codes = [divmod(int(arch[3:]), 10) for arch in facts["arch_list"]]  # "sm_86" -> (8, 6)\n'
              '    if any(code[0] == gpu[0] and code[1] <= gpu[1] for code in codes):\n'
              '        return "ok"\n'
              '    return "gpu too old for this build" if gpu < min(codes) else "gpu too new for this build"\n')

_SOLUTION = (_DOC + _PARSE +
             '    if facts["torch_cuda"] is None:\n'
             '        return "cpu-only build"\n'
             + _DRIVER_CHECK + _GPU_CHECK)

_MISTAKES = [
    # The driver's CUDA must equal the build's.
    Mistake(_DOC + _PARSE +
            '    if facts["torch_cuda"] is None:\n'
            '        return "cpu-only build"\n'
            '    if facts["driver_cuda"] != facts["torch_cuda"]:\n'
            '        return "driver too old"\n' + _GPU_CHECK, "exact match"),
    # Only backward compatibility: the driver's CUDA must be the build's or newer.
    Mistake(_DOC + _PARSE +
            '    if facts["torch_cuda"] is None:\n'
            '        return "cpu-only build"\n'
            '    if version(facts["driver_cuda"]) < version(facts["torch_cuda"]):\n'
            '        return "driver too old"\n' + _GPU_CHECK, "minor-version compatibility"),
    # Versions compared as strings.
    Mistake(_DOC +
            '    if facts["torch_cuda"] is None:\n'
            '        return "cpu-only build"\n'
            '    build, driver = facts["torch_cuda"], facts["driver_cuda"]\n'
            '    if driver < build and driver.split(".")[0] != build.split(".")[0]:\n'
            '        return "driver too old"\n'
            '    gpu = facts["capability"]\n'
            '    codes = [arch[3:-1] + "." + arch[-1] for arch in facts["arch_list"]]  # "sm_86" -> "8.6"\n'
            '    if any(code.split(".")[0] == gpu.split(".")[0] and code <= gpu for code in codes):\n'
            '        return "ok"\n'
            '    return "gpu too old for this build" if gpu < min(codes) else "gpu too new for this build"\n',
            "compared as text"),
    # nvidia-smi's "CUDA Version" taken for the CUDA the build uses.
    Mistake(_DOC + _PARSE +
            '    if facts["driver_cuda"] is None:\n'
            '        return "cpu-only build"\n'
            + _DRIVER_CHECK.replace('version(facts["torch_cuda"])', 'version(facts["driver_cuda"])')
            + _GPU_CHECK, "nvidia-smi"),
    # Machine code only for the exact compute capability.
    Mistake(_DOC + _PARSE +
            '    if facts["torch_cuda"] is None:\n'
            '        return "cpu-only build"\n'
            + _DRIVER_CHECK +
            '    gpu = version(facts["capability"])\n'
            '    codes = [divmod(int(arch[3:]), 10) for arch in facts["arch_list"]]\n'
            '    if gpu in codes:\n'
            '        return "ok"\n'
            '    return "gpu too old for this build" if gpu < min(codes) else "gpu too new for this build"\n',
            "same major"),
    # Any newer GPU taken to run older machine code, across major versions.
    Mistake(_DOC + _PARSE +
            '    if facts["torch_cuda"] is None:\n'
            '        return "cpu-only build"\n'
            + _DRIVER_CHECK +
            '    gpu = version(facts["capability"])\n'
            '    codes = [divmod(int(arch[3:]), 10) for arch in facts["arch_list"]]\n'
            '    if any(code <= gpu for code in codes):\n'
            '        return "ok"\n'
            '    return "gpu too old for this build"\n',
            "never across a major version"),
    # The GPU judged before the driver.
    Mistake(_DOC + _PARSE +
            '    if facts["torch_cuda"] is None:\n'
            '        return "cpu-only build"\n'
            '    gpu = version(facts["capability"])\n'
            '    codes = [divmod(int(arch[3:]), 10) for arch in facts["arch_list"]]\n'
            '    if not any(code[0] == gpu[0] and code[1] <= gpu[1] for code in codes):\n'
            '        return "gpu too old for this build" if gpu < min(codes) else "gpu too new for this build"\n'
            + _DRIVER_CHECK + '    return "ok"\n',
            "build, then the driver"),
    # The branch minimum taken as exclusive: a branch-525 driver refused for CUDA 12.
    Mistake(_DOC + _PARSE +
            '    if facts["torch_cuda"] is None:\n'
            '        return "cpu-only build"\n'
            + _DRIVER_CHECK.replace("branch >= minimum", "branch > minimum") + _GPU_CHECK,
            "the branch minimum is inclusive"),
    # Too old or too new decided on the major version alone.
    Mistake(_DOC + _PARSE +
            '    if facts["torch_cuda"] is None:\n'
            '        return "cpu-only build"\n'
            + _DRIVER_CHECK + _GPU_CHECK.replace("if gpu < min(codes)", "if gpu[0] < min(codes)[0]"),
            "the whole version, major and minor"),
]

# What each mistake means, said when the learner's verdicts follow it (same order as _MISTAKES).
_EXPLANATIONS = [
    N_("an exact match of the CUDA versions is not required: a driver runs code built for its own CUDA version or "
       "any older one (backward compatibility), and, from CUDA 11, a newer minor release of its major release"),
    N_("the driver's CUDA version may be older than the build's within the same major release: minor-version "
       "compatibility (CUDA 11 and later) runs 12.8 code on a 12.2 driver of branch 525 or newer"),
    N_("versions compared as text: as strings, \"10.0\" < \"9.0\" and \"10.0\" < \"7.5\" (so sm_100 passes for a "
       "build's oldest entry); turn them into tuples of numbers first, (10, 0) > (9, 0)"),
    N_("driver_cuda is nvidia-smi's \"CUDA Version\", the newest CUDA the driver supports; the CUDA this torch was "
       "built with is torch_cuda (torch.version.cuda, None on a CPU-only build)"),
    N_("machine code runs on every GPU of the same major version and an equal or higher minor: sm_86 code runs on an "
       "8.9 GPU, so an exact sm_89 is not needed"),
    N_("machine code runs only within its major version, never across a major version: sm_90 code does not run on a "
       "10.0 GPU (only PTX, compute_XY, is compiled for newer GPUs, and these lists have none)"),
    N_("the GPU was judged before the driver; report the first problem, in the order build, then the driver, then the "
       "GPU: on a driver too old for the build CUDA does not start, so the GPU's code is never tried"),
    N_("the branch minimum is inclusive: a driver of branch 525 (525.60.13, CUDA 12.0) is new enough for any CUDA "
       "12 build; the branch must be at least 450, 525 or 580 (>=, not >)"),
    N_("too old or too new is decided on the whole version, major and minor: a 7.0 GPU is below a build whose oldest "
       "entry is sm_75, so it is too old, although both have major 7; compare (7, 0) < (7, 5)"),
]

# Wrong answers that _run_all itself reports (they need no explanation of their verdicts).
_OTHER_MISTAKES = [
    # The arch list converted in the caller's dict.
    Mistake(_SOLUTION.replace(
        '    codes = [divmod(int(arch[3:]), 10) for arch in facts["arch_list"]]  # "sm_86" -> (8, 6)\n',
        '    facts["arch_list"] = [divmod(int(arch[3:]), 10) for arch in facts["arch_list"]]  # "sm_86" -> (8, 6)\n'
        '    codes = facts["arch_list"]\n'), "changed its argument 1"),
]

_HELPERS = {"driver_runs_build", "build_supports_gpu", "diagnose", "gpu_support_problems", "describe_environment",
            "expected_verdict"}


def _names_used(fn) -> set[str]:
    """Global and attribute names the function's code (and the code nested in it) refers to."""
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    names, todo = set(), [code] if code is not None else []
    while todo:
        c = todo.pop()
        names.update(c.co_names)
        todo.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return names


def _direct(fn):
    return fn()


def _run_all(fn, run, name: str = "diagnose_stack") -> list[str]:
    """The verdict of `fn` for every recorded machine, or "!" and what it raised. An answer that is no verdict is
    feedback at once. `run` runs each call: observe() for the learner's answer, _direct for the course's own
    mistakes (worked out wherever the checker runs, the grader's process included)."""
    # core.call's feedback for an exception the answer raised begins so (in the language being spoken)
    raised = _("calling {call} raised {error}: {message}").split("{call}")[0]
    answers = []
    for machine, facts in CASES:
        try:
            got = run(lambda: call(fn, {**facts, "arch_list": list(facts["arch_list"])}, name=name))
        except Incorrect as exc:
            if not str(exc).startswith(raised):  # not an exception of the answer's own (a changed argument)
                raise
            answers.append("!" + str(exc))
            continue
        if not isinstance(got, str) or got not in VERDICTS:
            raise Incorrect(_("for {label}, {name} returned {value}; return one of {verdicts}").format(
                label=_label(machine), name=name, value=describe(got),
                verdicts=", ".join(repr(v) for v in VERDICTS)))
        answers.append(got)
    return answers


_EXPECTED = [expected_verdict(facts) for _machine, facts in CASES]
# filled on first use, per language (an answer's exception is told in it): each mistake's verdicts on CASES
_MISTAKE_ANSWERS: dict[str, list[list[str]]] = {}


def _mistake_answers() -> list[list[str]]:
    language = get_language()
    if language not in _MISTAKE_ANSWERS:
        answers = []
        for mistake in _MISTAKES:
            ns: dict = {}
            exec(compile(mistake.code, "<mistake 00.1>", "exec"), ns)
            answers.append(_run_all(ns["diagnose_stack"], _direct))
        _MISTAKE_ANSWERS[language] = answers
    return _MISTAKE_ANSWERS[language]


def _check_diagnose_stack(diagnose_stack):
    if observe(lambda: isinstance(diagnose_stack, type) or not callable(diagnose_stack)):
        raise Incorrect(_("diagnose_stack should be a function (written with `def diagnose_stack(facts):`), got "
                          "{value}").format(value=observe(lambda: describe(diagnose_stack))))
    helpers = observe(lambda: sorted(_names_used(diagnose_stack) & _HELPERS))
    if helpers:
        raise Incorrect(_("diagnose_stack calls {helpers}, the checker's answer key: write the rules yourself "
                          "(versions as numbers, the driver's compatibility, the GPU against arch_list)").format(
                              helpers=", ".join(helpers)))
    answers = _run_all(diagnose_stack, observe)  # each call of the answer inside observe()
    wrong = [i for i, (got, want) in enumerate(zip(answers, _EXPECTED)) if got != want]
    if not wrong:
        return _("all {total} recorded machines get course_utils.environment's verdict: backward and "
                 "minor-version compatibility for the driver, same-major machine code for the GPU").format(
                     total=len(CASES))
    best = None  # (agreement, explanation, first failure it explains)
    for explanation, theirs in zip(_EXPLANATIONS, _mistake_answers()):
        explained = [i for i in wrong if theirs[i] == answers[i]]
        if explained and 2 * len(explained) >= len(wrong):
            agreement = sum(a == b for a, b in zip(theirs, answers))
            if best is None or agreement > best[0]:
                best = (agreement, explanation, explained[0])
    i = best[2] if best else wrong[0]
    machine, facts = CASES[i]
    outcome = (answers[i][1:] if answers[i].startswith("!")
               else _("your function returned {verdict!r}").format(verdict=answers[i]))
    message = _("{wrong} of {total} recorded machines get a wrong verdict; for example {label} ({facts}): "
                "expected {expected!r}, but {outcome}").format(
                    wrong=len(wrong), total=len(CASES), label=_label(machine), facts=_facts_text(facts),
                    expected=_EXPECTED[i], outcome=outcome)
    if best:
        message += _(". Likely mistake: {explanation}").format(explanation=_(best[1]))
    raise Incorrect(message)


def _facts_text(facts: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in facts.items() if k != "arch_list") + \
        f", arch_list={' '.join(facts['arch_list']) or '[]'}"


register(Exercise(
    id="00.1", title=N_("Diagnose a machine's GPU stack"), answer="diagnose_stack",
    blank=_DOC + "    raise NotImplementedError  # your code here\n",
    solution=_SOLUTION,
    checker=_check_diagnose_stack,
    hints=[N_("Turn each version into a tuple of numbers first: tuple(int(p) for p in \"12.8\".split(\".\")) is "
              "(12, 8), and tuples compare as versions do; strings do not (\"10.0\" < \"9.0\")."),
           N_("The driver is new enough when its CUDA version is the build's or newer, or, from CUDA 11, has the "
              "same major number (minor-version compatibility) and a branch (the driver version before its first "
              "dot) of at least 450, 525 or 580 for CUDA 11, 12 or 13."),
           N_("\"sm_86\" is machine code for 8.6: it runs on a GPU with major 8 and minor 6 or more. When no entry "
              "runs, the GPU is too old if it is below the oldest entry, and too new otherwise.")],
    mistakes=_MISTAKES + _OTHER_MISTAKES,
))
