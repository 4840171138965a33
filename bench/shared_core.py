#!/usr/bin/env python3
"""What memtrack costs a job that shares its core.

    python3 bench/shared_core.py [--bin target/release/memtrack] [--steps 1500]
        [--rounds 3] [--core 1] [--output FILE]

On a training node every core is busy, so memtrack runs on a core a job
thread is using. This pins memtrack and its job to one core (``--core``);
the job runs steps of a fixed amount of Python work (about a millisecond),
calling memtrack's step hooks (``memtrack.frameworks._Steps``, what the
Lightning and Hugging Face callbacks call) around each. It prints the
job's wall time per step with memtrack on that core against the same job
with no memtrack (the floor), as a ratio, and the time per step spent
inside the hooks both ways; median of ``--rounds`` runs each. The wall time
is what counts: memtrack's work on the shared core lands somewhere in the
job's steps, inside the hooks' ``send`` (a wake-up that preempts the job)
or elsewhere.
Needs only the Python client (``clients/python/src``); give it a release
build for figures to quote.
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
# Additions per step: about a millisecond of Python.
WORK = 30000


def job(steps):
    """The job: `steps` steps of fixed work, the step hooks around each;
    prints its wall time per step and the time in the hooks per step."""
    from memtrack import frameworks

    hooks = frameworks._Steps()
    clock = time.perf_counter

    def work():
        x = 0
        for j in range(WORK):
            x += j
        return x

    in_hooks = 0.0
    start = clock()
    for i in range(steps):
        a = clock()
        hooks.begin(i)
        b = clock()
        work()
        c = clock()
        hooks.end()
        in_hooks += (b - a) + (clock() - c)
    wall = clock() - start
    print("wall_s %.9f" % (wall / steps))
    print("hooks_s %.9f" % (in_hooks / steps))


def measure(binary, steps, core, daemon):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(REPO, "clients", "python", "src")] + [p for p in [env.get("PYTHONPATH")] if p])
    for k in [k for k in env if k.startswith("MEMTRACK_")]:
        del env[k]
    me = [sys.executable, os.path.abspath(__file__), "--job", "--steps", str(steps)]
    with tempfile.TemporaryDirectory() as out:
        if daemon:
            argv = [binary, "run", "--listen", "off", "--no-html-report", "--output", out,
                    "--name", "bench", "--"] + me
        else:
            argv = me
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=True,
                              preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    figures = {}
    for line in proc.stdout.splitlines():
        name, _, value = line.partition(" ")
        if name in ("wall_s", "hooks_s"):
            figures[name] = float(value)
    if "wall_s" not in figures:
        raise SystemExit("no timing in the job's output:\n" + proc.stdout + proc.stderr)
    return figures


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin", default=os.path.join(REPO, "target", "release", "memtrack"))
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--core", type=int, default=os.cpu_count() - 1)
    parser.add_argument("--output", help="also write the table to this Markdown file")
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        return job(args.steps)
    alone, shared = [], []
    for _ in range(args.rounds):
        alone.append(measure(args.bin, args.steps, args.core, False))
        shared.append(measure(args.bin, args.steps, args.core, True))

    def median(runs, name):
        return statistics.median(r[name] for r in runs) * 1e6

    load = os.getloadavg()[0]
    lines = [
        "memtrack `%s` and its job pinned to core %d; %d steps of fixed work, median of %d runs; "
        "1-minute load average %.2f at the end, other work included" % (
            os.path.relpath(args.bin, REPO), args.core, args.steps, args.rounds, load),
        "",
        "| per step | no memtrack (floor) | memtrack on the same core | ratio |",
        "|---|---|---|---|",
    ]
    a, s = median(alone, "wall_s"), median(shared, "wall_s")
    lines.append("| job's wall time | %.1f µs | %.1f µs | %.3f× |" % (a, s, s / a))
    a, s = median(alone, "hooks_s"), median(shared, "hooks_s")
    lines.append("| inside the step hooks | %.1f µs | %.1f µs | |" % (a, s))
    print("\n".join(lines))
    if args.output:
        command = "python3 bench/shared_core.py " + " ".join(sys.argv[1:])
        with open(args.output, "w") as f:
            f.write("# What memtrack's wake-ups cost a job on its core\n\n")
            f.write("Generated by `bench/shared_core.py` on %s (`%s`). Do not edit by hand: rerun "
                    "the script.\n\n" % (time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), command))
            f.write(__doc__.split("\n\n", 2)[2].split("Needs only")[0].strip() + "\n\n")
            f.write("\n".join(lines) + "\n")

if __name__ == "__main__":
    main()
