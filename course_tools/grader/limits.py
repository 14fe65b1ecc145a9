"""What one notebook may use (`Limits`), sizes as written on the command line, and the error for bad input."""
from __future__ import annotations

import re

GiB, MiB = 2 ** 30, 2 ** 20


class GradeError(Exception):
    """Bad input (no such folder, no notebooks, unwritable report...): a message for the user, no traceback."""


def parse_size(text: str) -> int:
    """'8G', '512M', '100k', '8GiB', '1.5G' or a number of bytes -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(i?[bB])?\s*", str(text))
    if not match:
        raise ValueError(f"expected a size such as 8G, 512M or 100000 (bytes), got {text!r}")
    scale = {"": 1, "k": 2 ** 10, "m": MiB, "g": GiB, "t": 2 ** 40}[match.group(2).lower()]
    return int(float(match.group(1)) * scale)


def format_size(n: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 2 ** 10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} bytes"


class Limits:
    """What one notebook may use. `cpu` defaults to twice the time limit (the kernel's threads add up)."""

    def __init__(self, timeout: float = 300, memory: int | None = 8 * GiB, cpu: int | None = None,
                 output: int = 10 * MiB, file_size: int = 256 * MiB, disk: int = 1 * GiB, gpu: bool = False,
                 processes: int = 1024):
        if timeout <= 0:
            raise GradeError(f"the time limit must be positive, got {timeout}")
        self.timeout, self.memory, self.output, self.file_size, self.disk, self.gpu = (
            float(timeout), memory, int(output), int(file_size), int(disk), gpu)
        self.processes = int(processes)  # RLIMIT_NPROC: threads count too (torch starts one per core)
        self.cpu = int(cpu) if cpu else int(max(10, 2 * timeout))
        if self.gpu:
            self.memory = None  # CUDA reserves far more address space than any useful RLIMIT_AS
