"""The Trainer against PyTorch itself: a hand-written loop for every mode of the step, exact resume for every
loader kind (in process and in a fresh process after a real SIGINT), callbacks that act, corrupt checkpoints."""
import copy
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from course_utils import rng
from course_utils.amp import MixedPrecision
from course_utils.callbacks import Callback, EarlyStopping, LRScheduler, StopTraining
from course_utils.data import TensorLoader
from course_utils.memory import ResilientStep, ResilientStepOutOfMemoryError, SimulatedGPU
from course_utils.models import SimpleCNN
from course_utils.trainer import CheckpointError, Trainer, read_checkpoint

HERE = Path(__file__).parent


class DropoutNet(nn.Module):
    """Small, fast, and uses the RNG inside forward (dropout), so an exact resume must restore RNG state too."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 10))

    def forward(self, x):
        return self.net(x)


def data(n=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


def make_trainer(checkpoint=None, loader="tensor", **kwargs):
    torch.manual_seed(0)
    model = DropoutNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    x, y = data()
    if loader == "tensor":
        train = TensorLoader(x, y, batch_size=16, seed=0)
    else:
        train = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16, shuffle=True)
    return Trainer(model, opt, nn.CrossEntropyLoss(), train, device="cpu", checkpoint=checkpoint,
                   scheduler=sched, **kwargs)


class InterruptAt(Callback):
    def __init__(self, batch, how="raise"):
        self.batch, self.how = batch, how

    def on_batch_end(self, trainer, loss):
        if trainer.batches_trained == self.batch:
            if self.how == "signal":
                os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C / Jupyter's interrupt button sends
            else:
                raise KeyboardInterrupt


def assert_same_weights(a, b):
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name


# --- the step, against a hand-written loop -------------------------------------------------------

def linear_setup(seed=0, bn=False):
    torch.manual_seed(seed)
    layers = [nn.Flatten(), nn.Linear(64, 16)] + ([nn.BatchNorm1d(16)] if bn else []) + [nn.ReLU(), nn.Linear(16, 10)]
    return nn.Sequential(*layers)


def hand_loop(model, opt, batches, *, accumulate=1, autocast=None, scaler=None, clip=None, chunk=None):
    """The course's step written out by hand in plain PyTorch: the oracle."""
    groups = [batches[i:i + accumulate] for i in range(0, len(batches), accumulate)]
    for group in groups:
        total = sum(len(y) for _, y in group)
        opt.zero_grad(set_to_none=True)
        for x, y in group:
            parts = [(x, y)] if chunk is None else list(zip(x.split(chunk), y.split(chunk)))
            for px, py in parts:
                if autocast is None:
                    loss = F.cross_entropy(model(px), py)
                else:
                    with torch.autocast("cpu", dtype=autocast):
                        loss = F.cross_entropy(model(px), py)
                if len(py) != total:
                    loss = loss * (len(py) / total)
                (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.unscale_(opt)
        if clip is not None:
            nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], clip)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()


def batches_of(x, y, size):
    return [(x[i:i + size], y[i:i + size]) for i in range(0, len(y), size)]


@pytest.mark.parametrize("mode", ["fp32", "bf16", "fp16_scaler_clip", "accumulate", "accumulate_partial"])
def test_trainer_equals_a_hand_written_loop(mode):
    x, y = data(80)
    model = linear_setup()
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    kwargs, hand = {}, {}
    size = 16
    if mode == "bf16":
        kwargs["mixed_precision"] = "bf16"
        hand["autocast"] = torch.bfloat16
    if mode == "fp16_scaler_clip":
        kwargs.update(mixed_precision="fp16", grad_clip=0.5)
        hand.update(autocast=torch.float16, scaler=torch.amp.GradScaler("cpu"), clip=0.5)
    if mode.startswith("accumulate"):
        kwargs["accumulate"] = hand["accumulate"] = 2 if mode == "accumulate" else 3  # 5 batches: 3 + 2
    trainer = Trainer(model, opt, nn.CrossEntropyLoss(), TensorLoader(x, y, size, shuffle=False), device="cpu",
                      **kwargs)
    trainer(2)
    for _ in range(2):
        hand_loop(twin, twin_opt, batches_of(x, y, size), **hand)
    if mode == "fp16_scaler_clip":
        assert trainer.precision.scaler is not None
        assert trainer.precision.scaler.get_scale() == hand["scaler"].get_scale()
        assert trainer.train_step.grad_norm is not None
    if mode in ("fp32", "bf16", "fp16_scaler_clip"):
        assert_same_weights(model, twin)  # the same operations in the same order: bit for bit
    else:  # the grouped mean is summed in another order than one big batch's: float rounding only
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert trainer.optimizer_steps == 2 * len(range(0, 5, hand.get("accumulate", 1)))


def test_bf16_autocast_really_runs():
    seen = []
    model = linear_setup()
    model[1].register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    Trainer(model, torch.optim.SGD(model.parameters(), 0.1), nn.CrossEntropyLoss(), TensorLoader(*data(32), 16),
            device="cpu", mixed_precision="bf16")(1)
    assert seen == [torch.bfloat16, torch.bfloat16]


def test_accumulation_equals_the_large_batch():
    x, y = data(64)
    big, small = linear_setup(), linear_setup()
    t_big = Trainer(big, torch.optim.SGD(big.parameters(), 0.1), nn.CrossEntropyLoss(),
                    TensorLoader(x, y, 32, shuffle=False), device="cpu")
    t_small = Trainer(small, torch.optim.SGD(small.parameters(), 0.1), nn.CrossEntropyLoss(),
                      TensorLoader(x, y, 8, shuffle=False), device="cpu", accumulate=4)
    assert t_big(2) == pytest.approx(t_small(2), rel=1e-6)
    for p, q in zip(big.parameters(), small.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert (t_small.batches_trained, t_small.optimizer_steps) == (16, 4)


def _budget_between(model, opt, x, y, chunk):
    """A SimulatedGPU budget in which a step in chunks of `chunk` fits and one on the whole batch does not."""
    peaks = {}
    for size in (len(y), chunk):
        trial = copy.deepcopy(model)
        trial_opt = type(opt)(trial.parameters(), **{k: v for k, v in opt.defaults.items()
                                                     if k in ("lr", "momentum")})
        with SimulatedGPU("1GiB", model=trial, optimizer=trial_opt) as sim:
            for _ in range(2):
                ResilientStep(trial, trial_opt, F.cross_entropy).step.group([(x, y)], chunk_size=size)
            peaks[size] = sim.max_memory_allocated()
    assert peaks[chunk] < peaks[len(y)]
    return (peaks[chunk] + peaks[len(y)]) // 2


def test_oom_recovered_step_equals_the_hand_written_chunked_step():
    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    torch.manual_seed(0)
    model = SimpleCNN()
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), 0.05, momentum=0.9)
    twin_opt = torch.optim.SGD(twin.parameters(), 0.05, momentum=0.9)
    budget = _budget_between(model, opt, x, y, 32)
    trainer = Trainer(model, opt, nn.CrossEntropyLoss(), TensorLoader(x, y, 64, shuffle=False), device="cpu",
                      oom_recovery=True)
    with SimulatedGPU(budget, model=model, optimizer=opt):
        got = trainer(2)
    assert trainer.step.oom_count == 1 and trainer.step.micro_batch_size == 32
    for _ in range(2):
        hand_loop(twin, twin_opt, [(x, y)], chunk=32)
    assert_same_weights(model, twin)
    assert len(got) == 2


def test_accumulation_and_oom_recovery_compose():
    x, y = torch.randn(96, 1, 28, 28), torch.randint(0, 10, (96,))
    torch.manual_seed(0)
    model = SimpleCNN()
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), 0.05)
    twin_opt = torch.optim.SGD(twin.parameters(), 0.05)
    budget = _budget_between(model, opt, x[:32], y[:32], 16)
    trainer = Trainer(model, opt, nn.CrossEntropyLoss(), TensorLoader(x, y, 32, shuffle=False), device="cpu",
                      accumulate=3, oom_recovery=True)
    with SimulatedGPU(budget, model=model, optimizer=opt):
        trainer(1)
    assert trainer.step.oom_count >= 1 and trainer.step.micro_batch_size == 16
    assert trainer.optimizer_steps == 1
    hand_loop(twin, twin_opt, batches_of(x, y, 32), accumulate=3, chunk=16)  # the whole group's update
    assert_same_weights(model, twin)


def test_batchnorm_statistics_are_not_changed_by_a_failed_attempt():
    x, y = data(64)
    model = linear_setup(bn=True)
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), 0.1)
    twin_opt = torch.optim.SGD(twin.parameters(), 0.1)
    budget = _budget_between(model, opt, x, y, 16)
    step = ResilientStep(model, opt, F.cross_entropy)
    with SimulatedGPU(budget, model=model, optimizer=opt):
        step(x, y)
    assert step.oom_count >= 1
    hand_loop(twin, twin_opt, [(x, y)], chunk=step.micro_batch_size)
    assert_same_weights(model, twin)  # running_mean, running_var and num_batches_tracked included
    assert model[2].num_batches_tracked.item() == 64 // step.micro_batch_size


def test_micro_batch_size_grows_back_after_clean_steps():
    x, y = data(64)
    model = linear_setup()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    step = ResilientStep(model, opt, F.cross_entropy, regrow_after=3)
    step.micro_batch_size = 16  # as after an out-of-memory error
    for _ in range(2):
        step(x, y)
    assert step.micro_batch_size == 16
    step(x, y)
    assert step.micro_batch_size is None  # three clean steps: whole batches again


def test_oom_in_the_first_optimizer_step_names_the_cause():
    x, y = data(8)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 2048), nn.Linear(2048, 10))
    opt = torch.optim.Adam(model.parameters())
    params = sum(p.numel() * 4 for p in model.parameters())
    step = ResilientStep(model, opt, F.cross_entropy)
    # room for weights, gradients and a small batch's activations, not for Adam's two state tensors
    with SimulatedGPU(int(params * 2.5), model=model, optimizer=opt):
        with pytest.raises(ResilientStepOutOfMemoryError, match="first step.*Adam.*state") as info:
            step(x, y)
    assert "foreach=False" in str(info.value)


# --- resume -------------------------------------------------------------------------------------

@pytest.mark.parametrize("loader", ["tensor", "dataloader"])
@pytest.mark.parametrize("how", ["signal", "raise"])
def test_interrupted_and_resumed_run_is_bit_identical(tmp_path, loader, how):
    reference = make_trainer(loader=loader)
    expected = reference(3)

    path = tmp_path / "run.pt"
    first = make_trainer(path, loader=loader, callbacks=[InterruptAt(9, how)])  # 6 batches an epoch: mid-epoch 2
    partial = first(3)
    assert first.interrupted and len(partial) == 1 and path.exists()

    resumed = make_trainer(loader=loader)
    resumed.load_checkpoint(path)
    assert resumed.epoch == 1 and resumed.batches_trained == 9 and resumed.batch_in_epoch == 3
    rest = resumed(3 - resumed.epoch)
    assert partial + rest == expected
    assert resumed.history == reference.history
    assert_same_weights(resumed.model, reference.model)
    assert resumed.optimizer.param_groups[0]["lr"] == reference.optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("kind", ["tensor", "stateful"])  # every kind x stop point: test_trainer_edges.py
def test_resume_in_a_fresh_process_after_a_real_sigint(tmp_path, kind):
    """Ctrl-C really sent to a training process; a new process resumes; the result equals an uninterrupted run."""
    path = tmp_path / "ck.pt"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(HERE / "resume_worker.py"), kind]
    proc = subprocess.Popen(cmd + ["first", str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    lines = []
    for line in proc.stdout:
        lines.append(line.strip())
        if line.strip() == "batch 17":  # epoch 2 of 12 batches, mid-way
            proc.send_signal(signal.SIGINT)
            break
    out, err = proc.communicate(timeout=120)
    lines += out.split()
    assert proc.returncode == 0, err
    assert "interrupted=True" in out, out + err
    done = subprocess.run(cmd + ["finish", str(path)], capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "same", done.stdout


def test_loader_whose_order_cannot_be_saved_warns_once_at_save_time(tmp_path):
    x, y = data(64)

    class Batches:  # an arbitrary iterable
        def __iter__(self):
            return iter([(x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)])

    model = DropoutNet()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), 0.1), nn.CrossEntropyLoss(), Batches(), device="cpu",
                      callbacks=[InterruptAt(2)])
    trainer(1)
    with pytest.warns(UserWarning, match="order of a Batches cannot be saved"):
        trainer.save_checkpoint(tmp_path / "a.pt")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.save_checkpoint(tmp_path / "b.pt")  # said once
        make_trainer().save_checkpoint(tmp_path / "c.pt")  # a TensorLoader: nothing to say


def test_rng_states_are_restored_whatever_device_the_checkpoint_was_mapped_to(tmp_path):
    path = tmp_path / "ck.pt"
    make_trainer(path)(1)
    state = read_checkpoint(path, map_location="meta")  # a non-CPU device: every tensor of the file goes there
    assert state["model"]["net.1.weight"].device.type == "meta"
    rng.set_rng_state(state["ranks"][0]["rng"])  # one entry per rank: a single process has one
    a = torch.rand(3)
    rng.set_rng_state(read_checkpoint(path)["ranks"][0]["rng"])
    assert torch.equal(a, torch.rand(3))
    # a state kept as a tensor (what torch.get_rng_state() returns) works too
    saved = torch.get_rng_state()
    b = torch.rand(3)
    rng.set_rng_state({"python": state["ranks"][0]["rng"]["python"], "torch": saved})
    assert torch.equal(b, torch.rand(3))


def test_checkpoint_is_written_atomically_and_loads_weights_only(tmp_path):
    path = tmp_path / "ck.pt"
    trainer = make_trainer(path)
    trainer(1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.pt"]  # no temporary files left behind
    state = torch.load(path, weights_only=True)  # loads without unpickling arbitrary objects
    assert state["epoch"] == 1 and "optimizer" in state and state["ranks"][0]["position"] is None


def test_a_save_removes_what_a_writer_killed_mid_save_left_and_the_file_is_readable_by_others(tmp_path):
    """SIGKILL during a save runs no cleanup: its temporary file stays; the next save removes it. mkstemp makes
    files only their owner can read (0o600): the checkpoint gets a plain file's permissions instead."""
    import stat

    path = tmp_path / "ck.pt"
    left = [tmp_path / ".ck.pt.abc123.tmp", tmp_path / ".ck.pt.x_y.tmp"]
    for p in left:
        p.write_bytes(b"half a checkpoint")
    unrelated = tmp_path / ".other.pt.abc.tmp"
    unrelated.write_bytes(b"another file's")
    make_trainer(path)(1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.pt.abc.tmp", "ck.pt"]
    mask = os.umask(0o022)
    try:
        make_trainer(path)(1)
    finally:
        os.umask(mask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_resume_true_on_a_corrupt_file_says_how_to_start_again(tmp_path):
    path = tmp_path / "run.pt"
    make_trainer(path)(1)
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="truncated or corrupt") as info:
        make_trainer(path, resume=True)
    assert "move 'run.pt' away to start from scratch" in str(info.value)


def test_truncated_or_corrupt_checkpoints_give_a_clear_error_naming_the_file(tmp_path):
    good = tmp_path / "good.pt"
    make_trainer(good)(1)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(os.urandom(2048))
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(2)}, other)
    for path, words in [(truncated, "truncated or corrupt"), (garbage, "truncated or corrupt"),
                        (other, "not a course_utils Trainer checkpoint"), (tmp_path / "missing.pt", "does not exist")]:
        with pytest.raises(CheckpointError, match=words) as info:
            make_trainer().load_checkpoint(path)
        assert path.name in str(info.value)
    with pytest.raises(CheckpointError, match="does not fit") as info:
        cnn = SimpleCNN()
        wrong = Trainer(cnn, torch.optim.SGD(cnn.parameters(), 0.1), nn.CrossEntropyLoss(), [])
        wrong.load_checkpoint(good)
    assert good.name in str(info.value)
    with pytest.raises(CheckpointError, match="LRScheduler"):  # its schedule would be lost silently
        no_sched = make_trainer()
        no_sched.callbacks.clear()
        no_sched.load_checkpoint(good)
    if not torch.cuda.is_available():
        with pytest.raises(CheckpointError, match="cannot be mapped") as info:
            make_trainer().load_checkpoint(good, map_location="cuda")
        assert good.name in str(info.value)


def test_fp16_scaler_state_goes_into_the_checkpoint(tmp_path):
    path = tmp_path / "fp16.pt"
    trainer = make_trainer(path, mixed_precision=MixedPrecision("cpu", "fp16", init_scale=1024.0))
    assert trainer.precision.scaler is not None  # a scale the fresh trainer below does not start with
    trainer(1)
    assert read_checkpoint(path)["precision"]["scaler"]["scale"] == trainer.precision.scaler.get_scale()
    resumed = make_trainer(mixed_precision="fp16").load_checkpoint(path)
    assert resumed.precision.scaler.get_scale() == trainer.precision.scaler.get_scale() != 2.0 ** 16


# --- callbacks that act ------------------------------------------------------------------------

def test_early_stopping_stops_and_its_state_is_checkpointed(tmp_path, capsys):
    x, y = data(32)
    path = tmp_path / "es.pt"
    stopper = EarlyStopping("val_loss", patience=2)
    trainer = make_trainer(path, val_loader=TensorLoader(x, y, 16, shuffle=False), callbacks=[stopper])
    trainer.optimizer.param_groups[0]["lr"] = 0.0  # nothing improves
    trainer.callbacks = [cb for cb in trainer.callbacks if not isinstance(cb, LRScheduler)]
    history = trainer(10)
    assert len(history) == 3 and trainer.stop_reason and "val_loss" in trainer.stop_reason
    assert "stopped after epoch 3" in capsys.readouterr().out
    saved = read_checkpoint(path)
    assert saved["epoch"] == 3  # the checkpoint callback (order 100) ran after EarlyStopping raised
    assert {"best": stopper.best, "best_epoch": 1, "bad_epochs": 2}.items() <= \
        [e for e in saved["callbacks"] if e["class"] == "EarlyStopping"][0]["state"].items()


def test_stop_training_mid_epoch_keeps_the_position_and_continues():
    class StopAt(Callback):
        def on_batch_end(self, trainer, loss):
            if trainer.batches_trained == 4:
                raise StopTraining("enough")

    reference = make_trainer()
    expected = reference(2)
    trainer = make_trainer(callbacks=[StopAt()])
    assert trainer(2) == [] and trainer.stop_reason == "enough" and not trainer.interrupted
    trainer.callbacks = [cb for cb in trainer.callbacks if not isinstance(cb, StopAt)]
    assert trainer(2) == expected
    assert_same_weights(trainer.model, reference.model)


def test_per_step_scheduler_and_hook_order():
    x, y = data(64)
    model = linear_setup()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    events = []

    class Recorder(Callback):
        def on_train_start(self, t): events.append("train_start")
        def on_epoch_start(self, t): events.append("epoch_start")
        def on_batch_start(self, t, batch): events.append("batch_start")
        def on_after_backward(self, t):
            events.append("after_backward")
            assert all(p.grad is not None for p in t.model.parameters())
        def on_before_optimizer_step(self, t): events.append("before_step")
        def on_after_optimizer_step(self, t): events.append(("lr", t.optimizer.param_groups[0]["lr"]))
        def on_batch_end(self, t, loss):
            assert isinstance(loss, torch.Tensor) and loss.dim() == 0 and not loss.requires_grad
            events.append("batch_end")
        def on_epoch_end(self, t, logs): events.append("epoch_end")
        def on_train_end(self, t): events.append("train_end")

    trainer = Trainer(model, opt, nn.CrossEntropyLoss(), TensorLoader(x, y, 16), device="cpu", accumulate=2,
                      callbacks=[Recorder(), LRScheduler(sched, interval="step")])
    trainer(1)
    step = ["batch_start", "batch_start", "after_backward", "before_step"]
    # the scheduler (order -10) steps before the recorder reads the learning rate
    assert events == ["train_start", "epoch_start", *step, ("lr", 0.5), "batch_end", "batch_end",
                      *step, ("lr", 0.25), "batch_end", "batch_end", "epoch_end", "train_end"]


def test_interrupt_leaves_a_usable_model_and_continues_in_process(capsys):
    trainer = make_trainer(callbacks=[InterruptAt(4, "signal")])
    trainer(2)
    assert "interrupted at epoch 1, batch 4 of 6" in capsys.readouterr().out
    trainer.callbacks = [cb for cb in trainer.callbacks if not isinstance(cb, InterruptAt)]
    out = trainer.model(data(4)[0])
    assert torch.isfinite(out).all()
    assert all(p.grad is None for p in trainer.model.parameters())
    trainer(1)  # finishes the interrupted epoch
    assert trainer.epoch == 1 and trainer.batches_trained == 6
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handler restored


def test_evaluation_logs_and_clear_errors():
    x, y = data(32)
    trainer = make_trainer(val_loader=TensorLoader(x, y, 16, shuffle=False))
    trainer(1)
    assert set(trainer.logs[0]) == {"loss", "val_loss", "val_accuracy"}
    assert 0 <= trainer.logs[0]["val_accuracy"] <= 1
    with pytest.raises(TypeError, match="optimizer"):
        Trainer(DropoutNet(), "sgd", nn.CrossEntropyLoss(), [])
    with pytest.raises(ValueError, match="epochs"):
        make_trainer()(True)
    with pytest.raises(ValueError, match="accumulate"):
        make_trainer(accumulate=0)
    with pytest.raises(TypeError, match="precision"):
        from course_utils.step import TrainStep
        TrainStep(DropoutNet(), torch.optim.SGD(DropoutNet().parameters(), 0.1), F.cross_entropy, object())
    assert isinstance(make_trainer().precision, MixedPrecision)  # float32 is a precision too: no None


def test_loader_caveats_name_what_cannot_be_restored():
    from torch.utils.data import DataLoader, TensorDataset
    from torchdata.stateful_dataloader import StatefulDataLoader

    from course_utils.loader_state import LoaderState

    ds = TensorDataset(*data(32))
    assert LoaderState(DataLoader(ds, batch_size=8, shuffle=True, num_workers=2)).caveat() is None
    assert "persistent workers" in LoaderState(DataLoader(ds, batch_size=8, num_workers=2,
                                                          persistent_workers=True)).caveat()
    assert "TensorDataset" in LoaderState(StatefulDataLoader(ds, batch_size=8, num_workers=2)).caveat()
    assert LoaderState(StatefulDataLoader(ds, batch_size=8)).caveat() is None  # draws in this process: restored
    assert LoaderState(TensorLoader(*data(32))).kind == "stateful"


def test_the_trainer_does_not_import_the_monitor():
    code = "import sys, course_utils.trainer; print('course_utils.monitor' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_memory_check_before_the_first_step_warns_with_the_numbers():
    from course_utils.memory import MemoryWarning

    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))

    def run(budget, **kwargs):
        torch.manual_seed(0)
        model = SimpleCNN()
        opt = torch.optim.Adam(model.parameters())
        trainer = Trainer(model, opt, nn.CrossEntropyLoss(), TensorLoader(x, y, 64), device="cpu", **kwargs)
        with SimulatedGPU(budget, model=model, optimizer=opt) as gpu:
            import warnings
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    trainer(1)
                except torch.OutOfMemoryError:
                    pass
        assert trainer.callbacks[0].result is not None  # the MemoryCheck callback, first
        warned = [w for w in caught if issubclass(w.category, MemoryWarning)]
        assert all(w.filename == __file__ for w in warned), [w.filename for w in warned]  # at the learner's call
        return warned, gpu

    quiet, gpu = run("1GiB")
    assert quiet == []
    peak = gpu.max_memory_allocated()
    warned, gpu = run(int(peak * 0.7))
    assert len(warned) == 1 and gpu.oom_count >= 1  # the warning came true
    text = str(warned[0].message)
    assert "batches of 64" in text and "free" in text and "smaller batch_size" in text
    warned, _ = run(int(peak * 0.7), oom_recovery=True)
    assert warned == []  # running out is the plan then: recovered, not warned about
