"""Slides from the same notebooks: RISE slide metadata generated from the headings.

`python -m course_tools.slides notebooks/` gives every cell of every notebook a
`metadata.slideshow.slide_type` for RISE (`jupyterlab-rise`, which shows a notebook as a reveal.js slideshow):

* the first cell, and every markdown cell with a `# ` or `## ` heading (a section): `"slide"`;
* a markdown cell with a `### ` heading (a part of a section): `"subslide"`, shown below the section's slide;
* a cell that would make its slide overflow the screen (the model below): `"subslide"`, a new screen. When that
  cell is code and comes right after a markdown cell (its introduction) that is not the first of the screen, the
  break moves up to that markdown cell, so that text and code stay on one screen (when both fit);
* a code cell right after a markdown cell that ends with a question or a colon (the result should appear after
  the question is asked): `"fragment"`, shown on the next key press;
* every other cell: `"-"` (continues the slide or fragment before it).

A heading anywhere in a markdown cell counts (cells often end one section and open the next: the whole cell goes on
the new slide). Cells marked `"skip"` or `"notes"` by hand keep that type and take no room. Only `slideshow`
metadata is rewritten: sources, outputs, execution counts and other metadata stay, and so does the file's JSON
layout (nbformat's, as nbconvert writes it, or the key order the file has), so the diff is metadata-only. The types
follow from the cells' contents alone, so a second run changes nothing. `--check` changes nothing and exits 1,
naming the notebook and cell, when some cell's slide type is missing or not what the headings give.

Overflow model
--------------
RISE's defaults (jupyterlab-rise 0.43: reveal.js theme "simple", width and height "100%", margin 0.1,
minScale 1.0) lay the slide out at scale 1, so on a 1280x720 screen cells are drawn at JupyterLab's own sizes:
14 px prose and 13 px code, both 18.2 px a line. One **line** here is 18.2 px, so the screen holds 720 / 18.2 =
39.5 lines; a slide may fill `BUDGET` = 37 of them (673 px), which leaves room for reveal's controls and for the
estimate's error. A cell's height in lines, measured against Chromium's rendering of the course's notebooks in
RISE at 1280x720 (DejaVu Sans, a wide font: narrower system fonts only fit more):

* every cell: 0.55 (its padding);
* markdown: paragraphs joined and wrapped at 160 characters a line, list items at 155 characters and 1.23 lines
  (22.4 px) a line, table rows 1.23 lines (a long row wraps at 160 characters); links count by their text,
  emphasis marks not at all, inline code 1.2 characters a character plus 1 for its pad; a `#` heading 3.5 lines a
  line of 40 characters, `##` 1.95 a line of 70, `###` 1.43 a line of 95; a fenced code block 1 a line;
  1.1 between two blocks (20 px margins), above the first 1.1 (0.97 above a `##` heading, 1.74 above `#`, 0.71
  above `###`) and 0.38 below the last; an image in markdown 12 lines;
* code: 0.55 for the editor plus one line per source line;
* outputs: 0.27 for the output area and 0.16 per output; text (stream, text/plain, errors) 0.92 a line, a line
  wrapped every 140 characters; an image/png by its height (from the PNG header, or the output's width/height
  metadata), scaled down to the 1138 px the output area is wide, plus 3.3 lines; a widget 8 lines (the monitor's
  panel; jupyterlab-rise 0.43 does not load the widget manager, jupyterlab-rise#119, so RISE shows one text line
  for now); HTML tables by their rows, HTML, LaTeX, SVG and other rich outputs by their text, at least 3 lines.

Checked against Chromium rendering RISE at 1280x720 when this was written (the course's notebooks 00-07, 414
cells, 241 screens): the model was 0.5 lines under to 3.8 over the rendered height of every cell but the widget
ones (and code cells of over 36 lines, which CodeMirror had not laid out in full), and found the same 31 single cells taller than the screen as the browser did; the tallest screen of several
cells was 663 px.

The rule the metadata keeps (`overflows()`, `long_cells()`; `tests/test_slides.py` checks it on every committed
notebook): a screen of several cells is never over `BUDGET` + `OVERFLOW_TOLERANCE` = 37 + 0 lines, since a cell
that would push it over starts a new screen. A single cell taller than the screen (`SCREEN_LINES`, 39.5) cannot be
split by metadata: it is a screen of its own, cut at the bottom in RISE (or scrolled, with RISE's `scroll` setting),
and counted; such cells may be at most `LONG_CELL_SHARE` = 15% of the course's screens (when this was written:
31 of 241 in notebooks 00-07, the same 31 in the browser; 37 of 268, 13.8%, with notebook 08).
"""
from __future__ import annotations

import argparse
import base64
import json
import math
import re
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

SLIDE_TYPES = ("slide", "subslide", "fragment", "skip", "notes", "-")
HAND_SET = ("skip", "notes")  # never generated: a cell marked so by hand keeps it

SCREEN = (1280, 720)  # px, the presenter's screen
LINE_PX = 18.2  # one line: JupyterLab's 14 px prose and 13 px code line height, at RISE's default scale 1
SCREEN_LINES = SCREEN[1] / LINE_PX  # 39.56
BUDGET = 37.0  # lines a screen may fill
OVERFLOW_TOLERANCE = 0.0  # lines a screen of several cells may go over BUDGET
LONG_CELL_SHARE = 0.15  # of all screens, at most this share may be a single cell taller than the screen

# The model, in lines (see the docstring); measured against Chromium's rendering in RISE at 1280x720.
CELL_PADDING = 10 / LINE_PX
MD_CHARS = 160  # prose characters a line
LIST_CHARS = 155
LIST_LINE = 22.4 / LINE_PX
# heading level: (top margin when it opens the cell, height of one line, characters a line)
HEADING = {1: (31.7 / LINE_PX, 63.3 / LINE_PX, 40), 2: (17.7 / LINE_PX, 35.5 / LINE_PX, 70),
           3: (13.0 / LINE_PX, 26.0 / LINE_PX, 95)}
TABLE_ROW = 22.4 / LINE_PX
FENCE_LINE = 18.3 / LINE_PX
BLOCK_GAP = 20 / LINE_PX  # collapsed margins between two blocks
FIRST_MARGIN = 20 / LINE_PX  # above a first paragraph, list, table or code block
LAST_MARGIN = 7 / LINE_PX  # below the last block
EDITOR = 10 / LINE_PX
OUTPUT_AREA = 5 / LINE_PX
PER_OUTPUT = 3 / LINE_PX
TEXT_LINE = 16.8 / LINE_PX
OUTPUT_CHARS = 140  # monospace 13 px in an 1150 px output area, broken at spaces
IMAGE_WIDTH = 1138  # px the output area gives an image
IMAGE_EXTRA = 60 / LINE_PX
WIDGET_LINES = 8.0
RICH_MIN_LINES = 3.0
MARKDOWN_IMAGE_LINES = 12.0

HEADING_RE = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
LIST_RE = re.compile(r"^(\s*)([*+-]|\d+[.)])\s+(.*)$")
FENCE_RE = re.compile(r"^\s*(```|~~~)")


def _source(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else (value or "")


def _visible_len(text: str) -> int:
    """Characters of prose width a line of markdown takes: links by their text, emphasis marks dropped, inline
    code a fifth wider (13 px monospace on a grey pad) plus one character for the pad."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    code = re.findall(r"`([^`]*)`", text)
    text = re.sub(r"`[^`]*`", "", text).replace("**", "").replace("__", "")
    text = re.sub(r"(?<!\w)[*_](?=\S)|(?<=\S)[*_](?!\w)", "", text)
    return len(text.strip()) + sum(round(1.2 * len(c)) + 1 for c in code)


def _wrapped(chars: int, width: int) -> int:
    return max(1, math.ceil(chars / width))


def heading_level(cell) -> int | None:
    """The highest heading level (1 for `#`) of a markdown cell, None without one (fenced code ignored)."""
    if cell.get("cell_type") != "markdown":
        return None
    levels, fenced = [], False
    for line in _source(cell).splitlines():
        if FENCE_RE.match(line):
            fenced = not fenced
        elif not fenced and (m := HEADING_RE.match(line)):
            levels.append(len(m.group(1)))
    return min(levels) if levels else None


def markdown_lines(source: str) -> float:
    """Lines a markdown cell's rendering takes (without the cell's padding)."""
    blocks: list[tuple[float, float]] = []  # (top margin if it is the first block, height)
    para: list[str] = []
    items: list[str] = []
    table: list[str] = []
    fence: list[str] | None = None

    def flush():
        nonlocal para, items, table
        if para:
            text = " ".join(line.strip() for line in para)
            images = len(re.findall(r"!\[[^\]]*\]\([^)]*\)|<img\b", text))
            chars = _visible_len(text)
            blocks.append((FIRST_MARGIN, images * MARKDOWN_IMAGE_LINES + (_wrapped(chars, MD_CHARS) if chars else 0)))
        if items:
            blocks.append((FIRST_MARGIN, sum(_wrapped(_visible_len(item), LIST_CHARS) for item in items) * LIST_LINE))
        if table:
            rows = [r for r in table if not re.fullmatch(r"\|?[\s:|-]+\|?", r.strip())]
            height = sum(_wrapped(_visible_len(r.replace("|", " ")), MD_CHARS) for r in rows) * TABLE_ROW
            blocks.append((FIRST_MARGIN, height))
        para, items, table = [], [], []

    for line in source.splitlines():
        if fence is not None:
            if FENCE_RE.match(line):
                blocks.append((FIRST_MARGIN, max(1, len(fence)) * FENCE_LINE))
                fence = None
            else:
                fence.append(line)
            continue
        if FENCE_RE.match(line):
            flush()
            fence = []
            continue
        if not line.strip():
            if not items:  # a blank line inside a list keeps the list going
                flush()
            continue
        if m := HEADING_RE.match(line):
            flush()
            top, height, width = HEADING[min(len(m.group(1)), 3)]
            blocks.append((top, _wrapped(_visible_len(m.group(2)), width) * height))
            continue
        if line.lstrip().startswith("|"):
            if para or items:
                flush()
            table.append(line)
            continue
        if m := LIST_RE.match(line):
            if para or table:
                flush()
            items.append(m.group(3))
            continue
        if items and line.startswith((" ", "\t")):
            items[-1] += " " + line.strip()
            continue
        if items or table:
            flush()
        para.append(re.sub(r"^\s*>\s?", "", line))
    if fence is not None:
        blocks.append((FIRST_MARGIN, max(1, len(fence)) * FENCE_LINE))
    flush()
    if not blocks:
        return 0.0
    return blocks[0][0] + sum(h for _, h in blocks) + BLOCK_GAP * (len(blocks) - 1) + LAST_MARGIN


def png_size(data: str) -> tuple[int, int] | None:
    """(width, height) in pixels from a base64 PNG's header, None if it is not one."""
    try:
        head = base64.b64decode("".join(data.split())[:48])
    except (ValueError, TypeError):
        return None
    if head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR":
        return None
    return struct.unpack(">II", head[16:24])


def _text_lines(text: str) -> float:
    text = text[:-1] if text.endswith("\n") else text  # a final newline ends the last line; more show as blank lines
    lines = text.split("\n") if text else []
    return sum(_wrapped(len(line.expandtabs()), OUTPUT_CHARS) for line in lines) * TEXT_LINE


def output_lines(output) -> float:
    """Lines one output takes (without the output area's own margin)."""
    kind = output.get("output_type")
    if kind == "stream":
        return PER_OUTPUT + _text_lines(_text(output.get("text")))
    if kind == "error":
        return PER_OUTPUT + _text_lines("\n".join(output.get("traceback", [])))
    data = output.get("data", {})
    meta = output.get("metadata", {})
    if "application/vnd.jupyter.widget-view+json" in data:
        return PER_OUTPUT + WIDGET_LINES
    for mime in ("image/png", "image/jpeg", "image/gif"):
        if mime in data:
            size = meta.get(mime, {}) if isinstance(meta.get(mime), dict) else {}
            width, height = size.get("width"), size.get("height")
            if not (width and height) and mime == "image/png":
                width, height = png_size(_text(data[mime])) or (None, None)
            if not (width and height):
                width, height = IMAGE_WIDTH, 400  # unknown size: a typical figure
            shown = height * min(1.0, IMAGE_WIDTH / width)
            return PER_OUTPUT + shown / LINE_PX + IMAGE_EXTRA
    for mime in ("text/html", "text/markdown", "text/latex", "image/svg+xml", "application/json"):
        if mime in data:
            text = _text(data[mime])
            rows = len(re.findall(r"<tr\b", text)) if mime == "text/html" else 0
            lines = rows * TABLE_ROW if rows else _text_lines(re.sub(r"<[^>]+>", "", text))
            return PER_OUTPUT + max(RICH_MIN_LINES, lines)
    if "text/plain" in data:
        return PER_OUTPUT + _text_lines(_text(data["text/plain"]))
    return PER_OUTPUT


def cell_lines(cell) -> float:
    """The lines a cell takes on a slide, in the model above."""
    if cell.get("cell_type") == "markdown":
        return CELL_PADDING + markdown_lines(_source(cell))
    if cell.get("cell_type") == "code":
        n = max(1, len(_source(cell).splitlines()))
        outputs = cell.get("outputs", [])
        return (CELL_PADDING + EDITOR + n
                + (OUTPUT_AREA + sum(output_lines(o) for o in outputs) if outputs else 0.0))
    return CELL_PADDING + _text_lines(_source(cell))  # raw cells: RISE shows their text


def _introduces(cell) -> bool:
    """A markdown cell whose last line ends with a question or a colon."""
    if cell.get("cell_type") != "markdown":
        return False
    lines = [line.strip() for line in _source(cell).splitlines() if line.strip()]
    return bool(lines) and lines[-1].rstrip("*_)`").endswith(("?", ":"))


def current_type(cell) -> str | None:
    slideshow = cell.get("metadata", {}).get("slideshow")
    return slideshow.get("slide_type") if isinstance(slideshow, dict) else None


def plan(cells) -> list[str]:
    """The slide type of every cell (cells: nbformat cells or their JSON dicts)."""
    types: list[str] = []
    used = 0.0  # lines on the current (sub)slide
    start = None  # index of the cell that opened it
    prev = None  # index of the last visible cell
    for i, cell in enumerate(cells):
        if current_type(cell) in HAND_SET:
            types.append(current_type(cell))
            continue
        lines = cell_lines(cell)
        level = heading_level(cell)
        if start is None or level in (1, 2):
            kind = "slide"
        elif level == 3:
            kind = "subslide"
        elif used + lines > BUDGET:
            kind = "subslide"
            before = cells[prev]
            if (cell.get("cell_type") == "code" and before.get("cell_type") == "markdown" and prev != start
                    and types[prev] == "-" and cell_lines(before) + lines <= BUDGET):
                types[prev] = "subslide"  # the text that leads to this code goes along with it
                start, used = prev, cell_lines(before)
                kind = "fragment" if _introduces(before) else "-"
        elif cell.get("cell_type") == "code" and _introduces(cells[prev]):
            kind = "fragment"
        else:
            kind = "-"
        if kind in ("slide", "subslide"):
            start, used = i, 0.0
        used += lines
        types.append(kind)
        prev = i
    return types


@dataclass
class Slide:
    """One screen: a slide or subslide, from cell `first` to `last` (indices), `lines` tall in the model."""
    first: int
    last: int
    cells: int
    lines: float


def slides(cells, types=None) -> list[Slide]:
    """The screens the cells make with the given types (default: their metadata), skipped and notes cells aside."""
    types = [current_type(c) or "-" for c in cells] if types is None else types
    out: list[Slide] = []
    for i, (cell, kind) in enumerate(zip(cells, types)):
        if kind in HAND_SET:
            continue
        if not out or kind in ("slide", "subslide"):
            out.append(Slide(i, i, 0, 0.0))
        s = out[-1]
        s.last, s.cells, s.lines = i, s.cells + 1, s.lines + cell_lines(cell)
    return out


def overflows(cells, types=None, tolerance: float = OVERFLOW_TOLERANCE) -> list[Slide]:
    """The screens of several cells taller than BUDGET + tolerance lines (none, with the planned types)."""
    return [s for s in slides(cells, types) if s.cells > 1 and s.lines > BUDGET + tolerance]


def long_cells(cells, types=None) -> list[Slide]:
    """The screens that are one cell taller than the whole screen (SCREEN_LINES): metadata cannot split those."""
    return [s for s in slides(cells, types) if s.cells == 1 and s.lines > SCREEN_LINES]


# --- files ---------------------------------------------------------------------------------------------------


def _layout(text: str, data) -> tuple[bool, int | None, bool, bool] | None:
    """How a notebook's JSON is laid out, (sorted keys, indent, ASCII only, final newline), when json.dumps
    reproduces the text exactly; None otherwise."""
    newline = text.endswith("\n")
    for indent in (1, 2, 4, None):
        for sort_keys in (True, False):
            for ascii_only in (False, True):
                layout = (sort_keys, indent, ascii_only, newline)
                if _dumps(data, layout) == text:
                    return layout
    return None


def _dumps(data, layout) -> str:
    """The notebook's JSON in the given layout; None: nbformat's own (sorted keys, indent 1, UTF-8, newline)."""
    sort_keys, indent, ascii_only, newline = layout or (True, 1, False, True)
    return json.dumps(data, sort_keys=sort_keys, indent=indent, ensure_ascii=ascii_only) + ("\n" if newline else "")


def _notebooks(paths) -> list[Path]:
    found: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            found += sorted(p for p in path.glob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
        else:
            found.append(path)
    return found


def stale_cells(data) -> list[tuple[int, str | None, str]]:
    """(index, current type, planned type) for every cell whose slide type is not the planned one."""
    cells = data["cells"]
    return [(i, current_type(c), t) for i, (c, t) in enumerate(zip(cells, plan(cells))) if current_type(c) != t]


def apply(data) -> int:
    """Set the planned slide type on every cell of a notebook's JSON dict; returns how many cells changed."""
    stale = stale_cells(data)
    for i, _, kind in stale:
        meta = data["cells"][i].setdefault("metadata", {})
        slideshow = meta.get("slideshow") if isinstance(meta.get("slideshow"), dict) else {}
        meta["slideshow"] = {**slideshow, "slide_type": kind}
    return len(stale)


def rewrite(path: Path) -> int:
    """Give one notebook file its slide metadata; returns how many cells changed (0: file untouched)."""
    text = Path(path).read_text(encoding="utf-8")
    data = json.loads(text)
    layout = _layout(text, data)
    changed = apply(data)
    if changed:
        Path(path).write_text(_dumps(data, layout), encoding="utf-8")
    return changed


def check(paths) -> list[str]:
    """One line per notebook cell whose slide metadata is missing or out of date (empty: all up to date)."""
    problems = []
    for path in _notebooks(paths):
        data = json.loads(path.read_text(encoding="utf-8"))
        for i, now, want in stale_cells(data):
            cell = data["cells"][i]
            first = next((line.strip() for line in _source(cell).splitlines() if line.strip()), "")[:60]
            have = f"slide_type {now!r}" if now else "no slide metadata"
            problems.append(f"{path}: cell {i} ({cell.get('cell_type')}, {first!r}): {have}, expected {want!r}")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m course_tools.slides",
        description="Give notebooks RISE slide metadata (slideshow.slide_type) from their headings: a slide per "
                    "## section, subslides for ### parts and wherever a slide would overflow a 1280x720 screen, "
                    "fragments for results that answer a question. Only slideshow metadata is rewritten.")
    parser.add_argument("paths", nargs="+", help="notebooks, or folders of notebooks")
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 naming each notebook cell whose slide metadata is out of date")
    args = parser.parse_args(argv)
    notebooks = _notebooks(args.paths)
    missing = [p for p in notebooks if not p.is_file()]
    if missing or not notebooks:
        parser.error(f"no notebook at {', '.join(map(str, missing)) or ' '.join(args.paths)}")
    if args.check:
        problems = check(notebooks)
        for line in problems:
            print(line)
        if problems:
            print(f"{len(problems)} cell(s) without up-to-date slide metadata: "
                  f"run python -m course_tools.slides {' '.join(args.paths)}", file=sys.stderr)
            return 1
        print(f"slide metadata up to date in {len(notebooks)} notebook(s)")
        return 0
    for path in notebooks:
        changed = rewrite(path)
        data = json.loads(path.read_text(encoding="utf-8"))
        screens, long = slides(data["cells"]), long_cells(data["cells"])
        print(f"{path}: {changed} cell(s) changed; {len(screens)} screens"
              + (f", {len(long)} of them a single cell taller than the screen (cells "
                 f"{', '.join(str(s.first) for s in long)})" if long else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
