"""Benchmark job, TorchTitan framework mode: TorchTitan's own trainer, with the benchmark's step log.

    torchtitan_job.py --log-dir DIR --mode {plain,checkpoint,torchpass} [TorchTitan's command line]

* ``plain`` and ``checkpoint``: ``torchtitan.train``'s ``main(Trainer)``, as ``python -m torchtitan.train``
  runs it (the driver enables TorchTitan's checkpointer for ``checkpoint``: ``[checkpoint] enable``, an
  interval of K steps; on a restart the trainer loads the newest checkpoint itself);
* ``torchpass``: the adapter's entry point ``torchpass.adapters.torchtitan.train`` (TorchTitan's ``main``
  with the migratable trainer); the driver's TOML carries a ``[torchpass]`` section.

The only addition to TorchTitan is the measurement: ``Trainer.train_step`` is wrapped to append the
benchmark's ``ready`` (before the first step this process executes) and ``step`` (each step it completes)
records to ``<log-dir>/rank<r>.jsonl`` (``bench/workload.py``). On CPU the driver puts the test-support
shim on the ``PYTHONPATH`` (``tests/support/torchtitan/cpu_shim.py``, which says what it replaces).
"""

import time

T_START = time.time()  # before the heavy imports: a restart's cost includes them

import argparse
import os
import runpy
import sys
from typing import Any


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--log-dir", required=True)
    p.add_argument("--mode", choices=("plain", "checkpoint", "torchpass"), required=True)
    args, titan_argv = p.parse_known_args()
    # TorchTitan's ConfigManager binds sys.argv[1:] as its default when torchtitan.config is first imported.
    sys.argv = [sys.argv[0], *titan_argv]

    from torchtitan.train import Trainer
    from torchtitan.train import main as titan_main

    install_step_log(Trainer, args.log_dir)
    if args.mode == "torchpass":
        runpy.run_module("torchpass.adapters.torchtitan.train", run_name="__main__", alter_sys=True)
    else:
        titan_main(Trainer)


def install_step_log(trainer_class: type, log_dir: str) -> None:
    """Wrap ``trainer_class.train_step`` to log ``ready`` before this process's first step, ``step`` after each."""
    from bench.workload import StepLog

    train_step = trainer_class.train_step
    log: StepLog | None = None

    def logged_train_step(self: Any, data_iterator: Any) -> Any:
        nonlocal log
        if log is None:
            log = StepLog(log_dir, int(os.environ["RANK"]), T_START)
            log.event("ready", step=self.step - 1)
        t0 = time.perf_counter()
        out = train_step(self, data_iterator)
        samples = int(os.environ["WORLD_SIZE"]) * self.job_config.training.local_batch_size
        log.step(self.step, time.perf_counter() - t0, samples=samples)
        return out

    trainer_class.train_step = logged_train_step


if __name__ == "__main__":
    main()
