"""The code and the notebooks pass the linter (ruff): no unused names, undefined names or star imports."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_is_clean_on_code_and_notebooks():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (it is in requirements.txt)")
    result = subprocess.run([ruff, "check", "course_utils", "tests", "benchmarks", "notebooks"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
