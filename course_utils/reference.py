"""Reference GPU figures for learners who have no GPU: measured by this course where it can, published otherwise.

`benchmarks/gpu_check.sh` writes `benchmarks/results/gpu_reference.json` on a GPU machine. Notebooks
show its figures beside the live CPU figures, always with the hardware, torch version and date they
were measured with.

While that file is absent or lacks a section, `show_reference(section)` prints published figures
instead, from `published_figures.json` next to this module: vendor peaks (the ceiling), the seed
article's own CPU-vs-GPU run and published measured results, each with its source, hardware and date,
and labelled "published, not measured by this course". `published(section)` returns them. Figures the
course measured always take precedence: when a section has them, nothing published is shown.
"""
from __future__ import annotations

import copy
import functools
import json
from importlib import resources
from pathlib import Path

from .i18n import N_, _, wrap

REFERENCE_FILE = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "gpu_reference.json"
PUBLISHED_FILE = "published_figures.json"  # package data of course_utils
PUBLISHED_LABEL = N_("published, not measured by this course")  # shown as _(PUBLISHED_LABEL)
_WIDTH = 118


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
    return _("measured on {hardware}, torch {torch}, {date}").format(
        hardware=stamp.get("hardware", _("unknown hardware")), torch=stamp.get("torch", "?"),
        date=stamp.get("date", _("unknown date")))


@functools.lru_cache(maxsize=1)
def _published_data() -> dict:
    return json.loads(resources.files(__package__).joinpath(PUBLISHED_FILE).read_text(encoding="utf-8"))


def load_published() -> dict:
    """The whole published-figures file: {"label", "sources": {id: source}, "figures": [figure, ...]} (a copy)."""
    return copy.deepcopy(_published_data())


def published(section: str) -> list[dict]:
    """The published figures relevant to `section`, in file order, each a copy whose "source" (and
    "also_sources") hold the source records themselves (title, url, publisher, date or retrieved, ...). Its texts
    (quantity, hardware, note) are in the language set (`set_language`; published_figures.po); titles stay as
    published."""
    data = _published_data()
    out = []
    for figure in data["figures"]:
        if section not in figure["sections"]:
            continue
        fig = copy.deepcopy(figure)
        for key in ("quantity", "hardware", "note"):
            if fig.get(key):
                fig[key] = _(fig[key])
        fig["source"] = {"id": figure["source"], **data["sources"][figure["source"]]}
        fig["also_sources"] = [{"id": s, **data["sources"][s]} for s in figure.get("also_sources", [])]
        out.append(fig)
    return out


def format_value(value, unit: str) -> str:
    """'19.5 TFLOPS', '9.8-13.1 TFLOPS', '2,039 GB/s', '17 min 42 s', '12.3x'."""
    def number(v):
        return f"{v:,}"

    if unit == "s" and not isinstance(value, list) and value >= 60:
        minutes, seconds = divmod(value, 60)
        return f"{int(minutes)} min {seconds:g} s" if seconds else f"{int(minutes)} min"
    text = "-".join(number(v) for v in value) if isinstance(value, list) else number(value)
    return f"{text}x" if unit == "x" else f"{text} {unit}"


def describe_date(source: dict) -> str:
    if source.get("date"):
        return source["date"]
    if source.get("retrieved"):
        return _("retrieved {date}").format(date=source["retrieved"])
    return _(source["date_as_stated"]) if source.get("date_as_stated") else _("undated")


def describe_source(source: dict) -> str:
    """'title; publisher, date: url' (no url for a source that has none, such as the seed article)."""
    where = f": {source['url']}" if source.get("url") else ""
    return f"{source['title']}; {_(source['publisher'])}, {describe_date(source)}{where}"


def published_table(section: str) -> str:
    """The published figures for `section` as a compact table with numbered sources ('' if there are none)."""
    figures = published(section)
    if not figures:
        return ""
    numbers: dict[str, int] = {}
    sources: list[dict] = []

    def ref(source: dict) -> str:
        if source["id"] not in numbers:
            numbers[source["id"]] = len(numbers) + 1
            sources.append(source)
        return f"[{numbers[source['id']]}]"

    values = [format_value(f["value"], f["unit"]) for f in figures]
    width = max(len(v) for v in values)
    indent = " " * (2 + width + 2)
    lines = []
    for fig, value in zip(figures, values):
        refs = " ".join(ref(s) for s in [fig["source"], *fig["also_sources"]])
        row = f"  {value:>{width}}  {fig['quantity']}; {fig['hardware']} {refs}"  # translated by published()
        lines += wrap(row, _WIDTH, subsequent_indent=indent + "  ")
        if fig.get("note"):
            lines += wrap(fig["note"], _WIDTH, initial_indent=indent + "  ", subsequent_indent=indent + "  ")
    if any(f["kind"] == "vendor peak" for f in figures):
        if any(f["unit"] == "TFLOPS" for f in figures):
            lines.append(_("  Vendor peaks are ceilings (tensor peaks: dense, without 2:4 sparsity), not what a "
                           "training step reaches."))
        else:
            lines.append(_("  Vendor peaks are ceilings, not what a training step reaches."))
    lines.append(_("  Sources:"))
    for i, source in enumerate(sources, 1):
        lines += wrap(f"[{i}] {describe_source(source)}", _WIDTH, initial_indent="    ",
                      subsequent_indent="        ", break_long_words=False, break_on_hyphens=False)
    return "\n".join(lines)


_shown: set[str] = set()  # sections whose published figures this process has printed


def show_reference(section: str, path: Path | str | None = None) -> dict | None:
    """Print where the reference figures for `section` come from; return the course-measured ones.

    Returns None when the course has measured none for `section` (gpu_reference.json absent or lacking
    it); it then prints the published figures for the section, labelled as such, instead: the sentence on what a
    GPU run would record once per process, each section's table once, and a pointer back when asked again."""
    ref = load_reference(section, path)
    if ref is None:
        if not _shown:  # the first section shown without measured figures: say once what a GPU run would add
            print(_("No GPU has run this course's measurements yet: a run of benchmarks/gpu_check.sh on a machine "
                    "with an NVIDIA GPU records them, and these cells then show them. Until then they show "
                    "published figures ({label}) for comparison.").format(label=_(PUBLISHED_LABEL)))
        if section in _shown:
            print(_("Published figures for '{section}': shown above.").format(section=section))
            return None
        _shown.add(section)
        table = published_table(section)
        if table:
            print(_("Published figures for '{section}':").format(section=section))
            print(table)
        else:
            print(_("No published figures for '{section}' either.").format(section=section))
        return None
    print(_("Reference GPU figures for '{section}': {stamp}.").format(section=section, stamp=describe_stamp(ref["stamp"])))
    return ref["figures"]

