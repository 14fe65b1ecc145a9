"""Data parallelism for real: two processes on gloo, launched with torchrun, against one process."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from course_utils import distributed
from course_utils.data import TensorLoader
from course_utils.examples import train_digits
from course_utils.trainer import Trainer

HERE = Path(__file__).parent
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")


def torchrun(*args, nproc=2, timeout=180, env=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *map(str, args)]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)


def example(*args, nproc=1):
    base = ["-m", "course_utils.examples.train_digits", "--model", "linear", "--samples", "512", "--device", "cpu"]
    if nproc == 1:
        return subprocess.run([sys.executable, *base, *map(str, args)], capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
    return torchrun(*base, *args, nproc=nproc)


def test_two_processes_equal_one_process_with_the_global_batch(tmp_path):
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    single = example("--epochs", 2, "--batch-size", 64, "--save-weights", one)
    assert single.returncode == 0, single.stderr
    double = example("--epochs", 2, "--batch-size", 32, "--save-weights", two, nproc=2)
    assert double.returncode == 0, double.stderr
    assert "2 process(es)" in double.stdout and "global batch 64" in double.stdout
    a, b = torch.load(one), torch.load(two)
    assert list(a) == list(b) and not any(k.startswith("module.") for k in b)  # no DDP prefix in saved weights
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    assert not torch.equal(a["1.weight"], train_digits.build_model("linear")[1].weight)  # it did train
    losses = lambda out: [float(line.split()[-1]) for line in out.splitlines() if line.startswith("epoch")]  # noqa: E731
    assert losses(single.stdout) == pytest.approx(losses(double.stdout), rel=1e-5)  # global, not rank 0's


def test_accumulation_all_reduces_once_per_optimizer_step(tmp_path):
    out = tmp_path / "count.json"
    run = torchrun(HERE / "ddp_worker.py", "count", out)
    assert run.returncode == 0, run.stderr
    counts = json.loads(out.read_text())
    assert counts["batches"] == 16 and counts["optimizer_steps"] == 8  # 512 / 2 ranks / 16, in pairs
    assert counts["allreduce_calls"] == counts["optimizer_steps"]  # no_sync for the first batch of each pair


def test_a_distributed_run_resumes_and_its_checkpoint_loads_in_one_process(tmp_path):
    ck, resumed, straight = tmp_path / "ck.pt", tmp_path / "resumed.pt", tmp_path / "straight.pt"
    first = example("--epochs", 1, "--batch-size", 32, "--checkpoint", ck, nproc=2)
    assert first.returncode == 0, first.stderr
    again = example("--epochs", 2, "--batch-size", 32, "--checkpoint", ck, "--resume", "--save-weights", resumed,
                    nproc=2)
    assert again.returncode == 0, again.stderr
    whole = example("--epochs", 2, "--batch-size", 32, "--save-weights", straight, nproc=2)
    assert whole.returncode == 0, whole.stderr
    a, b = torch.load(resumed), torch.load(straight)
    assert all(torch.equal(a[k], b[k]) for k in a)  # the resumed run is the uninterrupted one, bit for bit
    # the 2-rank checkpoint, in this single process
    torch.manual_seed(0)
    model = train_digits.build_model("linear")
    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), nn.CrossEntropyLoss(),
                             TensorLoader(torch.zeros(64, 1, 28, 28), torch.zeros(64, dtype=torch.long), 32),
                             device="cpu", checkpoint=ck)
    t.load_checkpoint(ck)
    state = torch.load(ck, weights_only=True)
    assert t.epoch == 2 and state["world_size"] == 2 and len(state["ranks"]) == 2  # written by the resumed run
    assert not any(k.startswith("module.") for k in state["model"])


def test_a_rank_that_raises_stops_the_job_with_its_error():
    start = time.monotonic()
    run = torchrun(HERE / "ddp_worker.py", "fail", env={distributed.ENV_TIMEOUT: "20"}, timeout=120)
    elapsed = time.monotonic() - start
    assert run.returncode != 0
    assert "rank 1 broke on purpose" in run.stdout + run.stderr
    assert elapsed < 60, f"the job took {elapsed:.0f} s to stop"


def test_an_oom_on_one_rank_stops_every_rank_with_a_clear_error():
    start = time.monotonic()
    run = torchrun(HERE / "ddp_worker.py", "oom", env={distributed.ENV_TIMEOUT: "20"}, timeout=120)
    assert run.returncode != 0
    assert "out of memory in a distributed run" in run.stdout + run.stderr
    assert time.monotonic() - start < 60


def test_process_from_environment():
    assert distributed.Process.from_environment({}) is None
    assert distributed.Process.from_environment({"RANK": "0", "WORLD_SIZE": "1"}) is None
    p = distributed.Process.from_environment({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    assert (p.rank, p.world_size, p.local_rank, p.is_main) == (3, 4, 1, False)


def test_tensor_loader_shards_cover_the_epoch_like_one_global_batch():
    x, y = torch.arange(20.).reshape(20, 1), torch.arange(20)
    glob = TensorLoader(x, y, batch_size=8, seed=3)  # one process, the global batch
    shards = [TensorLoader(x, y, batch_size=4, seed=3).shard(r, 2) for r in range(2)]  # 2 ranks, 4 each
    for _ in range(2):  # two epochs: reshuffled alike on both ranks
        expected = [set(b.tolist()) for _, b in glob]
        parts = [[set(b.tolist()) for _, b in s] for s in shards]
        assert [a | b for a, b in zip(*parts)] == expected and len(parts[0]) == len(expected) == 3
        assert all(a.isdisjoint(b) for a, b in zip(*parts))
    assert expected != [set(range(8)), set(range(8, 16)), set(range(16, 20))]  # it does shuffle
    odd = [TensorLoader(x[:7], y[:7], batch_size=2, shuffle=False).shard(r, 2) for r in range(2)]
    assert [len(s) for s in odd] == [2, 2]  # 7 samples padded to 8: both ranks take the same number of steps
    assert sorted(sum([b.tolist() for s in odd for _, b in s], [])) == [0, 0, 1, 2, 3, 4, 5, 6]
