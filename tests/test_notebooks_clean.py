"""Committed notebooks are what a fresh top-to-bottom run printed, with nothing machine-specific leaking out."""
import json
import re
from pathlib import Path

import pytest

FOLDER = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(FOLDER.glob("[0-9][0-9]_*.ipynb")) + sorted(FOLDER.glob("zh-CN/[0-9][0-9]_*.ipynb"))
MACHINE_PATH = re.compile(r"/root/|/tmp/|/home/\w+/|/Users/\w+/|/work/")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[f"{p.parent.name}/{p.stem}" for p in NOTEBOOKS])
def test_notebook_is_a_clean_fresh_run(path):
    nb = json.loads(path.read_text())
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    assert "widgets" not in nb["metadata"], "saved widget state (images, values) bloats the diff: execute with " \
                                            "--ExecutePreprocessor.store_widget_state=False"
    counts = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code" or not "".join(cell["source"]).strip():
            continue
        counts.append(cell["execution_count"])
        for out in cell["outputs"]:
            assert out["output_type"] != "error", f"cell {i} has an error output"
            text = "".join(out.get("text", "")) + "".join(out.get("data", {}).get("text/plain", ""))
            assert not MACHINE_PATH.search(text), f"cell {i} prints a machine path: {text[:200]!r}"
    assert counts == list(range(1, len(counts) + 1)), "execution counts must be 1..N (one fresh run)"
