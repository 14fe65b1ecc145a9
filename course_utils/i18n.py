"""The language course_utils speaks: English (the default) or Simplified Chinese.

    from course_utils import set_language
    set_language("zh-CN")        # feedback, diagnoses, warnings and monitor labels in Chinese

The choice is per kernel (per Python process) and is inherited by processes started from it through the
environment variable `COURSE_UTILS_LANG`, which also sets it before the first import. The code behaves
identically in both languages: only the text changes.

Translations are gettext PO catalogs, one per source module, in `course_utils/locale/zh_CN/` (edited with
any PO editor, read here through `polib`). In the source, a message is written `_("text {name}")` and
formatted after translation (`.format(name=...)`), never as an f-string, so the catalog can hold the
template; `N_("text")` marks a message kept in a data structure and translated where it is shown.

For plots, `set_language("zh-CN")` also points matplotlib at a CJK font (Noto Sans CJK, Source Han Sans,
WenQuanYi, PingFang, Microsoft YaHei, ...). Without one, Chinese labels would be drawn as empty boxes: it
says so in one line and `plot_label_language()` returns "en", so labels fall back to English.
"""
from __future__ import annotations

import os
import textwrap
import unicodedata
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

__all__ = ["LANGUAGES", "N_", "_", "cjk_font", "display_width", "get_language", "pad", "plot_label_language",
           "set_language", "speaking", "wrap"]

LANGUAGES = ("en", "zh-CN")
ENV_VAR = "COURSE_UTILS_LANG"
LOCALE_DIR = Path(__file__).with_name("locale")
# Font families that cover Simplified Chinese, most common first: Debian/Ubuntu, Adobe, Linux, macOS, Windows.
CJK_FONTS = ("Noto Sans CJK SC", "Noto Sans SC", "Source Han Sans SC", "WenQuanYi Zen Hei", "WenQuanYi Micro Hei",
             "PingFang SC", "Hiragino Sans GB", "Heiti SC", "STHeiti", "Microsoft YaHei", "SimHei",
             "Noto Sans CJK JP", "Arial Unicode MS")


def _(message: str) -> str:
    """`message` in the current language (itself when English, or when the catalog has no translation)."""
    if _language == "en":
        return message
    return _catalog(_language).get(message, message)


def N_(message: str) -> str:
    """Mark `message` for the catalog without translating it now (it is translated where it is shown)."""
    return message


def _normalize(language: str | None) -> str:
    if not language:
        return "en"
    key = language.strip().replace("_", "-").lower()
    if key in ("en", "en-us", "en-gb", "english", "c", "posix"):
        return "en"
    if key in ("zh", "zh-cn", "zh-hans", "zh-hans-cn", "zh-sg", "chinese"):
        return "zh-CN"
    raise ValueError(_("unknown language {language!r}; course_utils speaks {languages}").format(
        language=language, languages=", ".join(LANGUAGES)))


_language = "en"
try:
    _language = _normalize(os.environ.get(ENV_VAR))
except ValueError:  # a bad environment value must not break `import course_utils`: stay English
    pass


def get_language() -> str:
    """The language messages are shown in: "en" or "zh-CN"."""
    return _language


def set_language(language: str) -> str:
    """Show course_utils' messages in `language` ("en" or "zh-CN"; "zh", "zh_CN" work too) from now on,
    in this process and the processes it starts. For "zh-CN" it also sets up a CJK font for plots
    (see `plot_label_language`). Returns the normalized language."""
    global _language
    _language = _normalize(language)
    os.environ[ENV_VAR] = _language
    if _language != "en":
        _catalog(_language)  # read the catalog now: a broken PO file is reported here, not mid-training
        if cjk_font() is None:
            print(_("No Chinese (CJK) font was found for matplotlib, so plots keep English labels; install one "
                    "(Debian/Ubuntu: apt install fonts-noto-cjk) and restart the kernel to see Chinese labels."))
    return _language


@contextmanager
def speaking(language: str):
    """`with speaking("zh-CN"):` messages in that language inside the block, the previous one after it."""
    global _language
    previous, previous_env = _language, os.environ.get(ENV_VAR)
    _language = _normalize(language)
    if _language != "en":
        _catalog(_language)
    try:
        yield _language
    finally:
        _language = previous
        if previous_env is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = previous_env


# English in every language: the catalogs it reports cannot be read to translate it (_() would read them again).
UNREADABLE_CATALOG = "the translation catalog {path} cannot be read: {exc}"


@lru_cache(maxsize=None)
def _catalog(language: str) -> dict[str, str]:
    """msgid -> msgstr for every translated, non-fuzzy entry of every PO file of `language`."""
    import polib

    folder = LOCALE_DIR / language.replace("-", "_")
    table: dict[str, str] = {}
    for path in sorted(folder.glob("*.po")):
        try:
            po = polib.pofile(str(path))
        except (OSError, ValueError) as exc:
            raise ValueError(UNREADABLE_CATALOG.format(path=path, exc=exc)) from None
        for entry in po.translated_entries():
            table.setdefault(entry.msgid, entry.msgstr)
    return table


@lru_cache(maxsize=1)
def cjk_font() -> str | None:
    """The name of a font matplotlib can draw Chinese with, registered and first in its sans-serif list;
    None when the machine has none. Looks only once per process."""
    from matplotlib import font_manager, rcParams

    names = {f.name for f in font_manager.fontManager.ttflist}
    found = next((n for n in CJK_FONTS if n in names), None)
    if found is None:  # matplotlib's font cache may predate the font's installation: look at the files
        for path in font_manager.findSystemFonts():
            stem = Path(path).name.lower()
            if any(k in stem for k in ("cjk", "sourcehansans", "wqy", "pingfang", "msyh", "simhei", "notosanssc")):
                try:
                    font_manager.fontManager.addfont(path)
                except Exception:  # an unreadable font file: try the next one
                    continue
        names = {f.name for f in font_manager.fontManager.ttflist}
        found = next((n for n in CJK_FONTS if n in names), None)
    if found is not None:
        rcParams["font.sans-serif"] = [found] + [n for n in rcParams["font.sans-serif"] if n != found]
        rcParams["axes.unicode_minus"] = False  # CJK fonts often lack U+2212, the minus sign matplotlib uses
    return found


def plot_label_language() -> str:
    """The language plot labels should use: the current language if it can be drawn, else "en"."""
    if _language == "en" or cjk_font() is not None:
        return _language
    return "en"


def _is_wide(char: str) -> bool:
    return unicodedata.east_asian_width(char) in "WF"


def display_width(text: str) -> int:
    """The columns `text` takes in a terminal or a notebook's output: a wide (Chinese) character counts as two."""
    return sum(2 if _is_wide(c) else 1 for c in text)


def pad(text: str, width: int, align: str = "<") -> str:
    """`text` in `width` columns, a wide (Chinese) character counting as two: `f"{text:<width}"` (or `">"`, right-
    aligned) for any language, so that a table's columns line up in the Chinese edition too."""
    space = " " * max(width - display_width(text), 0)
    return space + text if align == ">" else text + space


# Never at the start of a line (a break may come after them) / never at the end of one (a break may come before).
_NO_LINE_START = set("，。；：、）！？」』》】〉…—%,.;:!?)]}'\"")
_NO_LINE_END = set("（「『《【〈([{'\"")


def _break_between(left: str, right: str) -> bool:
    """Whether a line may break between two adjacent non-space characters: after a closing Chinese punctuation mark
    or around a wide (CJK) character, but never before a closing mark nor after an opening one."""
    if right in _NO_LINE_START or left in _NO_LINE_END:
        return False
    return _is_wide(left) or _is_wide(right)


class _WidthWrapper(textwrap.TextWrapper):
    """textwrap.TextWrapper that measures in display columns and may also break inside a run of Chinese text."""

    def _split(self, text):
        chunks = []
        for chunk in super()._split(text):
            if chunk.strip() == "" or not any(_is_wide(c) for c in chunk):
                chunks.append(chunk)
                continue
            start = 0
            for i in range(1, len(chunk)):
                if _break_between(chunk[i - 1], chunk[i]):
                    chunks.append(chunk[start:i])
                    start = i
            chunks.append(chunk[start:])
        return chunks

    def _handle_long_word(self, reversed_chunks, cur_line, cur_len, width):
        space_left = 1 if width < 1 else width - cur_len
        chunk = reversed_chunks[-1]
        if self.break_long_words:
            end, used = 0, 0
            while end < len(chunk) and used + display_width(chunk[end]) <= space_left:
                used += display_width(chunk[end])
                end += 1
            if end == 0 and not cur_line:
                end = 1  # a character wider than the whole line: it goes alone, so that the text moves on
            if self.break_on_hyphens and end < len(chunk):
                hyphen = chunk.rfind("-", 0, end)
                if hyphen > 0 and any(c != "-" for c in chunk[:hyphen]):
                    end = hyphen + 1
            if end:
                cur_line.append(chunk[:end])
                reversed_chunks[-1] = chunk[end:]
        elif not cur_line:
            cur_line.append(reversed_chunks.pop())

    def _wrap_chunks(self, chunks):
        # textwrap's greedy filling (without max_lines), with display_width in place of len
        if self.width <= 0:
            raise ValueError(_("invalid width {width!r} (must be > 0)").format(width=self.width))
        lines: list[str] = []
        chunks.reverse()
        while chunks:
            cur_line: list[str] = []
            cur_len = 0
            indent = self.subsequent_indent if lines else self.initial_indent
            width = self.width - display_width(indent)
            if self.drop_whitespace and chunks[-1].strip() == "" and lines:
                del chunks[-1]
            while chunks:
                length = display_width(chunks[-1])
                if cur_len + length <= width:
                    cur_line.append(chunks.pop())
                    cur_len += length
                else:
                    break
            if chunks and display_width(chunks[-1]) > width:
                self._handle_long_word(chunks, cur_line, cur_len, width)
                cur_len = sum(map(display_width, cur_line))
            if self.drop_whitespace and cur_line and cur_line[-1].strip() == "":
                cur_len -= display_width(cur_line[-1])
                del cur_line[-1]
            if cur_line:
                lines.append(indent + "".join(cur_line))
        return lines


def wrap(text: str, width: int, initial_indent: str = "", subsequent_indent: str = "", **options) -> list[str]:
    """`textwrap.wrap(text, width, ...)` measured in display columns (a wide, Chinese, character counts as two, as
    in `pad`), so that Chinese lines are as wide on screen as English ones. English text is broken at spaces (and
    hyphens) exactly as textwrap does; Chinese text, which has no spaces, may also break after its punctuation or
    between two Chinese characters (never before a closing mark such as ，。） nor after an opening one such as （).
    A line exceeds `width` only for a single token that cannot be broken (with `break_long_words=False`).
    `options`: those of `textwrap.TextWrapper` (`break_long_words`, `break_on_hyphens`, ...; not `max_lines`)."""
    if options.get("max_lines") is not None:
        raise TypeError(_("wrap() does not support max_lines"))
    wrapper = _WidthWrapper(width, initial_indent=initial_indent, subsequent_indent=subsequent_indent, **options)
    return wrapper.wrap(text)
