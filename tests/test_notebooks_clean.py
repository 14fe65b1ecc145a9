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


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: str(p.relative_to(FOLDER)))
def test_openmps_spin_is_set_before_anything_imports_torch(path):
    """OpenMP reads GOMP_SPINCOUNT once, when torch loads it (notebook 04, section 6): the first code cell must set it
    before its first import of torch or of course_utils (which imports torch)."""
    import ast

    cell = next(c for c in json.loads(path.read_text(encoding="utf-8"))["cells"] if c["cell_type"] == "code")
    source = "".join(cell["source"])
    body = ast.parse(source).body
    names = [ast.unparse(node) for node in body]
    setting = next((i for i, text in enumerate(names) if text.startswith("os.environ.setdefault('GOMP_SPINCOUNT'")),
                   None)
    assert setting is not None, f"{path.name}: the first cell does not set GOMP_SPINCOUNT"

    def imports_torch(node):
        mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        return any(m.split(".")[0] in ("torch", "course_utils", "torchvision") for m in mods)

    first_torch = next(i for i, node in enumerate(body) if imports_torch(node))
    assert setting < first_torch, f"{path.name}: torch is imported (statement {first_torch}) before the setting"
    assert "follow_load()" in names, f"{path.name}: the first cell does not start the thread follower (notebook 04)"
