#!/usr/bin/env python3
"""The headline against the tree's distinct physical pages, on a PyTorch job.

    sudo PY bench/torch_truth.py [--memtrack BIN] [--interval 200ms]
        [--epochs 3] [--tensor-mb 512] [--strings 600000] [--workers 4]
        [--settle 20] [--budget 0.02] [--transient] [--subprocess]
        [--hogs N] [-- EXTRA memtrack run ARGS]

PY is a Python with torch (numpy makes the page count faster, not needed).
Runs, under `memtrack run`, a DataLoader job: a parent holding a float
tensor of --tensor-mb MiB and a Dataset of --strings Python strings, read
by --workers persistent fork workers (PyTorch's pattern; the workers'
reads turn shared pages of the parent's strings into private copies, the
"copy-on-read" growth), for --epochs epochs.

The job counts the truth itself, as root: the page frame numbers of every
page any process of its tree maps, from /proc/PID/pagemap, each counted
once. It does so

  loaded      once its tensor and dataset are built, before any worker;
              it then holds still for up to --settle seconds, asking
              memtrack for its figure every 0.25 s, and notes how long the
              figure took to come within 5 % of the count;
  epoch N     at the end of each epoch, workers idle: the figure memtrack
              recorded at that instant (an acknowledged mark,
              component "data", operation "epoch_end", label truth_mb)
              against the count, with no waiting.

Prints one row per check point (truth, memtrack, ratio, within 5 % or
not) and the run's host source and read cost; exits 1 when a check point
is off by more than 5 %. Needs root (page frame numbers read as 0
otherwise).
"""

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, ".."))
PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 1 << 20


# -- the truth: distinct page frame numbers of a set of processes ----------

def _pfns_numpy(pid, np):
    """The PFNs of `pid`'s present pages (a numpy array; empty when gone)."""
    try:
        maps = open(f"/proc/{pid}/maps").read().splitlines()
        fd = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY)
    except OSError:
        return np.zeros(0, dtype=np.uint64)
    parts = []
    try:
        for line in maps:
            a, b = (int(x, 16) for x in line.split()[0].split("-"))
            if a >= 0xFFFF000000000000:
                continue
            off, n = (a // PAGE) * 8, (b - a) // PAGE
            while n > 0:
                k = min(n, 1 << 18)
                try:
                    data = os.pread(fd, k * 8, off)
                except OSError:
                    break
                if not data:
                    break
                v = np.frombuffer(data, dtype="<u8")
                v = v[(v >> np.uint64(63)) == 1] & np.uint64((1 << 55) - 1)
                if v.size and not v.all():
                    raise SystemExit("page frame numbers read as 0: run this as root")
                parts.append(v)
                off += len(data)
                n -= len(data) // 8
    finally:
        os.close(fd)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint64)


def _pfns_python(pid, out):
    import struct

    try:
        maps = open(f"/proc/{pid}/maps").read().splitlines()
        fd = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY)
    except OSError:
        return
    try:
        for line in maps:
            a, b = (int(x, 16) for x in line.split()[0].split("-"))
            if a >= 0xFFFF000000000000:
                continue
            off, n = (a // PAGE) * 8, (b - a) // PAGE
            while n > 0:
                k = min(n, 1 << 16)
                try:
                    data = os.pread(fd, k * 8, off)
                except OSError:
                    break
                if not data:
                    break
                for (v,) in struct.iter_unpack("<Q", data):
                    if v >> 63:
                        pfn = v & ((1 << 55) - 1)
                        if pfn == 0:
                            raise SystemExit("page frame numbers read as 0: run this as root")
                        out.add(pfn)
                off += len(data)
                n -= len(data) // 8
    finally:
        os.close(fd)


def distinct_bytes(pids):
    """Bytes of distinct physical pages mapped by `pids`."""
    try:
        import numpy as np
    except ImportError:
        s = set()
        for p in pids:
            _pfns_python(p, s)
        return len(s) * PAGE
    arrays = [_pfns_numpy(p, np) for p in pids]
    n = np.unique(np.concatenate(arrays)).size if arrays else 0
    return int(n) * PAGE


def tree(pid):
    """`pid` and its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in glob.glob(f"/proc/{p}/task/*/children"):
            try:
                todo.extend(int(c) for c in open(task).read().split())
            except OSError:
                pass
    return out


# -- the job (runs under memtrack) -----------------------------------------

def job(a):
    started = a.t0 or time.time()
    sys.path.insert(0, os.path.join(REPO, "clients", "python", "src"))
    import memtrack
    import torch

    results = open(a.job, "a")

    def record(**row):
        results.write(json.dumps(row) + "\n")
        results.flush()

    def figure(name, labels=None):
        entry = memtrack.mark("data", name, labels=labels, ack=True)
        if entry is None:
            raise SystemExit("memtrack did not acknowledge the mark: is the job under `memtrack run`?")
        return entry["cpu_ram_used_mb"], entry["timestamp"]

    class Strings(torch.utils.data.Dataset):
        def __init__(self, n):
            self.items = [f"sample {i:08d} " + "abcdefgh" * 8 for i in range(n)]

        def __len__(self):
            return len(self.items)

        def __getitem__(self, i):
            s = self.items[i]
            return torch.tensor([len(s), ord(s[-1])])

    tensor = torch.ones((a.tensor_mb << 20) // 4, dtype=torch.float32)
    data = Strings(a.strings)
    me = os.getpid()

    truth = distinct_bytes([me]) / MIB
    waited = None
    t0 = time.time()
    while True:
        used, at = figure("loaded", {"truth_mb": f"{truth:.1f}"})
        if abs(used - truth) <= 0.05 * truth:
            waited = at - t0
            break
        if time.time() - t0 >= a.settle:
            break
        time.sleep(0.25)
    record(point="loaded", t=at - started, truth_mb=truth, memtrack_mb=used,
           settle_s=waited, processes=1)

    loader = torch.utils.data.DataLoader(
        data, batch_size=512, shuffle=True, num_workers=a.workers,
        persistent_workers=not a.transient)
    total = 0
    for epoch in range(1, a.epochs + 1):
        for i, batch in enumerate(loader):
            total += int(batch[:, 0].sum())
            if a.subprocess and i % 20 == 0:
                # A tokenizer, a git call, a data tool.
                subprocess.run([sys.executable, "-c", "pass"])
        pids = tree(me)
        truth = distinct_bytes(pids) / MIB
        used, at = figure("epoch_end", {"truth_mb": f"{truth:.1f}", "epoch": str(epoch)})
        again = distinct_bytes(pids) / MIB
        record(point=f"epoch {epoch}", t=at - started, truth_mb=truth, truth_after_mb=again,
               memtrack_mb=used, processes=len(pids))
    del loader
    assert total > 0 and tensor[0].item() == 1.0


# -- the driver -------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default = os.path.join(REPO, "target", "release", "memtrack")
    if not os.path.exists(default):
        default = os.path.join(REPO, "target", "debug", "memtrack")
    ap.add_argument("--memtrack", default=default)
    ap.add_argument("--interval", default="200ms")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--tensor-mb", type=int, default=512)
    ap.add_argument("--strings", type=int, default=600_000)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--settle", type=float, default=20.0,
                    help="seconds the job waits at most, once loaded, for the figure to come within 5 %%")
    ap.add_argument("--budget", type=float, default=None,
                    help="host.pss_budget (share of one core; memtrack's default when left out)")
    ap.add_argument("--keep", action="store_true", help="keep the run folder")
    ap.add_argument("--transient", action="store_true",
                    help="workers re-forked each epoch (persistent_workers=False, PyTorch's default)")
    ap.add_argument("--subprocess", action="store_true",
                    help="run `python -c pass` every 20 batches while training")
    ap.add_argument("--hogs", type=int, default=0,
                    help="CPU hogs (busy loops) to run beside the job")
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--t0", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("extra", nargs="*", help="more `memtrack run` arguments (after --)")
    a = ap.parse_args()
    if a.job:
        return job(a)
    if os.geteuid() != 0:
        sys.exit("torch_truth: run as root (page frame numbers read as 0 otherwise)")

    out = tempfile.mkdtemp(prefix="memtrack-torch-truth-")
    results = os.path.join(out, "results.jsonl")
    cmd = [a.memtrack, "run", "--interval", a.interval, "--listen", "off",
           "--output", os.path.join(out, "runs"), "--name", "torch-truth", *a.extra, "--",
           sys.executable, os.path.abspath(__file__), "--job", results,
           "--epochs", str(a.epochs), "--tensor-mb", str(a.tensor_mb),
           "--strings", str(a.strings), "--workers", str(a.workers), "--settle", str(a.settle),
           *(["--transient"] if a.transient else []), *(["--subprocess"] if a.subprocess else [])]
    env = dict(os.environ)
    if a.budget is not None:
        env["MEMTRACK_HOST_PSS_BUDGET"] = str(a.budget)
    started = time.time()
    cmd += ["--t0", str(started)]
    hogs = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(a.hogs)]
    try:
        proc = subprocess.run(cmd, env=env, stderr=subprocess.PIPE, text=True)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    wall = time.time() - started
    with open(os.path.join(out, "memtrack.stderr"), "w") as f:
        f.write(proc.stderr)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        sys.exit(f"torch_truth: the job failed ({proc.returncode}); folder {out}")
    doc = json.load(open(glob.glob(os.path.join(out, "runs", "*", "memory_usage.json"))[0]))
    host = doc.get("host") or {}
    rows = [json.loads(line) for line in open(results)]

    print(f"memtrack: {os.path.realpath(a.memtrack)}; interval {a.interval}; "
          f"budget {a.budget if a.budget is not None else 'default'}")
    print(f"job: {a.tensor_mb} MiB tensor, {a.strings} strings, {a.workers} {'re-forked' if a.transient else 'persistent'} workers{', a subprocess every 20 batches' if a.subprocess else ''}, "
          f"{a.epochs} epochs; {wall:.1f} s")
    print("t: seconds since memtrack started")
    print(f"{'point':10} {'t (s)':>7} {'procs':>5} {'truth MiB':>10} {'memtrack':>9} "
          f"{'ratio':>6}  verdict")
    ok = True
    for r in rows:
        ratio = r["memtrack_mb"] / r["truth_mb"] if r["truth_mb"] else float("nan")
        within = abs(ratio - 1.0) <= 0.05
        ok &= within
        extra = ""
        if r.get("settle_s") is not None:
            extra = f" (within 5 % {r['settle_s']:.1f} s after loading)"
        elif r["point"] == "loaded":
            extra = f" (not within 5 % after {a.settle:.0f} s)"
        if "truth_after_mb" in r:
            extra += f" (count after the mark {r['truth_after_mb']:.1f})"
        print(f"{r['point']:10} {r['t']:7.1f} {r['processes']:5} {r['truth_mb']:10.1f} "
              f"{r['memtrack_mb']:9.1f} {ratio:6.3f}  {'ok' if within else 'OFF'}{extra}")
    peak = doc.get("peak_usage", {}).get("cpu_ram_used_mb")
    print(f"host source {host.get('source')}; reads {host.get('pss_reads')}, "
          f"{host.get('pss_read_s')} s of CPU; missed ticks "
          f"{doc.get('counters', {}).get('missed_ticks')}; sampled peak {peak} MiB")
    if a.keep:
        print(f"run folder: {out}")
    else:
        subprocess.run(["rm", "-rf", out])
    sys.exit(0 if ok and rows else 1)


if __name__ == "__main__":
    main()
