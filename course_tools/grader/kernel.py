"""The grader's own cells, run in the learner's kernel (never the learner's code).

SETUP, the first cell, loads the course's checkers afresh under a private module name, records calls of
`solution()`, installs the audit hook (it refuses writes outside the working directory and signals to the grader,
and notes the reference solutions' text run through exec/compile) and leaves a `Grader` in the private module.
EVAL, after each exercise cell, checks the answer with it and prints the result, flags and signs of tampering as
one line framed by a token made for that call. Both are %-templates: `SETUP % {"args": json.dumps({...})}`,
`EVAL % {"private": ..., "id": ..., "answer": ..., "token": ...}`.
"""

SETUP = r'''
def __course_grader_setup(private, exercises_dir, course_dir, workdir, solutions, token, grader_pid):
    import functools, importlib.util, json, os, sys, tempfile
    shell = get_ipython()
    spec = importlib.util.spec_from_file_location(private, os.path.join(exercises_dir, "__init__.py"),
                                                  submodule_search_locations=[exercises_dir])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules[private] = pkg
    spec.loader.exec_module(pkg)
    registry = pkg.load_all()
    evaluate = pkg.evaluate
    import course_utils.exercises as public
    import course_utils.exercises.core as public_core
    public.load_all()  # the notebook's own check() then costs the learner's time budget no imports
    out, dumps, realpath, isabs, join, readlink, getcwd = (sys.stdout, json.dumps, os.path.realpath,
                                                            os.path.isabs, os.path.join, os.readlink, os.getcwd)
    calls, executed = set(), set()
    original_solution, original_check, original_evaluate = public_core.solution, public.check, public_core.evaluate

    @functools.wraps(original_solution)
    def solution(exercise_id):
        calls.add(str(exercise_id))
        return original_solution(exercise_id)

    public.solution = public_core.solution = solution
    try:
        from ipykernel.compiler import get_tmp_directory
        cell_prefixes = (get_tmp_directory() + os.sep, "<ipython-input-")
    except Exception:
        cell_prefixes = (join(tempfile.gettempdir(), "ipykernel_"), "<ipython-input-")
    allowed = (realpath(workdir), "/dev")
    protected_pids = {os.getppid(), grader_pid, -1} - {0, 1}
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    path_events = {"os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.chmod": (0,), "os.chown": (0,),
                   "os.truncate": (0,), "os.utime": (0,), "os.rename": (0, 1), "os.link": (1,), "os.symlink": (1,),
                   "os.mkfifo": (0,), "os.mknod": (0,), "os.setxattr": (0,), "os.removexattr": (0,),
                   "shutil.rmtree": (0,), "shutil.copyfile": (1,), "shutil.copytree": (1,), "shutil.move": (0, 1)}

    def outside(path, dir_fd=None):
        if isinstance(path, int):
            return False
        path = os.fsdecode(os.fspath(path))
        if not isabs(path):
            path = join(readlink(f"/proc/self/fd/{dir_fd}") if isinstance(dir_fd, int) else getcwd(), path)
        path = realpath(path)
        return not any(path == root or path.startswith(root + os.sep) for root in allowed)

    def guard(event, args):
        refused = None
        try:
            if event == "open":
                path, mode, flags = args
                if ((isinstance(mode, str) and any(c in mode for c in "wax+"))
                        or (mode is None and isinstance(flags, int) and flags & writes)) and outside(path):
                    refused = path
            elif event in path_events:
                dir_fd = args[-1] if event in ("os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.utime",
                                               "os.symlink", "os.mkfifo", "os.mknod", "os.chown") else None
                for i in path_events[event]:
                    if outside(args[i], dir_fd):
                        refused = args[i]
                        break
            elif event in ("os.kill", "os.killpg"):
                if args[0] in protected_pids:
                    refused = f"process {args[0]}"
            elif event == "compile":
                source, filename = args
                if isinstance(source, bytes):
                    source = source.decode("utf-8", "replace")
                name = str(filename)
                if (isinstance(source, str) and name != "<>" and not name.startswith(cell_prefixes)
                        and not name.startswith(course_dir)):  # "<>": IPython's own look at a cell
                    for ex_id, text in solutions.items():
                        if text in source:
                            executed.add(ex_id)
        except Exception:
            return
        if refused is not None:
            raise PermissionError(f"the grader does not let a notebook change {refused} ({event}): only its "
                                  "working directory is writable")

    sys.addaudithook(guard)

    class Grader:
        def evaluate(self, exercise_id, answer_name, token):
            ns = shell.user_ns
            try:
                if answer_name in ns:
                    result = evaluate(exercise_id, ns[answer_name])
                    status, message = result.status, result.message
                else:
                    status, message = "not attempted", (f"`{answer_name}` is not defined: the exercise's cell did "
                                                        "not define it")
            except BaseException as exc:
                status, message = "incorrect", f"checking the answer raised {type(exc).__name__}: {exc}"
            flags = []
            if exercise_id in calls:
                flags.append(f"called solution({exercise_id!r})")
            if exercise_id in executed:
                flags.append("ran the reference solution's text through exec/compile")
            tamper = []
            if "check" in ns and ns["check"] is not original_check:
                tamper.append("redefines check() (ignored: the grader checks with its own copy of the checkers)")
            if public.check is not original_check or public_core.evaluate is not original_evaluate:
                tamper.append("replaced course_utils.exercises.check or evaluate (ignored)")
            if sys.modules.get("course_utils.exercises") is not public:
                tamper.append("replaced the module course_utils.exercises in sys.modules (ignored)")
            mine, theirs = registry.get(exercise_id), public_core.REGISTRY.get(exercise_id)
            if theirs is not None and mine is not None and getattr(theirs.checker, "__code__", None) != mine.checker.__code__:
                tamper.append(f"replaced the checker of {exercise_id} in course_utils.exercises (ignored)")
            out.write(token + " " + dumps({"token": token, "id": exercise_id, "status": status, "message": message,
                                           "flags": flags, "tamper": tamper}) + "\n")
            out.flush()

    pkg.__grader__ = Grader()
    out.write(token + " " + dumps({"token": token, "ready": True}) + "\n")
    out.flush()

__course_grader_setup(**__import__("json").loads(%(args)r))
del __course_grader_setup
'''

EVAL = '__import__("sys").modules[%(private)r].__grader__.evaluate(%(id)r, %(answer)r, %(token)r)\n'
