"""When a process dies: real torchrun jobs that lose a rank (SIGKILL) or are preempted (SIGTERM to the launcher),
continued by the same command, end bit-identical to a run that was never interrupted; two torchrun agents (two
"nodes" on this machine) train like one process with the global batch.

The job: course_utils.examples.train_digits (linear model, 512 samples, 2 ranks x 16: 16 optimizer steps an epoch,
48 in all), a periodic checkpoint every 5 steps and --resume, run through tests/restart_worker.py, which prints
rank 0's "step N" lines.
"""
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from course_utils import distributed

HERE = Path(__file__).parent
WORKER = HERE / "restart_worker.py"
ARGS = ["--model", "linear", "--samples", "512", "--batch-size", "16", "--epochs", "3", "--device", "cpu",
        "--checkpoint-every", "5", "--resume"]
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")]


def command(checkpoint, *extra, restarts=0, grace=30):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            f"--max-restarts={restarts}", f"--shutdown-timeout={grace}", str(WORKER), *ARGS,
            "--checkpoint", str(checkpoint), *map(str, extra)]


def environment(share_store=False):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", COURSE_DIST_TIMEOUT="60")
    env.pop(distributed.SHARED_STORE_OFF, None)
    if not share_store:
        env[distributed.SHARED_STORE_OFF] = "1"  # what the course tells learners to set for --max-restarts
    return env


def launch(checkpoint, *extra, restarts=0, timeout=300):
    return subprocess.run(command(checkpoint, *extra, restarts=restarts), capture_output=True, text=True,
                          timeout=timeout, env=environment())


def steps(out):
    return [int(line.split()[1]) for line in out.splitlines() if line.startswith("step ")]


def differences(a, b):
    """What differs between two Trainer checkpoints: weights, optimizer state, loss history, counters."""
    diffs = [f"model {k}" for k in a["model"] if not torch.equal(a["model"][k], b["model"][k])]
    for i, state in a["optimizer"]["state"].items():
        diffs += [f"optimizer {i} {k}" for k, v in state.items()
                  if isinstance(v, torch.Tensor) and not torch.equal(v, b["optimizer"]["state"][i][k])]
    diffs += [k for k in ("history", "epoch", "optimizer_steps", "batches_trained") if a[k] != b[k]]
    return diffs


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    path = tmp_path_factory.mktemp("reference") / "run.pt"
    run = launch(path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert steps(run.stdout) == list(range(1, 49))
    return torch.load(path, weights_only=False)


def test_a_rank_killed_mid_epoch_restarts_under_torchrun_from_the_last_periodic_checkpoint(tmp_path, uninterrupted):
    """Rank 1 SIGKILLs itself after step 23 (epoch 2, batch 7): torchrun stops rank 0 and starts both again, the
    same command resumes from step 20's save, and the job ends as if nothing had happened, 3 steps trained twice."""
    path = tmp_path / "run.pt"
    run = launch(path, "--kill-at-step", 23, restarts=2)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "rank 1: killed (SIGKILL) after step 23" in run.stdout
    assert "failed (exitcode: -9) local_rank: 1" in run.stderr  # torchrun saw the kill and restarted the group
    assert "Resumed from 'run.pt' at epoch 2, batch 4 of 16." in run.stdout, run.stdout[-2000:]
    assert steps(run.stdout) == list(range(1, 24)) + list(range(21, 49))  # steps 21..23 lost, trained again
    assert differences(torch.load(path, weights_only=False), uninterrupted) == []


def test_a_preempted_job_saves_within_the_grace_period_and_the_same_command_continues_it(tmp_path, uninterrupted):
    """SIGTERM to torchrun (what a scheduler sends before it preempts a job): torchrun passes it to every worker
    and gives them --shutdown-timeout seconds before SIGKILL; the ranks agree on a step, save and exit with 143."""
    path = tmp_path / "run.pt"
    grace = 10
    proc = subprocess.Popen(command(path, grace=grace), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=environment())
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.strip() == "step 20":
            proc.send_signal(signal.SIGTERM)
            sent = time.perf_counter()
            break
    out, err = proc.communicate(timeout=120)
    ended = time.perf_counter() - sent
    out = "".join(seen) + out
    assert proc.returncode != 0, "torchrun reports a job it stopped on a signal as failed"
    assert "Received 15 death signal, shutting down workers" in err, err[-3000:]
    stopped = [line for line in out.splitlines() if line.startswith("Stopped by SIGTERM at epoch 2, batch")]
    assert stopped, out[-2000:]
    assert ended < grace, f"the workers took {ended:.1f} s to stop, past the {grace} s grace period"
    where = stopped[0].removeprefix("Stopped by SIGTERM at ").split(";")[0]
    last = steps(out)[-1]
    assert 20 <= last < 48 and where == f"epoch 2, batch {last - 16} of 16", (where, last)
    again = launch(path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"Resumed from 'run.pt' at {where}." in again.stdout, again.stdout[-2000:]
    assert steps(again.stdout) == list(range(last + 1, 49))  # nothing lost, nothing trained twice
    assert differences(torch.load(path, weights_only=False), uninterrupted) == []


def test_restarts_on_torchruns_shared_store_are_refused_before_training_with_the_fix(tmp_path):
    """With torchrun's default shared rendezvous store a restarted group connects to the dead workers' ports
    (gloo: refused, or a hang); the course refuses at the start of the first attempt and names the switch."""
    run = subprocess.run(command(tmp_path / "run.pt", restarts=1), capture_output=True, text=True, timeout=300,
                         env=environment(share_store=True))
    assert run.returncode != 0
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --max-restarts 1" in run.stderr, run.stderr[-3000:]
    assert "step 1" not in run.stdout.split() and not (tmp_path / "run.pt").exists()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_agents_as_two_nodes_train_like_one_process_with_the_global_batch(tmp_path):
    """`--nnodes 2 --nproc-per-node 1` twice, rendezvous through c10d on 127.0.0.1, as on two machines."""
    base = ["-m", "course_utils.examples.train_digits", "--model", "linear", "--samples", "512", "--device", "cpu",
            "--epochs", "2"]
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                                "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=course-two-nodes",
                                *base, "--batch-size", "32", "--save-weights", str(tmp_path / f"node{i}.pt")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment())
              for i in range(2)]
    outs = [agent.communicate(timeout=300) for agent in agents]
    for agent, (out, err) in zip(agents, outs):
        assert agent.returncode == 0, err[-3000:]
    printed = "".join(out for out, _ in outs)
    assert "2 process(es)" in printed and "global batch 64" in printed
    saved = [p for p in tmp_path.glob("node*.pt")]
    assert len(saved) == 1  # written by global rank 0 only, whichever agent it ran under
    single = subprocess.run([sys.executable, *base, "--batch-size", "64", "--save-weights", str(tmp_path / "one.pt")],
                            capture_output=True, text=True, timeout=120, env=environment())
    assert single.returncode == 0, single.stderr[-3000:]
    a, b = torch.load(tmp_path / "one.pt"), torch.load(saved[0])
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6)
    losses = lambda out: [float(line.split()[-1]) for line in out.splitlines() if line.startswith("epoch")]  # noqa: E731
    assert losses(printed) == pytest.approx(losses(single.stdout), rel=1e-5) and len(losses(printed)) == 2


def test_with_slow_steps_the_ranks_vote_on_a_stop_every_step():
    """A SIGTERM's grace period is seconds (torchrun: --shutdown-timeout, 30 s by default): with steps slower than
    the vote's quarter second, the vote goes every step, so the ranks stop 2 steps after the signal, not 16, also
    in a launch's first steps (before the interval was measured)."""
    from course_utils.exercises.nb08 import one_process_group

    with one_process_group():
        process = distributed.Process(rank=0, world_size=1, local_rank=0, backend="gloo",
                                      cpu_group=torch.distributed.group.WORLD)
        vote = distributed.StopVote(process, seconds=0.01)
        answers = []
        for call in range(40):
            time.sleep(0.02)  # a "step" slower than the vote's interval
            answers.append(vote(1 if call == 30 else 0))
        assert vote.every == 1
        assert answers.index(1) - 30 <= 2, answers
        early = distributed.StopVote(process, seconds=0.01)  # a wish in a launch's first steps: as prompt
        answers = []
        for call in range(10):
            time.sleep(0.02)
            answers.append(early(1 if call == 1 else 0))
        assert answers.index(1) - 1 <= 2, answers
        fixed = distributed.StopVote(process, seconds=0)  # as COURSE_STOP_VOTE_SECONDS=0: every 8 steps
        for call in range(40):
            fixed(0)
        assert fixed.every == 8
