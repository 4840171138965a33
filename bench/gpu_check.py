#!/usr/bin/env python3
"""Checks memtrack's GPU figures against the driver and PyTorch on a real GPU.

    python3 bench/gpu_check.py --memtrack target/release/memtrack --out DIR

Needs an NVIDIA GPU, nvidia-smi, PyTorch with CUDA and nvidia-ml-py. It runs
a PyTorch job through a shell wrapper (so the CUDA process is a child of the
process memtrack spawned) under `memtrack run`, and while the job holds
2 GiB it reads, at the same moment, `nvidia-smi --query-compute-apps`,
`nvidia-smi --query-gpu` and memtrack's /metrics. Afterwards it compares the
allocator figures memtrack logged with what torch.cuda reported at each mark.
It also times NVML per sample: memtrack's own tick histogram against the raw
pynvml calls the same sample needs (the floor). Prints a Markdown report and
writes it, with the raw numbers, to DIR.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

MIB = 1 << 20
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

JOB = r"""
import json, os, sys, time
import torch, memtrack
out = os.environ["CHECK_DIR"]
torch.cuda.init()
x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
rec = []
def snap(tag):
    entry = memtrack.mark("gpu_check", tag, ack=True)
    rec.append({"tag": tag, "pid": os.getpid(),
                "allocated": torch.cuda.memory_allocated(),
                "reserved": torch.cuda.memory_reserved(),
                "max_allocated": torch.cuda.max_memory_allocated(),
                "entry": entry})
snap("holding_2g")
open(os.path.join(out, "holding"), "w").write(str(os.getpid()))
deadline = time.time() + 30
while not os.path.exists(os.path.join(out, "measured")) and time.time() < deadline:
    time.sleep(0.05)
y = torch.empty(1 << 30, dtype=torch.uint8, device="cuda"); torch.cuda.synchronize()
snap("holding_3g")
del x, y
snap("freed_still_cached")
torch.cuda.empty_cache()
snap("after_empty_cache")
json.dump(rec, open(os.path.join(out, "job.json"), "w"))
"""


def sh(*cmd):
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


def smi_apps():
    out = sh("nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")
    return {int(p): int(m) for p, m in (l.split(",") for l in out.strip().splitlines() if l.strip())}


def smi_gpus():
    out = sh("nvidia-smi", "--query-gpu=index,uuid,name,memory.used,memory.total", "--format=csv,noheader,nounits")
    rows = []
    for l in out.strip().splitlines():
        i, uuid, name, used, total = [f.strip() for f in l.split(",")]
        rows.append({"index": int(i), "uuid": uuid, "name": name, "used_mib": int(used), "total_mib": int(total)})
    return rows


def scrape(addr):
    import urllib.request
    return urllib.request.urlopen("http://%s/metrics" % addr, timeout=5).read().decode()


def metric(text, name, **labels):
    out = []
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all('%s="%s"' % (k, v) in line for k, v in labels.items()):
            out.append(float(line.rsplit(" ", 1)[1]))
    return out


def nvml_floor(iterations=300):
    """Median time of the NVML calls one memtrack sample makes, per device."""
    import pynvml
    pynvml.nvmlInit()
    n = pynvml.nvmlDeviceGetCount()
    times = []
    for _ in range(iterations):
        t = time.perf_counter()
        for i in range(n):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            pynvml.nvmlDeviceGetMemoryInfo(h)
            pynvml.nvmlDeviceGetUtilizationRates(h)
            pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)
            pynvml.nvmlDeviceGetComputeRunningProcesses(h)
            try:
                pynvml.nvmlDeviceGetGraphicsRunningProcesses(h)
            except pynvml.NVMLError:
                pass
        times.append(time.perf_counter() - t)
    pynvml.nvmlShutdown()
    times.sort()
    return n, times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--memtrack", default=os.path.join(REPO, "target", "release", "memtrack"))
    ap.add_argument("--out", default=tempfile.mkdtemp(prefix="gpu-check-"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="gpu-check-work-")
    job = os.path.join(work, "job.py")
    open(job, "w").write(JOB)
    env = dict(os.environ, CHECK_DIR=work, PYTHONPATH=os.path.join(REPO, "clients", "python", "src"))
    env = {k: v for k, v in env.items() if not k.startswith("MEMTRACK_")}

    report = {"gpus_before": smi_gpus(), "driver": sh("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader").strip()}
    cmd = [args.memtrack, "run", "--interval", "200ms", "--name", "gpu-check", "--output", os.path.join(work, "runs"),
           "--listen", "127.0.0.1:0", "--", "sh", "-c", "python3 %s" % job]
    daemon = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    addr, log = [None], []

    def read_log():
        for line in daemon.stderr:
            log.append(line)
            m = re.search(r"metrics on http://(\S+)/metrics", line)
            if m:
                addr[0] = m.group(1)
    threading.Thread(target=read_log, daemon=True).start()

    holding = os.path.join(work, "holding")
    deadline = time.time() + 120
    while not os.path.exists(holding) and time.time() < deadline:
        time.sleep(0.05)
    pid = int(open(holding).read())
    time.sleep(0.6)  # at least two ticks with the 2 GiB held
    same_moment = []
    for _ in range(3):
        apps, gpus, text = smi_apps(), smi_gpus(), scrape(addr[0])
        same_moment.append({
            "nvidia_smi_used_mib": apps.get(pid),
            "memtrack_process_gpu_mib": sum(metric(text, "memtrack_process_gpu_memory_bytes", pid=pid)) / MIB,
            "nvidia_smi_device_used_mib": [g["used_mib"] for g in gpus],
            "memtrack_device_used_mib": [v / MIB for v in metric(text, "memtrack_gpu_memory_used_bytes")],
            "nvidia_smi_device_total_mib": [g["total_mib"] for g in gpus],
            "memtrack_device_total_mib": [v / MIB for v in metric(text, "memtrack_gpu_memory_total_bytes")],
        })
        time.sleep(0.5)
    text = scrape(addr[0])
    tick_sum = metric(text, "memtrack_tick_duration_seconds_sum")[0]
    tick_count = metric(text, "memtrack_tick_duration_seconds_count")[0]
    open(os.path.join(work, "measured"), "w").write("x")
    daemon.wait(timeout=120)
    report["memtrack_exit"] = daemon.returncode
    doc = json.load(open(os.path.join(work, "runs", "gpu-check", "memory_usage.json")))
    torch_marks = json.load(open(os.path.join(work, "job.json")))
    report["same_moment"] = same_moment
    entries = {e["operation"]: e for e in doc["detailed_log"] if e["component"] == "gpu_check"}
    report["allocator"] = [{
        "tag": r["tag"],
        "torch_allocated_mib": r["allocated"] / MIB, "memtrack_gpu_ram_used_mb": entries[r["tag"]]["gpu_ram_used_mb"],
        "torch_reserved_mib": r["reserved"] / MIB, "memtrack_reserved_gpu_ram_mb": entries[r["tag"]]["reserved_gpu_ram_mb"],
        "torch_max_allocated_mib": r["max_allocated"] / MIB, "memtrack_gpu_ram_peak_mb": entries[r["tag"]]["gpu_ram_peak_mb"],
        "gpu_source": entries[r["tag"]]["gpu_source"],
        "memtrack_gpu_process_used_mb": entries[r["tag"]]["gpu_process_used_mb"],
    } for r in torch_marks]
    report["gpus_in_json"] = doc["gpus"]
    report["peak_usage"] = doc["peak_usage"]
    report["summary"] = doc["summary"]
    report["gpu_backend"] = doc["run"]["gpu_backend"]
    n, floor = nvml_floor()
    report["nvml"] = {"devices": n, "floor_ms_per_sample": floor * 1e3,
                      "memtrack_mean_sample_ms": tick_sum / tick_count * 1e3, "samples": tick_count}

    lines = ["# memtrack GPU check", "",
             "device: %s, driver %s, backend %s" % (", ".join(g["name"] for g in report["gpus_before"]), report["driver"], report["gpu_backend"]), "",
             "## Per-process GPU memory at the same moment (MiB)", "",
             "| nvidia-smi compute-apps | memtrack /metrics | device used: nvidia-smi | memtrack | total: nvidia-smi | memtrack |",
             "|---|---|---|---|---|---|"]
    for m in same_moment:
        lines.append("| %s | %.0f | %s | %s | %s | %s |" % (
            m["nvidia_smi_used_mib"], m["memtrack_process_gpu_mib"], m["nvidia_smi_device_used_mib"],
            ["%.0f" % v for v in m["memtrack_device_used_mib"]], m["nvidia_smi_device_total_mib"],
            ["%.0f" % v for v in m["memtrack_device_total_mib"]]))
    lines += ["", "## Allocator figures in memory_usage.json vs torch.cuda at the mark (MiB)", "",
              "| mark | torch allocated | logged gpu_ram_used_mb | torch reserved | logged reserved_gpu_ram_mb | torch max_allocated | logged gpu_ram_peak_mb | gpu_source | NVML gpu_process_used_mb |",
              "|---|---|---|---|---|---|---|---|---|"]
    for a in report["allocator"]:
        lines.append("| %s | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %s | %.1f |" % (
            a["tag"], a["torch_allocated_mib"], a["memtrack_gpu_ram_used_mb"], a["torch_reserved_mib"],
            a["memtrack_reserved_gpu_ram_mb"], a["torch_max_allocated_mib"], a["memtrack_gpu_ram_peak_mb"],
            a["gpu_source"], a["memtrack_gpu_process_used_mb"]))
    nv = report["nvml"]
    lines += ["", "## NVML cost per sample (%d device%s)" % (nv["devices"], "s" if nv["devices"] > 1 else ""), "",
              "| floor: raw pynvml calls of one sample (median) | memtrack mean sample (procfs + NVML, %d samples) | ratio |" % nv["samples"],
              "|---|---|---|",
              "| %.3f ms | %.3f ms | %.2fx |" % (nv["floor_ms_per_sample"], nv["memtrack_mean_sample_ms"],
                                              nv["memtrack_mean_sample_ms"] / nv["floor_ms_per_sample"]),
              "", "memtrack exit status: %s; peak_usage %s" % (report["memtrack_exit"], json.dumps(report["peak_usage"]))]
    text = "\n".join(lines) + "\n"
    print(text)
    open(os.path.join(args.out, "gpu_check.md"), "w").write(text)
    json.dump(report, open(os.path.join(args.out, "gpu_check.json"), "w"), indent=2)
    return 0 if report["memtrack_exit"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
