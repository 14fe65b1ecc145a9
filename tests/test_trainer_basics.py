"""The Trainer as a callable: history, device handling, callbacks, and PyTorch's own loop as the oracle."""
import copy

import pytest
import torch
from torch import nn

from course_utils.data import TensorLoader
from course_utils.models import CifarCNN, SimpleCNN, count_parameters
from course_utils.trainer import Callback, Trainer


def tiny_data(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


def test_models_shapes_and_sizes():
    assert SimpleCNN()(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    assert CifarCNN()(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    # the count's two promises: a shared layer counts once, frozen parameters only when asked
    layer = nn.Linear(4, 3)  # 4 x 3 weights + 3 biases
    tied = nn.Sequential(layer, nn.ReLU(), nn.Linear(3, 4), nn.ReLU(), layer)
    assert count_parameters(tied) == 15 + (3 * 4 + 4)
    layer.bias.requires_grad_(False)
    assert count_parameters(tied, trainable_only=True) == 12 + 16 and count_parameters(tied) == 31
    assert len(list(SimpleCNN().children())) == 2  # features + classifier


def test_trainer_matches_a_hand_written_loop_exactly():
    x, y = tiny_data()
    torch.manual_seed(0)
    model_a = SimpleCNN()
    model_b = copy.deepcopy(model_a)
    opt_a = torch.optim.SGD(model_a.parameters(), lr=0.05, momentum=0.9)
    opt_b = torch.optim.SGD(model_b.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    history = Trainer(model_a, opt_a, loss_fn, TensorLoader(x, y, 16, shuffle=False), device="cpu")(2)

    expected = []
    for _ in range(2):
        losses = []
        for i in range(0, 64, 16):
            opt_b.zero_grad()
            loss = loss_fn(model_b(x[i:i + 16]), y[i:i + 16])
            loss.backward()
            opt_b.step()
            losses.append(loss.item())
        expected.append(sum(losses) / len(losses))
    assert history == pytest.approx(expected, abs=1e-6)
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_an_epochs_loss_is_the_exactly_rounded_mean_of_its_batch_losses(reduction):
    """The epoch's figure is the sum over its samples of their loss, added exactly and rounded once, over the
    samples: checked bit for bit against exact rational arithmetic (fractions) on the hand loop's batch losses, with
    an uneven last batch (sizes 7, 7, 7, 3) and both loss reductions."""
    from fractions import Fraction

    torch.manual_seed(1)
    x, y = torch.randn(24, 5) * 3, torch.randint(0, 4, (24,))
    model = nn.Linear(5, 4)
    hand = copy.deepcopy(model)
    loss_fn = nn.CrossEntropyLoss(reduction=reduction)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.3), loss_fn,
                      TensorLoader(x, y, 7, shuffle=False), device="cpu")
    history = trainer(3)
    opt = torch.optim.SGD(hand.parameters(), lr=0.3)
    expected = []
    for _ in range(3):
        exact = Fraction(0)
        for i in range(0, 24, 7):
            opt.zero_grad()
            loss = loss_fn(hand(x[i:i + 7]), y[i:i + 7])
            loss.backward()
            opt.step()
            n = len(y[i:i + 7])
            exact += Fraction(loss.item()) * (n if reduction == "mean" else 1)
        expected.append(float(exact) / 24)
    assert history == expected  # bit for bit, not approximately
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), hand.parameters()))


def test_history_accumulates_across_calls_and_returns_floats():
    x, y = tiny_data()
    model = SimpleCNN()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), 0.01), nn.CrossEntropyLoss(),
                      TensorLoader(x, y, 32), device="cpu")
    first = trainer(2)
    second = trainer(1)
    assert all(isinstance(v, float) for v in first + second)
    assert trainer.history == first + second and trainer.epoch == 3
    assert trainer(0) == []
    with pytest.raises(ValueError, match="epochs"):
        trainer(-1)


def test_callbacks_see_every_batch_with_device_tensors():
    x, y = tiny_data()
    events = []

    class Recorder(Callback):
        def on_train_start(self, trainer): events.append("start")
        def on_epoch_start(self, trainer): events.append(f"epoch{trainer.epoch}")
        def on_batch_end(self, trainer, loss):
            assert isinstance(loss, torch.Tensor) and loss.dim() == 0 and not loss.requires_grad
            events.append(trainer.batches_trained)
        def on_epoch_end(self, trainer, logs): events.append(("end", trainer.epoch, round(logs["loss"], 6)))
        def on_train_end(self, trainer): events.append("stop")

    model = SimpleCNN()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), 0.01), nn.CrossEntropyLoss(),
                      TensorLoader(x, y, 32), device="cpu", callbacks=[Recorder()])
    history = trainer(2)
    assert events[:4] == ["start", "epoch0", 1, 2]
    assert events[4] == ("end", 1, round(history[0], 6))
    assert events[-1] == "stop" and events.count("epoch1") == 1


def test_evaluate_on_its_own_is_the_sample_weighted_mean_over_an_uneven_last_batch():
    from course_utils.evaluation import evaluate
    x, y = tiny_data(70)  # batches of 32, 32 and 6: a mean of batch means would weigh the 6 like the 32s
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 10))
    loss_fn = nn.CrossEntropyLoss()
    got = evaluate(model, TensorLoader(x, y, 32, shuffle=False), loss_fn)  # device: the model's
    with torch.no_grad():
        logits = model(x)
    assert got["loss"] == pytest.approx(loss_fn(logits, y).item(), rel=1e-6)
    assert got["accuracy"] == (logits.argmax(1) == y).sum().item() / 70  # float64, as counted
    batch_means = [loss_fn(model(x[i:i + 32]), y[i:i + 32]).item() for i in range(0, 70, 32)]
    assert abs(got["loss"] - sum(batch_means) / 3) > 1e-4  # the mean of means is another number
    with pytest.raises(ValueError, match="no batches"):
        evaluate(model, [], loss_fn)


def test_evaluate_runs_in_eval_mode_and_restores_training_mode():
    x, y = tiny_data()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 64), nn.Dropout(0.5), nn.Linear(64, 10))
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), 0.01), nn.CrossEntropyLoss(),
                      TensorLoader(x, y, 32), device="cpu")
    model.train()
    result = trainer.evaluate(TensorLoader(x, y, 64, shuffle=False))
    model.eval()
    expected = (model(x).argmax(1) == y).float().mean().item()  # dropout off: deterministic
    model.train()
    train_mode = (model(x).argmax(1) == y).float().mean().item()  # dropout on: another answer
    assert result["accuracy"] == pytest.approx(expected) and train_mode != pytest.approx(expected)
    assert model.training


def _branches_per_step(make_trainer, skip_functions, skip_files) -> dict:
    """{(file, line): conditionals evaluated per step} in course_utils code during a steady-state epoch: an epoch
    of 12 batches minus one of 4, over the 8 extra steps (what an epoch costs once cancels out). A conditional is
    an `if`/`elif`/`while` test, a conditional expression, or a comprehension's `if`, found with `ast`."""
    import ast
    import collections
    import os
    import sys

    import course_utils

    package = os.path.dirname(course_utils.__file__) + os.sep
    tests_of: dict = {}

    def conditionals(path):
        if path not in tests_of:
            lines = set()
            for node in ast.walk(ast.parse(open(path).read())):
                if isinstance(node, (ast.If, ast.While)):
                    lines.add(node.test.lineno)
                elif isinstance(node, ast.IfExp):
                    lines.add(node.lineno)
                elif isinstance(node, ast.comprehension) and node.ifs:
                    lines.add(node.ifs[0].lineno)
            tests_of[path] = lines
        return tests_of[path]

    def count(trainer):
        hits = collections.Counter()

        def local(frame, event, arg):
            if event == "line" and frame.f_lineno in conditionals(frame.f_code.co_filename):
                hits[(os.path.relpath(frame.f_code.co_filename, package), frame.f_lineno)] += 1
            return local

        def calls(frame, event, arg):
            name = frame.f_code.co_filename
            if not name.startswith(package) or frame.f_code.co_name in skip_functions \
                    or os.path.relpath(name, package) in skip_files:
                return None
            return local

        sys.settrace(calls)
        try:
            trainer(1)
        finally:
            sys.settrace(None)
        return hits

    short, long = make_trainer(4), make_trainer(12)
    few, many = count(short), count(long)
    return {k: (many[k] - few.get(k, 0)) / 8 for k in many if many[k] != few.get(k, 0)}


def test_a_plain_step_passes_at_most_five_branches_on_how_the_trainer_was_built():
    """fp32, one process, accumulate=1, no callbacks: precision, processes, clipping and hooks are chosen once at
    construction, so a step does not ask about them. Not counted: the helpers that look at what a batch *is*
    (a tensor, a tuple, a dict: move_batch, as_pair, pair_on, batch_len, forward) and the loader's own code."""
    def maker(**options):
        def make(batches):
            torch.manual_seed(0)
            x, y = torch.randn(batches * 4, 6), torch.randint(0, 3, (batches * 4,))
            model = nn.Linear(6, 3)
            t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                        TensorLoader(x, y, batch_size=4, shuffle=False), device="cpu", **options)
            t(1)  # warm: the memory check and first-epoch work are done
            return t
        return make

    skip = dict(skip_functions={"move_batch", "as_pair", "pair_on", "batch_len", "forward"},
                skip_files={"data.py", "loader_state.py"})
    plain = _branches_per_step(maker(), **skip)
    assert sum(plain.values()) <= 5, plain
    assert _branches_per_step(maker(grad_clip=1.0), **skip) == plain  # clipping or not: chosen once
    # the count sees what a step does test: the OOM-resilient step asks about its chunk size every step
    assert sum(_branches_per_step(maker(oom_recovery=True), **skip).values()) > sum(plain.values())


class StopMidEpoch(Callback):
    def on_batch_end(self, trainer, loss):
        if trainer.batches_trained == 2:
            from course_utils.callbacks import StopTraining
            raise StopTraining("mid-epoch")

    def on_after_backward(self, trainer):  # a hook the step itself calls back
        pass


@pytest.mark.parametrize("options", [{}, {"oom_recovery": True}, {"accumulate": 2, "grad_clip": 1.0},
                                     {"mixed_precision": "bf16"}, {"checkpoint": "run.pt", "val": True}])
def test_a_dropped_trainer_is_freed_at_once_with_its_loaders_workers(tmp_path, options, capsys):
    """No reference cycle through the trainer: dropping it frees it (and its DataLoader's persistent workers) at
    once. In a cycle, the garbage collector would free it at some later moment, and a DataLoader iterator freed
    inside a cycle waits 5 s for each worker (its queues are closed before it can tell them to stop)."""
    import gc
    import weakref

    from torch.utils.data import DataLoader, TensorDataset

    options = dict(options)
    if "checkpoint" in options:
        options["checkpoint"] = tmp_path / options["checkpoint"]
    val = options.pop("val", False)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,)))
    loader = DataLoader(data, batch_size=16, num_workers=1, persistent_workers=True)
    model = SimpleCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gc.collect()
    gc.disable()
    try:
        trainer = Trainer(model, opt, nn.CrossEntropyLoss(), loader, device="cpu", callbacks=[StopMidEpoch()],
                          val_loader=TensorLoader(data.tensors[0][:16], data.tensors[1][:16], batch_size=16) if val
                          else None, **options)
        trainer(1)   # stops after 2 batches, its epoch's iterator (with the worker) kept for the resume
        trainer(1)
        workers = list(loader._iterator._workers)
        assert workers and all(w.is_alive() for w in workers)
        freed, model_freed = weakref.ref(trainer), weakref.ref(model)
        del trainer, loader, model, opt
        assert freed() is None, [type(r).__name__ for r in gc.get_referrers(freed())]
        assert model_freed() is None  # its step held no cycle either: the weights (GPU memory) go with it
        for w in workers:
            w.join(timeout=5)
        assert not any(w.is_alive() for w in workers)
    finally:
        gc.enable()


def test_train_epoch_on_its_own_with_a_deferred_stop_of_ones_own_stops_at_a_stoptraining():
    """A StopTraining is noted on the DeferredStop the epoch reads, also one passed in by the caller."""
    from course_utils.signals import DeferredStop

    x, y = tiny_data(64)
    model = SimpleCNN()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), nn.CrossEntropyLoss(),
                      TensorLoader(x, y, batch_size=16, shuffle=False), device="cpu", callbacks=[StopMidEpoch()])
    assert trainer.train_epoch(DeferredStop(), trainer._connect()) is None  # stopped: no mean loss
    assert trainer.batches_trained == 2 and trainer.position.batches_done == 2


def test_a_stopped_epochs_position_keeps_its_batch_losses_and_a_tampered_one_is_refused_whole():
    """An interrupted epoch's position holds each trained batch's loss and size (what its mean is made of); a
    state whose lists do not fit is refused with a message, and the trainer is left as it was."""
    x, y = tiny_data(64)
    model = SimpleCNN()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), nn.CrossEntropyLoss(),
                      TensorLoader(x, y, batch_size=16, shuffle=False), device="cpu", callbacks=[StopMidEpoch()])
    trainer(1)
    position = trainer.position
    assert position.sizes == [16, 16] and len(position.losses) == 2
    assert all(type(v) is float for v in position.losses)
    state = trainer.state_dict()
    before = copy.deepcopy(model.state_dict())
    for bad in ({"losses": position.losses[:1]}, {"sizes": [16, "16"]}, {"losses": [1, 2]}):
        tampered = copy.deepcopy(state)
        tampered["ranks"][0]["position"].update(bad)
        tampered["model"] = {k: v + 1 for k, v in tampered["model"].items()}
        with pytest.raises(ValueError, match="losses and sizes"):
            trainer.load_state_dict(tampered)
        assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
        assert trainer.position == position
    trainer.callbacks = [cb for cb in trainer.callbacks if not isinstance(cb, StopMidEpoch)]
    trainer(1)  # finishes the interrupted epoch from its position
    assert trainer.epoch == 1 and trainer.batches_trained == 4


def test_a_precision_whose_autocast_is_not_a_nullcontext_is_entered_however_it_is_flagged():
    """The step skips the autocast `with` only for a precision whose autocast() is a nullcontext, chosen again when
    `step.precision` is replaced."""
    from course_utils.amp import Float32, MixedPrecision
    from course_utils.step import TrainStep

    class Bf16(Float32):  # enabled stays False (inherited); its autocast is real
        def autocast(self):
            return torch.autocast("cpu", dtype=torch.bfloat16)

    seen = []
    model = nn.Linear(4, 2)
    model.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), Bf16("cpu"))
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    step(x, y)
    step.precision = MixedPrecision("cpu", enabled=False)
    step(x, y)
    step.precision = MixedPrecision("cpu", "bf16")
    step(x, y)
    assert seen == [torch.bfloat16, torch.float32, torch.bfloat16]


def test_the_memory_check_leaves_the_hooks_once_done_but_a_subclass_or_a_recheck_keeps_it():
    from course_utils.memory import MemoryCheck

    class Counting(MemoryCheck):
        calls = 0

        def on_batch_start(self, trainer, batch):
            Counting.calls += 1
            super().on_batch_start(trainer, batch)

    x, y = tiny_data(64)
    for check, per_call in ((MemoryCheck(), None), (Counting(), 4)):
        model = SimpleCNN()
        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), nn.CrossEntropyLoss(),
                          TensorLoader(x, y, batch_size=16, shuffle=False), device="cpu", callbacks=[check])
        trainer(1)
        trainer(1)
        hooked = check.on_batch_start in trainer._connect()["on_batch_start"] if check.on_batch_start else False
        assert hooked == (per_call is not None) and check.checked
        check.checked = False  # check the next batch again
        trainer(1)
        assert check.checked
    assert Counting.calls == 12  # its own hook ran at every batch of the three calls


@pytest.mark.parametrize("oom_recovery", [False, True])
def test_the_step_holds_the_gradient_accumulators_so_autograd_builds_them_once_per_call(oom_recovery):
    """Autograd keeps a parameter's AccumulateGrad node only while something holds it; the Trainer's step holds
    them (as DistributedDataParallel does), so each step's backward reuses the same nodes. Seen from outside: a
    hook put on a parameter's node after the first step, and then let go, still fires at every later step
    (without the hold the node is freed with the test's reference and its hook never fires)."""
    x, y = tiny_data()
    fired = []

    class HookAfterFirstStep(Callback):
        def on_batch_end(self, trainer, loss):
            if trainer.batches_trained == 1:
                for p in trainer.model.parameters():
                    node = p.view_as(p).grad_fn.next_functions[0][0]
                    assert type(node).__name__ == "AccumulateGrad"
                    node.register_prehook(lambda grads: fired.append(trainer.batches_trained))

    model = SimpleCNN()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), 0.01), nn.CrossEntropyLoss(),
                      TensorLoader(x, y, 16), device="cpu", callbacks=[HookAfterFirstStep()],
                      oom_recovery=oom_recovery)
    trainer(1)
    count = len(list(model.parameters()))
    assert fired == [b for b in (1, 2, 3) for _ in range(count)]  # steps 2, 3 and 4 (counted before each)
