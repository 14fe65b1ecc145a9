"""course_utils.speed (matrix products, the speed ladder, loader timing) and the GPU check's CPU dry run."""
import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import nbformat
import pytest
import torch
from nbformat.v4 import new_code_cell, new_notebook
from torch.utils.data import DataLoader

from course_utils import speed
from course_utils.data import ImageDataset, synthetic_cifar
from course_utils.reference import REFERENCE_FILE, load_reference

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(images=4, repeats=1, warmup_steps=1, batch_size=4)  # every rung in a fraction of a second


@pytest.fixture(scope="module")
def cifar():
    return synthetic_cifar(64, seed=0)


# --- matrix products --------------------------------------------------------------------------

def test_matmul_gflops_is_work_over_median_time():
    g = speed.matmul_gflops(64, "cpu", repeats=3, min_run_time=0.0)
    assert g > 0
    # on the CPU there is nothing to copy: both variants run the same product
    assert speed.matmul_gflops(64, "cpu", include_transfer=True, repeats=3, min_run_time=0.0) > 0
    assert set(speed.matmul_sweep([8, 16], "cpu", min_run_time=0.0)) == {8, 16}


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "64"])
def test_matmul_gflops_rejects_bad_sizes(bad):
    with pytest.raises(ValueError, match="positive int"):
        speed.matmul_gflops(bad, "cpu")


def test_bad_device_name_is_a_clear_error():
    with pytest.raises(ValueError, match="not a device"):
        speed.matmul_gflops(8, "gpu0")


@pytest.mark.parametrize("gpu, expected", [
    ({16: 1, 32: 30, 64: 100}, 32),   # loses small, wins from 32 on
    ({16: 20, 32: 30, 64: 100}, 16),  # wins everywhere
    ({16: 1, 32: 30, 64: 10}, None),  # wins at 32 but loses again at the largest size: no crossover for good
    ({16: 1, 32: 2, 64: 3}, None),    # never wins
])
def test_crossover(gpu, expected):
    cpu = {16: 10, 32: 20, 64: 40}
    assert speed.crossover(cpu, gpu) == expected


def test_crossover_uses_only_sizes_measured_on_both():
    assert speed.crossover({16: 10, 64: 40}, {16: 1, 32: 99, 64: 50}) == 64
    assert speed.crossover({}, {16: 1}) is None


# --- the ladder -------------------------------------------------------------------------------

def test_rungs_are_cumulative_one_change_each():
    configs = [speed.NAIVE, speed.NO_ITEM, speed.RESIDENT, speed.BIG_BATCH, speed.CHANNELS_LAST,
               speed.CUDNN_BENCHMARK, speed.TF32, speed.MIXED, speed.COMPILED]
    for before, after in zip(configs, configs[1:]):
        changed = [f for f in speed.LoopConfig.__dataclass_fields__ if getattr(before, f) != getattr(after, f)]
        assert len(changed) == 1, (before, after, changed)
    assert [r.name for r in speed.RUNGS][0] == "naive"
    assert [r.name for r in speed.RUNGS if r.cuda_only] == ["pinned_memory", "cudnn_benchmark", "tf32"]
    # the chain is the ladder in order; pinned_memory is a side step from no_item_sync (one change too)
    assert [r.config for r in speed.RUNGS if r.name != "pinned_memory"] == configs
    assert speed.PINNED == replace(speed.NO_ITEM, pin_memory=True)


def test_every_rung_is_importable_by_its_name():
    assert [getattr(speed, r.name) for r in speed.RUNGS] == list(speed.RUNGS)
    assert {r.name for r in speed.RUNGS} <= set(speed.__all__)


def _flags():
    return torch.backends.cudnn.benchmark, torch.get_float32_matmul_precision()


def test_backend_flags_set_cuda_flags_only_for_cuda_and_restore_them():
    before = _flags()
    assert before == (False, "highest")  # torch's defaults
    with speed.backend_flags(speed.TF32, "cpu"):
        assert _flags() == before  # nothing set for another device
    # setting the flags touches no device, so this runs without a GPU too
    with speed.backend_flags(speed.CUDNN_BENCHMARK, "cuda"):
        assert _flags() == (True, "highest")
    with speed.backend_flags(speed.TF32, "cuda"):
        assert _flags() == (True, "high")
    assert _flags() == before
    with pytest.raises(RuntimeError, match="inside"):
        with speed.backend_flags(speed.MIXED, "cuda"):
            raise RuntimeError("inside")
    assert _flags() == before  # restored after an error too


def test_ladder_step_is_one_step_returning_the_loss_on_the_device(cifar):
    step = speed.ladder_step("cpu", cifar, replace(speed.RESIDENT, batch_size=4))
    losses = [step(), step()]
    assert all(loss.dim() == 0 and not loss.requires_grad and loss.device.type == "cpu" for loss in losses)
    with pytest.raises(ValueError, match="CUDA"):
        speed.ladder_step("cpu", cifar, speed.PINNED)


def test_train_throughput_runs_each_loop_variant(cifar):
    for config in (speed.NAIVE, speed.NO_ITEM, speed.RESIDENT, speed.CHANNELS_LAST, speed.MIXED):
        assert speed.train_throughput("cpu", cifar, config, **TINY) > 0


def test_train_throughput_times_whole_steps(cifar, monkeypatch):
    # images=10 at batch 4 means 3 steps per chunk: images/s = 12 images / the chunk's time
    seen = {}
    from course_utils.speed import ladder

    real_measure = ladder.measure

    def spy(fn, **kwargs):
        m = real_measure(fn, **kwargs)
        seen["median"] = m.median
        return m

    monkeypatch.setattr(ladder, "measure", spy)
    ips = speed.train_throughput("cpu", cifar, speed.RESIDENT, images=10, repeats=1, warmup_steps=0, batch_size=4)
    assert ips == pytest.approx(12 / seen["median"])


def test_train_throughput_bad_input(cifar):
    with pytest.raises(ValueError, match="CUDA"):
        speed.train_throughput("cpu", cifar, speed.PINNED, **TINY)
    with pytest.raises(TypeError, match="LoopConfig"):
        speed.train_throughput("cpu", cifar, "naive", **TINY)
    with pytest.raises(TypeError, match=".images and .labels"):
        speed.train_throughput("cpu", [1, 2, 3], speed.NAIVE, **TINY)
    with pytest.raises(ValueError, match="3x32x32"):
        digits_shaped = ImageDataset(torch.zeros(8, 1, 28, 28), torch.zeros(8, dtype=torch.long), ["x"], "test")
        speed.train_throughput("cpu", digits_shaped, speed.NAIVE, **TINY)
    with pytest.raises(ValueError, match="fewer than one batch"):
        speed.train_throughput("cpu", cifar, speed.NAIVE, images=4, batch_size=128)
    with pytest.raises(ValueError, match="images must be"):
        speed.train_throughput("cpu", cifar, speed.NAIVE, images=0, batch_size=4)


def test_run_ladder_on_the_cpu(cifar):
    result = speed.run_ladder("cpu", cifar, include_compile=False, rounds=2, **TINY)
    expected = [r.name for r in speed.RUNGS if not r.cuda_only and not r.compiles]
    assert list(result.images_per_s) == expected
    assert all(v > 0 for v in result.images_per_s.values())
    assert set(result.skipped) == {"pinned_memory", "cudnn_benchmark", "tf32", "compiled"}
    assert all("CUDA" in result.skipped[name] for name in ("pinned_memory", "cudnn_benchmark", "tf32"))
    ratios = result.ratios()
    assert ratios["naive"] == 1.0
    assert ratios["big_batch"] == pytest.approx(result.images_per_s["big_batch"] / result.images_per_s["naive"])
    as_json = json.loads(json.dumps(result.to_dict()))
    assert as_json["ratios"] == pytest.approx(ratios) and set(as_json["labels"]) == {r.name for r in speed.RUNGS}


def test_a_failing_compile_is_reported_not_raised(cifar):
    result = speed.run_ladder("cpu", cifar, include_compile=True, compile_backend="no_such_backend", **TINY)
    assert "compiled" in result.errors and "compiled" not in result.images_per_s
    assert "naive" in result.images_per_s


def test_batch_size_sweep(cifar):
    sweep = speed.batch_size_sweep("cpu", cifar, (2, 8), rounds=2, images=8, repeats=1, warmup_steps=0)
    assert list(sweep) == [2, 8] and all(v > 0 for v in sweep.values())


# --- profiling and the limit ------------------------------------------------------------------

def _trace(*spans, cat="kernel"):
    return {"traceEvents": [{"ph": "X", "cat": cat, "name": "k", "ts": a, "dur": b - a} for a, b in spans]}


def test_gpu_busy_fraction_is_the_union_of_gpu_activity_over_its_span(tmp_path):
    # busy 0-20 (two overlapping kernels) and 30-40: 30 of the 40 us
    trace = _trace((0, 10), (5, 20), (30, 40))
    trace["traceEvents"].append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": -100, "dur": 500})
    assert speed.gpu_busy_fraction(trace) == pytest.approx(0.75)
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    assert speed.gpu_busy_fraction(path) == pytest.approx(0.75) and speed.gpu_busy_fraction(str(path)) == 0.75
    assert speed.gpu_busy_fraction(_trace((0, 10), (10, 30), cat="gpu_memcpy")) == 1.0
    assert speed.gpu_busy_fraction(_trace((0, 10), cat="cpu_op")) is None  # a CPU-only trace
    with pytest.raises(ValueError, match="traceEvents"):
        speed.gpu_busy_fraction({"events": []})


def test_a_real_cpu_trace_has_cpu_ops_and_no_gpu_rows(cifar, tmp_path):
    from torch.profiler import ProfilerActivity, profile

    step = speed.ladder_step("cpu", cifar, replace(speed.NAIVE, batch_size=4))
    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step().item()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    cats = {e.get("cat") for e in speed.trace_events(path)}
    assert "cpu_op" in cats and not cats & set(speed.GPU_TRACE_CATEGORIES)
    assert speed.gpu_busy_fraction(path) is None


def test_cuda_event_seconds_needs_cuda():
    if torch.cuda.is_available():
        a = torch.ones(256, 256, device="cuda")
        times = speed.cuda_event_seconds(lambda: a @ a, warmup=1, repeats=3)
        assert len(times) == 3 and all(t > 0 for t in times)
    else:
        with pytest.raises(RuntimeError, match="CUDA GPU"):
            speed.cuda_event_seconds(lambda: None)


def _cifar_cnn_flops_per_image() -> int:
    """By hand: 2 FLOPs per multiply-add. Convolutions 3x3 (padding 1) at 32, 16, 8 pixels; two linear layers.
    Backward: twice the forward (input and weight gradients), except the first convolution, whose input
    (the images) needs no gradient."""
    convs = [2 * 32 * 32 * 32 * 3 * 9, 2 * 64 * 16 * 16 * 32 * 9, 2 * 128 * 8 * 8 * 64 * 9]
    linears = [2 * 2048 * 256, 2 * 256 * 10]
    forward = sum(convs) + sum(linears)
    return forward + 2 * forward - convs[0]


def test_train_step_flops_matches_a_count_by_hand():
    assert speed.train_step_flops(1) == _cifar_cnn_flops_per_image() == 63_323_136
    assert speed.train_step_flops(64) == 64 * speed.train_step_flops(1)  # linear in the batch
    assert speed.train_step_flops(8, device="cpu") == speed.train_step_flops(8)  # meta counts what the CPU runs
    linear = speed.train_step_flops(16, model_fn=lambda: torch.nn.Linear(100, 7), input_shape=(100,))
    assert linear == 2 * 16 * 100 * 7 * 2  # forward + weight gradient: the input needs no gradient
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="positive int"):
            speed.train_step_flops(bad)


def test_matmul_peak_sweep_and_rung_precision():
    for precision in ("float32", "bfloat16"):
        sweep = speed.matmul_peak_sweep([8, 16], "cpu", precision, repeats=1, min_run_time=0.0)
        assert set(sweep) == {8, 16} and all(v > 0 for v in sweep.values())
    convs = speed.conv_sweep("cpu", "bfloat16", (2,), repeats=1, min_run_time=0.0)
    assert list(convs) == ["conv1, batch=2", "conv2, batch=2", "conv3, batch=2"] and all(v > 0 for v in convs.values())
    for sweep in (speed.matmul_peak_sweep, lambda *a: speed.conv_sweep(a[1], a[2])):
        with pytest.raises(ValueError, match="CUDA"):
            sweep([8], "cpu", "tf32")
    with pytest.raises(ValueError, match="precision"):
        speed.matmul_peak_sweep([8], "cpu", "fp8")
    assert speed.rung_precision(speed.NAIVE, "cpu") == "float32"
    assert speed.rung_precision(speed.TF32, "cpu") == "float32"  # TF32 is a CUDA format
    assert speed.rung_precision(speed.MIXED, "cpu") == "bfloat16"


def test_ladder_mfu_is_achieved_flops_over_the_rungs_peak():
    mfu = speed.ladder_mfu({"naive": 1000.0, "big_batch": 500.0, "mixed_precision": 2000.0},
                           {"float32": 200.0}, "cpu")
    assert set(mfu) == {"naive", "big_batch"}  # no bfloat16 peak given: mixed_precision is left out
    per_image = _cifar_cnn_flops_per_image()
    assert mfu["naive"]["batch_size"] == 64 and mfu["big_batch"]["batch_size"] == 256
    assert mfu["naive"]["flops_per_image"] == per_image
    assert mfu["naive"]["mfu"] == pytest.approx(1000 * per_image / 200e9)
    assert mfu["big_batch"]["achieved_gflops"] == pytest.approx(500 * per_image / 1e9)


def test_time_to_accuracy(cifar):
    val = synthetic_cifar(16, seed=1)
    config = replace(speed.RESIDENT, batch_size=8)
    easy = speed.time_to_accuracy("cpu", cifar, val, config, target=0.01, max_epochs=2, eval_every=8)
    assert easy.reached and easy.images == 8 and easy.epochs == 8 / 64 and easy.seconds > 0
    assert easy.history == [(8, easy.seconds, easy.history[0][2])] and easy.images_per_s > 0
    assert easy.precision == "float32" and easy.batch_size == 8
    hard = speed.time_to_accuracy("cpu", cifar, val, config, target=1.0, max_epochs=1, eval_every=48)
    if not hard.reached:  # 1.0 after one epoch of 64 images is unlikely but not impossible
        assert hard.seconds is None and hard.epochs is None and hard.history[-1][0] == 64
    assert [h[0] for h in hard.history][:1] == [48]
    with pytest.raises(ValueError, match="target"):
        speed.time_to_accuracy("cpu", cifar, val, config, target=0)
    with pytest.raises(ValueError, match="max_epochs"):
        speed.time_to_accuracy("cpu", cifar, val, config, max_epochs=0)


# --- input pipelines --------------------------------------------------------------------------

def test_augmented_images_keep_shape_range_and_labels(cifar):
    data = speed.AugmentedImages(cifar.images, cifar.labels)
    torch.manual_seed(0)
    x, y = data[3]
    assert x.shape == cifar.images[3].shape and 0 <= x.min() and x.max() <= 1 and y == cifar.labels[3]
    assert not torch.equal(x, cifar.images[3])  # augmented
    torch.manual_seed(0)
    assert torch.equal(data[3][0], x)  # reproducible under the global seed (workers get seeded per worker)
    with pytest.raises(ValueError, match="labels"):
        speed.AugmentedImages(cifar.images, cifar.labels[:3])


def test_loader_epochs_counts_every_image(cifar):
    loader = DataLoader(speed.AugmentedImages(cifar.images, cifar.labels), batch_size=16)
    timings = speed.loader_epochs(loader, epochs=2)
    assert [t.images for t in timings] == [64, 64]
    assert all(0 < t.first_batch_s <= t.seconds and t.images_per_s > 0 for t in timings)
    with pytest.raises(ValueError, match="no batches"):
        speed.loader_epochs([], epochs=1)


def test_importing_speed_touches_no_gpu():
    code = "import torch, course_utils.speed; print(torch.cuda.is_initialized())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --- the GPU check ----------------------------------------------------------------------------

def _load_gpu_check(monkeypatch):
    """benchmarks/gpu_check.py as a fresh module (its own section registry)."""
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


def test_gpu_check_records_a_failing_section_and_runs_the_others(monkeypatch):
    gpu_check = _load_gpu_check(monkeypatch)

    @gpu_check.section("broken_for_test")
    def broken(ctx):
        raise RuntimeError("measured nothing\nsecond line")

    report = {"sections": {}, "errors": {}}
    saves = []
    ctx = gpu_check.Context(torch.device("cpu"), gpu_check.DRY, dry_run=True)
    gpu_check.run_sections(ctx, ["broken_for_test", "transfers"], report, lambda: saves.append(1))
    assert report["errors"] == {"broken_for_test": "RuntimeError: measured nothing"}
    assert report["sections"]["transfers"]["d2h_read_after_sync"] == report["sections"]["transfers"]["d2h_expected"]
    assert len(saves) == 2  # saved after each section
    with pytest.raises(ValueError, match="twice"):
        gpu_check.section("broken_for_test")(broken)


def test_gpu_check_refuses_to_run_without_a_gpu_unless_asked():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    env = {k: v for k, v in os.environ.items() if k != "GPU_CHECK_ALLOW_CPU"}
    out = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--skip-notebooks"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "GPU_CHECK_ALLOW_CPU=1" in out.stderr
    # and a dry run never writes its CPU figures into the GPU reference file
    out = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--output", str(REFERENCE_FILE)],
                         env={**env, "GPU_CHECK_ALLOW_CPU": "1"}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "must not write" in out.stderr


def _notebook(path: Path, *sources: str) -> None:
    nbformat.write(new_notebook(cells=[new_code_cell(s) for s in sources],
                                metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                         "language": "python"}}), path)


@pytest.mark.slow
def test_gpu_check_dry_run_writes_every_section_and_reports_notebooks(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("with a GPU the check runs for real, not as a dry run")
    nbs = tmp_path / "notebooks"
    nbs.mkdir()
    _notebook(nbs / "01_fine.ipynb", "x = 1", "print(x + 1)")
    _notebook(nbs / "02_broken.ipynb", "x = 1", "raise ValueError('broken on purpose')")
    _notebook(nbs / "03_expected_error.ipynb", "# NBVAL_RAISES_EXCEPTION\n1 / 0", "print('after')")
    _notebook(nbs / "README_not_a_course_notebook.ipynb", "raise SystemExit")
    output, out_dir = tmp_path / "ref.json", tmp_path / "out"
    before = REFERENCE_FILE.read_bytes() if REFERENCE_FILE.exists() else None
    env = {**os.environ, "GPU_CHECK_ALLOW_CPU": "1", "OUT": str(out_dir)}
    run = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--output", str(output),
                          "--notebooks", str(nbs)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 1, run.stdout + run.stderr  # one notebook fails on purpose

    report = json.loads(output.read_text())
    assert report["dry_run"] is True and report["stamp"]["device"] == "cpu" and report["errors"] == {}
    assert report["notebooks"] == {"01_fine": "ok", "02_broken": "cell 1: ValueError: broken on purpose",
                                   "03_expected_error": "ok"}
    for name in ("matmul", "cpu_vs_gpu", "batch_size", "speed_ladder", "transfers", "setup_training", "amp"):
        ref = load_reference(name, output)  # what the notebooks read
        assert ref is not None and ref["stamp"]["date"], name
    matmul = load_reference("matmul", output)["figures"]
    assert len(matmul["sizes"]) == len(matmul["cpu_gflops"]) == len(matmul["gpu_with_transfer_gflops"])
    ladder = load_reference("speed_ladder", output)["figures"]
    assert "compiled" in ladder["images_per_s"] and ladder["ratios"]["naive"] == 1.0  # torch.compile path ran
    assert set(ladder["peak_gflops"]) == {"float32", "bfloat16"} and set(ladder["mfu"]) == set(ladder["images_per_s"])
    assert json.loads((out_dir / "ref.json").read_text()) == report  # copied to $OUT
    assert sorted(p.name for p in (out_dir / "executed").iterdir()) == [
        "01_fine.ipynb", "02_broken.ipynb", "03_expected_error.ipynb"]
    # the committed reference file is never touched by a dry run
    assert (REFERENCE_FILE.read_bytes() if REFERENCE_FILE.exists() else None) == before
