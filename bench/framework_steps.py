#!/usr/bin/env python3
"""What memtrack's framework callbacks cost a training step.

    target/fw-venv/bin/python bench/framework_steps.py [--bin target/debug/memtrack]
        [--steps 400] [--rounds 3] [--framework lightning,hf]

Runs the same tiny loop (Lightning: a 2-layer MLP, batch 4; Hugging Face: a
1-layer GPT-2 built from a config, batch 4) on CPU under ``memtrack run``,
with the automatic hooks on and with ``--no-auto-hooks``, alternately,
``--rounds`` times each, so that a step is as short as a real loop's gets
and the callback's share as large as it gets. Prints, per framework, the
median time per step of the training call both ways, their ratio and the
hooks' cost per step. Each job uses one torch thread, so that the figures
depend on the machine's other load as little as they can. With the hooks
on, each optimizer step sends a ``span_begin`` and a ``span_end``. Needs
torch, lightning and transformers in this Python; nothing is downloaded.
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


def lightning_job(steps):
    import lightning.pytorch as pl
    import torch

    torch.set_num_threads(1)

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


def hf_job(steps):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=97, n_positions=16))

    class Tokens(torch.utils.data.Dataset):
        def __init__(self, n):
            self.ids = torch.randint(0, 97, (n, 16))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=steps,
                             per_device_train_batch_size=4, save_strategy="no", eval_strategy="no",
                             logging_strategy="no", report_to=[], use_cpu=True,
                             dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(4 * steps))
    start = time.perf_counter()
    trainer.train()
    print("per_step_s %.9f" % ((time.perf_counter() - start) / steps))


JOBS = {"lightning": lightning_job, "hf": hf_job}

# No hub, no telemetry, no tracker of the libraries' own.
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
           "DISABLE_MLFLOW_INTEGRATION": "TRUE", "WANDB_DISABLED": "true", "DO_NOT_TRACK": "1"}


def measure(binary, framework, steps, hooks):
    env = dict(os.environ)
    env.pop("MEMTRACK_AUTO_HOOKS", None)
    env.update(OFFLINE)
    flags = [] if hooks else ["--no-auto-hooks"]
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run(
            [binary, "run", "--listen", "off", "--output", out, "--name", "bench"] + flags + ["--",
             sys.executable, os.path.abspath(__file__), "--job", framework, "--steps", str(steps)],
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
    parser.add_argument("--framework", default="lightning,hf",
                        help="comma-separated: lightning, hf (default both)")
    parser.add_argument("--job", choices=sorted(JOBS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        return JOBS[args.job](args.steps)
    frameworks = [f.strip() for f in args.framework.split(",") if f.strip()]
    unknown = [f for f in frameworks if f not in JOBS]
    if unknown or not frameworks:
        parser.error("--framework takes lightning and/or hf, not %s" % ", ".join(unknown or ["nothing"]))
    print("| per step (median of %d runs of %d steps) | hooks off (`--no-auto-hooks`) | hooks on "
          "| ratio on/off | hooks' cost per step |" % (args.rounds, args.steps))
    print("|---|---|---|---|---|")
    for framework in frameworks:
        on, off = [], []
        for _ in range(args.rounds):
            off.append(measure(args.bin, framework, args.steps, False))
            on.append(measure(args.bin, framework, args.steps, True))
        off_s, on_s = statistics.median(off), statistics.median(on)
        print("| %s | %.1f µs | %.1f µs | %.3f | %.1f µs |"
              % (framework, off_s * 1e6, on_s * 1e6, on_s / off_s, (on_s - off_s) * 1e6), flush=True)


if __name__ == "__main__":
    main()
