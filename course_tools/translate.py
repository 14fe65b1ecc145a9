"""The Chinese edition of the notebooks, generated from the English ones and gettext PO catalogs.

    python -m course_tools.translate update   # new or changed English text -> entries in the catalogs
    python -m course_tools.translate check    # every unit translated and current? exit 1 and say which if not
    python -m course_tools.translate build    # notebooks/zh-CN/NN_*.ipynb from the English ones (no outputs)
    python -m course_tools.translate build --execute   # ... and run each from a fresh kernel, outputs saved
    python -m course_tools.translate build --solved DIR  # the solved Chinese edition (instructor version)

The English notebooks are the source. Each notebook has a catalog, `notebooks/locale/zh_CN/NN_name.po`, with one
entry per unit a learner reads:

* a markdown cell (msgctxt: the cell id; msgid: the whole cell),
* a comment in a code cell (msgid: the comment, `#` included),
* a string literal in a code cell that reads as text (msgid: the literal as written, prefix and quotes included;
  f-strings whole, so a translation may move the `{...}` fields but must keep every one).

Everything else in a code cell stays as it is, so the Chinese notebook runs the same code. Each entry stores the
SHA-1 of the English text it translates (`#. source-sha1: ...`). `update` keeps translations whose English text is
unchanged; a unit whose text changed (a markdown cell, or the closest old comment or string of its cell) keeps its
old translation marked fuzzy, with the previous English beside it (`#| msgid`), as `msgmerge` does; units that left
the notebook are dropped. An entry is stale while it is fuzzy *or* still carries a previous msgid: a reviewer
compares the two, revises, and deletes both the flag and the `#|` lines. `check` reports missing, stale and
malformed translations and glossary problems (`notebooks/locale/glossary.zh-CN.csv`: a term whose rendering is
missing, or a refused rendering used), naming the notebook and cell; `build` refuses to build while `check` finds
any problem in either kind of catalog.

The built notebooks call `course_utils.set_language("zh-CN")` in their first code cell, so `course_utils`' own
messages (feedback, diagnoses, warnings, monitor labels) come from its catalogs (`course_utils/i18n.py`):

    python -m course_tools.translate messages  # extract _("...") / N_("...") of every module (Babel) into
                                               # course_utils/locale/zh_CN/<module>.po, keeping translations

`check` covers those catalogs too: every message translated and current, the same `{fields}` in both languages.
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import re
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

import course_utils

__all__ = ["LANGUAGE", "Problem", "Term", "Unit", "build_notebook", "catalog_path", "check", "check_messages", "code_units",
           "execute_notebook", "glossary", "join_cjk_lines", "solved_notebook", "with_language_line",
           "load_catalog", "load_glossary", "main", "notebook_units", "prose", "translate_notebook", "update_catalog",
           "update_messages"]

LANGUAGE = "zh-CN"
NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
FIRST_CELL_LINES = ('from course_utils import set_language\n'
                    'set_language("zh-CN")  # 课程工具包 course_utils 的提示、诊断与反馈均以中文显示\n')
_CJK = re.compile(r"[\u3400-\u9fff]")
# Text, not an identifier or an option: a word and something else separated by a space ("epoch 1", "{n} workers",
# "images / s"), or a word ending in a colon ("buggy:"). Single words ("mean", "cuda") are left as code.
_PROSE = re.compile(r"[A-Za-z]{2,}[^\S\n]+\S|\S[^\S\n]+[A-Za-z]{2,}|^\W*[A-Za-z]{2,}[^\w\n]*:\W*$")
# Text drawn on a plot, even a single word: the first argument of these calls, and these keyword arguments.
PLOT_TEXT_CALLS = {"set_title", "set_xlabel", "set_ylabel", "title", "xlabel", "ylabel", "suptitle", "set_label"}
PLOT_TEXT_KEYWORDS = {"label", "title", "xlabel", "ylabel"}
_DIRECTIVE = re.compile(r"#\s*(NBVAL_|noqa|type:|fmt:|pragma|%%|-\*-|!)")


@dataclass(frozen=True)
class Unit:
    """One piece of text a learner reads: a markdown cell, or a comment or string literal of a code cell."""
    cell_id: str
    kind: str            # "markdown", "comment" or "string"
    text: str            # the English text exactly as in the notebook
    start: int = 0       # offsets of `text` in the cell's source (code units)
    end: int = 0
    line: str = ""       # the code line it sits on (context for the translator)

    @property
    def sha1(self) -> str:
        return hashlib.sha1(self.text.encode()).hexdigest()


@dataclass(frozen=True)
class Problem:
    notebook: str
    cell_id: str
    kind: str            # "missing", "stale", "malformed", "glossary"
    detail: str

    def __str__(self) -> str:
        return f"{self.notebook} cell {self.cell_id}: {self.kind}: {self.detail}"


# --- units -----------------------------------------------------------------------------------------------------

def _masked(source: str) -> str:
    """The cell source with IPython magics and shell lines blanked (same length), so tokenize can read it."""
    lines = source.splitlines(keepends=True)
    out = []
    for line in lines:
        stripped = line.lstrip()
        if stripped.startswith(("%", "!")):
            body = line.rstrip("\n")
            out.append(" " * len(body) + line[len(body):])
        else:
            out.append(line)
    return "".join(out)


def code_units(cell_id: str, source: str) -> list[Unit]:
    """The comments and text-like string literals of a code cell, in order."""
    offsets = [0]
    for line in source.splitlines(keepends=True):
        offsets.append(offsets[-1] + len(line))

    def at(pos):
        return offsets[pos[0] - 1] + pos[1]

    units: list[Unit] = []
    fstring_start = None
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(_masked(source)).readline))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return units
    lines = source.splitlines()
    before: list[str] = ["", ""]  # the two code tokens before the current one
    brackets: list[tuple[str, bool]] = []  # open brackets: (the bracket, whether it is an API position)
    label = fstring_label = False
    code = [t for t in tokens if t.type not in (tokenize.COMMENT, tokenize.NL)]
    following = {id(a): b.string for a, b in zip(code, code[1:])}
    for tok in tokens:
        name = tokenize.tok_name[tok.type]
        word_shown = tok.type == tokenize.STRING and _shown_word(tok.string, before, following.get(id(tok), ""),
                                                                  brackets)
        if fstring_start is None and tok.type == tokenize.OP and tok.string in "([{":
            called = tok.string == "(" and re.match(r"[A-Za-z_]\w*$", before[-1]) and before[-1] != "print"
            brackets.append((tok.string, bool(called)))
        elif fstring_start is None and tok.type == tokenize.OP and tok.string in ")]}" and brackets:
            brackets.pop()
        if tok.type in (tokenize.STRING, tokenize.COMMENT) or name == "FSTRING_START":
            label = (before[-1] == "(" and before[-2] in PLOT_TEXT_CALLS) or \
                    (before[-1] == "=" and before[-2] in PLOT_TEXT_KEYWORDS)
        if fstring_start is None and tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE):
            before = [before[-1], tok.string]
        if name == "FSTRING_START":  # Python 3.12+ splits f-strings: keep them whole
            if fstring_start is None:
                fstring_start, fstring_label = tok.start, label
            continue
        if name == "FSTRING_END":
            start, end = at(fstring_start), at(tok.end)
            fstring_start, label = None, fstring_label
            text = source[start:end]
            before = [before[-1], text]
        elif fstring_start is not None:
            continue
        elif tok.type == tokenize.COMMENT:
            if _DIRECTIVE.match(tok.string) or not re.search(r"[A-Za-z]{2,}", tok.string):
                continue
            start, end, text = at(tok.start), at(tok.end), tok.string
        elif tok.type == tokenize.STRING:
            start, end, text = at(tok.start), at(tok.end), tok.string
        else:
            continue
        if tok.type != tokenize.COMMENT and not _PROSE.search(_string_body(text)) and not word_shown and \
                not (label and re.search(r"[A-Za-z]{2,}", _string_body(text))):
            continue
        units.append(Unit(cell_id, "comment" if text.startswith("#") else "string", text, start, end,
                          lines[tok.start[0] - 1].strip() if tok.start[0] <= len(lines) else ""))
    return units


# Single words that are values an API takes, not text: device types, start methods, backends, modes.
API_WORDS = frozenset("""cpu cuda mps meta xpu hpu fork spawn forkserver gloo nccl mpi eager inductor aot_eager
mean sum none high highest medium max min train eval fp16 bf16 float half double int long bool nan inf
linear relu gelu silu tanh sigmoid weight bias torch nvidia triton bin backends lib ptxas nvcc nvrtc aux""".split())


def _shown_word(literal: str, before: list[str], after: str, brackets: list[tuple[str, bool]]) -> bool:
    """A single-word string literal that may be shown: a value a function returns or a variable holds, a dict key,
    a list item, a branch of a conditional expression, an argument of print, and also the same word where the
    notebook looks it up or compares with it (an index, an operand of ==), so that one translation serves all of
    them (`check` requires the same translation of a word throughout a notebook). Not a keyword argument, an
    argument of a call other than print, or an API word."""
    body = _string_body(literal)
    if not re.fullmatch(r"[A-Za-z][a-z]+", body) or body.lower() in API_WORDS or re.match(r"^[A-Za-z]*[bBrR]", literal):
        return False
    if before[-1] == "=" and brackets and brackets[-1][0] == "(":
        return False  # a keyword argument's value
    return not (brackets and brackets[-1][0] == "(" and brackets[-1][1])


def _string_body(literal: str) -> str:
    """The text of a string literal without its prefix, quotes and {fields}."""
    body = re.sub(r"^[A-Za-z]*('''|\"\"\"|'|\")", "", literal)
    body = re.sub(r"('''|\"\"\"|'|\")$", "", body)
    return re.sub(r"\{[^{}]*\}", "X", body)


def _fields(literal: str) -> list[str]:
    """The replacement fields of an f-string (sorted); [] for a plain literal."""
    prefix = re.match(r"^[A-Za-z]*", literal).group(0).lower()
    if "f" not in prefix:
        return []
    return sorted(re.findall(r"(?<!\{)\{(?!\{)([^{}]*)\}", literal))


def notebook_units(nb: dict) -> list[Unit]:
    units = []
    for cell in nb["cells"]:
        source = _source(cell)
        if not source.strip():
            continue
        if cell["cell_type"] == "markdown":
            units.append(Unit(cell["id"], "markdown", source))
        elif cell["cell_type"] == "code":
            units.extend(code_units(cell["id"], source))
    return units


def _source(cell) -> str:
    src = cell["source"]
    return src if isinstance(src, str) else "".join(src)


# --- catalogs --------------------------------------------------------------------------------------------------

def catalog_path(notebook: Path) -> Path:
    return notebook.parent / "locale" / LANGUAGE.replace("-", "_") / (notebook.stem + ".po")


def _new_catalog(notebook: Path):
    import polib

    po = polib.POFile(wrapwidth=0)
    po.metadata = {
        "Project-Id-Version": f"course_utils notebooks: {notebook.name}",
        "Language": LANGUAGE.replace("-", "_"),
        "MIME-Version": "1.0",
        "Content-Type": "text/plain; charset=UTF-8",
        "Content-Transfer-Encoding": "8bit",
    }
    return po


def _sha_comment(unit: Unit) -> str:
    extra = f"\ncode: {unit.line}" if unit.kind != "markdown" else ""
    return f"source-sha1: {unit.sha1}\nkind: {unit.kind}{extra}"


def update_catalog(notebook: Path) -> tuple[int, int, int]:
    """Bring the notebook's catalog up to date with its English text. Returns (new, stale, dropped) counts."""
    import polib

    nb = json.loads(notebook.read_text(encoding="utf-8"))
    path = catalog_path(notebook)
    old = polib.pofile(str(path), wrapwidth=0) if path.exists() else _new_catalog(notebook)
    by_key = {(e.msgctxt, e.msgid): e for e in old if not e.obsolete}
    by_cell = {}
    for e in old:
        if not e.obsolete and "kind: markdown" in e.comment:
            by_cell.setdefault(e.msgctxt, e)
    po = _new_catalog(notebook)
    po.metadata = old.metadata or po.metadata
    units = notebook_units(nb)
    keys = {(u.cell_id, u.text) for u in units}
    orphans: dict[str, list] = {}  # per cell, the code entries whose English is no longer there
    for e in old:
        if not e.obsolete and "kind: markdown" not in e.comment and (e.msgctxt, e.msgid) not in keys and e.msgstr:
            orphans.setdefault(e.msgctxt, []).append(e)
    new = stale = 0
    used = set()
    for unit in units:
        key = (unit.cell_id, unit.text)
        if key in used:
            continue
        used.add(key)
        entry = by_key.get(key)
        prev = None
        if entry is None and unit.kind == "markdown":
            prev = by_cell.get(unit.cell_id)
        elif entry is None:  # a changed comment or string: the closest old one of its cell, if any is close
            prev = _closest(unit.text, [e for e in orphans.get(unit.cell_id, []) if f"kind: {unit.kind}" in e.comment])
            if prev is not None:
                orphans[unit.cell_id].remove(prev)
        if prev is not None:
            entry = polib.POEntry(msgctxt=unit.cell_id, msgid=unit.text, msgstr=prev.msgstr,
                                  previous_msgid=prev.previous_msgid or prev.msgid, flags=["fuzzy"])
            stale += 1
        elif entry is None:
            entry = polib.POEntry(msgctxt=unit.cell_id, msgid=unit.text, msgstr="")
            new += 1
        entry.comment = _sha_comment(unit)
        entry.occurrences = [(notebook.name, unit.cell_id)]
        po.append(entry)
    dropped = len(by_key) - len([k for k in by_key if k in used])
    path.parent.mkdir(parents=True, exist_ok=True)
    po.save(str(path))
    return new, stale, dropped


def _closest(text: str, entries: list, cutoff: float = 0.5):
    """The entry whose English is most like `text` (difflib's ratio, at least `cutoff`), or None."""
    import difflib

    best, score = None, cutoff
    for e in entries:
        ratio = difflib.SequenceMatcher(None, text, e.msgid).ratio()
        if ratio >= score:
            best, score = e, ratio
    return best


def load_catalog(notebook: Path):
    import polib

    path = catalog_path(notebook)
    if not path.exists():
        return None
    return polib.pofile(str(path), wrapwidth=0)


# --- glossary --------------------------------------------------------------------------------------------------

def glossary_path() -> Path:
    return NOTEBOOKS / "locale" / f"glossary.{LANGUAGE}.csv"


@dataclass(frozen=True)
class Term:
    """One glossary row: the English term, its accepted renderings (the first is the one to write) and the
    renderings that are refused wherever they appear (regular expressions), in any catalog."""
    english: str
    pattern: re.Pattern
    chinese: tuple[str, ...]
    forbidden: tuple[re.Pattern, ...]


def load_glossary(path: Path | None = None) -> list[Term]:
    """Every glossary row. `chinese` lists the accepted renderings; the English term itself is accepted only
    where the row lists it (a name kept in English, such as all-reduce), never as a fallback."""
    rows = []
    with open(path or glossary_path(), encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            english = row["english"].strip()
            # as written, or capitalised where a sentence, heading or item starts; a capitalised word inside a
            # sentence ("the Parameter objects") is a class's name
            body = re.escape(english[1:]).replace(r"\ ", r"[\s-]+") + r"s?(?![\w-])"
            pattern = re.compile(rf"(?<![\w-]){re.escape(english[0])}{body}" + ("" if english[0].isupper() else
                                 rf"|(?:^|(?<=[.!?:#*>\n-] )|(?<=[.!?:#*>\n-])){re.escape(english[0].upper())}{body}"))
            forbidden = tuple(re.compile(z.strip()) for z in (row.get("forbidden") or "").split("|") if z.strip())
            rows.append(Term(english, pattern, tuple(z.strip() for z in row["chinese"].split("|")), forbidden))
    return rows


_NOT_PROSE = re.compile(r"`[^`]*`|\$[^$]*\$|https?://\S+|\]\([^)]*\)|\([^)]*\.(ipynb|md|py)[^)]*\)|\{[^{}]*\}|"
                        r"\b\w+(\.\w+)*\([^()]*\)|\((\s*\w+\s*,)+\s*\w+\s*\)|\b\w+=\S+|\"[^\"\n]*\"|\*[A-Z][^*\n]{20,}\*|\b\w+(\.\w+)+\b|\b\w*_\w*\b")


def prose(text: str) -> str:
    """`text` without what is code or quoted, not prose: inline code, formulas, links' targets, {fields}, calls
    with their arguments, tuples of names, keyword arguments, dotted and snake_case names, double-quoted text, and
    titles in italics (`*A first order approximation ...*`)."""
    return _NOT_PROSE.sub(" ", text)


def glossary(msgid: str, msgstr: str, rows=None) -> list[str]:
    """What breaks the glossary: a term `msgid` uses whose accepted rendering `msgstr` lacks, and every refused
    rendering `msgstr` contains (as "term: refused 'X', write 'Y'"). A text kept exactly as the English (a quoted
    PyTorch message) breaks nothing here; the test of the built notebooks' outputs catches English left in prose."""
    rows = load_glossary() if rows is None else rows
    english, chinese = prose(msgid), prose(msgstr)
    kept = msgstr == msgid  # a text deliberately left as it is (PyTorch's own message, quoted): nothing to render
    problems = [t.english for t in rows
                if not kept and t.pattern.search(english) and not any(z in msgstr for z in t.chinese)]
    for t in [] if kept else rows:
        for refused in t.forbidden:
            found = refused.search(chinese)
            if found:
                problems.append(f"{t.english}: refused {found.group(0)!r}, write {t.chinese[0]!r}")
    return problems


# --- checking --------------------------------------------------------------------------------------------------

def _malformed(unit: Unit, msgstr: str) -> str | None:
    """Why `msgstr` cannot stand in for `unit` in the code, or None."""
    if unit.kind == "markdown":
        fences = msgstr.count("```"), unit.text.count("```")
        if fences[0] != fences[1]:
            return f"the translation has {fences[0]} ``` fences, the English {fences[1]}"
        return None
    if unit.kind == "comment":
        if not msgstr.startswith("#") or "\n" in msgstr:
            return "a comment's translation must be one line starting with #"
        return None
    try:
        toks = [t for t in tokenize.generate_tokens(io.StringIO(msgstr).readline)
                if t.type not in (tokenize.NEWLINE, tokenize.NL, tokenize.ENDMARKER)]
    except (tokenize.TokenError, SyntaxError) as exc:
        return f"the translation is not a string literal ({exc})"
    names = [tokenize.tok_name[t.type] for t in toks]
    if not (names == ["STRING"] or (names and names[0] == "FSTRING_START" and names[-1] == "FSTRING_END")):
        return "the translation must be one string literal, quotes included, like the English"
    prefix = re.match(r"^[A-Za-z]*", unit.text).group(0).lower()
    if re.match(r"^[A-Za-z]*", msgstr).group(0).lower() != prefix:
        return f"the string prefix must stay {prefix!r}"
    if _fields(unit.text) != _fields(msgstr):
        return f"the f-string fields must stay the same: {_fields(unit.text)} vs {_fields(msgstr)}"
    if "\n" in msgstr and not unit.text.startswith(("'''", '"""')) and "\n" not in unit.text:
        return "a one-line string's translation must stay on one line"
    return None


def check(notebooks: list[Path] | None = None, *, with_glossary: bool = True) -> list[Problem]:
    """Every unit of every notebook translated, current (not stale) and well-formed; glossary respected."""
    notebooks = notebooks if notebooks is not None else sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    rows = load_glossary() if with_glossary else []
    problems: list[Problem] = []
    for notebook in notebooks:
        nb = json.loads(notebook.read_text(encoding="utf-8"))
        po = load_catalog(notebook)
        name = notebook.name
        if po is None:
            problems.append(Problem(name, "-", "missing", f"no catalog {catalog_path(notebook).name}: run "
                                                          "python -m course_tools.translate update"))
            continue
        entries = {(e.msgctxt, e.msgid): e for e in po if not e.obsolete}
        by_cell = {e.msgctxt: e for e in po if not e.obsolete and "kind: markdown" in e.comment}
        words: dict[str, tuple[str, str]] = {}  # single-word string -> (first cell, its translation)
        for unit in notebook_units(nb):
            e = entries.get((unit.cell_id, unit.text))
            first = unit.text.strip().splitlines()[0][:70]
            if e is None:
                if unit.kind == "markdown" and unit.cell_id in by_cell:
                    problems.append(Problem(name, unit.cell_id, "stale", f"the English text changed since it was "
                                                                         f"translated ({first!r}); run update"))
                else:
                    problems.append(Problem(name, unit.cell_id, "missing", f"{unit.kind} {first!r} is not in the "
                                                                           f"catalog; run update"))
                continue
            if "fuzzy" in e.flags or f"source-sha1: {unit.sha1}" not in e.comment:
                problems.append(Problem(name, unit.cell_id, "stale", f"{unit.kind} {first!r}: the English text "
                                                                     "changed since it was translated"))
                continue
            if e.previous_msgid:
                problems.append(Problem(name, unit.cell_id, "stale", f"{unit.kind} {first!r} still carries the "
                                        "previous English (#| msgid): compare, revise, then delete those lines"))
                continue
            if not e.msgstr.strip():
                problems.append(Problem(name, unit.cell_id, "missing", f"{unit.kind} {first!r} has no translation"))
                continue
            why = _malformed(unit, e.msgstr)
            if why:
                problems.append(Problem(name, unit.cell_id, "malformed", f"{unit.kind} {first!r}: {why}"))
            if unit.kind == "string" and not _PROSE.search(_string_body(unit.text)):  # a single word: one rendering
                other = words.setdefault(unit.text, (unit.cell_id, e.msgstr))
                if other[1] != e.msgstr:
                    problems.append(Problem(name, unit.cell_id, "malformed", f"{unit.text} is translated {e.msgstr} "
                                            f"here but {other[1]} in cell {other[0]}: a word the notebook may look "
                                            "up or compare needs one translation"))
            for term in glossary(unit.text, e.msgstr, rows):
                problems.append(Problem(name, unit.cell_id, "glossary", f"{unit.kind} {first!r}: {term}"
                                        if ": refused" in term else f"{unit.kind} {first!r} uses {term!r} but the "
                                                                    "translation lacks its glossary rendering"))
    return problems


# --- course_utils' own messages --------------------------------------------------------------------------------

PACKAGE = Path(course_utils.__file__).resolve().parent  # the learner's package: its modules and catalogs
KEYWORDS = {"_": None, "N_": None}


def module_catalog_path(module: Path) -> Path:
    """course_utils/exercises/nb01.py -> course_utils/locale/zh_CN/exercises.nb01.po"""
    dotted = ".".join(module.relative_to(PACKAGE).with_suffix("").parts)
    return PACKAGE / "locale" / LANGUAGE.replace("-", "_") / f"{dotted}.po"


# Data files whose texts are shown translated: which strings of them are messages.
DATA_MESSAGES = {
    "published_figures.json": lambda data: [f[k] for f in data["figures"] for k in ("quantity", "hardware", "note")
                                            if f.get(k)] +
    [s[k] for s in data["sources"].values() for k in ("publisher", "date_as_stated") if s.get(k)],
}


def module_messages(module: Path) -> list[tuple[int, str]]:
    """(line, message) for every `_("...")` and `N_("...")` in a module, in order, once each (Babel's extractor);
    for a data file of DATA_MESSAGES, its texts (line 0)."""
    from babel.messages.extract import extract_from_file

    seen, out = set(), []
    if module.suffix == ".json":
        for message in DATA_MESSAGES[module.name](json.loads(module.read_text(encoding="utf-8"))):
            if message not in seen:
                seen.add(message)
                out.append((0, message))
        return out
    for lineno, message, _comments, _context in extract_from_file("python", str(module), keywords=KEYWORDS):
        if isinstance(message, str) and message not in seen:
            seen.add(message)
            out.append((lineno, message))
    return out


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "locale" not in p.parts) + [PACKAGE / n for n in DATA_MESSAGES]


def update_messages(modules: list[Path] | None = None) -> list[str]:
    """Write each module's catalog (only modules with messages); keep existing translations. Returns reports."""
    import polib

    reports = []
    for module in [m.resolve() for m in modules] if modules else _modules():
        messages = module_messages(module)
        path = module_catalog_path(module)
        if not messages:
            if path.exists():
                path.unlink()
            continue
        old = {e.msgid: e for e in polib.pofile(str(path), wrapwidth=0)} if path.exists() else {}
        po = _new_catalog(module)
        po.metadata["Project-Id-Version"] = f"course_utils: {module.relative_to(PACKAGE.parent)}"
        new = 0
        current = {m for _, m in messages}
        orphans = [e for m, e in old.items() if m not in current and e.msgstr]
        for lineno, message in messages:
            entry = old.get(message)
            if entry is None:  # a changed message keeps the closest old translation, fuzzy, as msgmerge does
                prev = _closest(message, orphans)
                if prev is not None:
                    orphans.remove(prev)
                    entry = polib.POEntry(msgid=message, msgstr=prev.msgstr, flags=["fuzzy"],
                                          previous_msgid=prev.previous_msgid or prev.msgid)
                else:
                    entry = polib.POEntry(msgid=message, msgstr="")
            new += message not in old
            entry.occurrences = [(str(module.relative_to(PACKAGE.parent)), str(lineno))]
            po.append(entry)
        path.parent.mkdir(parents=True, exist_ok=True)
        po.save(str(path))
        dropped = len(set(old) - {m for _, m in messages})
        reports.append(f"{path.relative_to(PACKAGE.parent)}: {len(messages)} messages, {new} new, {dropped} dropped")
    return reports


_FIELD = re.compile(r"(?<!\{)\{([^{}]*)\}(?!\})")


def check_messages(modules: list[Path] | None = None, *, with_glossary: bool = True) -> list[Problem]:
    """Every message of every module translated in its module's catalog, with the same {fields}."""
    import polib

    rows = load_glossary() if with_glossary else []
    problems = []
    for module in [m.resolve() for m in modules] if modules else _modules():
        messages = module_messages(module)
        if not messages:
            continue
        path = module_catalog_path(module)
        name = str(module.relative_to(PACKAGE.parent))
        if not path.exists():
            problems.append(Problem(name, "-", "missing", f"no catalog {path.name}: run python -m "
                                                          "course_tools.translate messages"))
            continue
        entries = {e.msgid: e for e in polib.pofile(str(path), wrapwidth=0) if not e.obsolete}
        for lineno, message in messages:
            e = entries.get(message)
            where = f"line {lineno}"
            if e is None:
                problems.append(Problem(name, where, "missing", f"{message[:70]!r} is not in {path.name}; run "
                                                                "python -m course_tools.translate messages"))
            elif "fuzzy" in e.flags:
                problems.append(Problem(name, where, "stale", f"{message[:70]!r} is marked fuzzy"))
            elif e.previous_msgid:
                problems.append(Problem(name, where, "stale", f"{message[:70]!r} still carries the previous "
                                        "English (#| msgid): compare, revise, then delete those lines"))
            elif not e.msgstr.strip():
                problems.append(Problem(name, where, "missing", f"{message[:70]!r} has no translation"))
            elif sorted(_FIELD.findall(message)) != sorted(_FIELD.findall(e.msgstr)):
                problems.append(Problem(name, where, "malformed", f"{message[:70]!r}: the {{fields}} differ: "
                                        f"{sorted(_FIELD.findall(message))} vs {sorted(_FIELD.findall(e.msgstr))}"))
            else:
                for term in glossary(message, e.msgstr, rows):
                    problems.append(Problem(name, where, "glossary", f"{message[:70]!r}: {term}" if ": refused"
                                            in term else f"{message[:70]!r} uses {term!r} but the translation "
                                                         "lacks its glossary rendering"))
    return problems


# --- building --------------------------------------------------------------------------------------------------

_CJK_END = re.compile(r"[\u3000-\u303f\u3400-\u9fff\uff00-\uffef]$")
_CJK_START = re.compile(r"^[\u3000-\u303f\u3400-\u9fff\uff00-\uffef]")
_NOT_JOINED = re.compile(r"^\s*(#|\||```|\$\$)|^\s{4}")  # a heading, table row, fence, formula or code line


def join_cjk_lines(markdown: str) -> str:
    """Join a paragraph's lines where one ends and the next begins with a Chinese character: Markdown turns a line
    break into a space, which Chinese text does not have between its characters. Code blocks, tables, headings
    and formulas are left as they are."""
    out: list[str] = []
    fenced = False
    for line in markdown.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append(line)
            continue
        text = line.lstrip()
        if (not fenced and out and len(line) - len(text) < 4 and _CJK_START.match(text) and _CJK_END.search(out[-1])
                and not _NOT_JOINED.match(out[-1])):
            out[-1] += text  # a list item's continuation line too (indented less than a code block)
        else:
            out.append(line)
    return "\n".join(out)


def _relink(markdown: str) -> str:
    """Links to files outside notebooks/ gain one `../` (the edition sits one folder deeper)."""
    return re.sub(r"(\]\()(\.\./)", r"\1../\2", markdown)


def with_language_line(source: str) -> str:
    """The cell with FIRST_CELL_LINES after its leading imports and environment settings (so the imports stay at the
    top of the cell, and an environment variable set for torch is set before `course_utils` imports torch)."""
    import ast

    try:
        body = ast.parse(_masked(source)).body
    except SyntaxError:
        body = []
    def sets_environment(node) -> bool:  # os.environ.setdefault(...) or os.environ[...] = ...: before torch loads
        text = ast.unparse(node)
        return isinstance(node, (ast.Expr, ast.Assign)) and text.startswith("os.environ")

    end = 0
    for node in body:
        if not isinstance(node, (ast.Import, ast.ImportFrom)) and not sets_environment(node):
            break
        end = node.end_lineno
    lines = source.splitlines(keepends=True)
    head = "".join(lines[:end])
    if head and not head.endswith("\n"):
        head += "\n"
    return head + FIRST_CELL_LINES + "".join(lines[end:])


def translate_notebook(nb: dict, po, *, strict: bool = True, source_name: str = "") -> dict:
    """A copy of `nb` with every unit replaced by its translation. `strict`: a missing or stale translation is an
    error; otherwise the English stays (used for the solved edition, whose solutions have no catalog entries)."""
    import copy

    table = {(e.msgctxt, e.msgid): e.msgstr for e in po
             if not e.obsolete and e.msgstr and "fuzzy" not in e.flags and not e.previous_msgid} \
        if po is not None else {}
    out = copy.deepcopy(nb)
    first_code = True
    for cell in out["cells"]:
        source = _source(cell)
        if cell["cell_type"] == "markdown" and source.strip():
            key = (cell["id"], source)
            if key not in table and strict:
                raise KeyError(f"cell {cell['id']}: no current translation")
            cell["source"] = join_cjk_lines(_relink(table.get(key, source)))
        elif cell["cell_type"] == "code":
            for unit in reversed(code_units(cell["id"], source)):
                key = (unit.cell_id, unit.text)
                if key not in table:
                    if strict:
                        raise KeyError(f"cell {cell['id']}: no current translation of {unit.text[:60]!r}")
                    continue
                source = source[:unit.start] + table[key] + source[unit.end:]
            if first_code and source.strip():
                source = with_language_line(source)
                first_code = False
            cell["source"] = source
    out["metadata"]["course_utils"] = {"language": LANGUAGE, "generated_from": f"../{source_name}"}
    return out


def build_notebook(notebook: Path, out_dir: Path | None = None, *, keep_outputs_from: Path | None = None) -> Path:
    """Write the Chinese edition of `notebook` (sources only; outputs cleared) and return its path."""
    nb = json.loads(notebook.read_text(encoding="utf-8"))
    zh = translate_notebook(nb, load_catalog(notebook), source_name=notebook.name)
    for cell in zh["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
    out_dir = out_dir or notebook.parent / LANGUAGE
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / notebook.name
    target.write_text(json.dumps(zh, sort_keys=True, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return target


def solved_notebook(notebook: Path) -> dict:
    """The solved Chinese edition of an English notebook: every exercise blank replaced by its reference solution
    (`course_tools.solve`), then translated by the notebook's catalog; the solutions' own text, which
    has no catalog entries, stays as written. Its cells' outputs are those of the English notebook (unrun)."""
    import nbformat

    from course_tools.solve import solve_notebook

    english = solve_notebook(nbformat.read(notebook, as_version=4))
    return nbformat.from_dict(translate_notebook(english, load_catalog(notebook), strict=False,
                                                 source_name=notebook.name))


def execute_notebook(path: Path, timeout: int = 600) -> None:
    """Run a notebook top to bottom in a fresh kernel from its folder and save it with its outputs (no widget
    state), as `jupyter nbconvert --execute --inplace` does."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=timeout, kernel_name="python3", store_widget_state=False,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    nb.metadata.pop("widgets", None)
    path.write_text(json.dumps(nb, sort_keys=True, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_tools.translate", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["update", "check", "build", "messages"])
    parser.add_argument("notebooks", nargs="*", type=Path, help="English notebooks (default: all in notebooks/)")
    parser.add_argument("--execute", action="store_true", help="build: also run each built notebook, saving outputs")
    parser.add_argument("--solved", type=Path, metavar="DIR",
                        help="build: write the solved Chinese edition (instructor version) to DIR instead")
    parser.add_argument("--no-glossary", action="store_true", help="check: skip the glossary test")
    parser.add_argument("--modules", nargs="+", type=Path, help="messages/check: only these course_utils modules' catalogs")
    args = parser.parse_intermixed_args(argv)
    notebooks = args.notebooks or sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    if args.command == "update":
        for nb in notebooks:
            new, stale, dropped = update_catalog(nb)
            print(f"{catalog_path(nb).relative_to(nb.parent)}: {new} new, {stale} stale, {dropped} dropped")
        return 0
    if args.command == "messages":
        print("\n".join(update_messages(args.modules)))
        return 0
    if args.command == "check":
        glossary_too = not args.no_glossary
        if args.modules:
            problems = check_messages(args.modules, with_glossary=glossary_too)
        else:
            problems = check(notebooks, with_glossary=glossary_too)
            if not args.notebooks:
                problems += check_messages(with_glossary=glossary_too)
        for p in problems:
            print(p)
        print(f"{len(problems)} problem(s)")
        return 1 if problems else 0
    problems = check(notebooks) + check_messages()  # missing, stale, malformed and glossary, in both kinds
    if problems:
        for p in problems:
            print(p)
        print("not built: fix the catalogs first (python -m course_tools.translate check)", file=sys.stderr)
        return 1
    if args.solved:
        args.solved.mkdir(parents=True, exist_ok=True)
        for nb in notebooks:
            target = args.solved / nb.name
            target.write_text(json.dumps(solved_notebook(nb), sort_keys=True, indent=1, ensure_ascii=False) + "\n",
                              encoding="utf-8")
            if args.execute:
                execute_notebook(target)
            print(target)
        return 0
    for nb in notebooks:
        target = build_notebook(nb)
        if args.execute:
            execute_notebook(target)
        print(target.relative_to(nb.parent.parent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
