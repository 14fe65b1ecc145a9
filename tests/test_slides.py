"""RISE slide metadata (course_tools.slides): the committed notebooks have it up to date and no screen overflows;
the command, run on copies of the real notebooks, changes only slide metadata, is idempotent and keeps the rule."""
import base64
import json
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from course_tools import slides

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def _without_slideshow(data):
    data = json.loads(json.dumps(data))
    for cell in data["cells"]:
        cell.get("metadata", {}).pop("slideshow", None)
    return data


def _course_rule(paths):
    """(screens of several cells over the budget, single cells taller than the screen, number of screens)."""
    over, long, screens = [], [], 0
    for path in paths:
        cells = json.loads(Path(path).read_text())["cells"]
        screens += len(slides.slides(cells))
        over += [(Path(path).name, s.first, round(s.lines, 1)) for s in slides.overflows(cells)]
        long += [(Path(path).name, s.first, round(s.lines, 1)) for s in slides.long_cells(cells)]
    return over, long, screens


# --- the committed notebooks -----------------------------------------------------------------------------------


CHINESE = sorted((ROOT / "notebooks" / "zh-CN").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("edition, paths", [("notebooks/", NOTEBOOKS), ("notebooks/zh-CN/", CHINESE)])
def test_committed_notebooks_have_up_to_date_slide_metadata(edition, paths):
    assert paths
    problems = slides.check(paths)
    if problems:
        pytest.fail(f"{len(problems)} cells without up-to-date slide metadata; run "
                    f"`python -m course_tools.slides {edition}`:\n" + "\n".join(problems[:20]), pytrace=False)


def test_no_slide_of_a_committed_notebook_overflows():
    over, long, screens = _course_rule(NOTEBOOKS)
    assert not over, (f"screens of several cells over {slides.BUDGET} + {slides.OVERFLOW_TOLERANCE} lines (is the "
                      f"slide metadata up to date? `python -m course_tools.slides notebooks/`): {over}")
    assert len(long) <= slides.LONG_CELL_SHARE * screens, (
        f"{len(long)} of {screens} screens are a single cell taller than the screen, more than "
        f"{slides.LONG_CELL_SHARE:.0%}: split some of these cells (notebook, cell, lines): {long}")


# --- the command on copies of the real notebooks -----------------------------------------------------------------


@pytest.fixture
def copies(tmp_path):
    """Exact copies of the committed notebooks."""
    folder = tmp_path / "notebooks"
    folder.mkdir()
    for path in NOTEBOOKS:
        shutil.copy(path, folder / path.name)
    return folder


def _strip(folder):
    """Take the slide metadata out of every notebook in folder, keeping each file's layout."""
    for path in sorted(folder.glob("*.ipynb")):
        text = path.read_text()
        path.write_text(slides._dumps(_without_slideshow(json.loads(text)), slides._layout(text, json.loads(text))))


def test_the_command_writes_metadata_only_and_is_idempotent(copies, capsys):
    before = {p.name: p.read_text() for p in sorted(copies.glob("*.ipynb"))}
    assert slides.main([str(copies)]) == 0
    after = {p.name: p.read_text() for p in sorted(copies.glob("*.ipynb"))}
    assert slides.main(["--check", str(copies)]) == 0
    for name, text in after.items():
        old, new = json.loads(before[name]), json.loads(text)
        # nothing but slideshow metadata changed, and the file keeps its layout: without the slide metadata both
        # files are the same text
        layout = slides._layout(before[name], old)
        assert slides._dumps(_without_slideshow(new), layout) == slides._dumps(_without_slideshow(old), layout), name
        assert _without_slideshow(new) == _without_slideshow(old)
        if layout is not None:  # a layout json.dumps reproduces (nbformat's) is kept as it is
            assert slides._layout(text, new) == layout
        nbformat.validate(nbformat.reads(text, as_version=nbformat.NO_CONVERT))
        types = [c["metadata"]["slideshow"]["slide_type"] for c in new["cells"]]
        assert set(types) <= set(slides.SLIDE_TYPES) and types[0] == "slide"
        for cell, kind in zip(new["cells"], types):
            level = slides.heading_level(cell)
            if level in (1, 2):
                assert kind == "slide", (name, cell["source"][:1])
            elif level == 3:
                assert kind == "subslide", (name, cell["source"][:1])

    capsys.readouterr()
    assert slides.main([str(copies)]) == 0  # a second run changes nothing
    assert {p.name: p.read_text() for p in sorted(copies.glob("*.ipynb"))} == after
    assert all(": 0 cell(s) changed" in line for line in capsys.readouterr().out.splitlines())


def test_check_fails_on_notebooks_without_metadata(copies, capsys):
    _strip(copies)
    stripped = {p.name: p.read_text() for p in sorted(copies.glob("*.ipynb"))}
    assert slides.main(["--check", str(copies)]) == 1
    report = capsys.readouterr()
    first = copies / NOTEBOOKS[0].name
    assert f"{first}: cell 0 (markdown, '# 00" in report.out and "no slide metadata, expected 'slide'" in report.out
    assert len(report.out.splitlines()) == sum(len(json.loads(t)["cells"]) for t in stripped.values())
    assert {p.name: p.read_text() for p in sorted(copies.glob("*.ipynb"))} == stripped  # --check writes nothing
    assert slides.main([str(copies)]) == 0 and slides.main(["--check", str(copies)]) == 0


def test_the_overflow_rule_holds_on_the_copies(copies):
    slides.main([str(copies)])
    over, long, screens = _course_rule(sorted(copies.glob("*.ipynb")))
    assert not over
    assert len(long) <= slides.LONG_CELL_SHARE * screens, long
    for path in sorted(copies.glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        for s in slides.slides(cells):
            assert s.cells == 1 or s.lines <= slides.BUDGET, (path.name, s)
            if s.lines > slides.SCREEN_LINES:  # a long cell is a screen of its own
                assert s.cells == 1


def test_check_from_the_command_line_names_notebook_and_cell(copies):
    target = copies / NOTEBOOKS[0].name
    slides.rewrite(target)
    data = json.loads(target.read_text())
    data["cells"][1]["metadata"]["slideshow"]["slide_type"] = "slide"  # a hand edit the headings do not give
    target.write_text(json.dumps(data, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
    run = subprocess.run([sys.executable, "-m", "course_tools.slides", "--check", str(target)],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 1, run
    assert f"{target}: cell 1 (" in run.stdout and "slide_type 'slide', expected '-'" in run.stdout
    assert "python -m course_tools.slides" in run.stderr
    run = subprocess.run([sys.executable, "-m", "course_tools.slides", str(target)],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0 and "1 cell(s) changed" in run.stdout, run


# --- the rules on small notebooks --------------------------------------------------------------------------------


def _png(width, height) -> str:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = struct.pack(">I", len(ihdr)) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return base64.b64encode(b"\x89PNG\r\n\x1a\n" + chunk).decode()


def _code(lines=1, output_lines=0):
    cell = new_code_cell("\n".join(f"x{i} = {i}" for i in range(lines)))
    if output_lines:
        cell.outputs = [new_output("stream", name="stdout", text="".join(f"{i}\n" for i in range(output_lines)))]
    return cell


def test_headings_questions_and_colons():
    cells = [new_markdown_cell("Intro without a heading"), _code(),
             new_markdown_cell("## 1. A section\n\nWhat does this print?"), _code(),
             new_markdown_cell("### A part\n\nSo these lines do the same thing:"), _code(), _code(),
             new_markdown_cell("A statement."), _code(),
             new_markdown_cell("Ends *emphasised?*"), _code(),
             new_markdown_cell("Text\n\n## 2. A heading inside the cell\n\nMore"), new_markdown_cell("Plain")]
    assert slides.plan(cells) == ["slide", "-", "slide", "fragment", "subslide", "fragment", "-", "-", "-", "-",
                                  "fragment", "slide", "-"]


def test_a_cell_that_would_overflow_starts_a_subslide_with_its_introduction():
    budget = int(slides.BUDGET)
    cells = [new_markdown_cell("## Section"), _code(budget // 2), new_markdown_cell("Now look at this:"),
             _code(budget // 2)]
    assert slides.plan(cells) == ["slide", "-", "subslide", "fragment"]  # the text goes with its code
    assert not slides.overflows(cells, slides.plan(cells))
    cells = [new_markdown_cell("## Section"), _code(budget // 3), _code(budget // 3), _code(budget // 3)]
    assert slides.plan(cells) == ["slide", "-", "-", "subslide"]
    long = [new_markdown_cell("## Section"), _code(3 * budget), _code(2)]
    types = slides.plan(long)
    assert types == ["slide", "subslide", "subslide"]
    assert [s.first for s in slides.long_cells(long, types)] == [1] and not slides.overflows(long, types)


def test_hand_set_skip_and_notes_stay_and_take_no_room():
    cells = [new_markdown_cell("# Title"), _code(int(slides.BUDGET) - 12), _code(30), _code(1)]
    cells[2].metadata["slideshow"] = {"slide_type": "skip"}
    cells[0].metadata["tags"] = ["keep-me"]
    nb = new_notebook(cells=cells)
    assert slides.apply(nb) == 3
    assert [slides.current_type(c) for c in nb.cells] == ["slide", "-", "skip", "-"]
    assert nb.cells[0].metadata["tags"] == ["keep-me"]
    assert slides.apply(nb) == 0


def test_a_file_with_its_own_key_order_keeps_it(tmp_path):
    nb = new_notebook(cells=[new_markdown_cell("## A"), _code(2, 3)])
    data = json.loads(nbformat.writes(nb))
    reordered = {"nbformat": data["nbformat"], "nbformat_minor": data["nbformat_minor"],
                 "cells": [dict(reversed(list(c.items()))) for c in data["cells"]], "metadata": data["metadata"]}
    path = tmp_path / "other.ipynb"
    text = json.dumps(reordered, indent=1, ensure_ascii=False) + "\n"
    path.write_text(text)
    assert slides.rewrite(path) == 2
    new = json.loads(path.read_text())
    assert list(new) == list(reordered) and [list(c) for c in new["cells"]] == [list(c) for c in reordered["cells"]]
    assert json.dumps(_without_slideshow(new), indent=1, ensure_ascii=False) + "\n" == text
    assert slides.rewrite(path) == 0


def test_the_overflow_model():
    assert slides.SCREEN == (1280, 720) and slides.BUDGET < slides.SCREEN_LINES < 40
    assert slides.png_size(_png(640, 480)) == (640, 480) and slides.png_size("bm90IGEgcG5n") is None
    # an image counts by its height, scaled down to the output area's width
    small, wide = _code(), _code()
    small.outputs = [new_output("display_data", data={"image/png": _png(600, 364), "text/plain": "<Figure>"})]
    wide.outputs = [new_output("display_data", data={"image/png": _png(2 * slides.IMAGE_WIDTH, 728)})]
    assert slides.cell_lines(small) == pytest.approx(slides.cell_lines(wide))
    assert slides.cell_lines(small) - slides.cell_lines(_code()) == pytest.approx(
        slides.OUTPUT_AREA + slides.PER_OUTPUT + 364 / slides.LINE_PX + slides.IMAGE_EXTRA)
    # code lines count one each; output text lines wrap
    assert slides.cell_lines(_code(11)) - slides.cell_lines(_code(1)) == pytest.approx(10)
    wrapped = _code()
    wrapped.outputs = [new_output("stream", name="stdout", text="y" * (2 * slides.OUTPUT_CHARS + 1) + "\n")]
    assert slides.cell_lines(wrapped) == pytest.approx(slides.cell_lines(_code(1, 3)))
    # markdown paragraphs are joined and wrapped; a heading, a table and a list take their room
    one = slides.markdown_lines("word " * 20)
    assert slides.markdown_lines(("word " * 20 + "\n") * 3) == one + 1  # 300 characters: two lines
    assert slides.markdown_lines("## H\n\n" + "word " * 20) > one + 2.5
    table = "| a | b |\n|---|---|\n" + "| 1 | 2 |\n" * 4
    assert slides.markdown_lines(table) == pytest.approx(slides.markdown_lines("| a | b |") + 4 * slides.TABLE_ROW)
    assert slides.markdown_lines("* a\n* b\n  continued\n* c") == pytest.approx(
        slides.FIRST_MARGIN + 3 * slides.LIST_LINE + slides.LAST_MARGIN)
    assert slides.markdown_lines("```python\n# not a heading\nx = 1\n```") == pytest.approx(
        slides.FIRST_MARGIN + 2 * slides.FENCE_LINE + slides.LAST_MARGIN)
    assert slides.heading_level(new_markdown_cell("```\n# comment\n```")) is None
    # a widget counts as its panel
    widget = _code()
    widget.outputs = [new_output("display_data", data={"application/vnd.jupyter.widget-view+json": {},
                                                       "text/plain": "VBox()"})]
    assert slides.cell_lines(widget) - slides.cell_lines(_code()) == pytest.approx(
        slides.OUTPUT_AREA + slides.PER_OUTPUT + slides.WIDGET_LINES)


def test_the_command_refuses_a_missing_path(tmp_path, capsys):
    with pytest.raises(SystemExit) as err:
        slides.main([str(tmp_path / "nope.ipynb")])
    assert err.value.code == 2 and "no notebook" in capsys.readouterr().err


def test_the_course_has_its_notebooks():
    assert len(NOTEBOOKS) >= 8  # the tests above ran on every one of them
