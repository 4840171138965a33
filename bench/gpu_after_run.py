#!/usr/bin/env python3
"""The after-the-run features on a real GPU: the OOM flight recorder on a real
CUDA out-of-memory error, GPU leak detection, and report/plot of GPU runs.

    python3 bench/gpu_after_run.py --memtrack target/release/memtrack --out DIR

Needs an NVIDIA GPU, PyTorch with CUDA. Three jobs run under `memtrack run`:

1. `oom`: allocates 8 GiB blocks until torch raises OutOfMemoryError, with
   `memtrack.install_oom_hook()`; memtrack must keep a `cuda_oom` flight
   window whose last GPU figure is close to what torch had reserved at the
   error, carrying torch's memory summary.
2. `leak`: grows GPU memory by 64 MiB every 0.5 s for 40 s (5 GiB in all,
   far above any threshold): the leak verdict must name `gpu`.
3. `sawtooth`: allocates and frees 2 GiB every step for 40 s: no leak.

Then `memtrack report --json` and `memtrack plot` run on each file. Prints a
Markdown summary and writes it, with the files, to DIR.
"""

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

OOM = r"""
import json, os, torch, memtrack
memtrack.install_oom_hook()
blocks = []
info = {}
try:
    while True:
        blocks.append(torch.empty(8 << 30, dtype=torch.uint8, device="cuda"))
        torch.cuda.synchronize()
        info = {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved()}
except torch.OutOfMemoryError:
    info["at_error_reserved"] = torch.cuda.memory_reserved()
    info["blocks"] = len(blocks)
    json.dump(info, open(os.environ["CHECK_OUT"], "w"))
    raise
"""

LEAK = r"""
import time, torch, memtrack
keep = []
memtrack.mark("train", "start")
for i in range(80):
    keep.append(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    time.sleep(0.5)
memtrack.mark("train", "end")
"""

SAWTOOTH = r"""
import time, torch, memtrack
for i in range(80):
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    time.sleep(0.25)
    del x
    torch.cuda.empty_cache()
    time.sleep(0.25)
"""


def run(memtrack, out, name, code, env):
    script = os.path.join(out, name + ".py")
    with open(script, "w") as f:
        f.write(code)
    res = subprocess.run(
        [memtrack, "run", "--name", name, "--output", out, "--interval", "200ms", "--listen", "off",
         "--", sys.executable, script],
        env=env, capture_output=True, text=True, timeout=300)
    doc_path = os.path.join(out, name, "memory_usage.json")
    with open(doc_path) as f:
        doc = json.load(f)
    rep = subprocess.run([memtrack, "report", "--json", doc_path], capture_output=True, text=True)
    text = subprocess.run([memtrack, "report", doc_path], capture_output=True, text=True).stdout
    with open(os.path.join(out, name + ".report.txt"), "w") as f:
        f.write(text)
    plot = subprocess.run([memtrack, "plot", doc_path, "-o", os.path.join(out, name + ".png")],
                          capture_output=True, text=True)
    return res, doc, json.loads(rep.stdout) if rep.returncode == 0 else None, text, plot.returncode


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--memtrack", default=os.path.join(REPO, "target", "release", "memtrack"))
    ap.add_argument("--out", default=tempfile.mkdtemp(prefix="gpu-after-"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "clients", "python", "src"))
    env = {k: v for k, v in env.items() if not k.startswith("MEMTRACK_")}
    lines = ["# After the run on a real GPU", ""]
    ok = True

    env["CHECK_OUT"] = os.path.join(args.out, "oom_torch.json")
    res, doc, rep, text, plot_rc = run(args.memtrack, args.out, "oom", OOM, env)
    torch_info = json.load(open(env["CHECK_OUT"]))
    windows = [w for w in doc.get("flight_recorder", []) if w["reason"] == "cuda_oom"]
    lines.append("## CUDA OOM (blocks of 8 GiB until OutOfMemoryError)")
    lines.append("")
    lines.append("- memtrack exit status %d (the job's: Python exits 1 on the uncaught error)" % res.returncode)
    lines.append("- torch at the error: %d blocks, reserved %.0f MiB" % (
        torch_info.get("blocks", -1), torch_info.get("at_error_reserved", 0) / 2**20))
    if windows:
        w = windows[0]
        last = w["points"][-1] if w["points"] else {}
        peak = max((p["gpu_mb"] for p in w["points"]), default=0)
        lines.append("- flight window: %d points at %.2f s, last GPU %.0f MiB, window peak %.0f MiB, summary %s" % (
            len(w["points"]), w["interval_s"], last.get("gpu_mb", 0), peak,
            "present" if w.get("cuda_summary") else "missing"))
        expected = torch_info.get("at_error_reserved", 0) / 2**20
        close = expected > 0 and abs(peak - expected) <= max(0.05 * expected, 1024)
        lines.append("- window peak within 5 %% (or 1 GiB) of torch's reserved memory + CUDA context: %s" % close)
        ok &= close and bool(w.get("cuda_summary"))
    else:
        lines.append("- **no cuda_oom flight window** (%s)" % [w["reason"] for w in doc.get("flight_recorder", [])])
        ok = False
    lines.append("- `report` shows the window: %s; plot exit %d" % ("flight" in text.lower(), plot_rc))
    adv = subprocess.run([args.memtrack, "advise", "--json", os.path.join(args.out, "oom", "memory_usage.json")],
                         capture_output=True, text=True)
    try:
        items = json.loads(adv.stdout)
        items = items.get("advice", items) if isinstance(items, dict) else items
    except ValueError:
        items = []
    oom_items = [a for a in items if a.get("code") == "cuda-oom"]
    if oom_items:
        a = oom_items[0]
        lines.append("- `memtrack advise`: [%s] %s: %s" % (a.get("level"), a["code"], a.get("finding")))
        lines.append("  -> %s" % a.get("action"))
    else:
        lines.append("- `memtrack advise` (exit %d) has **no cuda-oom item**: %s" % (
            adv.returncode, [a.get("code") for a in items] or adv.stderr.strip()[:300]))
    ok &= bool(oom_items)
    lines.append("")

    for name, code, want in (("leak", LEAK, True), ("sawtooth", SAWTOOTH, False)):
        res, doc, rep, text, plot_rc = run(args.memtrack, args.out, name, code, env)
        leak = doc.get("leak") or {}
        gpu = leak.get("gpu") or {}
        lines.append("## %s" % name)
        lines.append("")
        lines.append("- exit %d, peak GPU %.0f MiB (process), leak suspects %s, GPU rate %.0f MiB/h, reason: %s" % (
            res.returncode, doc["peak_usage"].get("gpu_process_used_mb", 0), leak.get("suspects"),
            gpu.get("rate_mib_per_hour", 0), gpu.get("reason", "")))
        got = "gpu" in (leak.get("suspects") or [])
        lines.append("- GPU leak suspected: %s (expected %s); plot exit %d" % (got, want, plot_rc))
        ok &= got == want and res.returncode == 0
        lines.append("")

    lines.append("Result: %s" % ("all checks passed" if ok else "SOME CHECKS FAILED"))
    report = "\n".join(lines)
    print(report)
    with open(os.path.join(args.out, "gpu_after_run.md"), "w") as f:
        f.write(report + "\n")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
