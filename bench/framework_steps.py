#!/usr/bin/env python3
"""What memtrack's framework callbacks cost a training step.

    target/fw-venv/bin/python bench/framework_steps.py [--bin target/debug/memtrack]
        [--steps 2000] [--rounds 7] [--framework lightning,hf] [--hogs 0]
        [--output docs/hook-cost.md]

Runs the same tiny loop (Lightning: a 2-layer MLP, batch 4; Hugging Face: a
1-layer GPT-2 built from a config, batch 4) on CPU under ``memtrack run``,
with the automatic hooks on and with ``--no-auto-hooks``, alternately,
``--rounds`` times each, so that a step is as short as a real loop's gets
and the callback's share as large as it gets. Prints, per framework, the
median time per step of the training call both ways, their ratio and the
hooks' cost per step (the median of the rounds' differences, each round
running off then on back to back, against the goal), and, as checks
that move less with the machine's other load, the job process's CPU time
per step both ways and the time spent inside memtrack's step hooks (a
step's two messages built and sent, or held back: steps less than 10 ms
apart go to memtrack in batches). Each job uses one torch thread, so that
the figures depend on the machine's other load as little as they can.
Needs torch, lightning and transformers in this Python; nothing is
downloaded. Give it a release build (``--bin target/release/memtrack``)
for figures to quote: a debug daemon's own work is several times larger.
``--output FILE`` also writes the table, with the machine and its load, to
FILE (docs/hook-cost.md is this script's), where README copies it from.
"""

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, ".."))


def time_the_hooks():
    """With the hooks on, time what memtrack's step hooks themselves take
    (``memtrack.frameworks._Steps``: building and sending a step's two
    messages); returns a function giving the seconds spent so far."""
    spent = [0.0]
    if not os.environ.get("MEMTRACK_SOCKET") or os.environ.get("MEMTRACK_AUTO_HOOKS") == "0":
        return lambda: None
    try:
        from memtrack import frameworks
    except ImportError:
        return lambda: None
    clock = time.perf_counter

    def timed(method):
        def run(self, *args):
            start = clock()
            try:
                return method(self, *args)
            finally:
                spent[0] += clock() - start
        return run

    frameworks._Steps.begin = timed(frameworks._Steps.begin)
    frameworks._Steps.end = timed(frameworks._Steps.end)
    return lambda: spent[0]


def report(start, cpu_start, steps, hooks_spent):
    print("per_step_s %.9f" % ((time.perf_counter() - start) / steps))
    print("cpu_per_step_s %.9f" % ((time.process_time() - cpu_start) / steps))
    spent = hooks_spent()
    if spent is not None:
        print("hooks_per_step_s %.9f" % (spent / steps))


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
    hooks_spent = time_the_hooks()
    start, cpu_start = time.perf_counter(), time.process_time()
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4))
    report(start, cpu_start, steps, hooks_spent)


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
    hooks_spent = time_the_hooks()
    start, cpu_start = time.perf_counter(), time.process_time()
    trainer.train()
    report(start, cpu_start, steps, hooks_spent)


JOBS = {"lightning": lightning_job, "hf": hf_job}

# What the hooks may add to a step: about what a bare fire-and-forget mark
# costs.
GOAL_US = 20

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
    figures = {}
    for line in proc.stdout.splitlines():
        name, _, value = line.partition(" ")
        if name in ("per_step_s", "cpu_per_step_s", "hooks_per_step_s"):
            figures[name] = float(value)
    if "per_step_s" not in figures:
        raise SystemExit("no timing in the job's output:\n" + proc.stdout + proc.stderr)
    return figures


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin", default=os.path.join(REPO, "target", "debug", "memtrack"))
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--framework", default="lightning,hf",
                        help="comma-separated: lightning, hf (default both)")
    parser.add_argument("--hogs", type=int, default=0,
                        help="CPU hogs (busy loops) beside the job, as on a training node whose "
                             "cores are all busy (default 0: a quiet machine)")
    parser.add_argument("--output", help="also write the table, with the machine and its load, to this "
                                         "Markdown file (docs/hook-cost.md is this script's)")
    parser.add_argument("--job", choices=sorted(JOBS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        return JOBS[args.job](args.steps)
    frameworks = [f.strip() for f in args.framework.split(",") if f.strip()]
    unknown = [f for f in frameworks if f not in JOBS]
    if unknown or not frameworks:
        parser.error("--framework takes lightning and/or hf, not %s" % ", ".join(unknown or ["nothing"]))
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
    load_before, started = loadavg(), time.time()
    try:
        lines = table(args, frameworks)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    if args.output:
        write(args.output, lines, load_before, loadavg(), time.time() - started, args)
        print("wrote %s" % args.output)


def loadavg():
    """The 1-minute load average (runnable tasks), from /proc/loadavg."""
    try:
        with open("/proc/loadavg") as f:
            return "%.2f" % float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return "unknown"


def write(path, lines, load_before, load_after, elapsed, args):
    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
    except OSError:
        pass
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = ["# What the framework hooks cost a training step", "",
            "Generated by `bench/framework_steps.py` on %s — %s, %d cores, Linux %s; memtrack `%s`; "
            "total %.0f s. Do not edit by hand: rerun the script with `--output`."
            % (when, cpu, os.cpu_count() or 0, platform.release(), os.path.relpath(args.bin, REPO), elapsed),
            "",
            "Load on the machine (1-minute load average, other work included): %s when the run began, "
            "%s when it ended. Hooks on and off ran alternately, so the two columns saw the same load."
            % (load_before, load_after),
            "",
            "A tiny loop on CPU (Lightning: a 2-layer MLP; Hugging Face: a 1-layer GPT-2; batch 4; one "
            "torch thread), run under `memtrack run` with the automatic hooks on and with "
            "`--no-auto-hooks`, off then on in each round. *Hooks' cost per step* is the median over the "
            "rounds of the difference in wall time per step; *in the hooks* is the time spent inside memtrack's step hooks themselves."
            "", ""] + lines + [""]
    with open(path, "w") as f:
        f.write("\n".join(text))


def table(args, frameworks):
    """Measures and prints the table; returns its lines."""
    lines = []

    def out(line):
        lines.append(line)
        print(line, flush=True)

    print("%d CPU hogs beside the job on %d cores; memtrack %s" % (args.hogs, os.cpu_count(), args.bin))
    out("| per step (median of %d runs of %d steps, %d CPU hogs) | hooks off (`--no-auto-hooks`) | hooks on "
        "| ratio on/off | hooks' cost per step | job CPU per step, off → on | in the hooks per step "
        "| goal |" % (args.rounds, args.steps, args.hogs))
    out("|---|---|---|---|---|---|---|---|")
    for framework in frameworks:
        on, off = [], []
        for _ in range(args.rounds):
            off.append(measure(args.bin, framework, args.steps, False))
            on.append(measure(args.bin, framework, args.steps, True))

        def median(runs, name):
            return statistics.median(r[name] for r in runs)

        off_s, on_s = median(off, "per_step_s"), median(on, "per_step_s")
        # Each round ran off then on, back to back: the median of the
        # rounds' differences cancels the machine's load drifting between
        # rounds, which the difference of the two medians does not.
        cost = statistics.median(b["per_step_s"] - a["per_step_s"] for a, b in zip(off, on))
        out("| %s | %.1f µs | %.1f µs | %.3f | %.1f µs | %.1f → %.1f µs | %.1f µs | ≤ %d µs: %s |"
            % (framework, off_s * 1e6, on_s * 1e6, on_s / off_s, cost * 1e6,
               median(off, "cpu_per_step_s") * 1e6, median(on, "cpu_per_step_s") * 1e6,
               median(on, "hooks_per_step_s") * 1e6, GOAL_US,
               "met" if cost * 1e6 <= GOAL_US else "not met"))
    return lines


if __name__ == "__main__":
    main()
