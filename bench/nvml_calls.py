#!/usr/bin/env python3
"""What each NVML call one memtrack sample makes costs on this machine.

    python3 bench/nvml_calls.py [--iterations 2000]

Needs nvidia-ml-py and a GPU; run it while a CUDA process holds memory so
the process lists are not empty. Prints the median and p99 of each call on
GPU 0, through pynvml (ctypes adds about the same small cost to every row).
"""

import argparse
import time

import pynvml


def timed(fn, n):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2] * 1e6, times[int(len(times) * 0.99)] * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=2000)
    args = ap.parse_args()
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)

    def graphics():
        try:
            pynvml.nvmlDeviceGetGraphicsRunningProcesses(h)
        except pynvml.NVMLError:
            pass
    calls = [
        ("nvmlDeviceGetHandleByIndex", lambda: pynvml.nvmlDeviceGetHandleByIndex(0)),
        ("nvmlDeviceGetMemoryInfo (v2)", lambda: pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)),
        ("nvmlDeviceGetUtilizationRates", lambda: pynvml.nvmlDeviceGetUtilizationRates(h)),
        ("nvmlDeviceGetTemperature", lambda: pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)),
        ("nvmlDeviceGetComputeRunningProcesses", lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(h)),
        ("nvmlDeviceGetGraphicsRunningProcesses", graphics),
    ]
    print("NVML call cost on GPU 0 (%s, driver %s), %d calls each, through pynvml" % (
        pynvml.nvmlDeviceGetName(h), pynvml.nvmlSystemGetDriverVersion(), args.iterations))
    print()
    print("| call | median | p99 |")
    print("|---|---|---|")
    for name, fn in calls:
        fn()
        p50, p99 = timed(fn, args.iterations)
        print("| %s | %.1f µs | %.1f µs |" % (name, p50, p99))
    pynvml.nvmlShutdown()


if __name__ == "__main__":
    main()
