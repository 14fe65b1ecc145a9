"""The Trainer's distributed promises with two real gloo processes (torchrun), ranks seeded differently:
a resume in a new torchrun is bit-exact for every rank (weights and loss history), from mid-epoch and from a
stop that landed after an epoch's last batch, for TensorLoader, DataLoader and a StatefulDataLoader whose
generators were seeded differently per rank (the shares stay disjoint); a stop raised on
one rank stops both at the same step with its reason (mid-epoch and at an epoch's end, well before the
collective timeout), and a nan loss on one rank is named on every rank."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")


def torchrun(*args, timeout=300):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *map(str, args)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", COURSE_DIST_TIMEOUT="60",
               COURSE_STOP_VOTE_SECONDS="0")  # the vote every 8 steps: stops land at known steps
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow
def test_per_rank_state_stop_agreement_and_nan_under_torchrun(tmp_path):
    start = time.perf_counter()
    first = torchrun(HERE / "edges_ddp_worker.py", "first", tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert time.perf_counter() - start < 50, "a stop waited for the collective timeout (60 s)"
    stopped = json.loads((tmp_path / "first.json").read_text())
    for kind in ("tensor", "dataloader", "stateful"):
        ranks = stopped[kind]
        # rank 1 asked after batch 27 (epoch 2, batch 3 of 24); the vote posted at the epoch's 8th step carries it,
        # read at its 16th: both ranks stop together there
        assert [r["batches"] for r in ranks] == [40, 40], ranks
        assert [r["batch_in_epoch"] for r in ranks] == [16, 16], ranks
        assert [r["reason"] for r in ranks] == ["rank 1 asked at batch 27"] * 2, ranks
        # asked after batch 20: the vote posted at the epoch's last step (24) is read at its end, before it closes
        ranks = stopped[kind + "_end"]
        assert [(r["batches"], r["batch_in_epoch"], r["epoch"]) for r in ranks] == [(24, 24, 0)] * 2, ranks
        # the ranks' shares of an epoch: disjoint, together the whole dataset (192 samples), even when the ranks'
        # StatefulDataLoaders were seeded differently (warned about, on both ranks, only then)
        shares = stopped[kind + "_share"]
        if kind != "tensor":
            assert not set(shares[0]) & set(shares[1]) and len(set(shares[0]) | set(shares[1])) == 192, shares
        assert [r["seeds_warned"] for r in stopped[kind]] == [kind == "stateful"] * 2, stopped[kind]
    assert stopped["epoch_end"] == [{"epoch": 1, "reason": "rank 1 asked at an epoch end"}] * 2
    assert all(m is not None and "epoch 1, batch 9 on rank 1" in m for m in stopped["nan"]), stopped["nan"]
    assert all(m is not None and m.startswith("not saving 'nan.pt'") and "epoch 1, batch 9 on rank 1" in m
               for m in stopped["nan_saving"]), stopped["nan_saving"]
    preempted = stopped["preempted"]  # SIGTERM on rank 1 only: both ranks save and leave with SIGTERM's status
    assert [r["code"] for r in preempted] == [143, 143] and preempted[0]["batches"] == preempted[1]["batches"], preempted
    assert [r["sigterm_ignored"] for r in preempted] == [True, True], preempted
    adaptive = stopped["adaptive"]  # ~10 ms steps, a vote about every 0.5 s: some 40 steps apart, never 8
    assert adaptive[0] == adaptive[1], adaptive
    assert 8 < adaptive[0]["every"] <= 60 and adaptive[0]["reason"] == "rank 1 asked at batch 60", adaptive
    assert 60 <= adaptive[0]["batches"] <= 72, adaptive

    finish = torchrun(HERE / "edges_ddp_worker.py", "finish", tmp_path)
    assert finish.returncode == 0, finish.stderr[-3000:]
    resumed = json.loads((tmp_path / "finish.json").read_text())
    for kind in ("tensor", "dataloader", "stateful", "tensor_end", "dataloader_end", "stateful_end"):
        for rank, r in enumerate(resumed[kind]):
            assert r["weights_equal"] and r["history_equal"], (kind, rank, r)
