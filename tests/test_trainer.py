"""The complete Trainer: exact resume, Ctrl-C, corrupt checkpoints, accumulation, AMP, OOM recovery."""
import copy
import os
import signal

import pytest
import torch
from torch import nn

from course_utils.data import TensorLoader
from course_utils.models import SimpleCNN
from course_utils.trainer import Callback, CheckpointError, Trainer, read_checkpoint


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
    def __init__(self, step, how="raise"):
        self.step, self.how = step, how

    def on_step_end(self, trainer, step, loss):
        if step == self.step:
            if self.how == "signal":
                os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C / Jupyter's interrupt button sends
            else:
                raise KeyboardInterrupt


def assert_same_weights(a, b):
    for (name, p), q in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("loader", ["tensor", "dataloader"])
@pytest.mark.parametrize("how", ["signal", "raise"])
def test_interrupted_and_resumed_run_is_bit_identical(tmp_path, loader, how):
    reference = make_trainer(loader=loader)
    expected = reference(3)

    ckpt = tmp_path / "run.pt"
    first = make_trainer(ckpt, loader=loader, callbacks=[InterruptAt(9, how)])  # 6 steps an epoch: mid-epoch 2
    partial = first(3)
    assert first.interrupted and len(partial) == 1 and ckpt.exists()

    resumed = make_trainer(loader=loader)  # a fresh process would start like this
    resumed.load_checkpoint(ckpt)
    assert resumed.epoch == 1 and resumed.global_step == 9
    rest = resumed(3 - resumed.epoch)
    assert partial + rest == expected
    assert resumed.history == reference.history
    assert_same_weights(resumed, reference)
    assert resumed.optimizer.param_groups[0]["lr"] == reference.optimizer.param_groups[0]["lr"]


def test_interrupt_leaves_a_usable_model_and_continues_in_process(capsys):
    trainer = make_trainer(callbacks=[InterruptAt(4, "signal")])
    trainer(2)
    assert "interrupted" in capsys.readouterr().out
    trainer.callbacks.clear()
    out = trainer.model(data(4)[0])
    assert torch.isfinite(out).all()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in trainer.model.parameters())
    trainer(1)  # finishes the interrupted epoch
    assert trainer.epoch == 1 and trainer.global_step == 6
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handler restored


def test_checkpoint_is_written_atomically_and_loads_weights_only(tmp_path):
    ckpt = tmp_path / "ck.pt"
    trainer = make_trainer(ckpt)
    trainer(1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.pt"]  # no temporary files left behind
    state = torch.load(ckpt, weights_only=True)  # loads without unpickling arbitrary objects
    assert state["epoch"] == 1 and "optimizer" in state and "rng" in state


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
    with pytest.raises(CheckpointError, match="does not fit"):
        wrong = Trainer(SimpleCNN(), torch.optim.SGD(SimpleCNN().parameters(), 0.1), nn.CrossEntropyLoss(), [])
        wrong.load_checkpoint(good)
    assert read_checkpoint(good)["epoch"] == 1


def test_gradient_accumulation_equals_the_large_batch():
    x, y = data(64)
    torch.manual_seed(0)
    big = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    small = copy.deepcopy(big)
    t_big = Trainer(big, torch.optim.SGD(big.parameters(), 0.1), nn.CrossEntropyLoss(),
                    TensorLoader(x, y, 32, shuffle=False), device="cpu")
    t_small = Trainer(small, torch.optim.SGD(small.parameters(), 0.1), nn.CrossEntropyLoss(),
                      TensorLoader(x, y, 8, shuffle=False), device="cpu", accumulate=4)
    t_big(2)
    t_small(2)
    for p, q in zip(big.parameters(), small.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert t_small.global_step == 16  # 8 batches an epoch, 2 optimizer steps an epoch


def test_accumulation_with_a_partial_last_group_weights_by_samples():
    x, y = data(40)
    torch.manual_seed(0)
    big = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    small = copy.deepcopy(big)
    Trainer(big, torch.optim.SGD(big.parameters(), 0.1), nn.CrossEntropyLoss(),
            TensorLoader(x, y, 24, shuffle=False), device="cpu")(1)  # batches of 24 and 16
    Trainer(small, torch.optim.SGD(small.parameters(), 0.1), nn.CrossEntropyLoss(),
            TensorLoader(x, y, 8, shuffle=False), device="cpu", accumulate=3)(1)  # groups 8+8+8, 8+8
    for p, q in zip(big.parameters(), small.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_mixed_precision_bf16_on_cpu_tracks_fp32():
    fp32 = make_trainer()
    bf16 = make_trainer(mixed_precision="bf16")
    assert bf16.precision is not None and bf16.precision.dtype == torch.bfloat16
    a, b = fp32(2), bf16(2)
    assert all(abs(u - v) < 0.1 for u, v in zip(a, b)), (a, b)


def test_fp16_scaler_state_goes_into_the_checkpoint(tmp_path):
    ckpt = tmp_path / "fp16.pt"
    trainer = make_trainer(ckpt, mixed_precision="fp16")
    if trainer.precision is None or trainer.precision.scaler is None:
        pytest.skip("fp16 autocast with a GradScaler is not available on this device")
    trainer(1)
    state = read_checkpoint(ckpt)
    assert state["precision"]["scaler"]["scale"] == trainer.precision.scaler.get_scale()
    resumed = make_trainer(mixed_precision="fp16").load_checkpoint(ckpt)
    assert resumed.precision.scaler.get_scale() == trainer.precision.scaler.get_scale()


def test_oom_recovery_in_the_trainer_keeps_the_update():
    from course_utils.memory import SimulatedGPU

    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    torch.manual_seed(0)
    model = SimpleCNN()
    twin = copy.deepcopy(model)
    plain = Trainer(twin, torch.optim.SGD(twin.parameters(), 0.05), nn.CrossEntropyLoss(),
                    TensorLoader(x, y, 64, shuffle=False), device="cpu")
    expected = plain(1)
    opt = torch.optim.SGD(model.parameters(), 0.05)
    trainer = Trainer(model, opt, nn.CrossEntropyLoss(), TensorLoader(x, y, 64, shuffle=False), device="cpu",
                      oom_recovery=True)
    with SimulatedGPU("10MiB", model=model, optimizer=opt):
        got = trainer(1)
    assert trainer.resilient.oom_count >= 1 and trainer.resilient.micro_batch_size < 64
    assert got == pytest.approx(expected, rel=1e-5)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)


def test_evaluation_logs_and_clear_errors():
    x, y = data(32)
    trainer = make_trainer(val_loader=TensorLoader(x, y, 16, shuffle=False))
    trainer(1)
    assert set(trainer.logs[0]) == {"loss", "val_loss", "val_accuracy"}
    assert 0 <= trainer.logs[0]["val_accuracy"] <= 1
    with pytest.raises(ValueError, match="oom_recovery or accumulate"):
        make_trainer(oom_recovery=True, accumulate=2)
    with pytest.raises(TypeError, match="optimizer"):
        Trainer(DropoutNet(), "sgd", nn.CrossEntropyLoss(), [])
    with pytest.raises(ValueError, match="epochs"):
        make_trainer()(True)
