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
import random
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


class Blocks(object):
    """Takes memtrack's step callback out of the framework's callback list
    and puts it back, in blocks of ``size`` steps, and notes each block's
    wall and CPU time: the job then runs with and without the hooks in one
    process, in blocks a few tens of milliseconds long, so the two are
    compared under the same load, allocator state and memory layout. The
    blocks go in pairs, one with the hooks and one without, in an order
    drawn at random for each pair: whatever else the loop does every so
    many steps (a collection, the allocator growing) then falls as often in
    a block with the hooks as in one without, instead of always in the
    same one. Called first at each step's start (it is put first in the
    list). With ``module`` (Lightning's), the step hooks memtrack puts on
    the module's class go and come back with the callback."""

    def __init__(self, size, seed=20261128):
        self.size = size
        self.draw = random.Random(seed)
        self.blocks = []  # (with the hooks, wall at its start, CPU at its start)
        self.ends = []  # (wall, CPU) at each block's end, before the next one's toggle
        self.mine = None
        self.inside = True
        self.first_with = True

    def at_step(self, callbacks, step, module=None):
        if step % self.size:
            return
        self.ends.append((time.perf_counter(), time.process_time()))
        if self.mine is None:
            self.mine = next((c for c in callbacks if type(c).__name__.startswith("Memtrack")), False)
        if self.mine is False:
            raise SystemExit("memtrack's callback is not in the trainer's callbacks")
        # Block 0 is the loop's warm-up, with the hooks; then pairs.
        n = len(self.blocks)
        if n == 0:
            wanted = True
        elif n % 2:
            self.first_with = self.draw.random() < 0.5
            wanted = self.first_with
        else:
            wanted = not self.first_with
        if wanted != self.inside:
            self.toggle(callbacks, module)
        self.blocks.append((wanted, time.perf_counter(), time.process_time()))

    def toggle(self, callbacks, module):
        # The callback's own batch hooks are None when the module's are used.
        if module is not None and type(self.mine).on_train_batch_start is not None:
            module = None
        hooks = sys.modules["memtrack.frameworks"]._ModuleHooks if module is not None else None
        if self.inside:
            callbacks.remove(self.mine)
            if module is not None:
                hooks.detach(module)
        else:
            callbacks.append(self.mine)
            if module is not None:
                hooks.attach(module, self.mine)
            # As if the hooks had never been out: the block's first step
            # is as close to the last one as any other, so it is held
            # back like the rest instead of sent at once.
            steps = getattr(self.mine, "_steps", None)
            if steps is not None:
                steps._began = steps._ended = time.time_ns()
        self.inside = not self.inside

    def report(self):
        """Prints, for each pair of blocks (one with the hooks, one
        without), the difference per step, with the hooks minus without,
        in wall and CPU time. A toggle falls between two blocks, in
        neither."""
        n = self.size
        timed = [(on, (end[0] - wall) / n, (end[1] - cpu) / n)
                 for (on, wall, cpu), end in zip(self.blocks, self.ends[1:])]
        pairs = timed[1:]
        for a, b in zip(pairs[0::2], pairs[1::2]):
            on, off = (a, b) if a[0] else (b, a)
            print("block_diff_s %.9f %.9f" % (on[1] - off[1], on[2] - off[2]))


def report(start, cpu_start, steps, hooks_spent):
    print("per_step_s %.9f" % ((time.perf_counter() - start) / steps))
    print("cpu_per_step_s %.9f" % ((time.process_time() - cpu_start) / steps))
    spent = hooks_spent()
    if spent is not None:
        print("hooks_per_step_s %.9f" % (spent / steps))


def lightning_job(steps, blocks=None):
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
    if blocks:
        class Toggle(pl.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                blocks.at_step(trainer.callbacks, batch_idx, pl_module)

        trainer.callbacks.insert(0, Toggle())
        trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4))
        return blocks.report()
    hooks_spent = time_the_hooks()
    start, cpu_start = time.perf_counter(), time.process_time()
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4))
    report(start, cpu_start, steps, hooks_spent)


def hf_job(steps, blocks=None):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

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
    if blocks:
        class Toggle(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                blocks.at_step(trainer.callback_handler.callbacks, state.global_step)

        trainer.callback_handler.callbacks.insert(0, Toggle())
        trainer.train()
        return blocks.report()
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


def measure(binary, framework, steps, hooks, blocks=None):
    """One run of the job under ``memtrack run``: with the hooks or with
    ``--no-auto-hooks``, or (``blocks``) with the hooks taken out and put
    back every ``blocks`` steps. Returns the job's figures; in blocks, the
    list of its (wall, CPU) differences per step."""
    env = dict(os.environ)
    env.pop("MEMTRACK_AUTO_HOOKS", None)
    env.update(OFFLINE)
    flags = [] if hooks else ["--no-auto-hooks"]
    job = ["--job", framework, "--steps", str(steps)] + (["--in-blocks", str(blocks)] if blocks else [])
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run(
            [binary, "run", "--listen", "off", "--output", out, "--name", "bench"] + flags + ["--",
             sys.executable, os.path.abspath(__file__)] + job,
            env=env, capture_output=True, text=True, check=True)
    figures, diffs = {}, []
    for line in proc.stdout.splitlines():
        name, _, value = line.partition(" ")
        if name in ("per_step_s", "cpu_per_step_s", "hooks_per_step_s"):
            figures[name] = float(value)
        elif name == "block_diff_s":
            diffs.append(tuple(float(v) for v in value.split()))
    if blocks:
        if not diffs:
            raise SystemExit("no blocks in the job's output:\n" + proc.stdout + proc.stderr)
        return diffs
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
    parser.add_argument("--blocks", type=int, default=50,
                        help="steps per block in the run that takes the hooks out and puts them "
                             "back (default 50)")
    parser.add_argument("--job", choices=sorted(JOBS), help=argparse.SUPPRESS)
    parser.add_argument("--in-blocks", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        return JOBS[args.job](args.steps, Blocks(args.in_blocks) if args.in_blocks else None)
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
            "torch thread), run under `memtrack run`: with the automatic hooks on and with "
            "`--no-auto-hooks` in separate runs (*on − off, per round*: the median of the rounds' "
            "differences), and in one process with memtrack's callback taken out of the trainer's "
            "callback list (Lightning: with its batch hooks on the module) and put back, in pairs "
            "of blocks of %d steps, one with the hooks and one without, in an order drawn at "
            "random for each pair (*hooks' cost*: the median difference within the pairs, with a "
            "95 %% confidence interval; the goal is met when all of the interval is within it). *In the hooks* is the time spent inside memtrack's step hooks "
            "themselves." % args.blocks,
            "", ""] + lines + [""]
    with open(path, "w") as f:
        f.write("\n".join(text))


def median_with_ci(values):
    """The median and a 95 % confidence interval for it, from the order
    statistics (no assumption on the distribution)."""
    values = sorted(values)
    n = len(values)
    half = 0.98 * n ** 0.5  # 1.96 * sqrt(n) / 2
    low, high = max(0, int(n / 2 - half)), min(n - 1, int(n / 2 + half + 0.5))
    return statistics.median(values), values[low], values[high]


def verdict(low, high):
    """Met only when the whole confidence interval is within the goal."""
    if high * 1e6 <= GOAL_US:
        return "met"
    if low * 1e6 > GOAL_US:
        return "not met"
    return "not decided (the interval spans the goal: rerun on a quieter machine)"


def table(args, frameworks):
    """Measures and prints the table; returns its lines."""
    lines = []

    def out(line):
        lines.append(line)
        print(line, flush=True)

    print("%d CPU hogs beside the job on %d cores; memtrack %s" % (args.hogs, os.cpu_count(), args.bin))
    out("| per step (median of %d runs of %d steps, %d CPU hogs) | hooks off (`--no-auto-hooks`) | hooks on "
        "| ratio on/off | on − off, per round | in one process, pairs of blocks of %d steps: hooks' cost (95 %% CI) "
        "| job CPU, same blocks | in the hooks | goal |" % (args.rounds, args.steps, args.hogs, args.blocks))
    out("|---|---|---|---|---|---|---|---|---|")
    for framework in frameworks:
        on, off, pairs = [], [], []
        for _ in range(args.rounds):
            off.append(measure(args.bin, framework, args.steps, False))
            on.append(measure(args.bin, framework, args.steps, True))
            pairs.extend(measure(args.bin, framework, args.steps, True, args.blocks))

        def median(runs, name):
            return statistics.median(r[name] for r in runs)

        off_s, on_s = median(off, "per_step_s"), median(on, "per_step_s")
        # Each round ran off then on, back to back: the median of the
        # rounds' differences cancels the machine's load drifting between
        # rounds, which the difference of the two medians does not. Runs
        # still differ by more than the hooks cost (memory layout, the
        # machine's other load), hence the blocks, compared in one process.
        rounds = statistics.median(b["per_step_s"] - a["per_step_s"] for a, b in zip(off, on))
        cost, low, high = median_with_ci(p[0] for p in pairs)
        cpu = statistics.median(p[1] for p in pairs)
        out("| %s | %.1f µs | %.1f µs | %.3f | %.1f µs | %.1f µs (%.1f–%.1f, %d pairs) | %.1f µs | %.1f µs "
            "| ≤ %d µs: %s |"
            % (framework, off_s * 1e6, on_s * 1e6, on_s / off_s, rounds * 1e6,
               cost * 1e6, low * 1e6, high * 1e6, len(pairs), cpu * 1e6,
               median(on, "hooks_per_step_s") * 1e6, GOAL_US,
               verdict(low, high)))
    return lines


if __name__ == "__main__":
    main()
