#!/usr/bin/env python3
"""What memtrack's framework callback costs a training step.

    target/fw-venv/bin/python bench/framework_steps.py [--bin target/debug/memtrack]
        [--steps 400] [--rounds 3]

Runs the same tiny Lightning loop (a 2-layer MLP on CPU, batch 4, so that a
step is as short as a real loop's gets and the callback's share as large as
it gets) under ``memtrack run``, with the automatic hooks on and off
(``MEMTRACK_AUTO_HOOKS=0``), alternately, ``--rounds`` times each. Prints
the median time per step of ``trainer.fit`` both ways and their ratio. With
the hooks on, each optimizer step sends a ``span_begin`` and a ``span_end``.
Needs torch and lightning in this Python.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, ".."))


def job(steps):
    import lightning.pytorch as pl
    import torch

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

        def training_step(self, batch, idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = torch.utils.data.TensorDataset(torch.randn(4 * steps, 8), torch.randn(4 * steps, 1))
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=tempfile.mkdtemp())
    start = time.perf_counter()
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4))
    print("per_step_s %.9f" % ((time.perf_counter() - start) / steps))


def measure(binary, steps, hooks):
    env = dict(os.environ)
    env["MEMTRACK_AUTO_HOOKS"] = "1" if hooks else "0"
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run(
            [binary, "run", "--listen", "off", "--output", out, "--name", "bench", "--",
             sys.executable, os.path.abspath(__file__), "--job", str(steps)],
            env=env, capture_output=True, text=True, check=True)
    for line in proc.stdout.splitlines():
        if line.startswith("per_step_s "):
            return float(line.split()[1])
    raise SystemExit("no timing in the job's output:\n" + proc.stdout + proc.stderr)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin", default=os.path.join(REPO, "target", "debug", "memtrack"))
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--job", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        return job(args.job)
    on, off = [], []
    for _ in range(args.rounds):
        off.append(measure(args.bin, args.steps, False))
        on.append(measure(args.bin, args.steps, True))
    off_s, on_s = statistics.median(off), statistics.median(on)
    print("| | per step (median of %d runs of %d steps) |" % (args.rounds, args.steps))
    print("|---|---|")
    print("| hooks off | %.1f µs |" % (off_s * 1e6))
    print("| hooks on (span per step) | %.1f µs |" % (on_s * 1e6))
    print("| ratio on/off | %.3f |" % (on_s / off_s))
    print("| cost per step | %.1f µs |" % ((on_s - off_s) * 1e6))


if __name__ == "__main__":
    main()
