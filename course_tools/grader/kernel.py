"""The grader's own code in the learner's kernel (never the learner's code).

SETUP, the first cell (run before any of the learner's code), loads the course's checkers afresh under a private
module name, records calls of `solution()`, installs the audit hook (it refuses writes outside the working directory
and signals to the grader, and notes the reference solutions' text run through exec/compile), takes note of the
kernel's IPython hooks as they are, and registers a comm target. After each exercise cell the grader opens a comm
to that target instead of running a cell: IPython runs no event hook and no input transformer for a comm message.
The handler first resets the IPython hooks and input transformers to what SETUP saw (what it removes is reported
as tampering), then runs the checker in recording mode (`course_utils.exercises.record`: what the learner's code
produced, as plain data) and prints that record, flags and signs of tampering as one line framed by a token made for
that call. The verdict is not decided here: the grader judges the record in its own process (run.py), where no
learner code runs, so nothing in this kernel can forge it. SETUP is a %-template: `SETUP % {"args": json.dumps({...})}`; a check's comm data is
`{"id": ..., "answer": ..., "token": ..., "seed": ...}` (the seed of the cases drawn afresh for this check, which the
grader's judgement draws again).
"""

SETUP = r'''
def __course_grader_setup(private, target, exercises_dir, course_dir, workdir, solutions, token, grader_pid):
    import functools, importlib.util, json, os, sys, tempfile
    shell = get_ipython()
    spec = importlib.util.spec_from_file_location(private, os.path.join(exercises_dir, "__init__.py"),
                                                  submodule_search_locations=[exercises_dir])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules[private] = pkg
    spec.loader.exec_module(pkg)
    registry = pkg.load_all()
    record = pkg.record
    import course_utils.exercises as public
    import course_utils.exercises.core as public_core
    public.load_all()  # the notebook's own check() then costs the learner's time budget no imports
    import base64
    b64 = base64.b64encode
    out, dumps, realpath, isabs, join, readlink, getcwd = (sys.stdout, json.dumps, os.path.realpath,
                                                            os.path.isabs, os.path.join, os.readlink, os.getcwd)
    calls, executed = set(), set()
    original_solution, original_check, original_evaluate = public_core.solution, public.check, public_core.evaluate

    @functools.wraps(original_solution)
    def solution(exercise_id):
        calls.add(str(exercise_id))
        return original_solution(exercise_id)

    del solution.__wrapped__  # functools.wraps' way to the unwrapped solution(), which would bypass the record
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

    # IPython's hooks as they are before the learner's first cell; extensions an honest notebook loads (inline
    # figures, autoreload) are kept, anything else added later is removed before each check and reported.
    events = shell.events
    callbacks = {name: list(cbs) for name, cbs in events.callbacks.items()}
    transformer_lists = {name: (getattr(shell, name), list(getattr(shell, name)))
                         for name in ("input_transformers_cleanup", "input_transformers_post", "ast_transformers")}
    # The hooks they register, compared by identity (a function's __module__ is the learner's to set): looked up
    # when a check runs, in the modules as imported (a module not imported yet registered nothing).
    benign = {"matplotlib.pyplot": "_draw_all_if_interactive", "matplotlib_inline.backend_inline": "flush_figures"}

    def is_benign(hook):
        real = [getattr(sys.modules.get(module), name, None) for module, name in benign.items()]
        autoreload = getattr(sys.modules.get("IPython.extensions.autoreload"), "AutoreloadMagics", None)
        if isinstance(autoreload, type) and isinstance(getattr(hook, "__self__", None), autoreload):
            real += [autoreload.__dict__.get("pre_run_cell"), autoreload.__dict__.get("post_execute_hook")]
        func = getattr(hook, "__func__", hook)  # a bound method: its function
        return any(func is r for r in real if r is not None)

    # The thread follower every notebook's first cell starts (`course_utils.threads.follow_load`), as the course
    # ships it, taken before the learner's first cell: its class, its methods and their code.
    import course_utils.threads as threads
    from course_utils.monitor.host import HostSource
    import torch
    follower_cls, follower_methods = threads.LoadFollower, dict(vars(threads.LoadFollower))
    follower_code = {k: getattr(v, "__code__", None) for k, v in follower_methods.items()}
    follower_fields = set(vars(follower_cls()))  # the attributes a follower has (one made here, not registered)

    def is_course_follower(hook, event):
        """The course's follower, unaltered, in pre_run_cell: removed like any hook (it would run before the
        checks), but not reported. Anything else dressed as it (another class, a method or its code replaced, an
        attribute of its own added) is reported."""
        owner = getattr(hook, "__self__", None)
        return (event == "pre_run_cell" and type(owner) is follower_cls
                and getattr(hook, "__func__", None) is follower_methods["before_cell"]
                and dict(vars(follower_cls)) == follower_methods
                and all(getattr(v, "__code__", None) is follower_code[k] for k, v in follower_methods.items())
                and set(vars(owner)) <= follower_fields and owner._torch is torch
                and type(owner._source) is HostSource)

    def reset_hooks():
        found = []
        if shell.events is not events:
            shell.events = events
            found.append("IPython's event manager")
        if type(events.callbacks) is not dict:  # a dict that hides entries from iteration: SETUP's hooks again
            events.callbacks = {name: list(cbs) for name, cbs in callbacks.items()}
            found.append("IPython's event manager")
        for name, cbs in list(dict.items(events.callbacks)):
            if type(cbs) is not list:  # a list that lies to iteration or assignment
                cbs = events.callbacks[name] = list.copy(cbs) if isinstance(cbs, list) else []
                found.append("IPython's event manager")
            added = [cb for cb in cbs if not any(cb is c for c in callbacks.get(name, []))]
            kept = [cb for cb in added if is_benign(cb)]
            removed = [cb for cb in added if not is_benign(cb) and not is_course_follower(cb, name)]
            if removed or len(cbs) - len(added) != len(callbacks.get(name, [])):
                found.append(name)
            cbs[:] = callbacks.get(name, []) + kept
        for name, (original, contents) in transformer_lists.items():
            current = getattr(shell, name)
            if current is not original or [id(t) for t in current] != [id(t) for t in contents]:
                found.append(name)
                try:
                    setattr(shell, name, original)
                except Exception:
                    pass
                original[:] = contents
        return found

    # The private copy of the checkers, as loaded: a check that finds it changed gives no result.
    private_core = sys.modules[private + ".core"]
    pristine = {k: (ex, ex.checker, getattr(ex.checker, "__code__", None)) for k, ex in registry.items()}
    record_code = record.__code__

    def private_copy_changed(exercise_id):
        ex, checker, code = pristine.get(exercise_id, (None, None, None))
        return (sys.modules.get(private) is not pkg or sys.modules.get(private + ".core") is not private_core
                or record.__code__ is not record_code or private_core.REGISTRY.get(exercise_id) is not ex
                or ex.checker is not checker or getattr(checker, "__code__", None) is not code)

    seen_hooks = []

    class Grader:
        def evaluate(self, exercise_id, answer_name, token, seed):
            for hook in reset_hooks():
                if hook not in seen_hooks:
                    seen_hooks.append(hook)
            ns = shell.user_ns
            tamper = []
            if seen_hooks:
                tamper.append("installed IPython hooks (" + ", ".join(seen_hooks) + "): removed before each of the "
                              "grader's checks, which never run them; their time in the notebook's own cells counts "
                              "against the time limit: no effect on the results")
            try:
                if private_copy_changed(exercise_id):
                    status, message = "interfered", ("the notebook's code changed the grader's private copy of the "
                                                     "checkers, so this answer could not be checked")
                elif answer_name in ns:
                    status, message = "recorded", b64(record(exercise_id, ns[answer_name], seed=seed)).decode("ascii")
                else:
                    status, message = "not attempted", (f"`{answer_name}` is not defined: the exercise's cell did "
                                                        "not define it")
            except BaseException as exc:
                status, message = "incorrect", f"checking the answer raised {type(exc).__name__}: {exc}"[:2000]
            flags = []
            if exercise_id in calls:
                flags.append(f"called solution({exercise_id!r})")
            if exercise_id in executed:
                flags.append("ran the reference solution's text through exec/compile")
            if "check" in ns and ns["check"] is not original_check:
                tamper.append("redefines check(): the grader does not use the notebook's check(): no effect on the "
                              "results")
            if public.check is not original_check or public_core.evaluate is not original_evaluate:
                tamper.append("replaced course_utils.exercises.check or evaluate: the grader does not use them: no "
                              "effect on the results")
            if sys.modules.get("course_utils.exercises") is not public:
                tamper.append("replaced the module course_utils.exercises in sys.modules: the grader does not use "
                              "it: no effect on the results")
            mine, theirs = registry.get(exercise_id), public_core.REGISTRY.get(exercise_id)
            if theirs is not None and mine is not None and getattr(theirs.checker, "__code__", None) != mine.checker.__code__:
                tamper.append(f"replaced the checker of {exercise_id} in course_utils.exercises: the grader does not "
                              "use it: no effect on the results")
            out.write(token + " " + dumps({"token": token, "id": exercise_id, "status": status, "message": message,
                                           "flags": flags, "tamper": tamper}) + "\n")
            out.flush()

    pkg.__grader__ = grader = Grader()

    def on_check(comm, msg):  # a comm message: no IPython hook or input transformer runs for it
        data = msg["content"]["data"]
        grader.evaluate(data["id"], data["answer"], data["token"], data["seed"])

    shell.kernel.comm_manager.register_target(target, on_check)
    out.write(token + " " + dumps({"token": token, "ready": True}) + "\n")
    out.flush()

__course_grader_setup(**__import__("json").loads(%(args)r))
del __course_grader_setup
'''
