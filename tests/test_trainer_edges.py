"""The Trainer's promises walked over their whole space, with PyTorch's own results as the oracle.

- Every stop point (after each batch of an epoch, first to last, inside and at the end of an accumulation
  group, and early in the next epoch) x every loader kind the Trainer accepts x accumulate 1 and 2: resumed in
  the same process and from the checkpoint file, the run ends bit-identical to an uninterrupted one (weights,
  optimizer state, loss history, counters). In a fresh process too (tests/resume_worker.py).
- Every hook a StopTraining can come from, and a real SIGINT: the stop takes effect at the step boundary.
- Checkpoints that do not fit: named, and the trainer is left as it was.
- Bad input: non-finite losses, an optimizer over another model, dict and namedtuple batches, misspelled hooks.
"""
import collections
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import edge_cases as ec
from course_utils import distributed
from course_utils.callbacks import HOOKS, Callback, CheckFinite, Checkpoint, LRScheduler
from course_utils.data import TensorLoader
from course_utils.trainer import CheckpointError, NonFiniteLossError, Trainer, move_batch, read_checkpoint

HERE = Path(__file__).parent


@pytest.fixture(autouse=True)
def quiet_loader_warnings():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata's own deprecation notice
        yield


# --- every stop point x every loader kind ---------------------------------------------------------

@pytest.mark.parametrize("kind", ec.KINDS)
def test_every_stop_point_resumes_exactly_for_every_loader(tmp_path, kind, capsys):
    bad = []
    for accumulate in (1, 2):
        reference = ec.trainer(kind, accumulate)
        reference(ec.EPOCHS)
        for at in ec.STOP_POINTS:
            first = ec.trainer(kind, accumulate, [ec.stopper(at)])
            first(ec.EPOCHS)
            expected = ec.group_end(at, accumulate)  # inside a group of 2, the group is finished first
            if first.batches_trained != expected or first.stop_reason != "stop point":
                bad.append(f"acc {accumulate} stop {at}: stopped after {first.batches_trained}, not {expected}")
            path = tmp_path / f"{kind}_{accumulate}_{at}.pt"
            first.save_checkpoint(path)
            from_file = ec.trainer(kind, accumulate).load_checkpoint(path)
            from_file(ec.EPOCHS - from_file.epoch)
            first(ec.EPOCHS - first.epoch)  # the same trainer, called again in this process
            for how, resumed in (("in process", first), ("from the file", from_file)):
                diffs = ec.same(resumed, reference)
                if diffs:
                    bad.append(f"acc {accumulate} stop {at} {how}: {diffs}")
    assert not bad, "\n".join(bad)


class KeepEvery(Callback):
    """After each step's periodic checkpoint, a copy of the file named by the step (order: after Checkpoint)."""

    order = 200

    def __init__(self, path):
        self.path = path

    def on_batch_end(self, trainer, loss):
        if trainer.at_step_boundary:
            copy = self.path.with_name(f"step{trainer.optimizer_steps}.pt")
            copy.write_bytes(self.path.read_bytes())


@pytest.mark.parametrize("kind", ec.KINDS)
def test_a_periodic_checkpoint_at_every_step_resumes_exactly(tmp_path, kind, capsys):
    from course_utils.callbacks import Checkpoint

    bad = []
    for accumulate in (1, 2):
        reference = ec.trainer(kind, accumulate)
        reference(ec.EPOCHS)
        path = tmp_path / f"{kind}{accumulate}.pt"
        saving = ec.trainer(kind, accumulate, [Checkpoint(path, every_n_steps=1), KeepEvery(path)])
        saving(ec.EPOCHS)
        if ec.same(saving, reference):
            bad.append(f"acc {accumulate}: saving changed the run: {ec.same(saving, reference)}")
        for step in range(1, saving.optimizer_steps + 1):
            resumed = ec.trainer(kind, accumulate).load_checkpoint(path.with_name(f"step{step}.pt"))
            assert resumed.optimizer_steps == step
            resumed(ec.EPOCHS - resumed.epoch)
            diffs = ec.same(resumed, reference)
            if diffs:
                bad.append(f"acc {accumulate} from step {step}: {diffs}")
    assert not bad, "\n".join(bad)


@pytest.mark.slow
def test_a_killed_process_restarts_from_its_last_periodic_checkpoint(tmp_path):
    """SIGKILL (no warning, nothing saved at the end), then the same command with resume=True: the run ends
    bit-identical to an uninterrupted one, having lost at most the steps since the last periodic save."""
    import signal

    path = tmp_path / "run.pt"
    cmd = [sys.executable, str(HERE / "resume_worker.py"), "periodic", str(path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.strip() == "batch 17":  # epoch 2 of 12 batches; the last save was after step 16
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Resumed from 'run.pt' at epoch 2, batch 4 of 12" in again.stdout, again.stdout[-2000:]
    assert again.stdout.strip().splitlines()[-1] == "same", again.stdout[-2000:]


@pytest.mark.slow
def test_a_sigterm_stops_at_the_step_boundary_saves_and_exits_with_its_status(tmp_path):
    """What a cluster scheduler sends before it preempts a job: the run saves where it is, exits with 143, and the
    same command with resume=True ends bit-identical to an uninterrupted run."""
    import signal

    path = tmp_path / "run.pt"
    cmd = [sys.executable, str(HERE / "resume_worker.py"), "periodic", str(path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.strip() == "batch 17":
            proc.send_signal(signal.SIGTERM)
            break
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-3000:]
    assert "Stopped by SIGTERM at epoch 2, batch 5 of 12" in out, out
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Resumed from 'run.pt' at epoch 2, batch 5 of 12" in again.stdout, again.stdout[-2000:]
    assert again.stdout.strip().splitlines()[-1] == "same", again.stdout[-2000:]


@pytest.mark.parametrize("hook", ["on_batch_start", "on_after_backward", "on_before_optimizer_step",
                                  "on_after_optimizer_step", "on_batch_end"])
@pytest.mark.parametrize("kind", ["tensor", "dataloader"])
def test_a_stop_from_any_hook_takes_effect_at_the_step_boundary(tmp_path, hook, kind, capsys):
    for accumulate in (1, 2):
        reference = ec.trainer(kind, accumulate)
        reference(ec.EPOCHS)
        for at in ec.STOP_POINTS:
            first = ec.trainer(kind, accumulate, [ec.stopper(at, hook)])
            first(ec.EPOCHS)
            assert first.stop_reason == "stop point" and first.position is not None
            assert first.batch_in_epoch % accumulate == 0 or first.batch_in_epoch == ec.BATCHES, \
                f"{hook} at {at}: stopped inside a group ({first.batches_trained} batches)"
            assert first.optimizer_steps * accumulate >= first.batches_trained
            first.save_checkpoint(tmp_path / "ck.pt")
            resumed = ec.trainer(kind, accumulate).load_checkpoint(tmp_path / "ck.pt")
            resumed(ec.EPOCHS - resumed.epoch)
            assert not ec.same(resumed, reference), (hook, at, accumulate, ec.same(resumed, reference))


@pytest.mark.parametrize("at", ec.STOP_POINTS)
def test_a_real_sigint_at_every_stop_point_resumes_exactly(tmp_path, at, capsys):
    for accumulate in (1, 2):
        reference = ec.trainer("dataloader_generator", accumulate)
        reference(ec.EPOCHS)
        first = ec.trainer("dataloader_generator", accumulate, [ec.stopper(at, how="signal")], checkpoint=tmp_path / "c.pt")
        first(ec.EPOCHS)
        assert first.interrupted and "interrupted" in capsys.readouterr().out
        resumed = ec.trainer("dataloader_generator", accumulate, checkpoint=tmp_path / "c.pt")
        resumed.load_checkpoint(tmp_path / "c.pt")
        resumed(ec.EPOCHS - resumed.epoch)
        assert not ec.same(resumed, reference), (at, accumulate, ec.same(resumed, reference))


def test_a_stop_at_an_epochs_last_batch_closes_that_epoch_on_resume(capsys):
    """The defect behind the enumeration: with TensorLoader a stop after the last batch used to train the
    whole epoch again (the loader said 'between epochs', the Trainer 'mid-epoch')."""
    reference = ec.trainer("tensor")
    reference(2)
    first = ec.trainer("tensor", callbacks=[ec.stopper(ec.BATCHES)])
    assert first(2) == [] and first.batch_in_epoch == ec.BATCHES and first.epoch == 0
    rest = first(2)
    assert len(rest) == 2 and first.batches_trained == 2 * ec.BATCHES == reference.batches_trained
    assert first.history == reference.history


class LateVote:
    """A distributed run's stop vote, as one process can have it: a wish is heard only at the epoch's end. Ranks
    agree every few steps, so a stop wished in an epoch's last steps lands after its last batch, before the
    epoch is closed (its mean, validation and epoch-end hooks then run on resume)."""

    def __call__(self, wish):
        return 0

    def settle(self, wish=0):
        return wish


@pytest.mark.parametrize("kind", ec.KINDS)
def test_a_stop_after_an_epochs_last_batch_or_between_epochs_resumes_exactly(tmp_path, kind, capsys):
    """Where the pass is over: after the last batch (heard late, as under torchrun) and in the epoch hooks.
    torchdata's StatefulDataLoader, loaded with a state whose pass is over, used to draw an extra seed at its
    next iter(), so the epoch after the resume shuffled and dropped out differently."""
    epochs, bad = 3, []
    reference = ec.trainer(kind)
    reference(epochs)
    for how in ("after the last batch", "on_epoch_end", "on_epoch_start"):
        first = ec.trainer(kind, callbacks=[ec.stopper(ec.BATCHES, "on_batch_end" if how.startswith("after")
                                                       else how)])
        if how.startswith("after"):
            first._vote = LateVote()
        first(epochs)
        where = (first.epoch, first.batches_trained, first.position is not None)
        if where != ((0, ec.BATCHES, True) if how.startswith("after") else (1, ec.BATCHES, False)):
            bad.append(f"{how}: stopped at (epoch, batches, position) {where}")
        path = tmp_path / f"{how}.pt"
        first.save_checkpoint(path)
        first(epochs - first.epoch)  # resumed in this process (before another trainer reseeds the generators)
        from_file = ec.trainer(kind).load_checkpoint(path)
        from_file(epochs - from_file.epoch)
        for resumed, where in ((first, "in process"), (from_file, "from the file")):
            diffs = ec.same(resumed, reference)
            if diffs:
                bad.append(f"{how}, {where}: {diffs}")
    assert not bad, "\n".join(bad)


@pytest.mark.slow
def test_every_stop_point_resumes_exactly_in_a_fresh_process(tmp_path):
    """Checkpoints written by one process for every loader kind and stop point, resumed by another."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, str(HERE / "resume_worker.py")]
    write = subprocess.run(cmd + ["edges-first", str(tmp_path)], capture_output=True, text=True, timeout=600, env=env)
    assert write.returncode == 0, write.stderr[-3000:]
    check = subprocess.run(cmd + ["edges-finish", str(tmp_path)], capture_output=True, text=True, timeout=600, env=env)
    assert check.returncode == 0, check.stderr[-3000:]
    lines = check.stdout.strip().splitlines()
    assert lines and lines[-1] == "all same", check.stdout[-3000:]


# --- stopping between epochs ----------------------------------------------------------------------

@pytest.mark.parametrize("hook, at", [("on_train_start", 0), ("on_epoch_start", 0), ("on_epoch_start", 1),
                                      ("on_epoch_end", 1)])
def test_stop_training_between_epochs_stops_cleanly_and_leaves_a_checkpoint(tmp_path, hook, at, capsys):
    """Raised when `at` epochs are done. Before the first epoch too (no epoch-end save yet): the file a resume
    looks for is written."""
    class Stop(Callback):
        pass

    def raise_(self, trainer, *args):
        if trainer.epoch == at:
            raise ec.StopTraining("between")

    setattr(Stop, hook, raise_)
    path = tmp_path / "ck.pt"
    t = ec.trainer("tensor", callbacks=[Stop()], checkpoint=path)
    losses = t(3)
    assert t.stop_reason == "between" and t.position is None
    assert t.epoch == at == len(losses) == read_checkpoint(path)["epoch"]


# --- checkpoints that do not fit ------------------------------------------------------------------

def _snapshot(t):
    return ({k: v.clone() for k, v in t.model.state_dict().items()}, repr(t.optimizer.state_dict()),
            t.epoch, t.batches_trained, list(t.history))


def _sgd_trainer(model=None):
    torch.manual_seed(0)
    model = model or nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 10))
    x, y = ec.data()
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), nn.CrossEntropyLoss(),
                   TensorLoader(x, y, batch_size=16), device="cpu")


@pytest.mark.parametrize("case", ["sgd_into_adamw", "shapes", "groups", "param_order", "callback", "no_scheduler",
                                  "other_scheduler", "loader_kind", "loader_class", "loader_generators",
                                  "loader_batches", "counters"])
def test_a_checkpoint_that_does_not_fit_is_named_and_changes_nothing(tmp_path, case, capsys):
    path = tmp_path / "ck.pt"
    stop_at = None  # mid-epoch checkpoints for the loader cases: their position must fit the loader
    if case == "sgd_into_adamw":
        source, target, words = _sgd_trainer(), ec.trainer("tensor"), "optimizer is SGD; this trainer's is AdamW"
    elif case == "shapes":
        torch.manual_seed(0)
        wide = nn.Sequential(nn.Flatten(), nn.Linear(64, 48), nn.ReLU(), nn.Dropout(0.3), nn.Linear(48, 10))
        source = Trainer(wide, torch.optim.AdamW(wide.parameters()), nn.CrossEntropyLoss(), ec.loader("tensor"))
        target, words = ec.trainer("tensor"), r"1\.weight: \(48, 64\) / \(32, 64\)"
    elif case == "groups":
        source = ec.trainer("tensor")
        torch.manual_seed(0)
        m = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 10))
        opt = torch.optim.AdamW([{"params": m[1].parameters()}, {"params": m[4].parameters(), "lr": 1e-3}])
        target = Trainer(m, opt, nn.CrossEntropyLoss(), ec.loader("tensor"),
                         scheduler=torch.optim.lr_scheduler.StepLR(opt, 1))
        words = r"groups of \[4\] tensors; this trainer's has \[2, 2\]"
    elif case == "param_order":  # the same group sizes, the parameters listed in another order
        source = ec.trainer("tensor")
        torch.manual_seed(0)
        m = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 10))
        opt = torch.optim.AdamW(list(m.parameters())[::-1])
        target = Trainer(m, opt, nn.CrossEntropyLoss(), ec.loader("tensor"),
                         scheduler=torch.optim.lr_scheduler.StepLR(opt, 1))
        words = r"'exp_avg' of parameter 0 has shape \(32, 64\); this trainer's parameter 0 has shape \(10,\)"
    elif case == "callback":
        source, target, words = ec.trainer("tensor"), ec.trainer("tensor"), "LRScheduler"
        target.callbacks.clear()
    elif case == "no_scheduler":  # saved without one, loaded with one: its schedule would start again
        source, target = ec.trainer("tensor"), ec.trainer("tensor")
        source.callbacks[:] = [cb for cb in source.callbacks if type(cb).__name__ != "LRScheduler"]
        words = r"this trainer has a LRScheduler\(StepLR\) callback, whose state the checkpoint lacks"
    elif case == "other_scheduler":  # a StepLR's state is not an ExponentialLR's
        source, target = ec.trainer("tensor"), ec.trainer("tensor")
        target.callbacks[:] = [cb for cb in target.callbacks if type(cb).__name__ != "LRScheduler"]
        target.callbacks.append(LRScheduler(torch.optim.lr_scheduler.ExponentialLR(target.optimizer, 0.9)))
        words = r"the checkpoint holds the state of a LRScheduler\(StepLR\) callback"
    elif case == "loader_kind":
        source, target, words = ec.trainer("tensor"), ec.trainer("dataloader"), "kind 'stateful'"
    elif case == "loader_class":  # two loaders with states of their own, each in its own format
        source, target = ec.trainer("stateful"), ec.trainer("tensor")
        words = "saved with a StatefulDataLoader, whose state this trainer's TensorLoader cannot read"
    elif case == "loader_generators":
        source, target, words = ec.trainer("dataloader_generator"), ec.trainer("dataloader"), "had 1 generator"
        stop_at = 3
    elif case == "loader_batches":
        source, target = ec.trainer("tensor"), ec.trainer("tensor")
        target.train_loader.batch_size = 8
        stop_at, words = 3, "an epoch of 5 batches; this loader has 9"
    else:
        source, target, words = ec.trainer("tensor"), ec.trainer("tensor"), "counters or loss history"
    if stop_at is not None:
        source.callbacks.append(ec.stopper(stop_at))
    source(1)
    source.save_checkpoint(path)
    if case == "counters":  # a learner's edit of the file
        state = torch.load(path, weights_only=True)
        state["history"] = "abc"
        torch.save(state, path)
    target(1)  # a trainer with some progress of its own, which a failed load must keep
    before = _snapshot(target)
    with pytest.raises(CheckpointError, match=words) as info:
        target.load_checkpoint(path)
    assert path.name in str(info.value)
    after = _snapshot(target)
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0]) and before[1:] == after[1:]
    target(1)  # and it still trains
    assert target.epoch == 2


def test_a_load_that_fails_half_way_is_rolled_back(tmp_path, monkeypatch, capsys):
    source, target = ec.trainer("tensor"), ec.trainer("tensor")
    source(1)
    source.save_checkpoint(tmp_path / "ck.pt")
    target(1)
    before = _snapshot(target)

    def broken(state):  # a failure after the model and the optimizer were loaded
        raise RuntimeError("the precision state could not be loaded")

    monkeypatch.setattr(target.precision, "load_state_dict", broken)
    with pytest.raises(CheckpointError, match="precision state could not"):
        target.load_checkpoint(tmp_path / "ck.pt")
    after = _snapshot(target)
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0]) and before[1:] == after[1:]


def test_a_failed_load_puts_the_loaders_generators_back(tmp_path, capsys):
    source, target, twin = (ec.trainer("dataloader_generator") for _ in range(3))
    source(1)
    source.save_checkpoint(tmp_path / "ck.pt")
    state = torch.load(tmp_path / "ck.pt", weights_only=True)
    state["ranks"][0]["position"] = {"garbage": 1}  # refused only after the loader's generators were set
    torch.save(state, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError):
        target.load_checkpoint(tmp_path / "bad.pt")
    rng = torch.get_rng_state()  # the two share the global generator: give both the same
    target(1)
    torch.set_rng_state(rng)
    twin(1)
    assert not ec.same(target, twin)


def test_a_custom_samplers_randomness_is_named_at_save_time(tmp_path):
    import numpy as np

    class NumpyOrder(torch.utils.data.Sampler):
        def __init__(self, n):
            self.n = n

        def __len__(self):
            return self.n

        def __iter__(self):
            return iter(np.random.permutation(self.n).tolist())

    x, y = ec.data()
    model = nn.Linear(64, 10)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x.flatten(1), y), batch_size=16,
                                         sampler=NumpyOrder(len(y)))
    t = Trainer(model, torch.optim.SGD(model.parameters(), 0.1), nn.CrossEntropyLoss(), loader, device="cpu",
                callbacks=[ec.stopper(2)])
    t(1)
    with pytest.warns(UserWarning, match="NumpyOrder of your own"):
        t.save_checkpoint(tmp_path / "ck.pt")


# --- bad input ------------------------------------------------------------------------------------

class NanAt(nn.Module):
    """Cross-entropy that returns nan at one call: a loss gone wrong at a known batch."""

    def __init__(self, at):
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, logits, y):
        self.calls += 1
        loss = nn.functional.cross_entropy(logits, y)
        return loss * math.nan if self.calls == self.at else loss


def test_a_non_finite_loss_stops_at_the_epoch_end_naming_the_batch_and_keeps_the_last_good_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    x, y = ec.data()
    path = tmp_path / "ck.pt"
    t = Trainer(model, torch.optim.SGD(model.parameters(), 0.1), NanAt(ec.BATCHES + 3), TensorLoader(x, y, 16),
                device="cpu", checkpoint=path)
    with pytest.raises(NonFiniteLossError, match="nan at epoch 2, batch 3"):
        t(3)
    saved = read_checkpoint(path)
    assert saved["epoch"] == 1 and all(torch.isfinite(v).all() for v in saved["model"].values())
    with pytest.raises(NonFiniteLossError, match="not saving 'ck.pt'"):
        t.save_checkpoint(path)  # the weights are nan now: never written
    assert read_checkpoint(path)["epoch"] == 1


def test_a_non_finite_loss_before_a_stop_is_named_at_the_stop_and_not_saved(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    x, y = ec.data()
    t = Trainer(model, torch.optim.SGD(model.parameters(), 0.1), NanAt(2), TensorLoader(x, y, 16), device="cpu",
                checkpoint=tmp_path / "ck.pt", callbacks=[ec.stopper(4)])
    with pytest.raises(NonFiniteLossError, match="nan at epoch 1, batch 2"):
        t(2)
    assert not (tmp_path / "ck.pt").exists()


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_periodic_checkpoint_that_meets_a_non_finite_loss_names_its_batch(tmp_path, accumulate, capsys):
    """A save every step is the first to read a bad loss: it refuses to write, naming the first bad batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    x, y = ec.data()
    path = tmp_path / "ck.pt"
    t = Trainer(model, torch.optim.SGD(model.parameters(), 0.1), NanAt(ec.BATCHES + 3), TensorLoader(x, y, 16),
                device="cpu", accumulate=accumulate, callbacks=[Checkpoint(path, every_n_steps=1)])
    with pytest.raises(NonFiniteLossError, match="not saving 'ck.pt': the loss became nan at epoch 2, batch 3"):
        t(3)
    assert all(torch.isfinite(v).all() for v in read_checkpoint(path)["model"].values())


def test_non_finite_weights_after_finite_losses_are_refused_saying_so(tmp_path, capsys):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    x, y = ec.data()
    t = Trainer(model, torch.optim.SGD(model.parameters(), 0.1), nn.CrossEntropyLoss(), TensorLoader(x, y, 16),
                device="cpu")
    t(1)
    with torch.no_grad():
        model[1].weight[0, 0] = math.inf
    with pytest.raises(NonFiniteLossError, match="not saving 'ck.pt': the weights are not finite .* at the end of "
                                                 "epoch 1, though every loss before was"):
        t.save_checkpoint(tmp_path / "ck.pt")
    assert not (tmp_path / "ck.pt").exists()


def test_check_finite_stops_at_the_bad_step_itself():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    x, y = ec.data()
    t = Trainer(model, torch.optim.SGD(model.parameters(), 0.1), NanAt(4), TensorLoader(x, y, 16), device="cpu",
                callbacks=[CheckFinite()])
    with pytest.raises(NonFiniteLossError, match="epoch 1, batch 4 of 5"):
        t(2)
    assert t.batches_trained == 4


def test_an_optimizer_over_another_models_parameters_is_refused():
    model, other = nn.Linear(4, 2), nn.Linear(4, 2)
    with pytest.raises(ValueError, match="2 of its 2 parameter tensors that are not this model's"):
        Trainer(model, torch.optim.SGD(other.parameters(), 0.1), nn.MSELoss(), [], device="cpu")
    Trainer(model, torch.optim.SGD([model.weight], 0.1), nn.MSELoss(), [], device="cpu")  # a subset: fine-tuning


Pair = collections.namedtuple("Pair", "inputs targets")


class Fields(tuple):
    """A tuple subclass built from its fields, not from an iterable."""

    def __new__(cls, a, b):
        return super().__new__(cls, (a, b))


def test_batches_keep_their_container_types_when_moved():
    t = torch.zeros(2)
    cases = [Pair(t, t), collections.OrderedDict(a=t), collections.defaultdict(list, a=t), [t, (t, {"b": t})],
             Fields(t, t)]
    for batch in cases:
        moved = move_batch(batch, torch.device("meta"))
        assert type(moved) is type(batch)
        leaves = torch.utils._pytree.tree_leaves(tuple(moved) if type(moved) is Fields else moved)
        assert all(v.device.type == "meta" for v in leaves)
    assert move_batch(cases[2], torch.device("meta")).default_factory is list


def test_dict_and_namedtuple_batches_train_like_tuples():
    x, y = ec.data()

    class KeywordModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))

        def forward(self, pixel_values, scale):
            return self.net(pixel_values) * scale

    def run(batches, batch_fn=None, accumulate=2, make=KeywordModel):
        torch.manual_seed(0)
        model = make()
        t = Trainer(model, torch.optim.SGD(model.parameters(), 0.1), nn.CrossEntropyLoss(), batches, device="cpu",
                    batch_fn=batch_fn, accumulate=accumulate, oom_recovery=True)
        t(2)
        return t

    one = torch.ones(())
    tuples = [({"pixel_values": x[i:i + 16], "scale": one.expand(len(y[i:i + 16]), 1)}, y[i:i + 16])
              for i in range(0, 72, 16)]
    dicts = [{"pixel_values": x[i:i + 16], "labels": y[i:i + 16]} for i in range(0, 72, 16)]
    a = run(tuples)
    b = run(dicts, batch_fn=lambda b: ({"pixel_values": b["pixel_values"], "scale": one.expand(len(b["labels"]), 1)},
                                       b["labels"]))
    assert a.history == b.history
    with pytest.raises(TypeError, match=r"dicts \(keys \['labels', 'pixel_values'\]\).*batch_fn"):
        run(dicts)
    plain = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 72, 16)]
    lin = lambda: nn.Sequential(nn.Flatten(), nn.Linear(64, 10))  # noqa: E731
    assert run(plain, make=lin).history == run([Pair(*b) for b in plain], make=lin).history


def test_a_hook_with_a_wrong_name_is_warned_about_with_the_nearest_hook():
    class Logger(Callback):
        def on_step_end(self, trainer):  # an old name: never called
            pass

        def onbatch_end(self, trainer, loss):  # a typo
            pass

        def summary(self):  # a method of its own: nothing to say
            pass

    t = ec.trainer("tensor", callbacks=[Logger()])
    with pytest.warns(UserWarning) as record:
        t(1)
    said = [str(w.message) for w in record if "is not a Trainer hook" in str(w.message)]
    assert len(said) == 2 and any("Logger.onbatch_end" in w and "did you mean on_batch_end" in w for w in said)
    assert any("Logger.on_step_end" in w for w in said)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t(1)  # said once
        ec.trainer("tensor", callbacks=[CheckFinite()])(1)  # a right name: nothing to say
    assert "on_step_end" not in HOOKS


def test_reduce_lr_on_plateau_steps_on_the_epoch_loss():
    t = ec.trainer("tensor")
    t.callbacks.clear()
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(t.optimizer, patience=0, factor=0.5, threshold=10.0)
    t.callbacks.append(ec.LRScheduler(plateau))
    t(2)  # a threshold no loss can beat: every epoch is a plateau
    assert t.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.25)


def test_an_iterable_dataset_under_torchrun_gets_advice_that_works():
    class Stream(torch.utils.data.IterableDataset):
        def __init__(self, rank=0, world=1):
            self.rank, self.world = rank, world

        def __iter__(self):
            return iter(range(self.rank, 8, self.world))

    rank1 = distributed.Process(rank=1, world_size=2, local_rank=1)
    with pytest.raises(TypeError, match=r"shard\(rank, world_size\).*get_worker_info"):
        distributed.shard_loader(torch.utils.data.DataLoader(Stream(), batch_size=2), rank1)

    class ShardedStream(Stream):
        def shard(self, rank, world_size):
            return ShardedStream(rank, world_size)

    loader = distributed.shard_loader(torch.utils.data.DataLoader(ShardedStream(), batch_size=2), rank1)
    assert [b.tolist() for b in loader] == [[1, 3], [5, 7]]  # what DataLoader accepts, and rank 1's share
