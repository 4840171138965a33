#!/usr/bin/env python3
"""batch-fit advice on a real CUDA training loop, against the largest batch
that really runs on the same GPU.

    python3 bench/gpu_batch_fit.py --memtrack target/release/memtrack --out DIR

Needs an NVIDIA GPU and PyTorch with CUDA.

1. Under `memtrack run`, a training loop on the GPU steps a few times at
   batch sizes 2, 4, 8 and 16, each step inside
   `memtrack.span("train", "step", labels={"batch_size": B})`. The model is
   a chain of elementwise layers with one weight each (autograd keeps every
   layer's input for backward), so its memory is linear in the batch, as a
   network's activations are, and a step costs little time at any size.
2. `memtrack advise --json` on the run gives batch-fit's `largest_batch`
   (with the run's headroom) and `largest_batch_at_limit` (without).
3. The truth, in a fresh process on the same GPU: the largest batch whose
   step runs, found by bisection (a step that raises OutOfMemoryError does
   not fit), and the named batch stepped three times.

Prints a Markdown report and writes it, with the run, to DIR.
"""

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODEL = r"""
import sys, torch
torch.manual_seed(0)
ELEMS = 8 << 20          # floats per sample: 32 MiB
LAYERS = 8
weights = [torch.nn.Parameter(torch.full((ELEMS,), 1.01, device="cuda")) for _ in range(LAYERS)]
opt = torch.optim.SGD(weights, lr=1e-6)

def step(bs):
    x = torch.randn(bs, ELEMS, device="cuda")
    y = x
    for w in weights:
        y = torch.sin(y * w)
    loss = y.square().mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    del x, y, loss
    torch.cuda.synchronize()
"""

STEPPED = MODEL + r"""
import memtrack
for bs in map(int, sys.argv[1:]):
    for _ in range(4):
        with memtrack.span("train", "step", labels={"batch_size": bs}):
            step(bs)
print("peak allocated %d MiB" % (torch.cuda.max_memory_allocated() >> 20), flush=True)
"""

TRUTH = r"""
import json
def runs(bs, times=1):
    try:
        for _ in range(times):
            step(bs)
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        torch.cuda.empty_cache()
lo, hi = 1, 2
while runs(hi):
    lo, hi = hi, hi * 2
while hi - lo > 1:
    mid = (lo + hi) // 2
    if runs(mid):
        lo = mid
    else:
        hi = mid
named = int(sys.argv[1])
free, total = torch.cuda.mem_get_info()
print(json.dumps({"largest_that_runs": lo, "first_that_does_not": hi,
                  "named_runs_3_steps": runs(named, 3) if named > 0 else None,
                  "gpu_total_mib": total >> 20}), flush=True)
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--memtrack", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "clients", "python", "src"))
    run = subprocess.run([args.memtrack, "run", "--name", "batch_fit", "--output", args.out, "--interval", "100ms",
                          "--listen", "off", "--", sys.executable, "-c", STEPPED, "2", "4", "8", "16"],
                         env=env, capture_output=True, text=True, timeout=300)
    doc = os.path.join(args.out, "batch_fit", "memory_usage.json")
    adv = subprocess.run([args.memtrack, "advise", "--json", doc], capture_output=True, text=True, timeout=60)
    items = json.loads(adv.stdout or "[]")
    fit = next((i for i in items if i.get("code") == "batch-fit"), None)
    figures = (fit or {}).get("figures", {})
    named = int(figures.get("largest_batch", 0) or 0)
    truth = subprocess.run([sys.executable, "-c", MODEL + TRUTH, str(named)], capture_output=True, text=True,
                           timeout=300)
    found = json.loads(truth.stdout.strip().splitlines()[-1]) if truth.returncode == 0 and truth.stdout.strip() else {}
    lines = ["# batch-fit on a real CUDA loop", "",
             "`python3 bench/gpu_batch_fit.py --memtrack BIN --out DIR`: a CUDA loop of elementwise layers "
             "(32 MiB of activations per sample and layer input), stepped at batches 2, 4, 8, 16 under "
             "`memtrack run --interval 100ms`; then the largest batch that runs, by bisection in a fresh process.", "",
             "- memtrack run: exit %d; %s" % (run.returncode, run.stdout.strip().splitlines()[-1:] or run.stderr[-300:]),
             "- advice: %s" % ((fit or {}).get("finding") or "no batch-fit item (%s)" % adv.stderr.strip()[-300:]),
             "- action: %s" % (fit or {}).get("action"),
             "- figures: %s" % json.dumps(figures, sort_keys=True),
             "- truth: %s" % (json.dumps(found, sort_keys=True) if found else "failed: %s" % truth.stderr[-500:]),
             ""]
    if found and named:
        largest = found["largest_that_runs"]
        at_limit = int(figures.get("largest_batch_at_limit", 0) or 0)
        lines += ["| | batch | against the largest that runs |", "|---|---|---|",
                  "| named (`largest_batch`) | %d | %.3f |" % (named, named / largest),
                  "| without headroom (`largest_batch_at_limit`) | %d | %.3f |" % (at_limit, at_limit / largest),
                  "| largest that runs (bisection) | %d | 1 |" % largest, "",
                  "The named batch %s three steps in a fresh process; %d does not run." % (
                      "ran" if found.get("named_runs_3_steps") else "did NOT run", found["first_that_does_not"])]
    report = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "batch-fit.md"), "w") as f:
        f.write(report)
    sys.stdout.write(report)
    return 0 if found and named and found.get("named_runs_3_steps") and named <= found["largest_that_runs"] else 1


if __name__ == "__main__":
    sys.exit(main())
