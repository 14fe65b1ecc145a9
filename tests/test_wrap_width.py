"""course_utils.i18n.wrap: textwrap.wrap measured in display columns, which may break Chinese text between characters."""
import textwrap

import pytest

from course_utils.i18n import _is_wide, display_width, speaking, wrap

ENGLISH = [
    "The quick brown fox jumps over the lazy dog. " * 6,
    "NVIDIA's published ResNet-50 v1.5 training throughput on one A100, times the FLOPs per image that "
    "torch.utils.flop_counter counts, over the dense BF16 tensor peak: MFU proper, labelled as such.",
    "  19.5 TFLOPS  FP32 peak, CUDA cores (not tensor cores); NVIDIA A100 SXM 80GB [1] [2] [3]",
    "[1] NVIDIA A100 Tensor Core GPU datasheet; NVIDIA, 2021: "
    "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf",
    "a-very-long-hyphenated-identifier-that-textwrap-splits-at-its-hyphens-when-break_on_hyphens-is-true and more",
    "supercalifragilisticexpialidocious" * 3 + " short words after it",
    "",
    "   ",
    "tabs\tand\nnewlines  and   several    spaces",
]
OPTIONS = [
    {},
    {"initial_indent": "    ", "subsequent_indent": "        "},
    {"subsequent_indent": "      ", "break_long_words": False, "break_on_hyphens": False},
    {"break_on_hyphens": False},
]
CHINESE = (
    "在一块 A100 上，NVIDIA 公布的 ResNet-50 v1.5 训练吞吐量约为每秒 2,500 张图像（混合精度，批量大小 256）；"
    "乘以 torch.utils.flop_counter 统计的每张图像的 FLOPs，再除以稠密 BF16 张量核心峰值，就得到名副其实的 MFU。"
    "显存不足时，先减小批量大小，或者用激活检查点以计算换显存；这些办法在笔记本 05 中都有演示、测量和比较。"
)


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("width", [20, 40, 79, 118])
def test_ascii_text_wraps_exactly_as_textwrap(width, options):
    for text in ENGLISH:
        assert wrap(text, width, **options) == textwrap.wrap(text, width, **options), text


def _is_lossless(text: str, lines: list[str], indents: tuple[str, str] = ("", "")) -> bool:
    """Whether `text` is the lines (indents removed) joined, each break dropping nothing or only spaces."""
    rest = text
    for i, line in enumerate(lines):
        indent = indents[0] if i == 0 else indents[1]
        assert line.startswith(indent)
        body = line[len(indent):]
        if i:
            rest = rest.lstrip(" ")
        if not rest.startswith(body):
            return False
        rest = rest[len(body):]
    return rest.strip(" ") == ""


@pytest.mark.parametrize("width", [10, 24, 40, 60, 80, 118])
def test_chinese_lines_never_exceed_the_width_in_display_columns_and_lose_nothing(width):
    indents = ("  ", "      ")
    lines = wrap(CHINESE, width, initial_indent=indents[0], subsequent_indent=indents[1])
    assert all(display_width(line) <= width for line in lines), [(display_width(x), x) for x in lines]
    assert _is_lossless(CHINESE, lines, indents)
    assert "".join(line.strip() for line in lines).replace(" ", "") == CHINESE.replace(" ", "")
    if width >= 24:  # full lines: only the last one, and those ended by an unbreakable token, are much shorter
        assert sum(display_width(x) >= width - 8 for x in lines[:-1]) >= len(lines[:-1]) * 0.75


def test_chinese_breaks_respect_punctuation():
    for width in range(8, 60):
        lines = wrap(CHINESE, width, break_long_words=False)  # English words whole, even when wider than a line
        for line in lines:
            assert line[0] not in "，。；：、）", (width, line)  # never a closing mark first
            assert line[-1] not in "（", (width, line)  # never an opening mark last
        for line, after in zip(lines, lines[1:]):  # a break without a space comes next to a wide character
            joined = line + after
            if CHINESE.find(joined) >= 0:
                assert _is_wide(line[-1]) or _is_wide(after[0]), (width, line, after)


def test_english_words_in_chinese_text_stay_whole():
    text = "用 torch.compile 编译模型，然后测量 images_per_second 与 batch_size 的关系。" * 3
    words = {w for w in text.replace("，", " ").replace("。", " ").split() if w.isascii()}
    for width in (20, 30, 44):
        lines = wrap(text, width)
        assert all(display_width(x) <= width for x in lines)
        assert _is_lossless(text, lines)
        for line in lines:
            for word in line.split():
                if word.isascii():
                    assert word in words, (width, word)


def test_unbreakable_token_is_the_only_excess():
    url = "https://example.com/" + "x" * 60
    text = "来源：" + url + " 检索于 2025 年"
    lines = wrap(text, 40, break_long_words=False)
    assert url in lines[1] or any(url in x for x in lines)
    assert all(display_width(x) <= 40 for x in lines if url not in x)
    lines = wrap("中" * 50, 11)  # an odd width: a wide character never straddles the edge
    assert all(display_width(x) <= 11 for x in lines) and "".join(lines) == "中" * 50


def test_width_must_be_positive():
    with pytest.raises(ValueError):
        wrap("abc", 0)
    with speaking("zh-CN"), pytest.raises(ValueError, match="必须大于 0"):
        wrap("abc", 0)


def test_published_table_in_chinese_fits_the_width():
    from course_utils import reference

    with speaking("zh-CN"):
        for section in ("cpu_vs_gpu", "matmul", "transfers", "speed_ladder", "batch_size", "amp", "memory",
                        "monitor", "ddp"):
            table = reference.published_table(section)
            assert table
            for line in table.splitlines():
                if "http" not in line:  # a URL is one unbreakable token
                    assert display_width(line) <= reference._WIDTH, line
