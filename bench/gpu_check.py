#!/usr/bin/env python3
"""Checks memtrack's GPU figures against the driver and PyTorch on a real GPU.

    python3 bench/gpu_check.py --memtrack target/release/memtrack --out DIR [--scenario all]

Needs an NVIDIA GPU, nvidia-smi, PyTorch with CUDA and nvidia-ml-py. It runs
a PyTorch job through a shell wrapper (so the CUDA process is a child of the
process memtrack spawned) under `memtrack run`, and while the job holds
2 GiB it reads, at the same moment, `nvidia-smi --query-compute-apps`,
`nvidia-smi --query-gpu` and memtrack's /metrics. Afterwards it compares the
allocator figures memtrack logged with what torch.cuda reported at each mark.
It also times NVML per sample: memtrack's own tick histogram against the raw
pynvml calls the same sample needs (the floor). Prints a Markdown report and
writes it, with the raw numbers, to DIR.

Process trees (`--scenario dataloader|child|two-jobs|all`): while each job
holds its memory, every process NVML lists is compared with the figure the
memtrack that follows it gives, at the same moment:
  - dataloader: a parent holding 2 GiB with a DataLoader of 4 workers
    (fork, pin_memory): the workers hold no CUDA memory and must show none;
  - child: a parent holding 1 GiB whose child process holds 3 GiB: both
    processes and their sum;
  - two-jobs: two memtracks at once, each following a job on the same GPU
    (1 GiB and 3 GiB): each counts its own job and never the other.
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


def single(args):
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
    lines += ["", "## memtrack's whole tick against NVML's calls alone (%d device%s)" % (
                  nv["devices"], "s" if nv["devices"] > 1 else ""), "",
              "The tick is everything a default sample reads (procfs, the VmHWM and Pss passes as they fall "
              "due, NVML): an upper bound, not NVML's share. `cargo bench --bench tick` times the NVML "
              "sample alone against one process-list query.", "",
              "| raw pynvml calls of one sample (median) | memtrack mean tick (procfs + NVML, %d ticks) | ratio |" % nv["samples"],
              "|---|---|---|",
              "| %.3f ms | %.3f ms | %.2fx |" % (nv["floor_ms_per_sample"], nv["memtrack_mean_sample_ms"],
                                              nv["memtrack_mean_sample_ms"] / nv["floor_ms_per_sample"]),
              "", "memtrack exit status: %s; peak_usage %s" % (report["memtrack_exit"], json.dumps(report["peak_usage"]))]
    text = "\n".join(lines) + "\n"
    print(text)
    open(os.path.join(args.out, "gpu_check.md"), "w").write(text)
    json.dump(report, open(os.path.join(args.out, "gpu_check.json"), "w"), indent=2)
    return 0 if report["memtrack_exit"] == 0 else 1



# ---------------------------------------------------------------------------
# Process trees: every process NVML lists against the memtrack following it
# ---------------------------------------------------------------------------

TREE_JOB = r"""
import json, os, subprocess, sys, time
import torch
work, role, mib = os.environ["CHECK_DIR"], os.environ["ROLE"], int(os.environ["HOLD_MIB"])

def children(pid):
    out = []
    for t in os.listdir("/proc/%d/task" % pid):
        try:
            out += [int(c) for c in open("/proc/%d/task/%s/children" % (pid, t)).read().split()]
        except OSError:
            pass
    return out

def wait_for(name, seconds=60):
    deadline = time.time() + seconds
    while not os.path.exists(os.path.join(work, name)) and time.time() < deadline:
        time.sleep(0.05)

x = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
pids = [os.getpid()]
if role == "dataloader":
    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 10 ** 6
        def __getitem__(self, i):
            return torch.full((1024,), float(i))
    loader = iter(torch.utils.data.DataLoader(Data(), batch_size=64, num_workers=4, pin_memory=True,
                                             persistent_workers=True, multiprocessing_context="fork"))
    batch = next(loader).cuda()
    torch.cuda.synchronize()
    pids += children(os.getpid())
elif role == "child":
    code = ("import os, sys, time, torch; y = torch.empty(%d << 20, dtype=torch.uint8, device='cuda'); "
            "torch.cuda.synchronize(); open(sys.argv[1], 'w').write('x'); "
            "[time.sleep(0.05) for _ in iter(lambda: os.path.exists(sys.argv[2]), True)]" % int(os.environ["CHILD_MIB"]))
    child = subprocess.Popen([sys.executable, "-c", code, os.path.join(work, "child_ready"), os.path.join(work, "measured")])
    wait_for("child_ready")
    pids.append(child.pid)
open(os.path.join(work, "holding.tmp"), "w").write(json.dumps(pids))
os.rename(os.path.join(work, "holding.tmp"), os.path.join(work, "holding"))
wait_for("measured")
if role == "child":
    child.wait()
"""


class Run:
    """One `memtrack run` of TREE_JOB in its own work folder."""

    def __init__(self, memtrack, name, role, hold_mib, child_mib=0):
        self.name, self.work = name, tempfile.mkdtemp(prefix="gpu-tree-%s-" % name)
        job = os.path.join(self.work, "job.py")
        open(job, "w").write(TREE_JOB)
        env = {k: v for k, v in os.environ.items() if not k.startswith("MEMTRACK_")}
        env.update(CHECK_DIR=self.work, ROLE=role, HOLD_MIB=str(hold_mib), CHILD_MIB=str(child_mib),
                   PYTHONPATH=os.path.join(REPO, "clients", "python", "src"))
        cmd = [memtrack, "run", "--interval", "200ms", "--name", name, "--output", os.path.join(self.work, "runs"),
               "--listen", "127.0.0.1:0", "--", "sh", "-c", "%s %s" % (sys.executable, job)]
        self.daemon = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
        self.addr, self.log = None, []
        threading.Thread(target=self._read_log, daemon=True).start()

    def _read_log(self):
        for line in self.daemon.stderr:
            self.log.append(line)
            m = re.search(r"metrics on http://(\S+)/metrics", line)
            if m:
                self.addr = m.group(1)

    def holding(self, seconds=180):
        path = os.path.join(self.work, "holding")
        deadline = time.time() + seconds
        while not os.path.exists(path):
            if time.time() > deadline or self.daemon.poll() is not None:
                raise SystemExit("%s: the job never held its memory:\n%s" % (self.name, "".join(self.log)))
            time.sleep(0.05)
        return json.load(open(path))

    def finish(self):
        open(os.path.join(self.work, "measured"), "w").write("x")
        self.daemon.wait(timeout=120)
        return json.load(open(os.path.join(self.work, "runs", self.name, "memory_usage.json")))


def compare_now(runs_pids):
    """nvidia-smi and each memtrack's /metrics, read back to back."""
    apps = smi_apps()
    texts = [scrape(run.addr) for run, _ in runs_pids]
    apps_after = smi_apps()
    rows = []
    for (run, pids), text in zip(runs_pids, texts):
        tree_smi = sum(apps.get(p, 0) for p in pids)
        for p in pids:
            rows.append({"run": run.name, "pid": p, "nvidia_smi_mib": apps.get(p, 0),
                         "nvidia_smi_after_mib": apps_after.get(p, 0),
                         "memtrack_mib": sum(metric(text, "memtrack_process_gpu_memory_bytes", pid=p)) / MIB})
        rows.append({"run": run.name, "pid": "tree", "nvidia_smi_mib": tree_smi,
                     "nvidia_smi_after_mib": sum(apps_after.get(p, 0) for p in pids),
                     "memtrack_mib": sum(metric(text, "memtrack_tree_gpu_memory_bytes")) / MIB})
    foreign = sorted(set(apps) - {p for _, pids in runs_pids for p in pids})
    return rows, foreign


def tree_scenario(args, name, specs):
    runs = [Run(args.memtrack, *spec) for spec in specs]
    runs_pids = [(run, run.holding()) for run in runs]
    while any(run.addr is None for run in runs):
        time.sleep(0.05)
    time.sleep(0.6)  # two ticks with everything held
    moments = [compare_now(runs_pids) for _ in range(3)]
    docs = [run.finish() for run in runs]
    ok = all(r["memtrack_mib"] == r["nvidia_smi_mib"] or r["memtrack_mib"] == r["nvidia_smi_after_mib"]
             for rows, _ in moments for r in rows)
    ok &= all(run.daemon.returncode == 0 for run in runs)
    lines = ["## %s" % name, "",
             "| moment | run | pid | nvidia-smi compute-apps | memtrack /metrics |", "|---|---|---|---|---|"]
    for i, (rows, foreign) in enumerate(moments):
        for r in rows:
            smi = r["nvidia_smi_mib"] if r["nvidia_smi_mib"] == r["nvidia_smi_after_mib"] else \
                "%s → %s" % (r["nvidia_smi_mib"], r["nvidia_smi_after_mib"])
            lines.append("| %d | %s | %s | %s | %.0f |" % (i + 1, r["run"], r["pid"], smi, r["memtrack_mib"]))
    lines.append("")
    for run, doc in zip(runs, docs):
        peak = doc["peak_usage"]
        lines.append("- %s: exit %s, peak_usage.gpu_process_used_mb %.0f, gpu_attribution %s" % (
            run.name, run.daemon.returncode, peak.get("gpu_process_used_mb", 0),
            (doc.get("gpu_attribution") or {}).get("mode")))
    lines.append("- other processes on the GPU at the moments: %s" % sorted({p for _, f in moments for p in f}))
    lines.append("- every figure equal to nvidia-smi's: %s" % ok)
    lines.append("")
    return ok, lines


SCENARIOS = {
    "dataloader": [("dataloader", "dataloader", 2048)],
    "child": [("child", "child", 1024, 3072)],
    "two-jobs": [("job-a", "plain", 1024), ("job-b", "plain", 3072)],
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--memtrack", default=os.path.join(REPO, "target", "release", "memtrack"))
    ap.add_argument("--out", default=tempfile.mkdtemp(prefix="gpu-check-"))
    ap.add_argument("--scenario", default="single", choices=["single", "all"] + sorted(SCENARIOS))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rc = 0
    if args.scenario in ("single", "all"):
        rc |= single(args)
    if args.scenario != "single":
        names = sorted(SCENARIOS) if args.scenario == "all" else [args.scenario]
        lines = ["# memtrack GPU check: process trees", "",
                 "Per-process GPU memory: NVML's figure for each process as nvidia-smi prints it, and as the "
                 "memtrack following that process serves it on /metrics, read back to back ('a → b': "
                 "nvidia-smi read before and after the scrape differ). `tree`: the sum over the job's processes "
                 "against memtrack_tree_gpu_memory_bytes.", ""]
        for name in names:
            ok, part = tree_scenario(args, name, SCENARIOS[name])
            lines += part
            rc |= 0 if ok else 1
        text = "\n".join(lines) + "\n"
        print(text)
        open(os.path.join(args.out, "gpu_trees.md"), "w").write(text)
    return rc


if __name__ == "__main__":
    sys.exit(main())
