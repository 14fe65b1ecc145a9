"""The answer key of exercise 08.4, checked for real: every snippet run on 2 gloo processes (ddp_demos diverge)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from course_utils.examples.ddp_demos import SNIPPETS
from course_utils.exercises.nb08 import DIVERGING

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")


@pytest.mark.slow
def test_exactly_the_diverging_snippets_drift_apart_on_two_processes(tmp_path):
    out = tmp_path / "drift.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "course_utils.examples.ddp_demos", "diverge", "--out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                         env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
    assert run.returncode == 0, run.stderr[-3000:]
    drift = json.loads(out.read_text())["drift"]
    assert sorted(drift) == sorted(SNIPPETS)
    for letter, gap in drift.items():
        if letter in DIVERGING:
            assert gap > 1e-3, f"snippet {letter} should make the replicas drift apart, largest gap {gap:.1e}"
        else:
            assert gap == 0.0, f"snippet {letter} should keep the replicas equal, largest gap {gap:.1e}"
