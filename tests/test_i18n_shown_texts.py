"""Texts course_utils shows learners in the language set: speed ladder rungs, the FSDP demo's log, the simulated OOM."""
import pytest
import torch

from course_utils import speed
from course_utils.i18n import speaking


def test_rung_labels_and_docs_follow_the_language_and_keys_do_not():
    english = {r.name: (r.label, r.doc) for r in speed.RUNGS}
    with speaking("zh-CN"):
        chinese = {r.name: (r.label, r.doc) for r in speed.RUNGS}
        data = speed.LadderResult("cpu").to_dict()
    assert set(chinese) == set(english) and "naive" in chinese and "resident_data" in chinese
    assert chinese["resident_data"][0] == "数据放在设备上\n（TensorLoader）"
    assert chinese["big_batch"][0] == "批量大小 256" and chinese["mixed_precision"][0] == "混合精度"
    assert all(chinese[name][1] != english[name][1] for name in english)  # every doc is translated
    assert chinese["channels_last"][0] == "channels_last"  # an identifier, the same in both
    # the results' data (benchmarks, reference figures) keep the English labels
    assert data["labels"]["resident_data"] == "data on the device (TensorLoader)"


def test_fsdp_log_is_read_in_either_language():
    pytest.importorskip("torch.distributed.fsdp")
    from course_utils.examples import fsdp_shards as fs

    def log():
        line = fs._(fs.COLLECTIVE_LINE).format
        return [line(collective="all_gather", bytes=471000), line(collective="all_gather", bytes=6020),
                fs._(fs.FORWARD_DONE), line(collective="all_gather", bytes=6020),
                line(collective="reduce_scatter", bytes=12040), line(collective="all_gather", bytes=471000),
                line(collective="reduce_scatter", bytes=942000), fs._(fs.BACKWARD_DONE)]

    english = log()
    with speaking("zh-CN"):
        chinese = log()
    assert english[2] == "forward done" and english[0] == "all_gather 471000 bytes in"
    assert chinese[2] == "前向传播完成" and chinese[0] == "all_gather 471000 字节（输入）"
    for lines in (english, chinese):
        for language in ("en", "zh-CN"):
            with speaking(language):
                forward, backward = fs.phases(lines)
            assert fs.collective_bytes(forward, "all_gather") == [6020, 471000]
            assert fs.collective_bytes(backward, "all_gather") == [6020, 471000]
            assert fs.collective_bytes(backward, "reduce_scatter") == [12040, 942000]


def test_simulated_oom_remark_is_translated_and_the_cuda_part_is_an_attribute():
    from course_utils.memory import SimulatedGPU

    for language, remark in (("en", " (Simulated by course_utils.memory.SimulatedGPU on the CPU"),
                             ("zh-CN", " （由 course_utils.memory.SimulatedGPU 在 CPU 上模拟")):
        with speaking(language), SimulatedGPU("1MiB"):
            with pytest.raises(torch.OutOfMemoryError) as info:
                torch.zeros(2 ** 20)
        message, cuda = str(info.value), info.value.cuda_message
        assert cuda.startswith("CUDA out of memory. Tried to allocate 4.00 MiB.")
        assert cuda.endswith("is reserved by PyTorch but unallocated.") and message.startswith(cuda + remark)
        if language == "zh-CN":
            assert "Simulated by" not in message
