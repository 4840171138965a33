#!/usr/bin/env python3
"""Where memtrack's resident memory goes with NVML loaded, against host-only.

    python3 bench/gpu_rss.py --memtrack target/release/memtrack [--seconds 8]

Needs an NVIDIA GPU and PyTorch with CUDA. The same job (a process holding
1 GiB of CUDA memory) runs twice under `memtrack run --interval 100ms`: with
`--no-gpu` and with NVML. After the given time each memtrack's
/proc/PID/status and /proc/PID/smaps are read: the totals (RssAnon, RssFile,
threads) and the largest mappings by RSS, so the difference between the two
runs can be told apart into the NVML library's own pages, the heap and the
threads' stacks. Prints a Markdown report.
"""

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = "import time, torch; x = torch.empty(1 << 30, dtype=torch.uint8, device='cuda'); torch.cuda.synchronize(); time.sleep(3600)"


def status(pid):
    out = {}
    for line in open("/proc/%d/status" % pid):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM", "Threads"):
            out[key] = int(value.split()[0])
    return out


def smaps(pid):
    """RSS (KiB) and Private_Dirty (KiB) by mapping name."""
    rss, dirty = collections.Counter(), collections.Counter()
    name = None
    for line in open("/proc/%d/smaps" % pid):
        fields = line.split()
        if "-" in fields[0] and ":" not in fields[0]:
            name = fields[5] if len(fields) > 5 else "[anonymous]"
        elif fields[0] == "Rss:":
            rss[name] += int(fields[1])
        elif fields[0] == "Private_Dirty:":
            dirty[name] += int(fields[1])
    return rss, dirty


def measure(memtrack, gpu, seconds, extra_env=None):
    work = tempfile.mkdtemp(prefix="gpu-rss-")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMTRACK_")}
    env.update(extra_env or {})
    cmd = [memtrack, "run", "--interval", "100ms", "--name", "rss", "--output", work, "--listen", "off"]
    if not gpu:
        cmd.append("--no-gpu")
    cmd += ["--", sys.executable, "-c", JOB]
    daemon = subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL)
    time.sleep(seconds)
    st = status(daemon.pid)
    rss, dirty = smaps(daemon.pid)
    daemon.terminate()
    daemon.wait(timeout=60)
    return st, rss, dirty


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--memtrack", default=os.path.join(REPO, "target", "release", "memtrack"))
    ap.add_argument("--seconds", type=float, default=8)
    ap.add_argument("--nvml-rss", help="bench/nvml_rss.c built: NVML's own cost in a bare process")
    args = ap.parse_args()
    host = measure(args.memtrack, False, args.seconds)
    nvml = measure(args.memtrack, True, args.seconds)
    # glibc gives each thread that allocates its own arena: is that where
    # the difference goes?
    one_arena = measure(args.memtrack, True, args.seconds, {"MALLOC_ARENA_MAX": "1"})
    lines = ["# memtrack's RSS with NVML and without", "",
             "`python3 bench/gpu_rss.py --memtrack BIN --seconds %g`: the same job (1 GiB of CUDA memory) under "
             "`memtrack run --interval 100ms`, read after %g s." % (args.seconds, args.seconds), "",
             "| | host-only (`--no-gpu`) | with NVML | difference |", "|---|---|---|---|"]
    for key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
        a, b = host[0].get(key, 0), nvml[0].get(key, 0)
        lines.append("| %s | %.1f MiB | %.1f MiB | %+.1f MiB |" % (key, a / 1024, b / 1024, (b - a) / 1024))
    lines.append("| threads | %d | %d | %+d |" % (host[0]["Threads"], nvml[0]["Threads"],
                                                   nvml[0]["Threads"] - host[0]["Threads"]))
    lines += ["", "Mappings that differ most (RSS, KiB; private dirty in brackets):", "",
              "| mapping | host-only | with NVML | difference |", "|---|---|---|---|"]
    names = set(host[1]) | set(nvml[1])
    diff = sorted(names, key=lambda n: -abs(nvml[1][n] - host[1][n]))
    for n in diff[:12]:
        lines.append("| %s | %d (%d) | %d (%d) | %+d |" % (n, host[1][n], host[2][n], nvml[1][n], nvml[2][n],
                                                          nvml[1][n] - host[1][n]))
    lines += ["", "With NVML and `MALLOC_ARENA_MAX=1` (one malloc arena for every thread): VmRSS %.1f MiB, "
              "RssAnon %.1f MiB (%+.1f MiB against host-only)." % (
                  one_arena[0]["VmRSS"] / 1024, one_arena[0]["RssAnon"] / 1024,
                  (one_arena[0]["RssAnon"] - host[0]["RssAnon"]) / 1024)]
    if args.nvml_rss:
        floor = subprocess.run([args.nvml_rss, str(int(args.seconds * 10))], capture_output=True, text=True)
        lines += ["", "NVML's own cost in a bare C process (`bench/nvml_rss.c`, %d samples):" % int(args.seconds * 10),
                  "", "```", (floor.stdout + floor.stderr).strip(), "```"]
    text = "\n".join(lines) + "\n"
    print(text)


if __name__ == "__main__":
    main()
