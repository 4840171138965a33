#!/usr/bin/env python3
"""A small ML-shaped job for memtrack's demo: it holds known amounts of
memory in phases, like a real pipeline (load data, build a model, generate,
with a DataLoader-style worker process), so `memtrack run` has something
real to show.

Standard library only. When PyTorch with CUDA is importable, the model and
activations also go to the GPU; otherwise the job is host-only. Each phase
is a span sent through memtrack's Python client (components data, model,
generate and worker), so the report has a peak per phase and the plot a
lane per phase; the client is imported from clients/python/src when it is
not installed.

    memtrack run -- python3 examples/demo_job.py [--scale 1.0] [--steps 6]

Expected peaks at --scale 1 (host): data 200 MiB + model 300 MiB held, plus
150 MiB of activations at each step and a 100 MiB worker: about 750 MiB of
tree RSS on top of the interpreter.
"""

import argparse
import os
import sys
import time

try:
    import memtrack
except ImportError:
    # Run from a checkout without `pip install ./clients/python`.
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "clients", "python", "src"))
    import memtrack

MIB = 1 << 20


def touched(mib):
    """A buffer of `mib` MiB with every page written, so it is resident."""
    buf = bytearray(int(mib * MIB))
    for i in range(0, len(buf), 4096):
        buf[i] = 1
    return buf


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every allocation")
    parser.add_argument("--steps", type=int, default=6, help="generation steps")
    parser.add_argument("--pause", type=float, default=0.4, help="seconds per phase")
    args = parser.parse_args()
    s, pause = args.scale, args.pause

    torch = None
    try:
        import torch as _torch  # noqa: F401

        if _torch.cuda.is_available():
            torch = _torch
    except Exception:
        pass
    device = "cuda" if torch else "cpu"
    print(f"demo job (pid {os.getpid()}): scale {s}, {args.steps} steps, device {device}", flush=True)

    # Phase 1: data.
    with memtrack.span("data", "load"):
        dataset = touched(200 * s)
        time.sleep(pause)

    # Phase 2: model weights (and on the GPU when there is one).
    with memtrack.span("model", "build"):
        weights = touched(300 * s)
        gpu_weights = torch.empty(int(512 * s * MIB), dtype=torch.uint8, device="cuda") if torch else None
        time.sleep(pause)

    # A DataLoader-style worker: a child process holding its own batch. The
    # client reconnects in the child by itself after fork().
    worker = os.fork()
    if worker == 0:
        with memtrack.span("worker", "batch"):
            batch = touched(100 * s)
            time.sleep(pause * 3)
            del batch
        memtrack.get_client().flush(timeout=1.0)
        os._exit(0)

    # Phase 3: generation steps, each allocating and freeing activations.
    for step in range(args.steps):
        with memtrack.span("generate", "step", iteration=step):
            activations = touched(150 * s)
            gpu_act = torch.empty(int(256 * s * MIB), dtype=torch.uint8, device="cuda") if torch else None
            time.sleep(pause / 2)
            del activations, gpu_act
        time.sleep(pause / 4)

    os.waitpid(worker, 0)
    del dataset, weights, gpu_weights
    if torch:
        torch.cuda.empty_cache()
    time.sleep(pause)
    memtrack.get_client().flush(timeout=1.0)
    print("demo job done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
