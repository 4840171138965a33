#!/usr/bin/env python3
"""Cross-check the fake NVML library against NVIDIA's own Python bindings.

pynvml (PyPI package ``nvidia-ml-py``) carries NVIDIA's ctypes mirror of
nvml.h.  This script loads the fake through pynvml's normal loader
(``CDLL("libnvidia-ml.so.1")``: a temp dir holding a symlink with that
name goes on LD_LIBRARY_PATH and the script re-executes itself) and checks
that what pynvml reports equals what the state file says.  Expected values
come from a small, independent parser of the state file below, not from
the C code.

Usage:
    python3 -m venv /tmp/fn/venv && /tmp/fn/venv/bin/pip install nvidia-ml-py
    /tmp/fn/venv/bin/python tests/fake_nvml/check_pynvml.py [--lib PATH.so]

Without --lib the library is built into a temp dir with the test suite's
gcc command.  Exit status 0 and "ALL OK" on success.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "fake_nvml.c")
MIB = 1024 * 1024
NA = 0xFFFFFFFFFFFFFFFF
NO_ID = 0xFFFFFFFF
OVERHEAD_MIB = 300


# ---------------------------------------------------------------------------
# Independent reading of the state-file format (the subset used here)
# ---------------------------------------------------------------------------

def expected_from_state(text):
    devs = {}
    procs = {}  # (dev, 'compute'|'graphics') -> [(pid, used_bytes_or_None)]
    putil = {}
    driver = "550.54.15"
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].split()
        if not line:
            continue
        kw = line[0]
        if kw == "device":
            idx = int(line[1])
            d = dict(uuid="GPU-fa4e0000-0000-4000-8000-%012x" % idx,
                     name="NVIDIA Fake GPU", total_mib=81559, used_mib=None,
                     reserved_mib=0, util_gpu=0, util_mem=0, temp=40)
            for kv in line[2:]:
                k, v = kv.split("=", 1)
                if k == "name":
                    d[k] = v.replace("_", " ")
                elif k == "uuid":
                    d[k] = v
                else:
                    d[k] = int(v)
            devs[idx] = d
        elif kw == "process":
            dev, pid = int(line[1]), int(line[2])
            used = None if line[3] == "na" else int(line[3]) * MIB
            kind = line[4] if len(line) > 4 else "compute"
            procs.setdefault((dev, kind), []).append((pid, used))
        elif kw == "process_util":
            dev = int(line[1])
            vals = [int(x) for x in line[2:]] + [0, 0]
            putil.setdefault(dev, []).append(tuple(vals[:6]))
        elif kw == "driver_version":
            driver = line[1]
    for idx, d in devs.items():
        if d["used_mib"] is not None:
            used = d["used_mib"] * MIB
        else:
            per_pid = {}
            for kind in ("compute", "graphics"):
                for pid, u in procs.get((idx, kind), []):
                    per_pid[pid] = max(per_pid.get(pid, 0), u or 0)
            used = sum(per_pid.values()) + OVERHEAD_MIB * MIB
        total = d["total_mib"] * MIB
        reserved = d["reserved_mib"] * MIB
        d["mem_v2"] = dict(total=total, reserved=reserved, used=used,
                           free=max(total - used - reserved, 0))
        d["mem_v1"] = dict(total=total, used=used + reserved,
                           free=max(total - used - reserved, 0))
        d["compute"] = procs.get((idx, "compute"), [])
        d["graphics"] = procs.get((idx, "graphics"), [])
        d["putil"] = putil.get(idx, [])
    return dict(devices=devs, driver=driver)


# ---------------------------------------------------------------------------

failures = 0
checks = 0


def check(cond, what):
    global failures, checks
    checks += 1
    if not cond:
        failures += 1
        print("FAIL:", what, file=sys.stderr)


def write_state(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.rename(tmp, path)


def as_str(v):
    return v.decode() if isinstance(v, bytes) else v


def check_against(pynvml, text):
    exp = expected_from_state(text)
    check(as_str(pynvml.nvmlSystemGetDriverVersion()) == exp["driver"], "driver version")
    n = pynvml.nvmlDeviceGetCount()
    check(n == len(exp["devices"]), "device count %d" % n)
    for idx in range(n):
        d = exp["devices"][idx]
        h = pynvml.nvmlDeviceGetHandleByIndex(idx)
        check(pynvml.nvmlDeviceGetIndex(h) == idx, "index %d" % idx)
        name = as_str(pynvml.nvmlDeviceGetName(h))
        check(name == d["name"], "name %r != %r" % (name, d["name"]))
        uuid = as_str(pynvml.nvmlDeviceGetUUID(h))
        check(uuid == d["uuid"], "uuid %r != %r" % (uuid, d["uuid"]))
        h2 = pynvml.nvmlDeviceGetHandleByUUID(uuid.encode())
        check(pynvml.nvmlDeviceGetIndex(h2) == idx, "handle by uuid")

        m1 = pynvml.nvmlDeviceGetMemoryInfo(h)
        got = dict(total=m1.total, used=m1.used, free=m1.free)
        check(got == d["mem_v1"], "dev %d memory v1 %r != %r" % (idx, got, d["mem_v1"]))
        m2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
        got = dict(total=m2.total, reserved=m2.reserved, used=m2.used, free=m2.free)
        check(got == d["mem_v2"], "dev %d memory v2 %r != %r" % (idx, got, d["mem_v2"]))

        u = pynvml.nvmlDeviceGetUtilizationRates(h)
        check((u.gpu, u.memory) == (d["util_gpu"], d["util_mem"]), "dev %d util" % idx)
        t = pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)
        check(t == d["temp"], "dev %d temp %d" % (idx, t))

        for kind, fn in (("compute", pynvml.nvmlDeviceGetComputeRunningProcesses),
                         ("graphics", pynvml.nvmlDeviceGetGraphicsRunningProcesses)):
            got = pynvml_procs = fn(h)
            got = [(p.pid, p.usedGpuMemory) for p in pynvml_procs]
            check(got == d[kind], "dev %d %s procs %r != %r" % (idx, kind, got, d[kind]))
            for p in pynvml_procs:
                check(p.gpuInstanceId == NO_ID and p.computeInstanceId == NO_ID,
                      "instance ids")
        # the older entry points agree with the v3 ones
        got = [(p.pid, p.usedGpuMemory)
               for p in pynvml.nvmlDeviceGetComputeRunningProcesses_v2(h)]
        check(got == d["compute"], "dev %d compute v2 procs" % idx)
        check(pynvml.nvmlDeviceGetMPSComputeRunningProcesses(h) == [], "mps empty")

        if d["putil"]:
            samples = pynvml.nvmlDeviceGetProcessUtilization(h, 0)
            got = [(s.pid, s.smUtil, s.memUtil, s.encUtil, s.decUtil) for s in samples]
            want = [(p[0], p[1], p[2], p[3], p[4]) for p in d["putil"]]
            check(got == want, "dev %d process utilization %r != %r" % (idx, got, want))
            check(all(abs(s.timeStamp / 1e6 - time.time()) < 60 for s in samples),
                  "sample timestamps are CPU time in us")
        else:
            try:
                pynvml.nvmlDeviceGetProcessUtilization(h, 0)
                check(False, "expected NotFound for no samples")
            except pynvml.NVMLError_NotFound:
                pass


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", help="built fake library (default: build one)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir")
    args = ap.parse_args()

    if os.environ.get("FAKE_NVML_CHILD") != "1":
        work = tempfile.mkdtemp(prefix="fake_nvml_pynvml.")
        lib = args.lib
        if lib is None:
            lib = os.path.join(work, "libnvidia-ml-fake.so")
            subprocess.check_call(["gcc", "-shared", "-fPIC", "-O2", "-Wall", "-Wextra",
                                   "-Werror", "-o", lib, SRC])
        libdir = os.path.join(work, "lib")
        os.mkdir(libdir)
        os.symlink(os.path.abspath(lib), os.path.join(libdir, "libnvidia-ml.so.1"))
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = libdir + (":" + env["LD_LIBRARY_PATH"]
                                           if env.get("LD_LIBRARY_PATH") else "")
        env["FAKE_NVML_CHILD"] = "1"
        env["FAKE_NVML_WORK"] = work
        env["FAKE_NVML_CALLS"] = os.path.join(work, "calls.log")
        env.pop("FAKE_NVML_STATE", None)
        rc = subprocess.call([sys.executable, os.path.abspath(__file__)], env=env)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print("kept", work)
        sys.exit(rc)

    # ---- child: LD_LIBRARY_PATH points at the fake ------------------------
    import pynvml

    work = os.environ["FAKE_NVML_WORK"]
    calls = os.environ["FAKE_NVML_CALLS"]
    state = os.path.join(work, "state.txt")
    print("pynvml from", pynvml.__file__)

    # no state file -> driver not loaded
    os.environ["FAKE_NVML_STATE"] = state
    try:
        pynvml.nvmlInit()
        check(False, "init without state file should fail")
    except pynvml.NVMLError_DriverNotLoaded:
        pass
    # make sure pynvml really loaded *our* library
    check(os.path.realpath(pynvml.nvmlLib._name) != "" and
          hasattr(pynvml.nvmlLib, "nvmlDeviceGetProcessUtilization"), "lib loaded")

    many = "".join("process 0 %d %d\n" % (5000 + i, 100 + i) for i in range(12))
    state1 = (
        "# cross-check state\n"
        "driver_version 560.35.03\n"
        "device 0 uuid=GPU-0c1d2e3f-1111-2222-3333-444455556666 name=NVIDIA_Fake_H100 "
        "total_mib=81559 util_gpu=37 util_mem=12 temp=41\n"
        "device 1 uuid=GPU-beef name=NVIDIA_Fake_A10 total_mib=23028 used_mib=20000 "
        "reserved_mib=317 util_gpu=100 util_mem=88 temp=77\n"
        "device 2\n"
        "process 0 4242 1500\n"
        "process 0 4243 na\n"
        "process 0 4242 1500 graphics\n"
        "process 0 777 64 graphics\n"
        + many +
        "process 1 9001 19000\n"
        "process_util 1 9001 93 40\n"
        "process_util 1 9002 1 2 3 4\n"
    )
    write_state(state, state1)
    pynvml.nvmlInit()
    check_against(pynvml, state1)

    # live re-read after write-then-rename
    state2 = (
        "device 0 uuid=GPU-0c1d2e3f-1111-2222-3333-444455556666 name=NVIDIA_Fake_H100 "
        "total_mib=81559 temp=55\n"
        "process 0 31337 na\n"
        "process 0 31338 40000\n"
    )
    write_state(state, state2)
    check_against(pynvml, state2)

    # fault injection as seen through pynvml
    write_state(state, state2 + "fail nvmlDeviceGetComputeRunningProcesses_v3 15\n")
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    try:
        pynvml.nvmlDeviceGetComputeRunningProcesses(h)
        check(False, "fail injection")
    except pynvml.NVMLError_GpuIsLost as e:
        check(str(e) == "GPU is lost", "error string via nvmlErrorString: %r" % str(e))
    write_state(state, state2 + "fail * NVML_ERROR_GPU_IS_LOST\n")
    try:
        pynvml.nvmlDeviceGetMemoryInfo(h)
        check(False, "fail *")
    except pynvml.NVMLError_GpuIsLost:
        pass
    write_state(state, state2)

    # call counting: one list query with n>0 is two C calls in pynvml
    before = open(calls).read().splitlines().count("nvmlDeviceGetComputeRunningProcesses_v3")
    pynvml.nvmlDeviceGetComputeRunningProcesses(h)
    after = open(calls).read().splitlines().count("nvmlDeviceGetComputeRunningProcesses_v3")
    check(after - before == 2, "compute list query = 2 calls (got %d)" % (after - before))

    # process utilization with no samples: size query succeeds (72), the
    # data call raises NotFound -> still 2 calls, like a real driver
    name = "nvmlDeviceGetProcessUtilization"
    before = open(calls).read().splitlines().count(name)
    try:
        pynvml.nvmlDeviceGetProcessUtilization(h, 0)
        check(False, "NotFound expected")
    except pynvml.NVMLError_NotFound:
        pass
    after = open(calls).read().splitlines().count(name)
    check(after - before == 2, "process utilization query = 2 calls (got %d)" % (after - before))

    # wrong nvmlMemory_v2 version: a real driver says FUNCTION_NOT_FOUND
    try:
        pynvml.nvmlDeviceGetMemoryInfo(h, version=0x01000028)
        check(False, "version mismatch expected")
    except pynvml.NVMLError_FunctionNotFound:
        pass

    pynvml.nvmlShutdown()
    try:
        pynvml.nvmlDeviceGetCount()
        check(False, "uninitialized after shutdown")
    except pynvml.NVMLError_Uninitialized:
        pass

    print("%d checks, %d failures" % (checks, failures))
    if failures == 0:
        print("ALL OK")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
