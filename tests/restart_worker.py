"""course_utils.examples.train_digits under torchrun, saying where it is: rank 0 prints "step N" after every
optimizer step and waits a little, so a test can signal the launcher at a known point (tests/test_restarts.py).

    torchrun ... restart_worker.py TRAIN_DIGITS_ARGS...
"""
import sys
import time

from course_utils.callbacks import Callback
from course_utils.examples import train_digits


class Progress(Callback):
    def on_batch_end(self, trainer, loss):
        if trainer.at_step_boundary and trainer.is_main:
            print(f"step {trainer.optimizer_steps}", flush=True)
        time.sleep(0.02)


if __name__ == "__main__":
    train_digits.main(sys.argv[1:], callbacks=[Progress()])
