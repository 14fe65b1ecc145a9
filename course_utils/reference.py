"""Reference figures measured on a real GPU, for learners who have none.

`benchmarks/gpu_check.sh` writes `benchmarks/results/gpu_reference.json` on a GPU machine. Notebooks
show its figures beside the live CPU figures, always with the hardware, torch version and date they
were measured with, and say so plainly when none have been recorded yet.
"""
from __future__ import annotations

import json
from pathlib import Path

REFERENCE_FILE = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "gpu_reference.json"


def load_reference(section: str | None = None, path: Path | str | None = None) -> dict | None:
    """The recorded GPU figures (one section of them if `section` is given), or None if not recorded."""
    path = Path(path) if path is not None else REFERENCE_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if section is None:
        return data
    figures = data.get("sections", {}).get(section)
    if figures is None:
        return None
    return {"stamp": data.get("stamp", {}), "figures": figures}


def describe_stamp(stamp: dict) -> str:
    return (f"measured on {stamp.get('hardware', 'unknown hardware')}, torch {stamp.get('torch', '?')}, "
            f"{stamp.get('date', 'unknown date')}")


def show_reference(section: str, path: Path | str | None = None) -> dict | None:
    """Print where the reference figures for `section` come from; return them (None if not recorded)."""
    ref = load_reference(section, path)
    if ref is None:
        print(f"No reference GPU figures recorded yet for '{section}' "
              "(run benchmarks/gpu_check.sh on a GPU machine to record them).")
        return None
    print(f"Reference GPU figures for '{section}': {describe_stamp(ref['stamp'])}.")
    return ref["figures"]
