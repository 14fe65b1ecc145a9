"""What a Chinese learner reads in the Chinese notebooks' outputs is Chinese: no printed line mixes Chinese with
English words, and no English sentence printed by the course's own code, except PyTorch's, CUDA's and Python's own
texts (errors, warnings, the profiler's table), API names and citations, listed below and reviewed."""
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHINESE = sorted((ROOT / "notebooks" / "zh-CN").glob("[0-9][0-9]_*.ipynb"))
CJK = re.compile(r"[\u3400-\u9fff]")
# Code, not prose: quoted values (an English term glossed in “quotes” too), inline code, URLs, anything with
# punctuation that code has, hyphenated names (nvidia-ml-py, all-reduce), numbers and units with digits.
# A colon or a parenthesis makes code only inside a token (cuda:0, f(x)), not as the punctuation of a word
# ("refused:", "(nothing recorded)").
CODE = re.compile(r"'[^']*'|\"[^\"]*\"|“[^”]*”|`[^`]*`|https?://\S+|\S*[_./\\=\[\]{}<>@|]\S*|\S*\w[:(]\S+|\S*\w-\w\S*|\S*\d\S*")
# The text of an exception or warning that PyTorch, CUDA or Python raised, quoted after its class's name.
FOREIGN = re.compile(r"\b[A-Z]\w*(Error|Exception|Warning|Interrupt)\b:?.*$|Error\(s\) in .*$|WeightsUnpickler error: .*$")
CITATION = re.compile(r"^\s*\[\d+\] ")  # a source in a list of references: its title stays as published
SOURCE = re.compile(r"\[[^\[\]]*; [^\[\]]*\]")  # a source cited inline, [title; publisher, date: url]
# Names that stay in English in Chinese text (d2l-zh keeps them too): API words, tools, units.
NAMES = frozenset("""
cuda cpu mps meta xpu gloo nccl fork spawn forkserver eager inductor torchrun pip conda nvcc ptxas nvrtc libcudart
smi torch torchvision numpy python jupyter triton autocast dtype logits logit softmax rank all-reduce allreduce
sgd adam adamw relu dropout tf bf fp inf nan ok oom mfu ddp fsdp amp vs x s ms us ns gb mb kb gib mib kib
tflops gflops img except raise lambda len pickle highest high medium train eval forward offset trainer mini cell
greeter momentum trace linux min bug matmul eps list is cudnn cublas
""".split())
# Whole lines that are PyTorch's or another tool's own output, not the course's (English by design).
FOREIGN_LINES = [
    re.compile(r"^\s*Name\s+Self CPU %"),                               # torch.profiler's table
    re.compile(r"CUDA out of memory\. Tried to allocate"),             # the CUDA caching allocator's message
    re.compile(r"did not receive grad for rank|TORCH_DISTRIBUTED_DEBUG to either INFO or DETAIL"),  # DDP's error
    re.compile(r"^\s*if self\._compiled_call_impl is not None:|_call_impl\b|\*args, \*\*kwargs"),  # torch's source (inspect)
    re.compile(r"^<Figure size \d+x\d+ with \d+ Axes>$"),              # matplotlib's repr of a figure
    re.compile(r"^\s*def \w+\(self\b"),                                  # torch's source (inspect)
    re.compile(r"^Self (CPU|CUDA) time total:"),                       # torch.profiler's table footer
    re.compile(r"^func: \w+ \| args: .* \| keywords: "),                # a functools.partial's own attributes
    re.compile(r"<All keys matched successfully>"),                    # load_state_dict's result
    re.compile(r"^type -> Hi, there!$"),                               # a metaclass's name and the demo's greeting
    re.compile(r"failed \(exitcode: -?\d+\)"),                          # torchrun's log
    re.compile(r"Cuda compilation tools, release"),                    # nvcc --version
    re.compile(r"platform_system|python_version|sys_platform"),       # a requirement's environment marker
]


def english_words(line: str) -> list[str]:
    rest = CODE.sub(" ", FOREIGN.sub(" ", SOURCE.sub(" ", line)))
    return [w for w in re.findall(r"[A-Za-z][A-Za-z'-]*[A-Za-z]", rest)
            if not w[0].isupper() and w.lower() not in NAMES]  # a capitalised word is a name: a product, a class


def _citations(lines: list[str]) -> set[int]:
    """Indices of the lines of references ("  [2] title; publisher, date") and of their wrapped continuations."""
    out, indent = set(), None
    for i, line in enumerate(lines):
        if CITATION.match(line):
            out.add(i)
            indent = len(line) - len(line.lstrip())
        elif indent is not None and line.strip() and len(line) - len(line.lstrip()) > indent:
            out.add(i)
        else:
            indent = None
    return out


def printed_lines(nb: dict):
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        for out in cell.get("outputs", []):
            if out["output_type"] == "stream":
                text = "".join(out["text"])
            elif out["output_type"] in ("execute_result", "display_data"):
                text = "".join(out.get("data", {}).get("text/plain", ""))
            else:
                continue
            lines = text.splitlines()
            skip = _citations(lines)
            for i, line in enumerate(lines):
                if line.strip() and i not in skip and not any(p.search(line) for p in FOREIGN_LINES):
                    yield cell["id"], line


def untranslated(nb: dict) -> list[str]:
    """Printed lines that mix Chinese and English words, or English sentences with no Chinese at all."""
    found = []
    for cell_id, line in printed_lines(nb):
        words = english_words(line)
        if (CJK.search(line) and words) or (not CJK.search(line) and len(words) >= 2):
            found.append(f"cell {cell_id}: {line.strip()[:140]}  <- {' '.join(words[:6])}")
    return found


@pytest.mark.parametrize("path", CHINESE, ids=[p.stem for p in CHINESE])
def test_the_chinese_outputs_are_chinese(path):
    found = untranslated(json.loads(path.read_text(encoding="utf-8")))
    assert not found, f"{path.name}: {len(found)} line(s) with English words:\n" + "\n".join(found[:30])


def test_the_detector_sees_mixed_and_english_lines_and_spares_names():
    nb = {"cells": [{"cell_type": "code", "id": "c", "outputs": [{"output_type": "stream", "text": [
        "在 cpu 上训练 3 轮，AdamW，`torch.compile`\n",            # names and code: fine
        "每个 batch 64 张图像\n",                                   # mixed
        "the loss went down\n",                                     # an English sentence
        "RuntimeError: Expected all tensors to be on the same device\n",  # PyTorch's own text
        "  [2] NVIDIA H100 Tensor Core GPU datasheet and product page, H100 SXM\n",
        "        column; NVIDIA, 检索于 2026-12-01\n",                    # a reference, wrapped
        "README 中的“strong scaling”（强扩展）\n",                      # a quoted term
        "938 img/s，硬件 1 块 A100 [NVIDIA A100 datasheet; NVIDIA, 2022-05: https://x.y/z]\n",  # cited inline
        "并设置了 MASTER_ADDR and MASTER_PORT\n",                       # mixed
        ".cpu()       (nothing recorded)\n",                            # English words in parentheses
        "AsFactor -> refused: WeightsUnpickler error\n",                   # a word before a colon is a word
        "cuda:0 (f(x)) [1]\n",                                              # code: fine
    ]}]}]}
    found = untranslated(nb)
    assert len(found) == 5 and "batch" in found[0] and "loss" in found[1] and "and" in found[2], found
    assert "nothing recorded" in found[3] and "refused" in found[4], found


# Columns that count characters, not display width: a Chinese character is two columns wide, so a table padded
# with str.ljust or a width on a text (a literal, a byte count with its unit) loses its alignment in Chinese.
# `course_utils.i18n.pad` counts display width; the English notebooks use it for every text column.
ENGLISH = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
CHAR_PADDING = re.compile(r"\.(ljust|rjust|center)\(|\{format_bytes\([^{}]*\):[<>^]?\d+\}|\{'[A-Za-z][^'{}]*':[<>^]?\d+\}")


@pytest.mark.parametrize("path", ENGLISH, ids=[p.stem for p in ENGLISH])
def test_text_columns_are_padded_by_display_width(path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    found = [f"cell {cell['id']}: {m.group(0)}" for cell in nb["cells"] if cell["cell_type"] == "code"
             for m in CHAR_PADDING.finditer("".join(cell["source"]))]
    assert not found, f"{path.name}: pad text columns with course_utils.i18n.pad:\n" + "\n".join(found)


def test_pad_counts_a_chinese_character_as_two_columns():
    from course_utils.i18n import pad

    assert pad("峰值", 6) == "峰值  " and pad("peak", 6) == "peak  " and pad("0 字节", 8, ">") == "  0 字节"
    assert pad("很长的标签", 4) == "很长的标签"  # never cut
