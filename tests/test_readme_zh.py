"""README.zh-CN.md mirrors README.md: the same headings, the same code blocks, and links that resolve."""
from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENGLISH = ROOT / "README.md"
CHINESE = ROOT / "README.zh-CN.md"

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
# [text](target) and ![alt](target); the target ends at whitespace (an optional "title" may follow) or ")".
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+[\"'][^)]*[\"'])?\s*\)")
# A `#` starts a comment at the start of a line or after whitespace; shebangs and #SBATCH lines are directives.
COMMENT = re.compile(r"(^|\s)#.*$")
DIRECTIVE = re.compile(r"^\s*#(!|SBATCH\b)")


def _outside_fences(text: str) -> list[str]:
    """The lines of `text` that are not inside ``` (or ~~~) code fences."""
    lines, inside = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            inside = not inside
            continue
        if not inside:
            lines.append(line)
    return lines


def headings(text: str) -> list[tuple[int, str]]:
    """(level, text) of every ATX heading outside code fences, in order."""
    found = []
    for line in _outside_fences(text):
        match = HEADING.match(line)
        if match:
            found.append((len(match.group(1)), match.group(2)))
    return found


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(info string, body) of every fenced code block, in order."""
    blocks, info, body = [], None, []
    for line in text.splitlines():
        match = FENCE.match(line)
        if match and info is None:
            info, body = line.strip()[3:].strip(), []
        elif match:
            blocks.append((info, "\n".join(body)))
            info = None
        elif info is not None:
            body.append(line)
    assert info is None, "unclosed code fence"
    return blocks


def without_comments(code: str) -> str:
    """The code with comments and all whitespace removed (directive lines such as #!/bin/bash kept)."""
    kept = []
    for line in code.splitlines():
        if not DIRECTIVE.match(line):
            line = COMMENT.sub("", line)
        kept.append(re.sub(r"\s+", "", line))
    return "".join(kept)


def structure_differences(english: str, chinese: str) -> list[str]:
    """Why `chinese` does not mirror `english` (headings and code blocks); [] when it does."""
    problems = []
    en_h, zh_h = headings(english), headings(chinese)
    if len(en_h) != len(zh_h):
        problems.append(f"{len(zh_h)} headings in the Chinese file, {len(en_h)} in the English one")
    if [level for level, _ in en_h] != [level for level, _ in zh_h]:
        problems.append(f"heading levels differ: English {[lv for lv, _ in en_h]}, Chinese {[lv for lv, _ in zh_h]}")
    en_c, zh_c = code_blocks(english), code_blocks(chinese)
    if len(en_c) != len(zh_c):
        problems.append(f"{len(zh_c)} code blocks in the Chinese file, {len(en_c)} in the English one")
    for i, ((en_info, en_body), (zh_info, zh_body)) in enumerate(zip(en_c, zh_c), 1):
        if en_info != zh_info:
            problems.append(f"code block {i}: language {zh_info!r}, English {en_info!r}")
        if without_comments(en_body) != without_comments(zh_body):
            problems.append(f"code block {i} differs from the English one beyond its comments:\n{zh_body}")
    return problems


def relative_links(text: str) -> list[str]:
    """Link targets outside code fences and inline code that are not URLs or in-page anchors."""
    prose = "\n".join(_outside_fences(text))
    prose = re.sub(r"`[^`\n]*`", "", prose)  # inline code is not a link; [`name`](target) becomes [](target)
    targets = []
    for target in LINK.findall(prose):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue
        targets.append(unquote(target.split("#", 1)[0]))
    return targets


def test_the_chinese_readme_has_the_english_headings_and_code_blocks():
    problems = structure_differences(ENGLISH.read_text(encoding="utf-8"), CHINESE.read_text(encoding="utf-8"))
    assert not problems, "\n".join(problems)


def test_every_relative_link_of_the_chinese_readme_exists():
    links = relative_links(CHINESE.read_text(encoding="utf-8"))
    assert links, "no relative links found: the link pattern is broken"
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, f"README.zh-CN.md links to missing files: {missing}"


def test_the_chinese_readme_points_to_the_chinese_notebooks_and_both_readmes_link_each_other():
    zh_links = relative_links(CHINESE.read_text(encoding="utf-8"))
    en_links = relative_links(ENGLISH.read_text(encoding="utf-8"))
    assert "README.md" in zh_links and "README.zh-CN.md" in en_links
    notebooks = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "notebooks" / "zh-CN").glob("[0-9][0-9]_*.ipynb"))
    assert notebooks and set(notebooks) <= set(zh_links)


def _drop_line(text: str, prefix: str) -> str:
    lines = text.splitlines()
    index = next(i for i, line in enumerate(lines) if line.startswith(prefix))
    return "\n".join(lines[:index] + lines[index + 1:])


def test_the_comparison_reports_a_missing_heading():
    english = ENGLISH.read_text(encoding="utf-8")
    chinese = CHINESE.read_text(encoding="utf-8")
    third_level = next(line for line in chinese.splitlines() if line.startswith("### "))
    problems = structure_differences(english, _drop_line(chinese, third_level))
    assert any("headings" in p for p in problems), problems


@pytest.mark.parametrize("edit, why", [
    (lambda zh: zh.replace("--epochs 2", "--epochs 3", 1), "beyond its comments"),
    (lambda zh: zh.replace("#SBATCH --nodes=2", "#SBATCH --nodes=3", 1), "beyond its comments"),
    (lambda zh: zh.replace("```bash\nconda env create", "```sh\nconda env create", 1), "language"),
    (lambda zh: re.sub(r"```python\nfrom course_utils import describe_environment\n.*?```\n", "", zh, flags=re.S),
     "code blocks"),
])
def test_the_comparison_reports_a_changed_or_missing_code_block(edit, why):
    english = ENGLISH.read_text(encoding="utf-8")
    chinese = CHINESE.read_text(encoding="utf-8")
    edited = edit(chinese)
    assert edited != chinese
    assert any(why in p for p in structure_differences(english, edited))


def test_a_translated_comment_is_not_a_difference():
    english = "```bash\nls -l  # list the files\n```\n"
    chinese = "```bash\nls -l   # 列出文件\n```\n"
    assert structure_differences(english, chinese) == []
    assert structure_differences(english, "```bash\nls -la  # 列出文件\n```\n") != []


def test_a_missing_link_target_is_found():
    assert relative_links("see [a](notebooks/zh-CN/nope.ipynb), [b](https://x.org) and `[c](d)`") == [
        "notebooks/zh-CN/nope.ipynb"]
