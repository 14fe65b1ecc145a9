"""The Chinese edition: every unit translated and current, the generated notebooks up to date and running the same
code, course_utils' messages translated with the same fields, the glossary respected, Chinese plots drawable."""
import io
import re
import json
import shutil
import subprocess
import sys
import tokenize
import warnings
from pathlib import Path

import pytest

from course_tools import translate
from course_utils.i18n import _, get_language, speaking

ROOT = Path(__file__).resolve().parents[1]
ENGLISH = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
CHINESE = ROOT / "notebooks" / "zh-CN"


def test_every_notebook_unit_is_translated_current_and_well_formed():
    problems = translate.check()
    assert not problems, "\n".join(map(str, problems[:40])) + f"\n({len(problems)} in all)"


def test_every_course_utils_message_is_translated_with_the_same_fields():
    problems = translate.check_messages()
    assert not problems, "\n".join(map(str, problems[:40])) + f"\n({len(problems)} in all)"


@pytest.mark.parametrize("path", ENGLISH, ids=[p.stem for p in ENGLISH])
def test_the_chinese_notebook_is_generated_from_the_current_catalog(path):
    english = json.loads(path.read_text(encoding="utf-8"))
    expected = translate.translate_notebook(english, translate.load_catalog(path), source_name=path.name)
    committed = json.loads((CHINESE / path.name).read_text(encoding="utf-8"))
    assert committed["metadata"]["course_utils"]["language"] == "zh-CN"
    assert [c["id"] for c in committed["cells"]] == [c["id"] for c in english["cells"]]
    for want, got in zip(expected["cells"], committed["cells"]):
        assert translate._source(got) == translate._source(want), (
            f"{path.name} cell {want['id']}: notebooks/zh-CN is stale; run python -m course_tools.translate build "
            "and execute it")


def _code_tokens(source: str) -> list[str]:
    """The code of a cell with comments and string contents removed: what must be identical in both editions."""
    out, in_fstring = [], 0
    for tok in tokenize.generate_tokens(io.StringIO(translate._masked(source)).readline):
        name = tokenize.tok_name[tok.type]
        if name == "FSTRING_START":
            in_fstring += 1
            out.append("<string>")
        elif name == "FSTRING_END":
            in_fstring -= 1
        elif in_fstring or tok.type in (tokenize.COMMENT, tokenize.NL):
            continue
        elif tok.type == tokenize.STRING:
            out.append("<string>")
        else:
            out.append(tok.string)
    return out


@pytest.mark.parametrize("path", ENGLISH, ids=[p.stem for p in ENGLISH])
def test_the_chinese_notebook_runs_the_same_code(path):
    english = json.loads(path.read_text(encoding="utf-8"))["cells"]
    chinese = json.loads((CHINESE / path.name).read_text(encoding="utf-8"))["cells"]
    first, with_text, translated = True, 0, 0
    for en, zh in zip(english, chinese):
        assert en["cell_type"] == zh["cell_type"]
        if en["cell_type"] != "code" or not translate._source(en).strip():
            continue
        zh_source = translate._source(zh)
        if first:
            assert translate.FIRST_CELL_LINES in zh_source, "the first code cell must set the language"
            zh_source, first = zh_source.replace(translate.FIRST_CELL_LINES, "", 1), False
        same = _code_tokens(zh_source.rstrip() + "\n") == _code_tokens(translate._source(en).rstrip() + "\n")
        assert same, f"{path.name} cell {en['id']}"
        if translate.code_units(en["id"], translate._source(en)):
            with_text += 1
            translated += bool(translate._CJK.search(zh_source))
    # a cell may keep all its literals (keys, PyTorch's texts), but nearly every cell with text reads Chinese
    assert translated >= 0.9 * with_text, f"{path.name}: only {translated} of {with_text} cells with text translated"


def test_a_changed_or_new_english_text_is_reported_with_its_cell(tmp_path):
    source = ENGLISH[1]
    (tmp_path / "locale" / "zh_CN").mkdir(parents=True)
    nb_path = tmp_path / source.name
    shutil.copy(source, nb_path)
    shutil.copy(translate.catalog_path(source), translate.catalog_path(nb_path))
    po = translate.load_catalog(nb_path)
    for entry in po:  # a complete catalog to start from (the English kept is a valid translation)
        entry.msgstr = entry.msgstr or entry.msgid
    po.save(str(translate.catalog_path(nb_path)))
    assert translate.check([nb_path], with_glossary=False) == []
    nb = json.loads(source.read_text(encoding="utf-8"))
    markdown = next(c for c in nb["cells"] if c["cell_type"] == "markdown")
    code = next(c for c in nb["cells"] if c["cell_type"] == "code" and translate._source(c).strip())
    markdown["source"] = translate._source(markdown) + "\nOne more English sentence."
    code["source"] = "# a comment nobody has translated yet\n" + translate._source(code)
    nb_path.write_text(json.dumps(nb), encoding="utf-8")
    problems = {(p.cell_id, p.kind) for p in translate.check([nb_path], with_glossary=False)}
    assert problems == {(markdown["id"], "stale"), (code["id"], "missing")}, problems

    new, stale, dropped = translate.update_catalog(nb_path)
    assert (new, stale) == (1, 1)
    entry = next(e for e in translate.load_catalog(nb_path) if e.msgctxt == markdown["id"])
    assert "fuzzy" in entry.flags and entry.previous_msgid and entry.msgstr, "the old translation is kept, fuzzy"
    problems = {(p.cell_id, p.kind) for p in translate.check([nb_path], with_glossary=False)}
    assert problems == {(markdown["id"], "stale"), (code["id"], "missing")}, problems
    with pytest.raises(KeyError, match=markdown["id"]):
        translate.translate_notebook(nb, translate.load_catalog(nb_path))


@pytest.mark.parametrize("english, chinese, why", [
    ('f"loss {loss:.3f}"', 'f"损失 {loss}"', "fields"),
    ('f"loss {loss:.3f}"', '"损失 {loss:.3f}"', "prefix"),
    ('"a label"', '"一个"标签"', "string literal"),
    ('"a label"', '"一个标签" + x', "one string literal"),
    ('"a label"', '"一个\\n标签"', None),
    ('"a label"', '"""一个\n标签"""', "one line"),
])
def test_a_translation_that_would_change_the_code_is_malformed(english, chinese, why):
    unit = translate.Unit("c", "string", english)
    result = translate._malformed(unit, chinese)
    assert (result is None) if why is None else (why in result), result


def test_a_comment_translation_stays_a_comment():
    unit = translate.Unit("c", "comment", "# move the batch")
    assert translate._malformed(unit, "# 把批次移到设备上") is None
    assert "#" in translate._malformed(unit, "把批次移到设备上")


def test_the_glossary_is_enforced_and_accepts_its_renderings():
    rows = translate.load_glossary()
    assert translate.glossary("Free GPU memory after each step", "每一步之后释放内存", rows) == ["GPU memory"]
    assert translate.glossary("Free GPU memory after each step", "每一步之后释放显存", rows) == []
    assert translate.glossary("`optimizer.step()` runs", "`optimizer.step()` 执行", rows) == []  # code is exempt
    assert "mixed precision" in translate.glossary("Mixed-precision training", "半精度训练", rows)


@pytest.mark.parametrize("english, chinese, problem", [
    ("the batch size is 32", "批量大小为 32", None),
    ("the batch size is 32", "batch size 为 32", "batch size"),            # no English fallback
    ("the batch size is 32", "批大小为 32", "refused '批大小'"),
    ("one batch at a time", "一次一个批次", "refused '批次'"),               # 批次 reads as "batch number"
    ("3 epochs", "3 个 epoch", "refused 'epoch'"),
    ("in this notebook", "在本 notebook 中", "refused 'notebook'"),
    ("in this notebook", "在本笔记本中", None),
    ("two workers", "两个 worker", "refused 'worker'"),
    ("two workers", "两个工作进程，`num_workers=2`", None),              # the code name stays
    ("reserved memory", "已保留的显存", "refused '已保留'"),
    ("a CUDA kernel", "一个 CUDA 内核", "refused 'CUDA 内核'"),
    ("a CUDA kernel", "一个核函数", None),
    ("restart the Jupyter kernel", "重启内核", None),
    ("running statistics", "运行统计量", "refused '运行统计'"),
    ("the Parameter objects", "同样的 Parameter 对象", None),              # a class's name, not the term
    ("CUDA out of memory. Tried to", "CUDA out of memory. Tried to", None),  # PyTorch's message, kept whole
])
def test_the_glossary_refuses_other_renderings_and_english_fallbacks(english, chinese, problem):
    found = translate.glossary(english, chinese, translate.load_glossary())
    assert (found == []) if problem is None else any(problem in f for f in found), found


def _catalogued_copy(tmp_path, source):
    """A copy of an English notebook with its catalog, complete (the English kept where a translation is missing)."""
    (tmp_path / "locale" / "zh_CN").mkdir(parents=True)
    nb_path = tmp_path / source.name
    shutil.copy(source, nb_path)
    shutil.copy(translate.catalog_path(source), translate.catalog_path(nb_path))
    po = translate.load_catalog(nb_path)
    for entry in po:
        entry.msgstr = entry.msgstr or entry.msgid
    po.save(str(translate.catalog_path(nb_path)))
    assert translate.check([nb_path], with_glossary=False) == []
    return nb_path


@pytest.mark.parametrize("kind", ["markdown", "comment", "string"])
def test_an_edited_unit_keeps_its_old_translation_as_stale_until_reviewed(tmp_path, kind):
    nb_path = _catalogued_copy(tmp_path, ENGLISH[1])
    nb = json.loads(nb_path.read_text(encoding="utf-8"))
    units = [u for u in translate.notebook_units(nb) if u.kind == kind]
    unit = units[len(units) // 2]
    cell = next(c for c in nb["cells"] if c["id"] == unit.cell_id)
    source = translate._source(cell)
    closing = 3 if unit.text.endswith(('"""', "'''")) else 1  # before the closing quote(s)
    edited = unit.text[:-closing] + " now" + unit.text[-closing:] if kind == "string" else unit.text + " now"
    cell["source"] = source[:unit.start] + edited + source[unit.end:] if kind != "markdown" else edited
    nb_path.write_text(json.dumps(nb), encoding="utf-8")
    old = next(e for e in translate.load_catalog(nb_path) if (e.msgctxt, e.msgid) == (unit.cell_id, unit.text))

    new, stale, _dropped = translate.update_catalog(nb_path)
    assert (new, stale) == (0, 1)
    entry = next(e for e in translate.load_catalog(nb_path) if e.msgctxt == unit.cell_id and e.msgid.strip() ==
                 translate.Unit(unit.cell_id, kind, edited).text.strip())
    assert "fuzzy" in entry.flags and entry.previous_msgid == unit.text and entry.msgstr == old.msgstr
    def kinds():
        return [(p.cell_id, p.kind) for p in translate.check([nb_path], with_glossary=False)]
    assert kinds() == [(unit.cell_id, "stale")]
    with pytest.raises(KeyError):
        translate.translate_notebook(nb, translate.load_catalog(nb_path))
    assert translate.main(["build", str(nb_path)]) == 1 and not (tmp_path / "zh-CN").exists()

    po = translate.load_catalog(nb_path)  # a reviewer who only deletes "#, fuzzy" has not reviewed it
    reviewed = next(e for e in po if e.msgid == entry.msgid and e.msgctxt == unit.cell_id)
    reviewed.flags.remove("fuzzy")
    po.save(str(translate.catalog_path(nb_path)))
    assert kinds() == [(unit.cell_id, "stale")]
    assert "previous English" in str(translate.check([nb_path], with_glossary=False)[0])
    reviewed.previous_msgid = None  # compared and revised: the "#|" lines go
    po.save(str(translate.catalog_path(nb_path)))
    assert kinds() == []
    assert translate.main(["build", str(nb_path)]) == 0 and (tmp_path / "zh-CN" / nb_path.name).exists()


def test_a_glossary_problem_stops_the_build(tmp_path):
    nb_path = _catalogued_copy(tmp_path, ENGLISH[3])
    po = translate.load_catalog(nb_path)
    entry = next(e for e in po if "kind: markdown" in e.comment and e.msgstr != e.msgid)
    entry.msgstr += "一个批次。"
    po.save(str(translate.catalog_path(nb_path)))
    assert [p.kind for p in translate.check([nb_path])].count("glossary") >= 1
    assert translate.main(["build", str(nb_path)]) == 1 and not (tmp_path / "zh-CN").exists()
    entry.msgstr = entry.msgstr[:-len("一个批次。")]
    po.save(str(translate.catalog_path(nb_path)))
    assert translate.main(["build", str(nb_path)]) == 0, "the same catalog without the refused word builds"


def test_an_edited_course_utils_message_is_carried_as_fuzzy_and_stops_the_build(tmp_path, monkeypatch):
    import polib

    package = tmp_path / "course_utils"
    (package / "locale" / "zh_CN").mkdir(parents=True)
    module = package / "greeting.py"
    module.write_text('from course_utils.i18n import _\n\n\ndef hello():\n    return _("well done, {name}")\n')
    monkeypatch.setattr(translate, "PACKAGE", package)
    monkeypatch.setattr(translate, "DATA_MESSAGES", {})
    translate.update_messages()
    path = translate.module_catalog_path(module)
    po = polib.pofile(str(path), wrapwidth=0)
    po[0].msgstr = "做得好，{name}"
    po.save(str(path))
    assert translate.check_messages() == []

    module.write_text(module.read_text().replace("well done, {name}", "well done indeed, {name}"))
    translate.update_messages()
    entry = polib.pofile(str(path), wrapwidth=0)[0]
    assert entry.msgid == "well done indeed, {name}" and "fuzzy" in entry.flags
    assert entry.previous_msgid == "well done, {name}" and entry.msgstr == "做得好，{name}"
    assert [p.kind for p in translate.check_messages()] == ["stale"]
    nb_path = _catalogued_copy(tmp_path, ENGLISH[1])
    assert translate.main(["build", str(nb_path)]) == 1 and not (tmp_path / "zh-CN").exists()
    po = polib.pofile(str(path), wrapwidth=0)
    po[0].flags.remove("fuzzy")
    po.save(str(path))
    assert [p.kind for p in translate.check_messages()] == ["stale"]  # the previous msgid is still there
    po[0].previous_msgid = None
    po.save(str(path))
    assert translate.check_messages() == []
    assert translate.main(["build", str(nb_path)]) == 0 and (tmp_path / "zh-CN" / nb_path.name).exists()


def test_messages_switch_language_and_back():
    assert get_language() == "en"
    with speaking("zh-CN"):
        assert _("well done") == "做得好"
    assert _("well done") == "well done"
    with pytest.raises(ValueError, match="zh-CN"):
        with speaking("fr"):
            pass


def _draw(title: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.set_title(title)
    ax.set_xlabel("步数")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fig.savefig(io.BytesIO(), format="png")
    plt.close(fig)
    return [str(w.message) for w in caught if "missing from" in str(w.message)]


def test_chinese_plot_labels_draw_with_a_real_font():
    from course_utils.i18n import cjk_font

    font = cjk_font()
    assert font is not None, "no CJK font: install fonts-noto-cjk (.ci/browser-setup.sh does)"
    assert _draw("显存占用（每一步）") == [], "every Chinese glyph must come from the CJK font"


_NO_FONT = """
import warnings
from matplotlib import font_manager
import course_utils.i18n as i18n
i18n.CJK_FONTS = ("No Such Font",)                 # a machine without any CJK font
font_manager.findSystemFonts = lambda *a, **k: []
language = i18n.set_language("zh-CN")
print("language", language, "plots", i18n.plot_label_language())
"""


def test_without_a_cjk_font_it_says_so_once_and_plots_fall_back_to_english():
    out = subprocess.run([sys.executable, "-c", _NO_FONT], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2 and "fonts-noto-cjk" in lines[0] and "字体" in lines[0], lines
    assert lines[1] == "language zh-CN plots en"


def _binds_underscore(tree) -> list[int]:
    """Lines where a module that translates with `_` also binds `_` as a variable (a loop or an unpacking
    target, an assignment), which would make `_` a local in that function and break `_("...")`."""
    import ast

    lines = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.For):  # (a comprehension's variable is local to it: harmless)
            targets = [node.target]
        elif isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.With,)):
            targets = [i.optional_vars for i in node.items if i.optional_vars is not None]
        for t in targets:
            for name in ast.walk(t):
                if isinstance(name, ast.Name) and name.id == "_":
                    lines.append(name.lineno)
    return lines


def test_no_module_that_translates_rebinds_underscore():
    import ast

    offenders = []
    for module in sorted((ROOT / "course_utils").rglob("*.py")):
        text = module.read_text(encoding="utf-8")
        if "import N_, _" in text or "import _" in text or " _\n" in text and "i18n import" in text:
            lines = _binds_underscore(ast.parse(text))
            offenders += [f"{module.relative_to(ROOT)}:{n}" for n in lines]
    assert not offenders, f"`_` is the translation function there; rename these variables: {offenders}"


def test_a_message_in_several_catalogs_has_one_translation():
    import polib

    seen: dict[str, dict[str, str]] = {}
    for path in sorted((ROOT / "course_utils" / "locale" / "zh_CN").glob("*.po")):
        for entry in polib.pofile(str(path)).translated_entries():
            seen.setdefault(entry.msgid, {})[path.name] = entry.msgstr
    differing = {k: v for k, v in seen.items() if len(set(v.values())) > 1}
    assert not differing, f"the catalogs merge into one table, so these would depend on file order: {differing}"


def test_chinese_paragraph_lines_are_joined_without_a_space():
    """Markdown renders a line break as a space; between Chinese characters that is a visible gap."""
    text = "第一行在这里\n接着写。\n\n```python\n# 注释一\n# 注释二\n```\n## 标题\n正文\n- 列表项\n  的续行\n| 甲 |\n| 乙 |\nEnglish\n中文"
    assert translate.join_cjk_lines(text) == (
        "第一行在这里接着写。\n\n```python\n# 注释一\n# 注释二\n```\n## 标题\n正文\n- 列表项的续行\n| 甲 |\n| 乙 |\n"
        "English\n中文")
    built = json.loads((CHINESE / ENGLISH[7].name).read_text(encoding="utf-8"))
    markdown = "".join(translate._source(c) for c in built["cells"] if c["cell_type"] == "markdown")
    assert not re.search(r"[\u4e00-\u9fff。，]\n[\u4e00-\u9fff]", re.sub(r"```.*?```", "", markdown, flags=re.S))
