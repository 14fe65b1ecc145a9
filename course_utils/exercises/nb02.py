"""Exercises of notebook 02, "Inside nn.Module".

02.1 a forward hook that records activation shapes (and is removed), 02.2 a submodule missing from
`parameters()`, 02.3 buffers that move with the module, 02.4 deterministic inference (eval mode, no
graph, mode restored, even when forward raises), 02.5 a debugging hook that finds the first layer whose
output is NaN, inf or too large.

Checkers build their test models under `torch.random.fork_rng(devices=[])` with a fixed seed, so a check
is reproducible and leaves the notebook's random state (and CUDA) untouched.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from ..i18n import N_, _
from .core import Exercise, Incorrect, Mistake, call, describe, register, require_function, seeded
from .probe import hold, observe

# Every use of the learner's code, and every read of an object after the learner's code had it, goes through
# observe() (plain data back) or hold() (the object, for later observe() calls only): the class grader judges from
# the record of these, in a process where no learner code runs.


def _require_module_class(answer, name: str) -> None:
    if not (isinstance(answer, type) and issubclass(answer, nn.Module)):
        raise Incorrect(_("{name} should be a class that subclasses nn.Module, got {value}").format(
            name=name, value=describe(answer)))


def _require_function(answer, name: str) -> None:
    require_function(answer, name)


def _leaves(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if next(m.children(), None) is None]


# --- 02.1 a hook that records activation shapes ------------------------------------------------

class _TwiceAct(nn.Module):
    """Calls the same ReLU twice: the shapes list follows call order, not definition order."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(6, 5)

    def forward(self, x):
        return self.act(self.fc2(self.act(self.fc1(x))))


def _hooks_left(model: nn.Module) -> list[str]:
    return [name or _("(the model)") for name, m in model.named_modules()
            if m._forward_hooks or m._forward_pre_hooks]


def _normalise_shapes(result, label: str) -> list[tuple[str, tuple]]:
    if not isinstance(result, list):
        raise Incorrect(_("{label} should return a list of (name, shape) pairs, got {value}").format(
            label=label, value=describe(result)))
    pairs = []
    for item in result:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], tuple)):
            raise Incorrect(_("each item should be a (name, shape) pair such as ('0', (2, 8)), got {value}").format(
                value=describe(item)))
        pairs.append((item[0], tuple(item[1])))
    return pairs


def _check_record_shapes(record_shapes):
    observe(lambda: _require_function(record_shapes, "record_shapes"))
    with seeded():
        cases = [
            (nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 3), nn.Tanh())),
             [("0", (2, 8)), ("1", (2, 8)), ("2.0", (2, 3)), ("2.1", (2, 3))],
             [("0", (2, 4)), ("1", (2, 8)), ("2.0", (2, 8)), ("2.1", (2, 3))]),
            (_TwiceAct(),
             [("fc1", (2, 6)), ("act", (2, 6)), ("fc2", (2, 5)), ("act", (2, 5))],
             [("fc1", (2, 4)), ("act", (2, 6)), ("fc2", (2, 6)), ("act", (2, 5))]),
        ]
        x = torch.randn(2, 4)
    for model, expected, inputs in cases:
        # the model's structure as the checker built it, read before the learner's code has the model
        leaves, kind = _leaves(model), type(model).__name__
        children = {n: next(m.children(), None) is not None for n, m in model.named_children()}  # name: nested?
        got = observe(lambda: _normalise_shapes(
            call(record_shapes, model, x, name="record_shapes", check_mutation=False), "record_shapes"))
        left = observe(lambda: _hooks_left(model))
        if left:
            raise Incorrect(_("after record_shapes returned, hooks are still registered on {left}: likely mistake: "
                              "the hooks were not removed (keep each handle and call handle.remove()), so every "
                              "later call of the model would record again").format(left=left))
        if got == expected:
            continue
        if ([shape for _n, shape in got] == [shape for _n, shape in expected]
                and len(expected) > 1 and all(n == leaves[-1] for n, _ in got)):
            raise Incorrect(_("got {got}: likely mistake: every entry has the name {name!r}, the last leaf's: the hook "
                              "looks `name` up when it runs, after the loop has ended; bind it when the hook is made, "
                              "with a default argument (def hook(module, inputs, output, name=name))").format(
                                  got=got, name=leaves[-1]))
        if {n for n, _ in got} == set(children) and any(children.values()):
            raise Incorrect(_("got {got}: likely mistake: only the model's direct children were hooked "
                              "(named_children()); a child that has children of its own is a container, and its "
                              "leaves ({missed}) are missed. Walk every module with named_modules() and keep the "
                              "leaves").format(got=got, missed=", ".join(
                                  repr(e) for e, _ in expected if e not in children)))
        names = [n for n, _ in got]
        if (len(set(names)) == len(names) < len(expected)
                and set(names) == {e for e, _ in expected}):
            twice = sorted({e for e, _ in expected if [n for n, _ in expected].count(e) > 1})
            raise Incorrect(_("got {got}: {twice} runs twice but appears once: likely mistake: a dict keyed by name "
                              "keeps one entry per module, that of its last call; append (name, shape) to a list, one "
                              "entry per call").format(got=got, twice=", ".join(repr(n) for n in twice)))
        containers = [n for n, _ in got if n == "" or any(e.startswith(n + ".") for e, _ in expected)]
        if containers:
            raise Incorrect(_("got {got}: likely mistake: containers were hooked too; record only leaf modules "
                              "(modules with no children)").format(got=got))
        if got == inputs:
            raise Incorrect(_("got {got}: likely mistake: these are the input shapes; a forward hook receives "
                              "(module, inputs, output): record output.shape").format(got=got))
        raise Incorrect(_("for {model} and an input of shape (2, 4), expected {expected}, got {got}").format(
            model=kind, expected=expected, got=got))
    raising = _Raising()
    try:
        observe(lambda: call(record_shapes, raising, torch.ones(2, 4), name="record_shapes", check_mutation=False))
    except Incorrect:
        pass  # the error may come through; the hooks must not stay behind
    if observe(lambda: _hooks_left(raising)):
        raise Incorrect(_("when the model's forward raised, record_shapes left its hooks behind: likely mistake: the "
                          "hooks are removed after model(x), which an exception skips; remove them in a `finally` "
                          "block"))
    return _("one forward hook per leaf, removed afterwards; note 'act' appears twice: hooks follow calls")


_RECORD_SOLUTION = (
    "def record_shapes(model, x):\n"
    "    \"\"\"Run model(x) once; return [(name, tuple(output.shape)), ...] for each leaf module call.\"\"\"\n"
    "    shapes, handles = [], []\n"
    "    for name, module in model.named_modules():\n"
    "        if next(module.children(), None) is None:  # a leaf: no submodules\n"
    "            def hook(mod, inputs, output, name=name):\n"
    "                shapes.append((name, tuple(output.shape)))\n"
    "            handles.append(module.register_forward_hook(hook))\n"
    "    try:\n"
    "        model(x)\n"
    "    finally:\n"
    "        for handle in handles:\n"
    "            handle.remove()\n"
    "    return shapes\n")

register(Exercise(
    id="02.1", title=N_("A hook that records activation shapes"), answer="record_shapes",
    blank=("def record_shapes(model, x):\n"
           "    \"\"\"Run model(x) once; return [(name, tuple(output.shape)), ...] for each leaf module call.\"\"\"\n"
           "    raise NotImplementedError  # your code here\n"),
    solution=_RECORD_SOLUTION,
    setup="import torch\nfrom torch import nn\n",
    checker=_check_record_shapes,
    hints=[N_("model.named_modules() yields (name, module) for every module, the model itself first (name '')."),
           N_("A leaf has no children: next(module.children(), None) is None. A forward hook is called as "
              "hook(module, inputs, output); bind the name with a default argument (name=name)."),
           N_("register_forward_hook returns a handle: keep them all and call handle.remove() after model(x), "
              "in a finally block so that an error in forward does not leave hooks behind.")],
    mistakes=[
        Mistake("def record_shapes(model, x):\n    shapes = []\n    for name, module in model.named_modules():\n"
                "        if next(module.children(), None) is None:\n"
                "            module.register_forward_hook(lambda m, i, o, name=name: "
                "shapes.append((name, tuple(o.shape))))\n    model(x)\n    return shapes\n", "not removed"),
        Mistake("def record_shapes(model, x):\n    shapes, handles = [], []\n"
                "    for name, module in model.named_modules():\n"
                "        handles.append(module.register_forward_hook(lambda m, i, o, name=name: "
                "shapes.append((name, tuple(o.shape)))))\n    model(x)\n    for h in handles:\n"
                "        h.remove()\n    return shapes\n", "only leaf modules"),
        Mistake("def record_shapes(model, x):\n    shapes, handles = [], []\n"
                "    for name, module in model.named_modules():\n"
                "        if next(module.children(), None) is None:\n"
                "            handles.append(module.register_forward_hook(lambda m, i, o, name=name: "
                "shapes.append((name, tuple(i[0].shape)))))\n    model(x)\n    for h in handles:\n"
                "        h.remove()\n    return shapes\n", "input shapes"),
        Mistake(_RECORD_SOLUTION.replace("    try:\n        model(x)\n    finally:\n        for handle in handles:\n"
                                         "            handle.remove()\n",
                                         "    model(x)\n    for handle in handles:\n        handle.remove()\n"),
                "`finally` block"),
        Mistake(_RECORD_SOLUTION.replace("def hook(mod, inputs, output, name=name):", "def hook(mod, inputs, output):"),
                "the last leaf's"),
        Mistake(_RECORD_SOLUTION.replace("    shapes, handles = [], []\n", "    shapes, handles = {}, []\n").replace(
            "shapes.append((name, tuple(output.shape)))", "shapes[name] = tuple(output.shape)").replace(
            "    return shapes\n", "    return list(shapes.items())\n"), "a dict keyed by name"),
        Mistake(_RECORD_SOLUTION.replace("    for name, module in model.named_modules():\n"
                                         "        if next(module.children(), None) is None:  # a leaf: no submodules\n",
                                         "    for name, module in model.named_children():\n        if True:\n"),
                "direct children"),
    ],
))


# --- 02.2 a submodule missing from parameters() -----------------------------------------------

def _check_mlp(MLP):
    observe(lambda: _require_module_class(MLP, "MLP"))
    try:
        with seeded():
            model = hold(lambda: call(MLP, [4, 8, 3], name="MLP", check_mutation=False))
    except Incorrect as exc:
        if "before Module.__init__() call" in str(exc):
            raise Incorrect(_("{error}: likely mistake: super().__init__() is missing or comes too late; it must "
                              "run before any submodule is assigned").format(error=exc)) from None
        raise
    if not observe(lambda: isinstance(model, nn.Module)):
        raise Incorrect(_("MLP([4, 8, 3]) should be an nn.Module, got {value}").format(
            value=observe(lambda: describe(model))))

    def layers_facts():
        layers = getattr(model, "layers", None)
        return {"missing": layers is None, "python": isinstance(layers, (list, tuple, dict)),
                "module": isinstance(layers, nn.Module), "type": type(layers).__name__}

    layers = observe(layers_facts)
    n_params = observe(lambda: sum(p.numel() for p in model.parameters()))
    expected = 4 * 8 + 8 + 8 * 3 + 3  # two Linear layers: weights and biases
    if layers["missing"]:
        raise Incorrect(_("MLP([4, 8, 3]) has no attribute `layers`: likely mistake: the layers were assigned to a "
                          "local variable; assign them to self.layers (forward reads self.layers)"))
    if layers["python"] and n_params != expected:
        raise Incorrect(_("self.layers is a plain Python {kind}, so model.parameters() holds "
                          "{n_params} elements instead of {expected}: likely mistake: nn.Module registers only "
                          "modules assigned directly as attributes; wrap the layers in nn.ModuleList").format(
                              kind=layers["type"], n_params=n_params, expected=expected))
    if not (layers["module"] or layers["python"]):
        raise Incorrect(_("self.layers should hold the Linear layers (an nn.ModuleList), got {value}").format(
            value=observe(lambda: describe(model.layers))))
    if n_params != expected:
        raise Incorrect(_("MLP([4, 8, 3]) has {n_params} parameter elements; Linear(4, 8) and Linear(8, 3) "
                          "have {expected}").format(n_params=n_params, expected=expected))
    out = observe(lambda: call(model, torch.ones(2, 4), name="MLP([4, 8, 3])", check_mutation=False))
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, 3):
        raise Incorrect(_("MLP([4, 8, 3]) applied to a (2, 4) batch should give shape (2, 3), got {value}").format(
            value=describe(out)))

    def doubled():
        model.double()
        return [n for n, p in model.named_parameters() if p.dtype != torch.float64]

    not_moved = observe(doubled)
    if not_moved:
        raise Incorrect(_(".double() did not convert {names}: every layer must be registered").format(names=not_moved))
    keys = observe(lambda: sorted(model.state_dict()))
    if len(keys) != 4:
        raise Incorrect(_("state_dict() should hold 4 tensors (2 weights, 2 biases), holds {keys}").format(keys=keys))
    # Other sizes: the layers follow `sizes`, in number and in width.
    with seeded():
        deeper = hold(lambda: call(MLP, [5, 7, 6, 2], name="MLP", check_mutation=False))
    linears = observe(lambda: [(m.in_features, m.out_features) for m in deeper.modules() if isinstance(m, nn.Linear)])
    if linears != [(5, 7), (7, 6), (6, 2)]:
        raise Incorrect(_("MLP([5, 7, 6, 2]) has the Linear layers (in, out) {got}, expected [(5, 7), (7, 6), (6, 2)]: "
                          "likely mistake: the layers are written out for MLP([4, 8, 3]) (their sizes or their "
                          "number); make one nn.Linear(a, b) per pair of neighbouring sizes, "
                          "zip(sizes, sizes[1:])").format(got=linears))
    out = observe(lambda: call(deeper, torch.ones(2, 5), name="MLP([5, 7, 6, 2])", check_mutation=False))
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, 2):
        raise Incorrect(_("MLP([5, 7, 6, 2]) applied to a (2, 5) batch should give shape (2, 2), got {value}").format(
            value=describe(out)))
    return _("parameters(), .double() and state_dict() now all see both layers ({keys})").format(keys=keys)


_MLP_FORWARD = ("\n    def forward(self, x):\n"
                "        for layer in self.layers[:-1]:\n"
                "            x = torch.relu(layer(x))\n"
                "        return self.layers[-1](x)\n")


def _mlp(init_body: str, with_super: bool = True) -> str:
    return ("class MLP(nn.Module):\n"
            "    \"\"\"Linear layers of the given sizes with ReLU between them, e.g. MLP([4, 8, 3]).\"\"\"\n\n"
            "    def __init__(self, sizes):\n"
            + ("        super().__init__()\n" if with_super else "")
            + init_body + _MLP_FORWARD)


register(Exercise(
    id="02.2", title=N_("A submodule missing from parameters()"), answer="MLP",
    blank=_mlp("        raise NotImplementedError  # your code here: set self.layers\n"),
    solution=_mlp("        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))\n"),
    setup="import torch\nfrom torch import nn\n",
    checker=_check_mlp,
    hints=[N_("Compare with BrokenMLP above: what type is self.layers there, and what does __setattr__ do with it?"),
           N_("nn.ModuleList(...) is a list that is itself a Module, so assigning it registers every layer in it.")],
    mistakes=[
        Mistake(_mlp("        self.layers = [nn.Linear(a, b) for a, b in zip(sizes, sizes[1:])]\n"),
                "nn.ModuleList"),
        Mistake(_mlp("        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))\n",
                     with_super=False), "super().__init__() is missing"),
        Mistake(_mlp("        layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))\n"),
                "local variable"),
        Mistake(_mlp("        self.layers = nn.ModuleList([nn.Linear(4, 8), nn.Linear(8, 3)])\n"),
                "written out for MLP([4, 8, 3])"),
        Mistake(_mlp("        self.layers = nn.ModuleList([nn.Linear(sizes[0], sizes[1]), "
                     "nn.Linear(sizes[1], sizes[2])])\n"), "written out for MLP([4, 8, 3])"),
        Mistake(_mlp("        self.layers = nn.ModuleList(nn.Linear(sizes[i], sizes[i + 1]) "
                     "for i in range(len(sizes) - 2))\n"), "parameter elements"),
    ],
))


# --- 02.3 buffers that move with the module ---------------------------------------------------

def _check_normalize(Normalize):
    observe(lambda: _require_module_class(Normalize, "Normalize"))
    mean, std = torch.tensor([0.5, 1.0, -2.0]), torch.tensor([2.0, 4.0, 0.5])
    x = torch.tensor([[1.0, 2.0, 3.0], [0.0, -1.0, 0.5]])
    expected = (x - mean) / std  # before the learner's code has mean, std and x
    model = hold(lambda: call(Normalize, mean, std, name="Normalize", check_mutation=False))
    if not observe(lambda: isinstance(model, nn.Module)):
        raise Incorrect(_("Normalize(mean, std) should be an nn.Module, got {value}").format(
            value=observe(lambda: describe(model))))
    out = observe(lambda: call(model, x, name="Normalize(mean, std)", check_mutation=False))

    def kept_converted():
        kept = {n: getattr(model, n, None) for n in ("mean", "std")}
        return {n: t.dtype for n, t in kept.items() if isinstance(t, torch.Tensor) and t.dtype != torch.float32}

    converted = observe(kept_converted)
    if converted:
        raise Incorrect(_("mean and std were given in torch.float32, and the module keeps {converted}: likely mistake: "
                          "they were converted when stored; store them as given, and .double() or .to() converts them "
                          "with the module when asked").format(
                              converted=", ".join(f"{n} in {d}" for n, d in converted.items())))
    if not isinstance(out, torch.Tensor) or out.shape != expected.shape or not torch.allclose(out, expected):
        raise Incorrect(_("Normalize(mean, std)(x) should equal (x - mean) / std, got {value}").format(
            value=describe(out)))
    params = observe(lambda: {n: p.requires_grad for n, p in model.named_parameters()})  # name: requires_grad
    buffers = observe(lambda: [n for n, _b in model.named_buffers()])
    as_params = sorted({"mean", "std"} & set(params))
    if as_params:
        if not any(params[n] for n in as_params):
            raise Incorrect(_("{names} are frozen nn.Parameters: likely mistake: requires_grad=False stops the "
                              "gradients, but they are still parameters (in parameters(), handed to the optimizer, "
                              "counted as weights); register them as buffers").format(names=as_params))
        raise Incorrect(_("{names} are nn.Parameters: likely mistake: that makes them trainable (the optimizer "
                          "would change them, and they show up in parameters()); register them as buffers").format(
                              names=as_params))
    plain = observe(lambda: [n for n in ("mean", "std") if isinstance(vars(model).get(n), torch.Tensor)])
    if plain:
        raise Incorrect(_("{names} are plain tensor attributes: likely mistake: .to(), .double() and state_dict() "
                          "ignore those; use self.register_buffer(name, tensor)").format(names=plain))
    if set(buffers) != {"mean", "std"}:
        raise Incorrect(_("the module's buffers are {names}; expected exactly 'mean' and 'std'").format(
            names=sorted(buffers)))
    keys = observe(lambda: sorted(model.state_dict()))
    if set(keys) != {"mean", "std"}:
        raise Incorrect(_("state_dict() holds {keys}; mean and std should be saved with the model "
                          "(register_buffer's default persistent=True)").format(keys=keys))

    def doubled():
        model.double()
        return model.mean.dtype, model.std.dtype

    mean_dtype, std_dtype = observe(doubled)
    if mean_dtype != torch.float64 or std_dtype != torch.float64:
        raise Incorrect(_("after .double(), mean is {mean} and std is {std}; both should be float64").format(
            mean=mean_dtype, std=std_dtype))

    def moved():
        model.to("meta")
        device = model.mean.device
        return device.type, str(device)

    device_type, device = observe(moved)
    if device_type != "meta":
        raise Incorrect(_("after .to('meta'), mean is on {device}: it should move with the module").format(
            device=device))
    return _("mean and std follow .to()/.double() and are saved in state_dict(), yet are not trained")


def _normalize(init_body: str) -> str:
    return ("class Normalize(nn.Module):\n"
            "    \"\"\"(x - mean) / std, with mean and std moved by .to() and saved by state_dict().\"\"\"\n\n"
            "    def __init__(self, mean, std):\n"
            "        super().__init__()\n"
            + init_body
            + "\n    def forward(self, x):\n"
              "        return (x - self.mean) / self.std\n")


register(Exercise(
    id="02.3", title=N_("Buffers that move with the module"), answer="Normalize",
    blank=_normalize("        raise NotImplementedError  # your code here\n"),
    solution=_normalize("        self.register_buffer(\"mean\", mean)\n        self.register_buffer(\"std\", std)\n"),
    setup="import torch\nfrom torch import nn\n",
    checker=_check_normalize,
    hints=[N_("A buffer is module state that is not trained: BatchNorm's running_mean is one."),
           N_("self.register_buffer(\"mean\", mean) registers it; self.mean then reads it back.")],
    mistakes=[
        Mistake(_normalize("        self.mean = mean\n        self.std = std\n"), "register_buffer"),
        Mistake(_normalize("        self.mean = nn.Parameter(mean)\n        self.std = nn.Parameter(std)\n"),
                "trainable"),
        Mistake(_normalize("        self.register_buffer(\"mean\", mean, persistent=False)\n"
                           "        self.register_buffer(\"std\", std, persistent=False)\n"), "persistent=True"),
        Mistake(_normalize("        self.mean = nn.Parameter(mean, requires_grad=False)\n"
                           "        self.std = nn.Parameter(std, requires_grad=False)\n"), "frozen nn.Parameters"),
        Mistake(_normalize("        self.register_buffer(\"mean\", mean)\n        self.std = nn.Parameter(std)\n"),
                "['std'] are nn.Parameters"),
        Mistake(_normalize("        self.register_buffer(\"mean\", mean.double())\n"
                           "        self.register_buffer(\"std\", std.double())\n"), "converted when stored"),
        Mistake(_normalize("        self.register_buffer(\"mean\", mean)\n"
                           "        self.register_buffer(\"std\", std, persistent=False)\n"), "persistent=True"),
    ],
))


# --- 02.4 deterministic inference ---------------------------------------------------------------

def _probe_model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3))


class _FailingForward(nn.Module):
    """A model whose forward raises, as a real one can (a shape mismatch, an out-of-memory error)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        raise RuntimeError(_("the checker's model failed in forward on purpose"))


def _submodules_restored(model: nn.Module, training: bool) -> None:
    """After predict, every submodule is back in the mode the whole model was in (Dropout and BatchNorm read their
    own `training` flag, not the model's)."""
    left = observe(lambda: [name for name, m in model.named_modules() if name and m.training != training])
    if left:
        raise Incorrect(_("after predict, model.training is {training} again, but the submodules {names} are left "
                          "with training={other}: likely mistake: assigning model.training sets the flag of the "
                          "model alone; model.train(was_training) sets it on every submodule, and Dropout and "
                          "BatchNorm read their own").format(training=training, names=left, other=not training))


def _check_predict(predict):
    observe(lambda: _require_function(predict, "predict"))
    with seeded():
        model = _probe_model()
        x = torch.randn(8, 6)
        model.train()
        bn = model[1]
        stats_before = (bn.running_mean.clone(), int(bn.num_batches_tracked))
        with torch.no_grad():  # the model's eval-mode output, on a copy the learner's code never has
            reference = copy.deepcopy(model).eval()(x)
        out = observe(lambda: call(predict, model, x, name="predict", check_mutation=False))
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (8, 3):
        raise Incorrect(_("predict(model, x) should return the model's output, a tensor of shape (8, 3); got "
                          "{value}").format(value=describe(out)))
    running_mean, tracked = observe(lambda: (bn.running_mean, int(bn.num_batches_tracked)))
    if tracked != stats_before[1] or not torch.equal(running_mean, stats_before[0]):
        raise Incorrect(_("BatchNorm updated its running statistics during predict: likely mistake: the model is "
                          "still in training mode (no_grad does not switch modes); call model.eval() first"))
    if out.requires_grad:
        raise Incorrect(_("the output requires grad, so predict built an autograd graph it never uses: likely "
                          "mistake: run the model inside `with torch.inference_mode():` (or torch.no_grad())"))
    if not observe(lambda: bool(model.training)):
        raise Incorrect(_("after predict the model is left in eval mode although it was in training mode: likely "
                          "mistake: remember model.training first and restore it (model.train(was_training))"))
    _submodules_restored(model, True)
    if not torch.allclose(out, reference):
        raise Incorrect(_("predict's output differs from the model's eval-mode output"))

    def predict_in_eval_mode():
        model.eval()
        return call(predict, model, x, name="predict", check_mutation=False)

    again = observe(predict_in_eval_mode)
    if observe(lambda: bool(model.training)):
        raise Incorrect(_("predict was given a model in eval mode and left it in training mode: likely mistake: "
                          "restore the mode the model had (model.train(was_training)), not always train()"))
    _submodules_restored(model, False)
    if not isinstance(again, torch.Tensor) or not torch.equal(again, out):
        raise Incorrect(_("two calls of predict on the same input gave different outputs"))
    failing = _FailingForward().train()
    try:
        observe(lambda: call(predict, failing, x, name="predict", check_mutation=False))
        raised = False
    except Incorrect:
        raised = True  # the error came through, as it should
    if not raised:
        raise Incorrect(_("given a model whose forward raises, predict returned normally: it hid the error; let it "
                          "propagate (restore the mode in a `finally` block, without an `except` that swallows it)"))
    if not observe(lambda: bool(failing.training)):
        raise Incorrect(_("when forward raised, predict left the model in eval mode although it was in training "
                          "mode: likely mistake: the mode is restored after model(x), which an exception skips; "
                          "restore it in a `finally` block"))
    return _("eval() switched Dropout and BatchNorm, inference_mode() skipped the graph, and the mode was restored")


_PREDICT_DOC = ("def predict(model, x):\n"
                "    \"\"\"Deterministic inference: eval mode, no autograd graph, the model's mode restored.\"\"\"\n")

register(Exercise(
    id="02.4", title=N_("Deterministic inference"), answer="predict",
    blank=_PREDICT_DOC + "    raise NotImplementedError  # your code here\n",
    solution=_PREDICT_DOC + ("    was_training = model.training\n"
                             "    model.eval()\n"
                             "    try:\n"
                             "        with torch.inference_mode():\n"
                             "            return model(x)\n"
                             "    finally:\n"
                             "        model.train(was_training)\n"),
    setup="import torch\nfrom torch import nn\n",
    checker=_check_predict,
    hints=[N_("Two independent switches: model.eval() (Dropout, BatchNorm behave for inference) and "
              "torch.inference_mode() (no autograd graph). One does not imply the other."),
           N_("Save model.training before switching, and restore it with model.train(was_training) in a finally "
              "block.")],
    mistakes=[
        Mistake(_PREDICT_DOC + "    with torch.no_grad():\n        return model(x)\n", "still in training mode"),
        Mistake(_PREDICT_DOC + ("    was_training = model.training\n    model.eval()\n    out = model(x)\n"
                                "    model.train(was_training)\n    return out\n"), "inference_mode"),
        Mistake(_PREDICT_DOC + "    model.eval()\n    with torch.inference_mode():\n        return model(x)\n",
                "restore it"),
        Mistake(_PREDICT_DOC + ("    model.eval()\n    with torch.inference_mode():\n        out = model(x)\n"
                                "    model.train()\n    return out\n"), "not always train()"),
        Mistake(_PREDICT_DOC + ("    was_training = model.training\n    model.eval()\n"
                                "    with torch.inference_mode():\n        out = model(x)\n"
                                "    model.train(was_training)\n    return out\n"), "`finally` block"),
        Mistake(_PREDICT_DOC + ("    was_training = model.training\n    model.eval()\n    try:\n"
                                "        with torch.inference_mode():\n            return model(x)\n"
                                "    except Exception as error:\n        print(\"predict failed:\", error)\n"
                                "    finally:\n        model.train(was_training)\n"), "hid the error"),
        Mistake(_PREDICT_DOC + ("    was_training = model.training\n    model.eval()\n    try:\n"
                                "        with torch.inference_mode():\n            return model(x)\n"
                                "    finally:\n        model.training = was_training\n"),
                "sets the flag of the model alone"),
        Mistake(_PREDICT_DOC + ("    model.eval()\n    was_training = model.training\n    try:\n"
                                "        with torch.inference_mode():\n            return model(x)\n"
                                "    finally:\n        model.train(was_training)\n"), "remember model.training first"),
        Mistake(_PREDICT_DOC + ("    was_training = model.training\n    model.eval()\n    out = None\n    try:\n"
                                "        with torch.inference_mode():\n            out = model(x)\n"
                                "    finally:\n        model.train(was_training)\n        return out\n"),
                "hid the error"),
    ],
))


# --- 02.5 a debugging hook: the first layer that goes wrong ----------------------------------------

class _Log(nn.Module):
    """log(x): NaN for negative inputs, as a hand-written loss or normalisation can produce."""

    def forward(self, x):
        return torch.log(x)


class _Shuffled(nn.Module):
    """Defined in one order, called in another: `late` is registered first but runs after `early` and `bad`."""

    def __init__(self):
        super().__init__()
        self.late = nn.Linear(6, 4)
        self.early = nn.Linear(4, 6)
        self.bad = _Log()
        self.act = nn.Tanh()
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        x = self.bad(self.early(x) - 10)  # log of negative numbers: NaN
        return self.head(self.late(self.act(x)))


class _Raising(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        self.fc(x)
        raise RuntimeError(_("the checker's model failed in forward on purpose"))


def _cases() -> list[tuple[str, nn.Module, torch.Tensor, str | None]]:
    """(what it tests, model, input, the expected answer)."""
    with seeded(2):
        x = torch.randn(8, 4)
        exploding = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
        with torch.no_grad():
            exploding[2].weight.mul_(1e5)  # "2" explodes; ReLU "3" and Linear "4" inherit huge values
        negative = nn.Sequential(nn.Linear(4, 16), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
        with torch.no_grad():
            negative[1].weight.mul_(1e5)
            negative[1].bias.fill_(-1e6)  # "1" outputs huge *negative* values; ReLU "2" zeroes them
        overflow = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Softplus(), nn.Linear(8, 3))
        with torch.no_grad():
            overflow[1].weight.mul_(1e38)  # float32 overflow: inf in "1"
        healthy = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        twice = _TwiceAct()
        with torch.no_grad():
            twice.fc2.weight.mul_(1e6)  # "act" is fine on its first call, explodes on its second
        return [
            (N_("a layer whose weights blew up"), exploding, x, "2"),
            (N_("huge negative values"), negative, x, "1"),
            (N_("a NaN, with modules called in another order than they are defined"), _Shuffled(), x, "bad"),
            (N_("an overflow to inf"), overflow, x, "1"),
            (N_("a healthy model"), healthy, x, None),
            (N_("a module called twice"), twice, x[:, :4], "fc2"),
        ]


def _check_at_limit(first_bad_layer) -> None:
    """`limit` given (100): layer "0" reaches exactly 100 in absolute value (not larger: fine), ReLU "1" too, and
    layer "2" outputs 300."""
    with seeded(3):
        model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model[0].bias.copy_(torch.tensor([100.0, -100.0, 50.0]))
        model[2].bias.fill_(300.0)
    got = observe(lambda: call(first_bad_layer, model, torch.ones(2, 4), 100.0, name="first_bad_layer",
                               check_mutation=False))
    left = observe(lambda: _hooks_left(model))
    if left:
        raise Incorrect(_("after first_bad_layer returned, hooks are still registered on {left}: likely "
                          "mistake: the hooks were not removed (keep each handle and call handle.remove() in a "
                          "finally block)").format(left=left))
    if got == "2":
        return
    shown = _("first_bad_layer(model, x, limit=100) returned {got!r}, expected '2' (its outputs are 300; layer '0' "
              "reaches exactly 100 in absolute value, and so does ReLU '1')").format(got=got)
    if got is None:
        raise Incorrect(_("{shown}: likely mistake: the limit is written in the code (1e4) instead of read from the "
                          "`limit` argument").format(shown=shown))
    if got in ("0", "1"):
        raise Incorrect(_("{shown}: likely mistake: a value equal to the limit was taken for a bad one (>= instead of "
                          ">, or < instead of <=); only a value larger than the limit is bad").format(shown=shown))
    raise Incorrect(shown)


def _check_first_bad_layer(first_bad_layer):
    observe(lambda: _require_function(first_bad_layer, "first_bad_layer"))
    previous = None
    for what, model, x, expected in _cases():
        names = _leaves(model)  # as the checker built it, read before the learner's code has the model
        got = observe(lambda: call(first_bad_layer, model, x, name="first_bad_layer", check_mutation=False))
        before, previous = previous, got
        left = observe(lambda: _hooks_left(model))
        if left:
            raise Incorrect(_("after first_bad_layer returned, hooks are still registered on {left}: likely "
                              "mistake: the hooks were not removed (keep each handle and call handle.remove() in a "
                              "finally block)").format(left=left))
        if got == expected:
            continue
        if got is not None and not isinstance(got, str):
            raise Incorrect(_("first_bad_layer should return a module name (a str) or None, got {value}").format(
                value=describe(got)))
        shown = _("for {what}, first_bad_layer returned {got!r}, expected {expected!r}").format(
            what=_(what), got=got, expected=expected)
        if got is not None and got == before:
            raise Incorrect(_("{shown}, its answer for the previous model: likely mistake: the list that records the "
                              "bad layers outlives the call (a global, or a default argument such as found=[]), so "
                              "the first call's finding is still in it; create it inside first_bad_layer, at each "
                              "call").format(shown=shown))
        if got == "" and expected is not None:
            raise Incorrect(_("{shown}: likely mistake: the model itself (name '') was hooked; hook only leaf "
                              "modules").format(shown=shown))
        if expected is None:
            raise Incorrect(_("{shown}: every output of this model is finite and below the limit; return "
                              "None").format(shown=shown))
        if got is None:
            if what == "huge negative values":
                raise Incorrect(_("{shown}: likely mistake: only large positive values were looked for; the "
                                  "limit applies to the absolute value (output.abs().max())").format(shown=shown))
            if what.startswith("a NaN") or what.startswith("an overflow"):
                raise Incorrect(_("{shown}: likely mistake: NaN and inf were not looked for (a NaN is not greater "
                                  "than the limit: every comparison with NaN is False); use "
                                  "torch.isfinite").format(shown=shown))
            raise Incorrect(_("{shown}: no layer was reported, yet this layer's output exceeds the "
                              "limit").format(shown=shown))
        later = names.index(got) > names.index(expected) if got in names and expected in names else False
        if what.startswith("a NaN") and got == "late":
            raise Incorrect(_("{shown}: likely mistake: the layers were examined in the order they are defined "
                              "(named_modules()), not the order they run; record the first bad output as the hooks "
                              "fire").format(shown=shown))
        if got in names and (later or what == "a module called twice"):
            raise Incorrect(_("{shown}, a later layer: likely mistake: every bad layer overwrote the answer, so the "
                              "last one wins; once NaN or a huge value appears, every later layer inherits it. Keep "
                              "only the first").format(shown=shown))
        raise Incorrect(shown)
    _check_at_limit(first_bad_layer)
    raising = _Raising()
    try:
        observe(lambda: call(first_bad_layer, raising, torch.ones(2, 4), name="first_bad_layer",
                             check_mutation=False))
    except Incorrect:
        pass  # the error may come through; the hooks must not stay behind
    if observe(lambda: _hooks_left(raising)):
        raise Incorrect(_("when the model's forward raised, first_bad_layer left its hooks behind: likely mistake: "
                          "the hooks are removed after model(x), which an exception skips; remove them in a "
                          "`finally` block"))
    return _("forward hooks report the first leaf whose output is NaN, inf or too large, in the order they run")


_BAD_DOC = ("def first_bad_layer(model, x, limit=1e4):\n"
            "    \"\"\"Run model(x) once; return the name of the first leaf module, in the order they run, whose\n"
            "    output holds a NaN, an inf or a value larger than `limit` in absolute value (None if none).\"\"\"\n")
_BAD_SOLUTION = _BAD_DOC + (
    "    found, handles = [], []\n"
    "    for name, module in model.named_modules():\n"
    "        if next(module.children(), None) is None:  # a leaf\n"
    "            def hook(mod, inputs, output, name=name):\n"
    "                if not found and not (torch.isfinite(output).all() and output.abs().max() <= limit):\n"
    "                    found.append(name)\n"
    "            handles.append(module.register_forward_hook(hook))\n"
    "    try:\n"
    "        with torch.no_grad():\n"
    "            model(x)\n"
    "    finally:\n"
    "        for handle in handles:\n"
    "            handle.remove()\n"
    "    return found[0] if found else None\n")


def _bad_variant(condition: str = "not (torch.isfinite(output).all() and output.abs().max() <= limit)",
                 first: bool = True, remove: str = "finally") -> str:
    record = (f"                if not found and {condition}:\n                    found.append(name)\n" if first
              else f"                if {condition}:\n                    found.append(name)\n")
    body = (_BAD_DOC + "    found, handles = [], []\n"
            "    for name, module in model.named_modules():\n"
            "        if next(module.children(), None) is None:\n"
            "            def hook(mod, inputs, output, name=name):\n" + record
            + "            handles.append(module.register_forward_hook(hook))\n")
    if remove == "finally":
        body += ("    try:\n        model(x)\n    finally:\n        for handle in handles:\n"
                 "            handle.remove()\n")
    elif remove == "after":
        body += "    model(x)\n    for handle in handles:\n        handle.remove()\n"
    else:
        body += "    model(x)\n"
    return body + ("    return found[0] if found else None\n" if first else "    return found[-1] if found else None\n")


register(Exercise(
    id="02.5", title=N_("A debugging hook: the first layer that goes wrong"), answer="first_bad_layer",
    blank=_BAD_DOC + "    raise NotImplementedError  # your code here\n",
    solution=_BAD_SOLUTION,
    setup="import torch\nfrom torch import nn\n",
    checker=_check_first_bad_layer,
    hints=[N_("The same pattern as exercise 02.1: one forward hook per leaf module, removed in a finally block."),
           N_("A hook fires when its module's forward returns, so the hooks fire in the order the layers run. Keep "
              "only the first bad name: every later layer inherits a NaN or a huge value."),
           N_("A NaN compares False with everything, so `output.abs().max() > limit` misses it: test "
              "`torch.isfinite(output).all()` too.")],
    mistakes=[
        Mistake(_bad_variant(first=False), "the last one wins"),
        Mistake(_bad_variant("bool(output.abs().max() > limit)"), "NaN and inf were not looked for"),
        Mistake(_bad_variant("not (torch.isfinite(output).all() and output.max() <= limit)"),
                "absolute value"),
        Mistake(_bad_variant(remove="never"), "hooks were not removed"),
        Mistake(_bad_variant(remove="after"), "`finally` block"),
        Mistake(_BAD_DOC + (
            "    bad = {}\n    handles = []\n"
            "    for name, module in model.named_modules():\n"
            "        if next(module.children(), None) is None:\n"
            "            def hook(mod, inputs, output, name=name):\n"
            "                bad[name] = not (torch.isfinite(output).all() and output.abs().max() <= limit)\n"
            "            handles.append(module.register_forward_hook(hook))\n"
            "    try:\n        model(x)\n    finally:\n        for handle in handles:\n            handle.remove()\n"
            "    for name, _ in model.named_modules():\n"
            "        if bad.get(name):\n            return name\n    return None\n"), "the order they are defined"),
        Mistake(_bad_variant("not (torch.isfinite(output).all() and output.abs().max() <= 1e4)"),
                "written in the code (1e4)"),
        Mistake(_bad_variant("not (torch.isfinite(output).all() and output.abs().max() < limit)"),
                "a value equal to the limit"),
        Mistake("found = []\n\n\n" + _BAD_SOLUTION.replace("    found, handles = [], []\n", "    handles = []\n"),
                "outlives the call"),
    ],
))
