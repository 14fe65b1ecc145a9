"""An outside review of the Trainer's documented guarantees, attacked with cases a learner would write.

Every expectation here comes from the docstrings of course_utils/trainer.py (and its parts) and README.md's
Trainer section; the oracle is always a hand-written PyTorch loop. The bugs it found are fixed and their tests
pass: validation of a model that is not a classifier, a summed loss under accumulation, a callback class passed
for an instance, `Trainer.state_dict()` that was not a snapshot, the misspelled-hook warning shown at the package's
line, a folder given as the checkpoint file.
"""
from __future__ import annotations

import ast
import collections
import copy
import math
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from course_utils import Trainer
from course_utils.callbacks import Callback, Checkpoint, LRScheduler, StopTraining
from course_utils.checkpoint import CheckpointError
from course_utils.data import TensorLoader
from course_utils.epoch import NonFiniteLossError

torch.set_num_threads(1)
CPU = torch.device("cpu")
LOSS = nn.functional.cross_entropy


# --- helpers ---------------------------------------------------------------------------------------------------

def data(n=10, d=4, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randint(0, classes, (n,), generator=g)


def mlp(seed=0, d=4, classes=3):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, 8), nn.ReLU(), nn.Linear(8, classes))


def bn_dropout_model(seed=0, d=4, classes=3):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, classes))


def as_list(x, y, bs):
    return [(x[i:i + bs], y[i:i + bs]) for i in range(0, len(x), bs)]


def loader(x, y, bs, shuffle=True, seed=None):
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return DataLoader(TensorDataset(x, y), batch_size=bs, shuffle=shuffle, generator=gen)


def sgd(model, lr=0.1):
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def adamw(model, lr=0.01):
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def close_weights(a: nn.Module, b: nn.Module, rtol=1e-5, atol=1e-6) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.allclose(sa[k].double(), sb[k].double(), rtol=rtol, atol=atol)
                                          for k in sa)


def opt_equal(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    if sa["param_groups"] != sb["param_groups"] or sa["state"].keys() != sb["state"].keys():
        return False
    for k in sa["state"]:
        for name, v in sa["state"][k].items():
            w = sb["state"][k][name]
            if isinstance(v, torch.Tensor):
                if not torch.equal(v, w):
                    return False
            elif v != w:
                return False
    return True


def hand_loop(model, opt, batches_of_epoch, epochs, accumulate=1, loss_fn=LOSS, autocast_dtype=None,
              scaler=None, clip=None, to_pair=None):
    """The oracle: a plain PyTorch loop. `batches_of_epoch()` gives one epoch's batches. Gradient accumulation
    weights each micro-batch's mean loss by its share of the group's samples; the last group may be smaller.
    Returns the epochs' sample-weighted mean losses (in float64)."""
    history = []

    def fwd(inputs):
        if isinstance(inputs, dict):
            return model(**inputs)
        if isinstance(inputs, (tuple, list)):
            return model(*inputs)
        return model(inputs)

    def step(group):
        opt.zero_grad(set_to_none=True)
        total = sum(len(y) for _x, y in group)
        out = []
        for x, y in group:
            if autocast_dtype is not None:
                with torch.autocast("cpu", dtype=autocast_dtype):
                    loss = loss_fn(fwd(x), y)
            else:
                loss = loss_fn(fwd(x), y)
            weighted = loss if len(group) == 1 else loss * (len(y) / total)
            (scaler.scale(weighted) if scaler is not None else weighted).backward()
            out.append((loss.detach().double().item(), len(y)))
        if scaler is not None:
            scaler.unscale_(opt)
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        return out

    for _ in range(epochs):
        model.train()
        s, n, group = 0.0, 0, []
        for batch in batches_of_epoch():
            group.append(to_pair(batch) if to_pair else batch)
            if len(group) == accumulate:
                for loss, m in step(group):
                    s, n = s + loss * m, n + m
                group = []
        if group:
            for loss, m in step(group):
                s, n = s + loss * m, n + m
        history.append(s / n)
    return history


def make_trainer(model, opt, train_loader, **kw):
    kw.setdefault("device", CPU)
    return Trainer(model, opt, LOSS, train_loader, **kw)


class StopAt(Callback):
    """Raise StopTraining once, at the end of global batch `at` (counted from 1 over the trainer's life)."""

    def __init__(self, at, hook="on_batch_end"):
        self.at, self.hook, self.fired = at, hook, False

    def on_batch_end(self, trainer, loss):
        if self.hook == "on_batch_end" and not self.fired and trainer.batches_trained == self.at:
            self.fired = True
            raise StopTraining(f"stop at batch {self.at}")


class Crash(Callback):
    """Simulate a process dying (an ordinary exception, not StopTraining) after global batch `at`."""

    def __init__(self, at):
        self.at = at

    def on_batch_end(self, trainer, loss):
        if trainer.batches_trained == self.at:
            raise RuntimeError("simulated crash")


# --- 1. trainer(epochs) equals a hand-written loop ---------------------------------------------------------------

@pytest.mark.parametrize("n,bs", [(10, 4),    # uneven last batch (4, 4, 2)
                                  (9, 4),     # last batch of one sample
                                  (5, 16),    # batch_size larger than the dataset: one batch an epoch
                                  (8, 8)])    # exactly one batch an epoch
def test_history_and_weights_match_hand_loop_shuffled_dataloader(n, bs):
    x, y = data(n)
    model, ref = mlp(), mlp()
    torch.manual_seed(123)
    hist = make_trainer(model, sgd(model), loader(x, y, bs))(3)
    torch.manual_seed(123)
    ref_loader = loader(x, y, bs)
    expected = hand_loop(ref, sgd(ref), lambda: ref_loader, 3)
    assert len(hist) == 3 and all(isinstance(h, float) for h in hist)
    assert hist == pytest.approx(expected, rel=1e-6)
    assert same_weights(model, ref)


def test_mean_loss_is_sample_weighted_not_batch_mean():
    # batches 4, 4, 1: a plain mean of the three batch losses would weigh the single sample like four
    x, y = data(9)
    model, ref = mlp(), mlp()
    trainer = make_trainer(model, torch.optim.SGD(model.parameters(), lr=0.0), as_list(x, y, 4))
    (mean,) = trainer(1)
    with torch.no_grad():
        expected = LOSS(ref(x), y).item()
    assert mean == pytest.approx(expected, rel=1e-6)


def test_list_of_batches_with_bn_dropout_adamw_clip_match_hand_loop():
    x, y = data(22)
    batches = as_list(x, y, 5)  # 5, 5, 5, 5, 2
    model, ref = bn_dropout_model(), bn_dropout_model()
    torch.manual_seed(7)
    hist = make_trainer(model, adamw(model), batches, grad_clip=0.5)(3)
    torch.manual_seed(7)
    expected = hand_loop(ref, adamw(ref), lambda: batches, 3, clip=0.5)
    assert hist == pytest.approx(expected, rel=1e-6)
    assert same_weights(model, ref)  # BatchNorm's running statistics included


def test_course_tensor_loader_matches_hand_loop():
    x, y = data(11)
    model, ref = mlp(), mlp()
    hist = make_trainer(model, sgd(model), TensorLoader(x, y, batch_size=4, seed=3))(2)
    ref_loader = TensorLoader(x, y, batch_size=4, seed=3)
    expected = hand_loop(ref, sgd(ref), lambda: ref_loader, 2)
    assert hist == pytest.approx(expected, rel=1e-6)
    assert same_weights(model, ref)


def test_epochs_zero_trains_nothing(tmp_path):
    x, y = data(10)
    model, ref = mlp(), mlp()
    opt = sgd(model)
    trainer = make_trainer(model, opt, loader(x, y, 4), checkpoint=tmp_path / "run.pt")
    assert trainer(0) == []
    assert trainer.epoch == 0 and trainer.history == [] and trainer.optimizer_steps == 0
    assert same_weights(model, ref)
    assert opt.state_dict()["state"] == {}


@pytest.mark.parametrize("bad", [-1, 1.0, True, "2"])
def test_bad_epochs_refused(bad):
    x, y = data(4)
    model = mlp()
    with pytest.raises(ValueError):
        make_trainer(model, sgd(model), as_list(x, y, 2))(bad)


def test_two_calls_equal_one_call_bn_dropout_shuffled():
    x, y = data(14)
    m1, m2 = bn_dropout_model(), bn_dropout_model()
    torch.manual_seed(5)
    t1 = make_trainer(m1, adamw(m1), loader(x, y, 4))
    first = t1(2) + t1(1)
    torch.manual_seed(5)
    t2 = make_trainer(m2, adamw(m2), loader(x, y, 4))
    second = t2(3)
    assert first == second
    assert t1.history == t2.history and t1.epoch == t2.epoch == 3
    assert same_weights(m1, m2) and opt_equal(t1.optimizer, t2.optimizer)


def test_dict_batches_with_batch_fn_and_dict_inputs():
    class KwModel(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = nn.Linear(4, 3), nn.Linear(2, 3)

        def forward(self, features, extra):
            return self.a(features) + self.b(extra)

    x, y = data(10)
    extra = torch.randn(10, 2, generator=torch.Generator().manual_seed(9))
    batches = [{"features": x[i:i + 4], "extra": extra[i:i + 4], "label": y[i:i + 4]} for i in range(0, 10, 4)]
    fn = lambda b: ({"features": b["features"], "extra": b["extra"]}, b["label"])  # noqa: E731
    model, ref = KwModel(), KwModel()
    hist = make_trainer(model, sgd(model), batches, batch_fn=fn, accumulate=2)(2)
    expected = hand_loop(ref, sgd(ref), lambda: batches, 2, accumulate=2, to_pair=fn)
    assert hist == pytest.approx(expected, rel=1e-6)
    assert same_weights(model, ref)


def test_dict_batches_without_batch_fn_say_what_to_do():
    x, y = data(4)
    model = mlp()
    with pytest.raises(TypeError, match="batch_fn"):
        make_trainer(model, sgd(model), [{"x": x, "y": y}])(1)


Pair = collections.namedtuple("Pair", "inputs targets")


def test_namedtuple_batches():
    x, y = data(10)
    batches = [Pair(x[i:i + 3], y[i:i + 3]) for i in range(0, 10, 3)]  # 3, 3, 3, 1
    model, ref = mlp(), mlp()
    hist = make_trainer(model, sgd(model), batches, accumulate=3)(2)
    expected = hand_loop(ref, sgd(ref), lambda: batches, 2, accumulate=3)
    assert hist == pytest.approx(expected, rel=1e-6)
    assert same_weights(model, ref)


def test_two_input_model_with_tuple_inputs():
    class TwoIn(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.l = nn.Linear(6, 3)

        def forward(self, a, b):
            return self.l(torch.cat([a, b], 1))

    x, y = data(8, d=6)
    batches = [((x[i:i + 4, :3], x[i:i + 4, 3:]), y[i:i + 4]) for i in range(0, 8, 4)]
    model, ref = TwoIn(), TwoIn()
    hist = make_trainer(model, sgd(model), batches)(2)
    expected = hand_loop(ref, sgd(ref), lambda: batches, 2)
    assert hist == pytest.approx(expected, rel=1e-6)
    assert same_weights(model, ref)


def test_empty_loader_is_a_clear_error():
    model = mlp()
    with pytest.raises(ValueError, match="no batches"):
        make_trainer(model, sgd(model), [])(1)


def test_counters():
    x, y = data(17)
    model = mlp()
    trainer = make_trainer(model, sgd(model), as_list(x, y, 4), accumulate=2)  # 5 batches: steps of 2, 2, 1
    trainer(2)
    assert (trainer.epoch, trainer.batches_trained, trainer.optimizer_steps) == (2, 10, 6)


# --- 2. mixed precision and gradient accumulation ------------------------------------------------------------------

@pytest.mark.parametrize("accumulate", [1, 2])
def test_bf16_autocast_matches_hand_loop(accumulate):
    x, y = data(14)
    model, ref = bn_dropout_model(), bn_dropout_model()
    torch.manual_seed(1)
    trainer = make_trainer(model, sgd(model), loader(x, y, 4), mixed_precision=True, accumulate=accumulate)
    assert type(trainer.precision).__name__ == "Autocast" and trainer.precision.dtype == torch.bfloat16
    hist = trainer(2)
    torch.manual_seed(1)
    ref_loader = loader(x, y, 4)
    expected = hand_loop(ref, sgd(ref), lambda: ref_loader, 2, accumulate=accumulate, autocast_dtype=torch.bfloat16)
    assert hist == pytest.approx(expected, rel=1e-6)
    assert same_weights(model, ref)


@pytest.mark.parametrize("accumulate", [1, 3])
def test_fp16_gradscaler_matches_hand_loop(accumulate):
    x, y = data(13)
    model, ref = mlp(), mlp()
    trainer = make_trainer(model, sgd(model), as_list(x, y, 4), mixed_precision="fp16", accumulate=accumulate)
    assert trainer.precision.scaler is not None
    hist = trainer(2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=2000)
    expected = hand_loop(ref, sgd(ref), lambda: as_list(x, y, 4), 2, accumulate=accumulate,
                         autocast_dtype=torch.float16, scaler=scaler)
    assert hist == pytest.approx(expected, rel=1e-3)
    assert same_weights(model, ref)
    assert trainer.precision.scaler.get_scale() == scaler.get_scale()


def test_accumulate_uneven_final_group_equals_one_big_batch():
    # 17 samples in batches of 4: 4 4 | 4 4 | 1 with accumulate=2 == big batches of 8, 8, 1 without
    x, y = data(17)
    model, ref = mlp(), mlp()
    hist = make_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), as_list(x, y, 4), accumulate=2)(2)
    expected = hand_loop(ref, torch.optim.SGD(ref.parameters(), lr=0.1), lambda: as_list(x, y, 8), 2)
    assert hist == pytest.approx(expected, rel=1e-5)
    assert close_weights(model, ref)


def test_accumulate_uneven_micro_batches_inside_a_group():
    # batches 4, 4, 1 in one group (accumulate=3): the 1-sample batch must count 1/9, not 1/3
    x, y = data(9)
    model, ref = mlp(), mlp()
    make_trainer(model, torch.optim.SGD(model.parameters(), lr=0.5), as_list(x, y, 4), accumulate=3)(1)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    LOSS(ref(x), y).backward()
    opt.step()
    assert close_weights(model, ref)


def test_accumulate_larger_than_batches_per_epoch():
    # 3 batches an epoch, accumulate=5: one step an epoch over all of them; groups do not span epochs
    x, y = data(10)
    model, ref = mlp(), mlp()
    trainer = make_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), as_list(x, y, 4), accumulate=5)
    hist = trainer(3)
    assert trainer.optimizer_steps == 3
    expected = hand_loop(ref, torch.optim.SGD(ref.parameters(), lr=0.1), lambda: [(x, y)], 3)
    assert hist == pytest.approx(expected, rel=1e-5)
    assert close_weights(model, ref)


def test_accumulate_bitwise_equal_to_weighted_hand_loop_adamw():
    x, y = data(21)
    model, ref = mlp(), mlp()
    hist = make_trainer(model, adamw(model), as_list(x, y, 4), accumulate=4)(2)  # 4 4 4 4 | 4 1
    expected = hand_loop(ref, adamw(ref), lambda: as_list(x, y, 4), 2, accumulate=4)
    assert hist == pytest.approx(expected, rel=1e-6)
    assert same_weights(model, ref)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_accumulate_refused(bad):
    model = mlp()
    with pytest.raises(ValueError):
        make_trainer(model, sgd(model), [], accumulate=bad)


# --- 3. checkpoints ----------------------------------------------------------------------------------------------

def test_resume_mid_epoch_in_a_new_trainer_is_bit_identical(tmp_path):
    """Stop inside epoch 2 (StopTraining), the Checkpoint callback saves; a new process (new model, optimizer,
    loader, a different global seed) loads the file and finishes; same weights, optimizer, history as one run."""
    x, y = data(19)
    path = tmp_path / "run.pt"

    torch.manual_seed(11)
    ref = bn_dropout_model()
    t_ref = make_trainer(ref, adamw(ref), loader(x, y, 4), accumulate=2)
    full = t_ref(3)

    torch.manual_seed(11)
    m1 = bn_dropout_model()
    t1 = make_trainer(m1, adamw(m1), loader(x, y, 4), accumulate=2, checkpoint=path, callbacks=[StopAt(8)])
    part = t1(3)
    assert len(part) == 1 and t1.stop_reason == "stop at batch 8" and path.exists()

    torch.manual_seed(999)  # another process: another global state
    m2 = bn_dropout_model(seed=42)
    t2 = make_trainer(m2, adamw(m2), loader(x, y, 4), accumulate=2)
    t2.load_checkpoint(path)
    rest = t2(2)
    assert part + rest == full and t2.history == full
    assert same_weights(m2, ref) and opt_equal(t2.optimizer, t_ref.optimizer)
    assert (t2.batches_trained, t2.optimizer_steps) == (t_ref.batches_trained, t_ref.optimizer_steps)


def test_periodic_checkpoint_then_crash_then_resume_is_bit_identical(tmp_path):
    x, y = data(14)
    path = tmp_path / "run.pt"
    torch.manual_seed(3)
    ref = bn_dropout_model()
    full = make_trainer(ref, sgd(ref), loader(x, y, 3))(2)  # 5 batches an epoch

    torch.manual_seed(3)
    m1 = bn_dropout_model()
    t1 = make_trainer(m1, sgd(m1), loader(x, y, 3), callbacks=[Checkpoint(path, every_n_steps=3), Crash(8)])
    with pytest.raises(RuntimeError, match="simulated crash"):
        t1(2)  # the file holds the state after step 6 (epoch 2, batch 1)

    m2 = bn_dropout_model(seed=1)
    t2 = make_trainer(m2, sgd(m2), loader(x, y, 3), checkpoint=path, resume=True)
    assert t2.batches_trained == 6
    t2(1)
    assert t2.history == full
    assert same_weights(m2, ref)


def test_resume_between_epochs_rolls_back_exactly(tmp_path):
    x, y = data(11)
    path = tmp_path / "run.pt"
    torch.manual_seed(0)
    model = bn_dropout_model()
    trainer = make_trainer(model, sgd(model), loader(x, y, 3))
    trainer(1)
    trainer.save_checkpoint(path)
    trainer(1)
    after_two = copy.deepcopy(model.state_dict())
    history = list(trainer.history)
    trainer.load_checkpoint(path)
    assert trainer.epoch == 1 and trainer.history == history[:1]
    trainer(1)
    assert trainer.history == history
    assert all(torch.equal(v, after_two[k]) for k, v in model.state_dict().items())


def test_checkpoint_in_a_directory_that_does_not_exist(tmp_path):
    x, y = data(6)
    path = tmp_path / "not" / "yet" / "run.pt"
    model = mlp()
    make_trainer(model, sgd(model), as_list(x, y, 4), checkpoint=str(path))(1)
    assert path.exists()
    m2 = mlp(seed=5)
    t2 = make_trainer(m2, sgd(m2), as_list(x, y, 4)).load_checkpoint(path)
    assert same_weights(m2, model) and t2.epoch == 1


def test_resume_true_without_a_file_starts_fresh(tmp_path):
    x, y = data(6)
    path = tmp_path / "missing_dir" / "run.pt"
    model, ref = mlp(), mlp()
    trainer = make_trainer(model, sgd(model), as_list(x, y, 4), checkpoint=path, resume=True)
    assert trainer.epoch == 0 and same_weights(model, ref)


def _trained(model_fn=mlp, opt_fn=sgd, n=10, bs=4, epochs=1, loader_fn=as_list, **kw):
    x, y = data(n)
    model = model_fn()
    trainer = make_trainer(model, opt_fn(model), loader_fn(x, y, bs), **kw)
    trainer(epochs)
    return trainer


def _snapshot(trainer):
    import random
    return (copy.deepcopy(trainer.model.state_dict()), copy.deepcopy(trainer.optimizer.state_dict()),
            trainer.epoch, list(trainer.history), trainer.batches_trained, trainer.optimizer_steps,
            torch.get_rng_state().clone(), random.getstate())


def _assert_untouched(trainer, snap):
    model_state, opt_state, epoch, history, batches, steps, torch_rng, py_rng = snap
    assert all(torch.equal(v, model_state[k]) for k, v in trainer.model.state_dict().items())
    now = trainer.optimizer.state_dict()
    assert now["param_groups"] == opt_state["param_groups"]
    assert now["state"].keys() == opt_state["state"].keys()
    for k in now["state"]:
        for name, v in now["state"][k].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(opt_state["state"][k][name]))
    assert (trainer.epoch, trainer.history, trainer.batches_trained, trainer.optimizer_steps) == \
        (epoch, history, batches, steps)
    assert torch.equal(torch.get_rng_state(), torch_rng)


def test_sgd_checkpoint_into_adamw_trainer_refused_untouched(tmp_path):
    path = tmp_path / "sgd.pt"
    _trained(opt_fn=sgd, epochs=1).save_checkpoint(path)
    target = _trained(opt_fn=adamw, epochs=2)
    snap = _snapshot(target)
    with pytest.raises(CheckpointError, match="sgd.pt") as info:
        target.load_checkpoint(path)
    assert "SGD" in str(info.value) and "AdamW" in str(info.value)
    _assert_untouched(target, snap)
    target(1)  # still trains


def test_other_model_shape_refused_untouched(tmp_path):
    path = tmp_path / "small.pt"
    _trained(model_fn=lambda: mlp(), epochs=1).save_checkpoint(path)

    def wider():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))

    target = _trained(model_fn=wider, epochs=1)
    snap = _snapshot(target)
    with pytest.raises(CheckpointError, match="small.pt") as info:
        target.load_checkpoint(path)
    assert "shape" in str(info.value)
    _assert_untouched(target, snap)


def test_model_with_extra_batchnorm_refused_untouched(tmp_path):
    path = tmp_path / "plain.pt"
    _trained(model_fn=mlp, epochs=1).save_checkpoint(path)
    target = _trained(model_fn=bn_dropout_model, epochs=1)
    snap = _snapshot(target)
    with pytest.raises(CheckpointError, match="plain.pt"):
        target.load_checkpoint(path)
    _assert_untouched(target, snap)


def test_checkpoint_of_another_loader_kind_refused_untouched(tmp_path):
    path = tmp_path / "list.pt"
    src = _trained(epochs=1, callbacks=[StopAt(2)])  # stopped inside the epoch: a list-kind position
    src.save_checkpoint(path)
    target = _trained(loader_fn=lambda x, y, bs: loader(x, y, bs), epochs=1)
    snap = _snapshot(target)
    with pytest.raises(CheckpointError, match="list.pt"):
        target.load_checkpoint(path)
    _assert_untouched(target, snap)


def test_scheduler_state_without_a_scheduler_refused_untouched(tmp_path):
    path = tmp_path / "sched.pt"
    x, y = data(10)
    model = mlp()
    opt = sgd(model)
    t = make_trainer(model, opt, as_list(x, y, 4), scheduler=torch.optim.lr_scheduler.StepLR(opt, 1, 0.5))
    t(2)
    t.save_checkpoint(path)
    target = _trained(epochs=1)
    snap = _snapshot(target)
    with pytest.raises(CheckpointError, match="sched.pt"):
        target.load_checkpoint(path)
    _assert_untouched(target, snap)


@pytest.mark.parametrize("damage", ["truncate_half", "truncate_tail", "empty", "garbage", "state_dict_only",
                                    "text"])
def test_damaged_or_foreign_file_refused_untouched(tmp_path, damage):
    path = tmp_path / f"{damage}.pt"
    src = _trained(epochs=1)
    src.save_checkpoint(path)
    raw = path.read_bytes()
    if damage == "truncate_half":
        path.write_bytes(raw[: len(raw) // 2])
    elif damage == "truncate_tail":
        path.write_bytes(raw[:-30])
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "garbage":
        path.write_bytes(bytes(range(256)) * 20)
    elif damage == "state_dict_only":
        torch.save(src.model.state_dict(), path)  # what a learner saves by hand
    else:
        path.write_text("not a checkpoint\n")
    target = _trained(epochs=2)
    snap = _snapshot(target)
    with pytest.raises(CheckpointError, match=f"{damage}.pt"):
        target.load_checkpoint(path)
    _assert_untouched(target, snap)


def test_missing_file_named(tmp_path):
    target = _trained(epochs=1)
    snap = _snapshot(target)
    with pytest.raises(CheckpointError, match="nope.pt"):
        target.load_checkpoint(tmp_path / "nowhere" / "nope.pt")
    _assert_untouched(target, snap)


def test_resume_true_with_a_truncated_file_is_a_clear_error(tmp_path):
    path = tmp_path / "run.pt"
    _trained(epochs=1).save_checkpoint(path)
    path.write_bytes(path.read_bytes()[:100])
    x, y = data(10)
    model = mlp()
    with pytest.raises(CheckpointError, match="run.pt"):
        make_trainer(model, sgd(model), as_list(x, y, 4), checkpoint=path, resume=True)


def _nan_batches(bad_batch_index, n=12, bs=3):
    x, y = data(n)
    x = x.clone()
    x[bad_batch_index * bs] = float("nan")  # one sample of that batch: its loss is nan, and so the weights
    return as_list(x, y, bs)


def test_non_finite_loss_stops_with_error_naming_batch_and_keeps_last_good_checkpoint(tmp_path):
    path = tmp_path / "run.pt"
    good = as_list(*data(12), 3)
    model = mlp()
    trainer = make_trainer(model, sgd(model), good, checkpoint=path)
    trainer(1)
    good_state = copy.deepcopy(model.state_dict())
    trainer.train_loader = _nan_batches(2)  # a learner swaps in data with a nan: epoch 2, batch 3 is bad
    trainer.loader_state.loader = trainer.train_loader
    with pytest.raises(NonFiniteLossError, match="epoch 2, batch 3"):
        trainer(1)
    assert trainer.epoch == 1 and len(trainer.history) == 1
    state = torch.load(path, weights_only=True)
    assert all(torch.equal(state["model"][k], v) for k, v in good_state.items())
    assert all(torch.isfinite(t).all() for t in state["model"].values() if t.is_floating_point())


def test_non_finite_loss_with_periodic_checkpoint_writes_no_nan(tmp_path):
    path = tmp_path / "run.pt"
    model = mlp()
    trainer = make_trainer(model, sgd(model), _nan_batches(2), callbacks=[Checkpoint(path, every_n_steps=1)])
    with pytest.raises(NonFiniteLossError):
        trainer(1)
    state = torch.load(path, weights_only=True)
    assert state["batches_trained"] == 2  # the last good step
    assert all(torch.isfinite(t).all() for t in state["model"].values() if t.is_floating_point())
    assert all(map(math.isfinite, state["ranks"][0]["position"]["losses"]))


def test_non_finite_loss_first_epoch_no_checkpoint_written(tmp_path):
    path = tmp_path / "run.pt"
    model = mlp()
    trainer = make_trainer(model, sgd(model), _nan_batches(0), checkpoint=path)
    with pytest.raises(NonFiniteLossError, match="batch 1"):
        trainer(2)
    assert not path.exists()


def test_stop_after_nan_then_save_refused(tmp_path):
    # a StopTraining after a nan step: the stop itself raises (the running loss is nan), nothing is written
    path = tmp_path / "run.pt"
    model = mlp()
    trainer = make_trainer(model, sgd(model), _nan_batches(1), checkpoint=path, callbacks=[StopAt(3)])
    with pytest.raises(NonFiniteLossError):
        trainer(1)
    assert not path.exists()


def test_lr_too_high_is_caught(tmp_path):
    x, y = data(12)
    model = mlp()
    path = tmp_path / "run.pt"
    trainer = make_trainer(model, torch.optim.SGD(model.parameters(), lr=1e30), as_list(x, y * 0 + 1, 3),
                           checkpoint=path)
    with pytest.raises(NonFiniteLossError):
        trainer(3)
    if path.exists():
        state = torch.load(path, weights_only=True)
        assert all(torch.isfinite(t).all() for t in state["model"].values() if t.is_floating_point())


# --- 4. callbacks ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["on_epoch_ends", "on_step_end", "onbatch_end", "on_batch_ned", "on_train_begin"])
def test_misspelled_hook_is_flagged(name):
    body = {name: lambda self, trainer, *a: None}
    Typo = type("Typo", (Callback,), body)
    x, y = data(4)
    model = mlp()
    trainer = make_trainer(model, sgd(model), as_list(x, y, 2), callbacks=[Typo()])
    with pytest.warns(UserWarning, match=name):
        trainer(1)


def test_misspelled_hook_is_never_called_and_warned_once():
    """What the callbacks docstring promises (the brief said "refused": the code warns, it does not raise)."""
    calls = []

    class Typo(Callback):
        def on_epoch_ends(self, trainer, logs):
            calls.append(1)

    x, y = data(4)
    model = mlp()
    trainer = make_trainer(model, sgd(model), as_list(x, y, 2), callbacks=[Typo()])
    with pytest.warns(UserWarning, match="did you mean on_epoch_end"):
        trainer(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer(1)  # once per callback
    assert calls == [] and trainer.epoch == 2


def test_correct_hooks_do_not_warn():
    class Fine(Callback):
        def on_epoch_end(self, trainer, logs):
            pass

        def state_dict(self):
            return {}

        def helper(self):
            pass

    x, y = data(4)
    model = mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_trainer(model, sgd(model), as_list(x, y, 2), callbacks=[Fine()])(1)


@pytest.mark.parametrize("at", [1, 3, 4, 5, 8])  # first batch, mid-epoch, an epoch's last, next epoch's first...
@pytest.mark.parametrize("accumulate", [1, 2])
def test_stop_training_then_second_call_continues_exactly(at, accumulate):
    x, y = data(15)  # 4 batches of 4: 4 4 4 3
    torch.manual_seed(2)
    ref = bn_dropout_model()
    t_ref = make_trainer(ref, adamw(ref), loader(x, y, 4), accumulate=accumulate)
    full = t_ref(3)

    torch.manual_seed(2)
    model = bn_dropout_model()
    stop = StopAt(at)
    trainer = make_trainer(model, adamw(model), loader(x, y, 4), accumulate=accumulate, callbacks=[stop])
    first = trainer(3)
    assert stop.fired and trainer.stop_reason == f"stop at batch {at}"
    # the stop lands on a step boundary: never inside an accumulation group
    assert trainer.batches_trained % accumulate == 0 or trainer.batches_trained % 4 == 0
    remaining = 3 - len(first)
    second = trainer(remaining)
    assert first + second == full
    assert trainer.history == t_ref.history
    assert same_weights(model, ref) and opt_equal(trainer.optimizer, t_ref.optimizer)
    assert (trainer.batches_trained, trainer.optimizer_steps) == (t_ref.batches_trained, t_ref.optimizer_steps)


class StopOnce(Callback):
    def __init__(self, hook, when=1):
        self.hook, self.when, self.calls = hook, when, 0

    def _maybe(self):
        self.calls += 1
        if self.calls == self.when:
            raise StopTraining(f"stop in {self.hook}")


class StopAtEpochEnd(StopOnce):
    def on_epoch_end(self, trainer, logs):
        self._maybe()


class StopAtEpochStart(StopOnce):
    def on_epoch_start(self, trainer):
        self._maybe()


class StopAtTrainStart(StopOnce):
    def on_train_start(self, trainer):
        self._maybe()


class StopAtBatchStart(StopOnce):
    def on_batch_start(self, trainer, batch):
        self._maybe()


@pytest.mark.parametrize("cb,when", [(StopAtEpochEnd, 1), (StopAtEpochStart, 2), (StopAtTrainStart, 1),
                                     (StopAtBatchStart, 6)])
def test_stop_in_other_hooks_then_continue_exactly(cb, when):
    x, y = data(10)
    torch.manual_seed(4)
    ref = bn_dropout_model()
    full = make_trainer(ref, sgd(ref), loader(x, y, 4), accumulate=2)(3)
    torch.manual_seed(4)
    model = bn_dropout_model()
    trainer = make_trainer(model, sgd(model), loader(x, y, 4), accumulate=2, callbacks=[cb("x", when)])
    first = trainer(3)
    assert trainer.stop_reason == "stop in x"
    assert trainer.batches_trained % 2 == 0 or trainer.batches_trained % 3 == 0
    second = trainer(3 - len(first))
    assert first + second == full
    assert same_weights(model, ref)


def test_stop_training_every_hook_still_gets_the_event():
    seen = []

    class Stopper(Callback):
        def on_epoch_end(self, trainer, logs):
            raise StopTraining("enough")

    class Watcher(Callback):
        order = 5

        def on_epoch_end(self, trainer, logs):
            seen.append(trainer.epoch)

    x, y = data(6)
    model = mlp()
    trainer = make_trainer(model, sgd(model), as_list(x, y, 3), callbacks=[Stopper(), Watcher()])
    assert len(trainer(5)) == 1
    assert seen == [1] and trainer.stop_reason == "enough"


def test_scheduler_per_step_resume_exact(tmp_path):
    x, y = data(14)
    path = tmp_path / "run.pt"

    def build(stop=None, seed=0):
        model = mlp(seed)
        opt = sgd(model)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
        cbs = [LRScheduler(sched, interval="step")] + ([stop] if stop else [])
        return make_trainer(model, opt, as_list(x, y, 3), callbacks=cbs, checkpoint=path)

    ref = build()
    full = ref(2)
    t1 = build(StopAt(7))
    t1(2)
    t2 = build(seed=3)
    t2.load_checkpoint(path)
    t2(1)
    assert t2.history == full
    assert same_weights(t2.model, ref.model) and opt_equal(t2.optimizer, ref.optimizer)


# --- 5. the package's import graph has no cycles -------------------------------------------------------------

def _module_graph() -> dict[str, set[str]]:
    root = Path(__file__).resolve().parents[1] / "course_utils"
    modules = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root.parent).with_suffix("")
        parts = list(rel.parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        modules[".".join(parts)] = (path, is_pkg)

    def resolve(current: str, is_pkg: bool, level: int, module: str | None) -> str:
        if level == 0:
            return module or ""
        base = current.split(".") if is_pkg else current.split(".")[:-1]
        if level > 1:
            base = base[: len(base) - (level - 1)]
        return ".".join(base + ([module] if module else []))

    def type_checking_nodes(tree) -> set[int]:
        skip = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.If):
                test = node.test
                name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
                if name == "TYPE_CHECKING":
                    for sub in node.body:
                        for inner in ast.walk(sub):
                            skip.add(id(inner))
        return skip

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, is_pkg) in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = type_checking_nodes(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = resolve(name, is_pkg, node.level, node.module)
                for a in node.names:
                    sub = f"{base}.{a.name}" if base else a.name
                    targets.append(sub if sub in modules else base)
            for t in targets:
                # the deepest package module named (import course_utils.x.y runs course_utils.x.y)
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != name and t.startswith("course_utils"):
                    graph[name].add(t)
                    # importing a.b.c first runs the __init__ of a.b (unless the importer lives in a.b already)
                    own = name if is_pkg else name.rpartition(".")[0]
                    parent = t.rpartition(".")[0]
                    while parent and not (own == parent or own.startswith(parent + ".")):
                        graph[name].add(parent)
                        parent = parent.rpartition(".")[0]
    return graph


def _cycles(graph):
    cycles, state, stack = [], {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                cycles.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    return cycles


def test_import_graph_has_no_cycles():
    graph = _module_graph()
    assert "course_utils.trainer" in graph and "course_utils.checkpoint" in graph["course_utils.trainer"]
    cycles = _cycles(graph)
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


# --- more attacks: exact resume for every loader kind, at every stop point, in a new trainer ---------------------

LOADERS = {
    "list": lambda x, y, bs: as_list(x, y, bs),
    "dataloader_global_rng": lambda x, y, bs: loader(x, y, bs),
    "dataloader_own_generator": lambda x, y, bs: loader(x, y, bs, seed=17),
    "tensor_loader": lambda x, y, bs: TensorLoader(x, y, batch_size=bs, seed=5),
}


@pytest.mark.parametrize("kind", sorted(LOADERS))
@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("at", range(1, 9))  # 4 batches an epoch (4 4 4 2): every stop point of two epochs
def test_resume_from_file_at_every_stop_point(tmp_path, kind, accumulate, at):
    x, y = data(14)
    path = tmp_path / "run.pt"
    make = LOADERS[kind]
    torch.manual_seed(21)
    ref = bn_dropout_model()
    t_ref = make_trainer(ref, adamw(ref), make(x, y, 4), accumulate=accumulate)
    full = t_ref(2)

    torch.manual_seed(21)
    m1 = bn_dropout_model()
    t1 = make_trainer(m1, adamw(m1), make(x, y, 4), accumulate=accumulate, checkpoint=path, callbacks=[StopAt(at)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t1(2)
    if t1.epoch == 2:  # the stop asked for at the very last batch: nothing left
        assert t1.history == full
        return
    torch.manual_seed(1234)
    m2 = bn_dropout_model(seed=99)
    t2 = make_trainer(m2, adamw(m2), make(x, y, 4), accumulate=accumulate)
    t2.load_checkpoint(path)
    t2(2 - t2.epoch)
    assert t2.history == full
    assert same_weights(m2, ref) and opt_equal(t2.optimizer, t_ref.optimizer)


def test_crash_after_periodic_save_at_the_epochs_last_step(tmp_path):
    """every_n_steps lands on the epoch's last step (the pass is over, the epoch not closed); the process dies in
    an on_epoch_end hook before the epoch-end save. Resuming must close epoch 1 and train epoch 2 exactly."""
    x, y = data(14)
    path = tmp_path / "run.pt"

    class DieAtEpochEnd(Callback):
        def on_epoch_end(self, trainer, logs):
            raise RuntimeError("killed")

    torch.manual_seed(8)
    ref = bn_dropout_model()
    full = make_trainer(ref, sgd(ref), loader(x, y, 4))(2)
    torch.manual_seed(8)
    m1 = bn_dropout_model()
    t1 = make_trainer(m1, sgd(m1), loader(x, y, 4), callbacks=[Checkpoint(path, every_n_steps=4), DieAtEpochEnd()])
    with pytest.raises(RuntimeError, match="killed"):
        t1(2)
    m2 = bn_dropout_model(seed=3)
    t2 = make_trainer(m2, sgd(m2), loader(x, y, 4), checkpoint=path, resume=True)
    assert t2.epoch == 0 and t2.batches_trained == 4
    assert t2(2) == full
    assert same_weights(m2, ref)


def test_ctrl_c_between_steps_then_continue_exactly():
    import signal

    class CtrlC(Callback):
        def __init__(self, at):
            self.at = at

        def on_batch_end(self, trainer, loss):
            if trainer.batches_trained == self.at:
                signal.raise_signal(signal.SIGINT)

    x, y = data(14)
    torch.manual_seed(6)
    ref = bn_dropout_model()
    full = make_trainer(ref, sgd(ref), loader(x, y, 4), accumulate=2)(2)
    torch.manual_seed(6)
    model = bn_dropout_model()
    trainer = make_trainer(model, sgd(model), loader(x, y, 4), accumulate=2, callbacks=[CtrlC(5)])
    first = trainer(2)
    assert trainer.interrupted and trainer.batches_trained == 6  # the step (its whole group) finished first
    trainer.callbacks = [cb for cb in trainer.callbacks if not isinstance(cb, CtrlC)]
    assert first + trainer(2 - len(first)) == full
    assert same_weights(model, ref)


def test_after_nan_reload_last_good_checkpoint_and_continue(tmp_path):
    """The learner's way out of a NonFiniteLossError: lower the learning rate, load the last good checkpoint,
    go on. The result equals a fresh trainer that loads the same file."""
    path = tmp_path / "run.pt"
    x, y = data(12)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = make_trainer(model, opt, as_list(x, y, 3), checkpoint=path)
    trainer(1)
    opt.param_groups[0]["lr"] = 1e30
    with pytest.raises(NonFiniteLossError):
        trainer(3)
    trainer.load_checkpoint(path)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    m2 = mlp(seed=4)
    t2 = make_trainer(m2, torch.optim.SGD(m2.parameters(), lr=0.1), as_list(x, y, 3)).load_checkpoint(path)
    trainer(1)  # (overwrites run.pt)
    t2(1)
    assert trainer.history == t2.history and same_weights(model, m2)


def test_nan_gradient_with_finite_loss_never_saved(tmp_path):
    """The last step of the run makes the weights nan while every loss was finite: the epoch-end save must
    refuse (never non-finite weights in the file)."""
    class SqrtAtZero(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.l = nn.Linear(4, 3)
            self.z = nn.Parameter(torch.zeros(()))

        def forward(self, x):
            return self.l(x) + 0.0 * torch.sqrt(self.z)  # finite output; d/dz = 0 * inf = nan

    path = tmp_path / "run.pt"
    x, y = data(4)
    model = SqrtAtZero()
    trainer = make_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), [(x, y)], checkpoint=path)
    with pytest.raises(NonFiniteLossError):
        trainer(1)
    assert not path.exists()


def test_drop_last_with_batch_size_larger_than_dataset_is_a_clear_error():
    x, y = data(5)
    model = mlp()
    dl = DataLoader(TensorDataset(x, y), batch_size=8, drop_last=True)
    with pytest.raises(ValueError, match="no batches"):
        make_trainer(model, sgd(model), dl)(1)


def test_validation_figures_match_hand_computation_and_keep_train_mode():
    x, y = data(12)
    vx, vy = data(7, seed=1)
    model, ref = bn_dropout_model(), bn_dropout_model()
    torch.manual_seed(0)
    trainer = make_trainer(model, sgd(model), as_list(x, y, 4), val_loader=as_list(vx, vy, 3))
    trainer(2)
    torch.manual_seed(0)
    hand_loop(ref, sgd(ref), lambda: as_list(x, y, 4), 2)
    ref.eval()
    with torch.no_grad():
        out = ref(vx)
    assert same_weights(model, ref)
    assert trainer.logs[-1]["val_loss"] == pytest.approx(LOSS(out, vy).item(), rel=1e-6)
    assert trainer.logs[-1]["val_accuracy"] == pytest.approx((out.argmax(1) == vy).float().mean().item())
    assert model.training


@pytest.mark.parametrize("case", ["regression_1d", "tuple_output"])
def test_validation_with_models_that_train_fine(case):
    class Reg(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.l = nn.Linear(4, 3)

        def forward(self, x):
            out = self.l(x)
            return out.sum(1) if case == "regression_1d" else (out, out.pow(2).mean())

    x, y = data(12)
    if case == "regression_1d":
        targets, loss_fn = x.sum(1), nn.functional.mse_loss
    else:
        targets, loss_fn = y, lambda out, t: LOSS(out[0], t) + 0.01 * out[1]
    model = Reg()
    trainer = Trainer(model, sgd(model), loss_fn, as_list(x, targets, 4), device=CPU,
                      val_loader=as_list(x, targets, 4))
    trainer(1)  # training alone (no val_loader) works for both
    assert math.isfinite(trainer.logs[0]["val_loss"])


def test_accumulate_with_a_summed_loss_equals_one_big_batch():
    x, y = data(12)
    model, ref = mlp(), mlp()
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), loss_fn, as_list(x, y, 4), device=CPU,
            accumulate=3)(1)
    opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    loss_fn(ref(x), y).backward()
    opt.step()
    assert close_weights(model, ref)


class StopInStep(Callback):
    """StopTraining raised inside the optimizer step's hooks: the step must still complete."""

    def __init__(self, hook, at_step):
        self.hook, self.at_step, self.done = hook, at_step, False

    def _maybe(self, trainer):
        if not self.done and trainer.optimizer_steps + 1 == self.at_step:
            self.done = True
            raise StopTraining("inside the step")

    def on_after_backward(self, trainer):
        if self.hook == "after_backward":
            self._maybe(trainer)

    def on_before_optimizer_step(self, trainer):
        if self.hook == "before_step":
            self._maybe(trainer)

    def on_after_optimizer_step(self, trainer):
        if self.hook == "after_step":
            if not self.done and trainer.optimizer_steps == self.at_step:
                self.done = True
                raise StopTraining("inside the step")


@pytest.mark.parametrize("hook", ["after_backward", "before_step", "after_step"])
def test_stop_raised_inside_the_step_then_continue_exactly(hook):
    x, y = data(14)
    torch.manual_seed(12)
    ref = bn_dropout_model()
    full = make_trainer(ref, sgd(ref), loader(x, y, 4), accumulate=2)(2)
    torch.manual_seed(12)
    model = bn_dropout_model()
    trainer = make_trainer(model, sgd(model), loader(x, y, 4), accumulate=2, callbacks=[StopInStep(hook, 3)])
    first = trainer(2)
    assert trainer.stop_reason == "inside the step" and trainer.optimizer_steps == 3
    assert first + trainer(2 - len(first)) == full
    assert same_weights(model, ref)


def test_oom_recovery_option_changes_nothing_without_oom():
    x, y = data(14)
    torch.manual_seed(3)
    a = bn_dropout_model()
    ha = make_trainer(a, adamw(a), loader(x, y, 4), accumulate=2, oom_recovery=True)(2)
    torch.manual_seed(3)
    b = bn_dropout_model()
    hb = make_trainer(b, adamw(b), loader(x, y, 4), accumulate=2)(2)
    assert ha == hb and same_weights(a, b)


def test_triple_batches_without_batch_fn_say_what_to_do():
    x, y = data(4)
    model = mlp()
    with pytest.raises(TypeError, match="batch_fn"):
        make_trainer(model, sgd(model), [(x, y, y)])(1)


def test_callback_class_instead_of_instance_is_refused_clearly():
    from course_utils.callbacks import EarlyStopping
    x, y = data(4)
    model = mlp()
    with pytest.raises((TypeError, ValueError), match="EarlyStopping"):
        make_trainer(model, sgd(model), as_list(x, y, 2), callbacks=[EarlyStopping])(1)


class Batches:
    """A learner's own iterable of batches (no state_dict, not a DataLoader): the same order every pass."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        yield from self.batches


class NoisyDataset(torch.utils.data.Dataset):
    """Random augmentation in __getitem__ from torch's, numpy's and Python's global generators."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        import random

        import numpy as np
        noise = torch.randn(self.x.shape[1]) * 0.1 + float(np.random.rand()) * 0.01 + random.random() * 0.01
        return self.x[i] + noise, self.y[i]


@pytest.mark.parametrize("kind", ["own_iterable", "augmenting_dataloader"])
@pytest.mark.parametrize("at", [2, 5])
def test_resume_other_loaders_from_file(tmp_path, kind, at):
    x, y = data(14)
    path = tmp_path / "run.pt"

    def make():
        if kind == "own_iterable":
            return Batches(as_list(x, y, 4))
        return DataLoader(NoisyDataset(x, y), batch_size=4, shuffle=True)

    import random

    import numpy as np

    def seed_all(s):
        torch.manual_seed(s)
        np.random.seed(s)
        random.seed(s)

    seed_all(31)
    ref = bn_dropout_model()
    full = make_trainer(ref, sgd(ref), make())(2)
    seed_all(31)
    m1 = bn_dropout_model()
    t1 = make_trainer(m1, sgd(m1), make(), checkpoint=path, callbacks=[StopAt(at)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t1(2)
    seed_all(5)
    m2 = bn_dropout_model(seed=2)
    t2 = make_trainer(m2, sgd(m2), make()).load_checkpoint(path)
    t2(2 - t2.epoch)
    assert t2.history == full
    assert same_weights(m2, ref)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_resume_mixed_precision_mid_epoch_from_file(tmp_path, precision):
    x, y = data(14)
    path = tmp_path / "run.pt"
    torch.manual_seed(0)
    ref = bn_dropout_model()
    t_ref = make_trainer(ref, adamw(ref), loader(x, y, 4), mixed_precision=precision, accumulate=2, grad_clip=1.0)
    full = t_ref(2)
    torch.manual_seed(0)
    m1 = bn_dropout_model()
    make_trainer(m1, adamw(m1), loader(x, y, 4), mixed_precision=precision, accumulate=2, grad_clip=1.0,
                 checkpoint=path, callbacks=[StopAt(6)])(2)
    m2 = bn_dropout_model(seed=1)
    t2 = make_trainer(m2, adamw(m2), loader(x, y, 4), mixed_precision=precision, accumulate=2, grad_clip=1.0)
    t2.load_checkpoint(path)
    t2(1)
    assert t2.history == full and same_weights(m2, ref)
    if precision == "fp16":
        assert t2.precision.scaler.get_scale() == t_ref.precision.scaler.get_scale()


def test_fp16_with_grad_clip_matches_hand_loop():
    x, y = data(13)
    model, ref = mlp(), mlp()
    hist = make_trainer(model, sgd(model), as_list(x, y, 4), mixed_precision="fp16", accumulate=2,
                        grad_clip=0.3)(2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=2000)
    expected = hand_loop(ref, sgd(ref), lambda: as_list(x, y, 4), 2, accumulate=2, autocast_dtype=torch.float16,
                         scaler=scaler, clip=0.3)
    assert hist == pytest.approx(expected, rel=1e-3)
    assert same_weights(model, ref)


class Counter(Callback):
    """A learner's callback with state; version 2 renamed its state's key."""

    def __init__(self, key="count"):
        self.key, self.count = key, 0

    def on_batch_end(self, trainer, loss):
        self.count += 1

    def state_dict(self):
        return {self.key: self.count}

    def load_state_dict(self, state):
        self.count = state[self.key]  # KeyError for a checkpoint of the other version


def test_failure_half_way_through_loading_puts_everything_back(tmp_path):
    """The model and optimizer fit, a callback's load_state_dict fails after they were loaded: all of it must be
    put back (all-or-nothing), and the error must name the file."""
    path = tmp_path / "v1.pt"
    _trained(opt_fn=adamw, epochs=2, callbacks=[Counter("count")]).save_checkpoint(path)
    target = _trained(opt_fn=adamw, epochs=1, n=6, callbacks=[Counter("n_batches")])
    snap = _snapshot(target)
    counter = [cb for cb in target.callbacks if isinstance(cb, Counter)][0]
    before = counter.count
    with pytest.raises(CheckpointError, match="v1.pt"):
        target.load_checkpoint(path)
    _assert_untouched(target, snap)
    assert counter.count == before
    target(1)


def test_failure_half_way_on_a_fresh_optimizer_leaves_it_fresh(tmp_path):
    path = tmp_path / "v1.pt"
    _trained(opt_fn=adamw, epochs=1, callbacks=[Counter("count")]).save_checkpoint(path)
    x, y = data(10)
    model = mlp(seed=3)
    opt = adamw(model)
    target = make_trainer(model, opt, as_list(x, y, 4), callbacks=[Counter("n_batches")])
    snap = _snapshot(target)
    with pytest.raises(CheckpointError):
        target.load_checkpoint(path)
    _assert_untouched(target, snap)
    assert opt.state_dict()["state"] == {}


def test_save_after_a_nan_is_refused_and_writes_nothing(tmp_path):
    model = mlp()
    trainer = make_trainer(model, sgd(model), _nan_batches(1))
    with pytest.raises(NonFiniteLossError):
        trainer(1)
    with pytest.raises(NonFiniteLossError, match="other.pt"):
        trainer.save_checkpoint(tmp_path / "other.pt")
    assert list(tmp_path.iterdir()) == []


def test_persistent_workers_resume_from_file(tmp_path):
    x, y = data(14)
    path = tmp_path / "run.pt"

    def make():
        return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True, num_workers=1, persistent_workers=True)

    torch.manual_seed(9)
    ref = bn_dropout_model()
    full = make_trainer(ref, sgd(ref), make())(2)
    torch.manual_seed(9)
    m1 = bn_dropout_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer(m1, sgd(m1), make(), checkpoint=path, callbacks=[StopAt(6)])(2)
    torch.manual_seed(77)
    m2 = bn_dropout_model(seed=8)
    t2 = make_trainer(m2, sgd(m2), make()).load_checkpoint(path)
    t2(1)
    assert t2.history == full and same_weights(m2, ref)


def test_in_memory_state_dict_roll_back():
    x, y = data(12)
    model = mlp()
    trainer = make_trainer(model, adamw(model), as_list(x, y, 4))
    trainer(1)
    state = trainer.state_dict()
    after_one = copy.deepcopy(model.state_dict())
    trainer(2)
    second_epoch = trainer.history[1]
    trainer.load_state_dict(state)
    assert trainer.epoch == 1
    assert all(torch.equal(v, after_one[k]) for k, v in model.state_dict().items())
    assert trainer(1) == [second_epoch]


def test_in_memory_load_of_a_misfit_state_is_a_value_error_and_changes_nothing():
    src = _trained(opt_fn=sgd, epochs=1)
    state = copy.deepcopy(src.state_dict())
    target = _trained(opt_fn=adamw, epochs=1)
    snap = _snapshot(target)
    with pytest.raises(ValueError, match="SGD"):
        target.load_state_dict(state)
    _assert_untouched(target, snap)


def test_failed_load_keeps_a_stopped_trainers_position(tmp_path):
    """A trainer stopped inside an epoch; loading a checkpoint that does not fit fails; the trainer still
    continues exactly where it stopped."""
    path = tmp_path / "sgd.pt"
    _trained(opt_fn=sgd, epochs=1).save_checkpoint(path)
    x, y = data(14)
    torch.manual_seed(13)
    ref = bn_dropout_model()
    full = make_trainer(ref, adamw(ref), loader(x, y, 4))(2)
    torch.manual_seed(13)
    model = bn_dropout_model()
    trainer = make_trainer(model, adamw(model), loader(x, y, 4), callbacks=[StopAt(6)])
    first = trainer(2)
    with pytest.raises(CheckpointError):
        trainer.load_checkpoint(path)
    assert first + trainer(2 - len(first)) == full
    assert same_weights(model, ref)


def test_load_mid_epoch_checkpoint_into_a_trainer_stopped_elsewhere(tmp_path):
    x, y = data(14)
    path = tmp_path / "run.pt"
    torch.manual_seed(14)
    ref = bn_dropout_model()
    full = make_trainer(ref, sgd(ref), loader(x, y, 4))(2)
    torch.manual_seed(14)
    m1 = bn_dropout_model()
    make_trainer(m1, sgd(m1), loader(x, y, 4), checkpoint=path, callbacks=[StopAt(3)])(2)
    torch.manual_seed(50)
    m2 = bn_dropout_model(seed=6)
    t2 = make_trainer(m2, sgd(m2), loader(x, y, 4), callbacks=[StopAt(6)])
    t2(2)  # stopped at batch 6 of its own run
    t2.load_checkpoint(path)  # back to batch 3 of the reference run
    t2.callbacks = [cb for cb in t2.callbacks if not isinstance(cb, StopAt)]
    t2(2 - t2.epoch)
    assert t2.history == full and same_weights(m2, ref)


@pytest.mark.parametrize("accumulate,precision", [(1, False), (2, False), (3, "bf16")])
def test_non_finite_error_names_the_first_bad_batch(accumulate, precision):
    model = mlp()
    trainer = make_trainer(model, sgd(model), _nan_batches(2, n=15), accumulate=accumulate,
                           mixed_precision=precision)
    with pytest.raises(NonFiniteLossError, match=r"epoch 1, batch 3\b"):
        trainer(1)


def test_epoch_scheduler_and_early_stopping_state_survive_a_file_resume(tmp_path):
    from course_utils.callbacks import EarlyStopping
    x, y = data(14)
    vx, vy = data(6, seed=3)
    path = tmp_path / "run.pt"

    def build(stop=None, seed=0):
        model = bn_dropout_model(seed)
        opt = sgd(model)
        cbs = [EarlyStopping("val_loss", patience=50)] + ([stop] if stop else [])
        return make_trainer(model, opt, loader(x, y, 4), val_loader=as_list(vx, vy, 4), callbacks=cbs,
                            scheduler=torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
                            checkpoint=path)

    torch.manual_seed(0)
    ref = build()
    full = ref(3)
    torch.manual_seed(0)
    build(StopAt(6))(3)
    torch.manual_seed(123)
    t2 = build(seed=9)
    t2.load_checkpoint(path)
    t2(3 - t2.epoch)
    assert t2.history == full and t2.logs == ref.logs
    assert same_weights(t2.model, ref.model) and opt_equal(t2.optimizer, ref.optimizer)
    es2 = [cb for cb in t2.callbacks if isinstance(cb, EarlyStopping)][0]
    es1 = [cb for cb in ref.callbacks if isinstance(cb, EarlyStopping)][0]
    assert (es2.best, es2.best_epoch, es2.bad_epochs) == (es1.best, es1.best_epoch, es1.bad_epochs)


def test_a_per_sample_loss_a_folder_as_checkpoint_and_a_misspelled_hook_are_named_at_once(tmp_path):
    x, y = data(8)
    model = mlp()
    with pytest.raises(ValueError, match="reduction='none'"):
        Trainer(model, sgd(model), nn.CrossEntropyLoss(reduction="none"), as_list(x, y, 4), device=CPU)
    with pytest.raises(IsADirectoryError, match="run.pt"):
        make_trainer(model, sgd(model), as_list(x, y, 4), checkpoint=tmp_path)

    class Typo(Callback):
        def on_step_end(self, trainer):
            pass

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(model, sgd(model), as_list(x, y, 4), callbacks=[Typo()])(1)
    typo = [w for w in caught if "on_step_end" in str(w.message)]
    assert typo and typo[0].filename == __file__, [w.filename for w in typo]  # shown at the learner's line


def test_validation_of_a_regression_has_a_loss_and_no_accuracy():
    x, _y = data(12)
    model = nn.Sequential(nn.Linear(4, 1), nn.Flatten(0))
    trainer = Trainer(model, sgd(model), nn.functional.mse_loss, as_list(x, x.sum(1), 4), device=CPU,
                      val_loader=as_list(x, x.sum(1), 4))
    trainer(1)
    assert math.isfinite(trainer.logs[0]["val_loss"]) and "val_accuracy" not in trainer.logs[0]
    with torch.no_grad():
        expected = nn.functional.mse_loss(model(x), x.sum(1)).item()
    assert trainer.evaluate(as_list(x, x.sum(1), 4)) == pytest.approx({"loss": expected, "accuracy": None})
