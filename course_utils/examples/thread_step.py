"""One SimpleCNN training step (batch 64) timed in this process, on a quiet machine and beside one busy core: what
notebook 04's thread section runs in fresh processes, one per OpenMP setting, because OpenMP reads its settings
once, when torch is imported.

    GOMP_SPINCOUNT=10000 python -m course_utils.examples.thread_step --threads 2 1 --steps 10

For each thread count, the median step time in milliseconds (after 3 warm-up steps), first alone, then beside a
`course_utils.threads.BusyCores(1)`; printed as JSON: {"quiet": {"2": ms, "1": ms}, "busy": {...}}.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from course_utils.models import SimpleCNN
from course_utils.threads import BusyCores


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()],
                        help="thread counts to time (torch.set_num_threads); default: torch's own")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = SimpleCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))

    def step():
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    def median_ms(threads: int) -> float:
        torch.set_num_threads(threads)
        for _ in range(3):  # warm-up: first calls allocate and pick kernels
            step()
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            step()  # on the CPU: nothing runs asynchronously, the clock reads the step itself
            times.append(time.perf_counter() - start)
        return round(statistics.median(times) * 1e3, 2)

    result = {"quiet": {str(n): median_ms(n) for n in args.threads}}
    with BusyCores(1):
        result["busy"] = {str(n): median_ms(n) for n in args.threads}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
