"""Reference figures: course-measured ones take precedence; otherwise published ones, each with its source."""
import ast
import fnmatch
import json
import math
import re
from importlib import resources
from pathlib import Path

import pytest

from course_utils import reference
from course_utils.reference import (PUBLISHED_FILE, PUBLISHED_LABEL, format_value, load_published, published,
                                    published_table, show_reference)

ROOT = Path(__file__).resolve().parents[1]
ISO_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
ISO_MONTH_OR_DATE = re.compile(r"^\d{4}-\d{2}(-\d{2})?$")
UNITS = {"TFLOPS", "GB/s", "GB", "W", "s", "min", "x", "img/s"}
KINDS = {"vendor peak", "vendor spec", "published measurement"}
MACHINE_PATH = re.compile(r"/root/|/tmp/|/home/\w+/|/Users/\w+/|/work/")  # as tests/test_notebooks_clean.py


def gpu_check_sections() -> list[str]:
    """The section names benchmarks/gpu_check.py records (its @section("name") decorators), without importing it."""
    tree = ast.parse((ROOT / "benchmarks" / "gpu_check.py").read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            for dec in node.decorator_list:
                if isinstance(dec, ast.Call) and getattr(dec.func, "id", None) == "section":
                    names.append(dec.args[0].value)
    return names


SECTIONS = gpu_check_sections()
DATA = load_published()


def test_the_sections_are_the_ones_the_notebooks_read():
    assert set(SECTIONS) == {"matmul", "cpu_vs_gpu", "batch_size", "speed_ladder", "transfers", "setup_training",
                             "amp", "memory", "monitor", "ddp"}


@pytest.mark.parametrize("figure", DATA["figures"], ids=[f["id"] for f in DATA["figures"]])
def test_every_figure_names_its_source_hardware_date_and_value_with_unit(figure):
    assert figure["kind"] in KINDS
    assert figure["sections"] and set(figure["sections"]) <= set(SECTIONS), figure["sections"]
    assert figure["hardware"].strip() and figure["quantity"].strip()
    value = figure["value"]
    if isinstance(value, list):  # a range: the published figure is one
        assert len(value) == 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
        assert 0 < value[0] < value[1]
    else:
        assert isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    assert figure["unit"] in UNITS
    for source_id in [figure["source"], *figure.get("also_sources", [])]:
        source = DATA["sources"][source_id]
        assert source.get("url") or source.get("title"), source_id
        assert source.get("title", "").strip() and source.get("publisher", "").strip()
        if source.get("url"):
            assert source["url"].startswith("https://")


@pytest.mark.parametrize("source_id", sorted(DATA["sources"]))
def test_every_source_has_a_date_or_says_why_not(source_id):
    source = DATA["sources"][source_id]
    if "date" in source:
        assert ISO_MONTH_OR_DATE.match(source["date"]), source["date"]
    if "retrieved" in source:
        assert ISO_DATE.match(source["retrieved"]), source["retrieved"]
    if not source.get("date") and not source.get("retrieved"):
        # only the seed article may go without one: a learner's blog post that states no date
        assert "blog post" in source["kind"] and source["date_as_stated"].strip()


def test_every_source_is_used_and_every_reference_resolves():
    used = {s for f in DATA["figures"] for s in [f["source"], *f.get("also_sources", [])]}
    assert used == set(DATA["sources"])
    ids = [f["id"] for f in DATA["figures"]]
    assert len(ids) == len(set(ids))


def test_vendor_peaks_say_dense_and_which_precision_accumulates():
    for f in DATA["figures"]:
        if f["kind"] == "vendor peak" and f["unit"] == "TFLOPS":
            q = f["quantity"]
            assert "sparsity" not in q, f["id"]
            assert "dense" in q or "non-tensor" in q, f["id"]
            if "BF16" in q or "FP16" in q:
                assert "accumulate" in q, f["id"]


def test_the_seed_articles_run_is_recorded_as_written():
    """Lines 19-26 of the seed article: 17 min 42 s on an i7-12700H, 1 min 26 s on an RTX 3060 Laptop 6 GB."""
    by_id = {f["id"]: f for f in DATA["figures"]}
    assert by_id["article-cpu-time"]["value"] == 17 * 60 + 42 and by_id["article-cpu-time"]["unit"] == "s"
    assert by_id["article-gpu-time"]["value"] == 60 + 26 and by_id["article-gpu-time"]["unit"] == "s"
    assert by_id["article-speedup"]["value"] == pytest.approx((17 * 60 + 42) / 86, abs=0.05)
    assert "RTX 3060 Laptop" in by_id["article-gpu-time"]["hardware"]
    assert "i7-12700H" in by_id["article-cpu-time"]["hardware"]
    assert DATA["sources"]["seed-article"]["publisher"] == "a learner's blog post"


@pytest.mark.parametrize("section", SECTIONS)
def test_every_section_has_published_figures(section):
    figures = published(section)
    assert figures
    for f in figures:
        assert section in f["sections"]
        assert f["source"]["title"] and f["source"]["id"] in DATA["sources"]


def test_published_returns_copies():
    first = published("matmul")
    first[0]["value"] = -1
    first[0]["source"]["title"] = "changed"
    again = published("matmul")
    assert again[0]["value"] != -1 and again[0]["source"]["title"] != "changed"


def test_format_value():
    assert format_value(19.5, "TFLOPS") == "19.5 TFLOPS"
    assert format_value([9.8, 13.1], "TFLOPS") == "9.8-13.1 TFLOPS"
    assert format_value(2039, "GB/s") == "2,039 GB/s"
    assert format_value(1062, "s") == "17 min 42 s"
    assert format_value(120, "s") == "2 min"
    assert format_value(2.59, "s") == "2.59 s"
    assert format_value(12.3, "x") == "12.3x"


@pytest.fixture(autouse=True)
def fresh_process():
    """show_reference says some things once per process: each test starts as a fresh kernel would."""
    reference._shown.clear()
    yield
    reference._shown.clear()


@pytest.mark.parametrize("section", SECTIONS)
def test_without_measured_figures_the_published_ones_are_shown_with_their_sources(section, tmp_path, capsys):
    assert show_reference(section, tmp_path / "absent.json") is None  # the contract notebook cells rely on
    out = capsys.readouterr().out
    assert out.startswith("No GPU has run this course's measurements yet: a run of benchmarks/gpu_check.sh")
    assert PUBLISHED_LABEL in out and f"Published figures for '{section}':" in out
    for f in published(section):
        assert format_value(f["value"], f["unit"]) in out
        assert f["source"]["title"] in " ".join(out.split())
        if f["source"].get("url"):
            assert f["source"]["url"] in out
    assert not MACHINE_PATH.search(out), "notebook outputs must not show machine paths"


def test_the_notice_comes_once_per_process_and_each_table_once(tmp_path, capsys):
    """Notebook 05 asks for 'memory' three times, 04 for 'matmul' twice: one notice, one table each."""
    absent = tmp_path / "absent.json"
    sections = [s for s in SECTIONS if published(s)][:2]
    for section in [sections[0], sections[1], sections[0], sections[1]]:
        assert show_reference(section, absent) is None
    out = capsys.readouterr().out
    assert out.count("No GPU has run this course's measurements yet") == 1
    for section in sections:
        assert out.count(f"Published figures for '{section}':\n") == 1
        assert out.count(f"Published figures for '{section}': shown above.") == 1
        first = published(section)[0]
        assert out.count(first["source"]["title"].split()[0]) >= 1
    assert out.count("Sources:") == 2


def test_a_reference_file_lacking_the_section_still_shows_the_published_figures(tmp_path, capsys):
    path = tmp_path / "gpu_reference.json"
    path.write_text(json.dumps({"stamp": {"hardware": "NVIDIA X", "torch": "2.9", "date": "2026-11-30"},
                                "sections": {"amp": {"models": {}}}}))
    assert show_reference("matmul", path) is None
    assert PUBLISHED_LABEL in capsys.readouterr().out


def test_measured_figures_take_precedence_and_nothing_published_is_shown(tmp_path, capsys):
    path = tmp_path / "gpu_reference.json"
    figures = {"sizes": [1024], "gpu_gflops": [5000.0]}
    path.write_text(json.dumps({"stamp": {"hardware": "NVIDIA X", "torch": "2.9", "date": "2026-11-30"},
                                "sections": {"matmul": figures}}))
    assert show_reference("matmul", path) == figures
    out = capsys.readouterr().out
    assert out == "Reference GPU figures for 'matmul': measured on NVIDIA X, torch 2.9, 2026-11-30.\n"
    assert PUBLISHED_LABEL not in out


def test_a_section_without_published_figures_says_so(capsys, tmp_path):
    assert published("no_such_section") == [] and published_table("no_such_section") == ""
    assert show_reference("no_such_section", tmp_path / "absent.json") is None
    assert "No published figures for 'no_such_section' either." in capsys.readouterr().out


def test_the_data_file_is_read_as_package_data():
    resource = resources.files("course_utils").joinpath(PUBLISHED_FILE)
    assert resource.is_file()
    assert json.loads(resource.read_text(encoding="utf-8")) == DATA
    assert Path(reference.__file__).with_name(PUBLISHED_FILE).is_file()


def test_pyproject_ships_the_data_file_in_the_package():
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = config.get("package-data", {}).get("course_utils", [])
    assert any(fnmatch.fnmatch(PUBLISHED_FILE, p) for p in patterns), \
        "declare it: [tool.setuptools.package-data] course_utils = [\"published_figures.json\"]"
