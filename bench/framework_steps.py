#!/usr/bin/env python3
"""What memtrack's framework callbacks cost a training step.

    target/fw-venv/bin/python bench/framework_steps.py [--bin target/debug/memtrack]
        [--steps 2000] [--rounds 7] [--framework lightning,hf] [--hogs 0]
        [--output docs/hook-cost.md]

Runs the same tiny loop (Lightning: a 2-layer MLP, batch 4; Hugging Face: a
1-layer GPT-2 built from a config, batch 4) on CPU under ``memtrack run``,
so that a step is as short as a real loop's gets and the hooks' share as
large as it gets, three ways per round, ``--rounds`` times:

- with the automatic hooks on, and with ``--no-auto-hooks``, in separate
  runs, back to back: the median time per step both ways, their ratio and
  the median of the rounds' differences;
- in one process whose loop takes memtrack's step hooks out and puts them
  back in blocks of ``--blocks`` steps (``Blocks``), in pairs of blocks in
  an order drawn at random: per pair, the difference per step in wall
  time, in the job's CPU time and in the time the trainer spends in its
  callback dispatch (``Dispatch``), which holds memtrack's hooks and what
  it costs to call them without the rest of the step and its noise;
- the same blocks with a bare step timer (``Reference``: a callback that
  notes when each step began and ended) in place of memtrack's hooks,
  under ``--no-auto-hooks``: the peer, and memtrack's hooks ÷ the peer in
  the dispatch timing.

The goal (``GOAL_US`` a step) is decided from the pairs' 95 % confidence
intervals: met when all of the wall-time interval is within it, or all of
the dispatch interval is and the wall-time interval does not rule it out;
not met when either is all above it. Each job uses one torch thread, so
that the figures depend on the machine's other load as little as they
can. Needs torch, lightning and transformers in this Python; nothing is
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


class Dispatch(object):
    """Times the framework's own callback dispatch in the loop: the calls
    through which the trainer reaches its callbacks (Hugging Face: the
    callback handler's events, where memtrack puts its step hooks;
    Lightning: ``_call_callback_hooks``, and the module's batch hooks,
    where memtrack puts its own). With the
    hooks and without, the difference is what memtrack's callback adds to
    a step in the loop itself, dispatch included, without the step's own
    work and its noise. A call made from inside a timed one is not timed
    again; ``excluded`` is time inside a timed call that is the bench's
    own (the toggle)."""

    def __init__(self):
        self.spent = 0.0
        self.excluded = 0.0
        self._depth = 0

    def reading(self):
        return self.spent - self.excluded

    def wrap(self, owner, name, only=None):
        """Times ``owner.name``; with ``only``, only the calls whose hook
        name (the argument after the first) is in it."""
        original = getattr(owner, name)
        clock = time.perf_counter

        def timed(*args, **kwargs):
            if self._depth or (only is not None and args[1] not in only):
                return original(*args, **kwargs)
            self._depth = 1
            start = clock()
            try:
                return original(*args, **kwargs)
            finally:
                self.spent += clock() - start
                self._depth = 0

        setattr(owner, name, timed)


class Blocks(object):
    """Takes memtrack's step hooks out of the trainer and puts them back,
    in blocks of ``size`` steps, and notes each block's wall and CPU time
    and its time in the callback dispatch: the job then runs with and
    without the hooks in one process, in blocks a few tens of
    milliseconds long, so the two are compared under the same load,
    allocator state and memory layout. The blocks go in pairs, one with
    the hooks and one without, in an order drawn at random for each pair:
    whatever else the loop does every so many steps (a collection, the
    allocator growing) then falls as often in a block with the hooks as
    in one without, instead of always in the same one. ``at_step`` is
    called at each step's start, before memtrack's hooks; ``hooks`` (set
    by the job) is (take them out, put them back, their ``_Steps`` or None
    for a peer that holds nothing back)."""

    def __init__(self, size, reference=False, seed=20261128):
        self.size = size
        # Toggle a bare step timer (``Reference``) instead of memtrack's hooks.
        self.reference = reference
        self.draw = random.Random(seed)
        self.dispatch = Dispatch()
        self.hooks = None
        self.blocks = []  # (with the hooks, wall at its start, CPU at its start)
        self.ends = []  # (wall, CPU, dispatch) at each block's end, before the next one's toggle
        self.inside = True
        self.first_with = True

    def at_step(self, step):
        if step % self.size:
            return
        began = time.perf_counter()
        self.ends.append((began, time.process_time(), self.dispatch.reading()))
        try:
            self._next_block()
        finally:
            # Called from inside the timed dispatch: the toggle is not
            # the hooks' cost.
            self.dispatch.excluded += time.perf_counter() - began

    def _next_block(self):
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
            self.toggle()
        self.blocks.append((wanted, time.perf_counter(), time.process_time()))

    def toggle(self):
        take_out, put_back, steps = self.hooks
        if self.inside:
            take_out()
        else:
            put_back()
            # As if the hooks had never been out: the block's first step
            # is as close to the last one as any other, so it is held
            # back like the rest instead of sent at once.
            if steps is not None:
                steps._began = steps._ended = time.time_ns()
        self.inside = not self.inside

    def report(self):
        """Prints, for each pair of blocks (one with the hooks, one
        without), the difference per step, with the hooks minus without,
        in wall time, CPU time and time in the framework's callback
        dispatch. A toggle falls between two blocks, in neither."""
        n = self.size
        timed = [(on, (end[0] - wall) / n, (end[1] - cpu) / n, (end[2] - start[2]) / n)
                 for (on, wall, cpu), start, end in zip(self.blocks, self.ends, self.ends[1:])]
        pairs = timed[1:]
        for a, b in zip(pairs[0::2], pairs[1::2]):
            on, off = (a, b) if a[0] else (b, a)
            print("block_diff_s %.9f %.9f %.9f" % (on[1] - off[1], on[2] - off[2], on[3] - off[3]))


def report(start, cpu_start, steps):
    print("per_step_s %.9f" % ((time.perf_counter() - start) / steps))
    print("cpu_per_step_s %.9f" % ((time.process_time() - cpu_start) / steps))


class Reference(object):
    """The peer the hooks are compared with: a bare step timer, which notes
    when each step began and ended and keeps the two. Made a framework
    callback by ``reference_callback``."""

    def __init__(self):
        self.began = 0
        self.times = []

    def begin(self):
        self.began = time.time_ns()

    def end(self):
        self.times.append((self.began, time.time_ns()))


def reference_callback(base, begin, end):
    """A callback of class ``base`` whose hooks ``begin`` and ``end`` (by
    name) are a ``Reference``'s."""
    timer = Reference()

    class BareStepTimer(base):
        pass

    setattr(BareStepTimer, begin, lambda self, *args, **kwargs: timer.begin())
    setattr(BareStepTimer, end, lambda self, *args, **kwargs: timer.end())
    return BareStepTimer()


def in_list(callbacks, callback):
    """``Blocks.hooks`` for a callback in a framework's callback list."""
    return lambda: callbacks.remove(callback), lambda: callbacks.append(callback), None


def lightning_hooks(trainer, module):
    """memtrack's hooks on a Lightning trainer, as ``Blocks.hooks``: its
    callback in the trainer's list, and the step hooks it puts on the
    module's class (where its own batch hooks are None)."""
    mine = next((c for c in trainer.callbacks if type(c).__name__.startswith("Memtrack")), None)
    if mine is None:
        raise SystemExit("memtrack's callback is not in the trainer's callbacks")
    hooks = sys.modules["memtrack.frameworks"]._ModuleHooks
    on_module = type(mine).on_train_batch_start is None

    def take_out():
        trainer.callbacks.remove(mine)
        if on_module:
            hooks.detach(module)

    def put_back():
        trainer.callbacks.append(mine)
        if on_module:
            hooks.attach(module, mine)

    return take_out, put_back, mine._steps


def hf_hooks(handler, blocks):
    """memtrack's hooks on a Hugging Face trainer's callback handler, as
    ``Blocks.hooks``: the four events memtrack wraps on the handler (with
    ``blocks.reference``, the bare step timer in the handler's list
    instead). Every event of the handler is then called through a switch
    (with or without memtrack's wrapper), timed, and the step's begin
    first calls ``blocks.at_step``, before memtrack's hooks."""
    from transformers import TrainerCallback
    from transformers.trainer_callback import CallbackHandler

    names = [name for name in dir(CallbackHandler) if name.startswith("on_")]
    if blocks.reference:
        timer = reference_callback(TrainerCallback, "on_step_begin", "on_step_end")
        handler.callbacks.append(timer)
        current = {name: getattr(handler, name) for name in names}
        switched(handler, blocks, current)
        return in_list(handler.callbacks, timer)
    from memtrack.frameworks import _HandlerHooks

    own = vars(handler)
    mine = {name: own.get(name) for name in _HandlerHooks.EVENTS}
    if not all(getattr(f, "_memtrack_callback", None) for f in mine.values()):
        raise SystemExit("memtrack's hooks are not on the trainer's callback handler")
    for name in mine:
        del own[name]
    bare = {name: getattr(handler, name) for name in mine}
    current = {name: mine.get(name) or getattr(handler, name) for name in names}
    switched(handler, blocks, current)
    return (lambda: current.update(bare), lambda: current.update(mine),
            mine["on_step_begin"]._memtrack_callback._steps)


def switched(handler, blocks, current):
    """Each of the handler's events (the names in ``current``) called
    through ``current``, timed; the step's begin first calls
    ``blocks.at_step``."""
    def switch(name):
        def call(*args, **kwargs):
            if name == "on_step_begin":
                blocks.at_step(args[1].global_step)
            return current[name](*args, **kwargs)
        return call

    for name in current:
        setattr(handler, name, switch(name))
        blocks.dispatch.wrap(handler, name)


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
                if blocks.hooks is None:
                    blocks.hooks = (in_list(trainer.callbacks, reference) if blocks.reference
                                    else lightning_hooks(trainer, pl_module))
                blocks.at_step(batch_idx)

        from lightning.pytorch.trainer import call

        blocks.dispatch.wrap(call, "_call_callback_hooks")
        # The module's hooks that are the callback's (memtrack's wrap
        # these two), not the optimizer step, whose closure is the step.
        blocks.dispatch.wrap(call, "_call_lightning_module_hook",
                             only=("on_train_batch_start", "on_train_batch_end"))
        trainer.callbacks.insert(0, Toggle())
        if blocks.reference:
            reference = reference_callback(pl.Callback, "on_train_batch_start", "on_train_batch_end")
            trainer.callbacks.append(reference)
        trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4))
        return blocks.report()
    start, cpu_start = time.perf_counter(), time.process_time()
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4))
    report(start, cpu_start, steps)


def hf_job(steps, blocks=None):
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
    if blocks:
        blocks.hooks = hf_hooks(trainer.callback_handler, blocks)
        trainer.train()
        return blocks.report()
    start, cpu_start = time.perf_counter(), time.process_time()
    trainer.train()
    report(start, cpu_start, steps)


JOBS = {"lightning": lightning_job, "hf": hf_job}

# What the hooks may add to a step: about what a bare fire-and-forget mark
# costs.
GOAL_US = 20

# No hub, no telemetry, no tracker of the libraries' own.
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
           "DISABLE_MLFLOW_INTEGRATION": "TRUE", "WANDB_DISABLED": "true", "DO_NOT_TRACK": "1"}


def measure(binary, framework, steps, hooks, blocks=None):
    """One run of the job under ``memtrack run``: with the hooks (True) or
    with ``--no-auto-hooks`` (False), or (``blocks``) with the hooks taken
    out and put back every ``blocks`` steps; ``hooks="reference"`` does
    that with the bare step timer instead, under ``--no-auto-hooks``.
    Returns the job's figures; in blocks, the list of its (wall, CPU,
    dispatch) differences per step."""
    env = dict(os.environ)
    env.pop("MEMTRACK_AUTO_HOOKS", None)
    env.update(OFFLINE)
    flags = [] if hooks is True else ["--no-auto-hooks"]
    job = ["--job", framework, "--steps", str(steps)] + (["--in-blocks", str(blocks)] if blocks else [])
    if hooks == "reference":
        job.append("--reference")
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run(
            [binary, "run", "--listen", "off", "--output", out, "--name", "bench"] + flags + ["--",
             sys.executable, os.path.abspath(__file__)] + job,
            env=env, capture_output=True, text=True, check=True)
    figures, diffs = {}, []
    for line in proc.stdout.splitlines():
        name, _, value = line.partition(" ")
        if name in ("per_step_s", "cpu_per_step_s"):
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
    parser.add_argument("--reference", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        return JOBS[args.job](args.steps, Blocks(args.in_blocks, args.reference) if args.in_blocks else None)
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
            "differences), and in one process whose loop takes memtrack's step hooks out and puts "
            "them back, in pairs of blocks of %d steps, one with the hooks and one without, in an "
            "order drawn at random for each pair. For the pairs, the median difference per step "
            "with a 95 %% confidence interval: in wall time (*hooks' cost*), in the job's CPU time, "
            "and in the time the trainer spends in its callback dispatch (Hugging Face: the "
            "callback handler's events; Lightning: `_call_callback_hooks` and the module's batch "
            "hooks), which holds memtrack's hooks and what it costs to call them, without the "
            "rest of the step and its noise. The goal is met when all of the wall-time interval is "
            "within it, or all of the dispatch interval is and the wall-time interval does not "
            "rule it out." % args.blocks,
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


def verdict(wall, dispatch):
    """From the two confidence intervals (low, high) of the pairs of
    blocks: the step's wall time, which holds everything the hooks cost
    and the step's own noise, and the time in the callback dispatch, which
    holds the hooks and their dispatch without that noise. Met when all of
    the wall interval is within the goal, or when all of the dispatch
    interval is and the wall interval does not exclude it; not met when
    either interval is all above the goal."""
    goal = GOAL_US / 1e6
    if wall[0] > goal or dispatch[0] > goal:
        return "not met"
    if wall[1] <= goal:
        return "met"
    if dispatch[1] <= goal:
        return "met in the dispatch (the step's wall time varies more than the hooks cost)"
    return "not decided (the intervals span the goal: rerun on a quieter machine)"


def table(args, frameworks):
    """Measures and prints the table; returns its lines."""
    lines = []

    def out(line):
        lines.append(line)
        print(line, flush=True)

    print("%d CPU hogs beside the job on %d cores; memtrack %s" % (args.hogs, os.cpu_count(), args.bin))
    out("| per step (median of %d runs of %d steps, %d CPU hogs) | hooks off (`--no-auto-hooks`) | hooks on "
        "| ratio on/off | on − off, per round | in one process, pairs of blocks of %d steps: hooks' cost (95 %% CI) "
        "| job CPU, same blocks | callback dispatch, same blocks (95 %% CI) | goal |"
        % (args.rounds, args.steps, args.hogs, args.blocks))
    out("|---|---|---|---|---|---|---|---|---|")
    for framework in frameworks:
        on, off, pairs, peer = [], [], [], []
        for _ in range(args.rounds):
            off.append(measure(args.bin, framework, args.steps, False))
            on.append(measure(args.bin, framework, args.steps, True))
            pairs.extend(measure(args.bin, framework, args.steps, True, args.blocks))
            peer.extend(measure(args.bin, framework, args.steps, "reference", args.blocks))

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
        direct, direct_low, direct_high = median_with_ci(p[2] for p in pairs)
        out("| %s | %.1f µs | %.1f µs | %.3f | %.1f µs | %.1f µs (%.1f–%.1f, %d pairs) | %.1f µs "
            "| %.1f µs (%.1f–%.1f) | ≤ %d µs: %s |"
            % (framework, off_s * 1e6, on_s * 1e6, on_s / off_s, rounds * 1e6,
               cost * 1e6, low * 1e6, high * 1e6, len(pairs), cpu * 1e6,
               direct * 1e6, direct_low * 1e6, direct_high * 1e6,
               GOAL_US,
               verdict((low, high), (direct_low, direct_high))))
        # The peer: a bare step timer toggled the same way.
        p_cost, p_low, p_high = median_with_ci(p[0] for p in peer)
        p_direct, p_direct_low, p_direct_high = median_with_ci(p[2] for p in peer)
        out("| %s: a bare step timer (the peer) | — | — | — | — | %.1f µs (%.1f–%.1f, %d pairs) | %.1f µs "
            "| %.1f µs (%.1f–%.1f) | memtrack's hooks ÷ the peer, dispatch: %.2f× |"
            % (framework, p_cost * 1e6, p_low * 1e6, p_high * 1e6, len(peer),
               statistics.median(p[1] for p in peer) * 1e6,
               p_direct * 1e6, p_direct_low * 1e6, p_direct_high * 1e6,
               direct / p_direct if p_direct > 0 else float("nan")))
    return lines


if __name__ == "__main__":
    main()
