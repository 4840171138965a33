#!/usr/bin/env python3
"""A sampler built the way the ClearML, MLflow and W&B resource monitors are:
psutil for the process tree's memory and pynvml for GPU memory, polled in a
loop. Used by bench/run as a peer of memtrack at the same rate on the same
processes.

    py_sampler.py INTERVAL_MS SECONDS ROOT_PID
"""

import sys
import time

import psutil

try:
    import os

    if os.environ.get("BENCH_NO_GPU") == "1":
        raise ImportError("host-only comparison")
    import pynvml

    pynvml.nvmlInit()
    HANDLES = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
except Exception:  # no GPU: host figures only, as those monitors do
    pynvml = None
    HANDLES = []


def sample(root):
    procs = [root] + root.children(recursive=True)
    rss = {}
    for p in procs:
        try:
            rss[p.pid] = p.memory_info().rss
        except psutil.Error:
            pass
    gpu = {}
    for h in HANDLES:
        pynvml.nvmlDeviceGetMemoryInfo(h)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
            if p.pid in rss:
                gpu[p.pid] = gpu.get(p.pid, 0) + (p.usedGpuMemory or 0)
    return sum(rss.values()), sum(gpu.values())


def main():
    interval = int(sys.argv[1]) / 1000.0
    seconds = float(sys.argv[2])
    root = psutil.Process(int(sys.argv[3]))
    end = time.monotonic() + seconds
    next_tick = time.monotonic()
    ticks = 0
    while True:
        sample(root)
        ticks += 1
        next_tick += interval
        if next_tick > end:
            break
        time.sleep(max(0.0, next_tick - time.monotonic()))
    print(ticks, "ticks")


if __name__ == "__main__":
    main()
