"""Shared by the framework tests: the memtrack binary, the environment that
keeps every library offline, and a job runner."""

import glob
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", ".."))
JOBS = os.path.join(HERE, "jobs")
BIN = os.environ.get("MEMTRACK_BIN") or os.path.join(REPO, "target", "debug", "memtrack")

# No hub, no telemetry, no tracker of the libraries' own.
OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_DATASETS_OFFLINE": "1",
    "DISABLE_MLFLOW_INTEGRATION": "TRUE",
    "WANDB_DISABLED": "true",
    "WANDB_MODE": "disabled",
    "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false",
    "DO_NOT_TRACK": "1",
    "PYTHONDONTWRITEBYTECODE": "1",
}


@pytest.fixture(autouse=True)
def _binary():
    # A missing binary is a broken setup, never a skip.
    if not os.access(BIN, os.X_OK):
        pytest.fail("no memtrack binary at %s (cargo build, or set MEMTRACK_BIN)" % BIN)


def job_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MEMTRACK_", "MLFLOW_", "PYTHONPATH"))}
    env.update(OFFLINE)
    env.update(extra)
    return env


def run_memtrack(tmp_path, argv, env=None, flags=(), timeout=300):
    """``memtrack run`` of ``argv`` (this Python); returns (document, process)."""
    out = tmp_path / "out"
    cmd = [BIN, "run", "--interval", "100ms", "--listen", "off", "--output", str(out),
           "--name", "job"] + list(flags) + ["--", sys.executable] + list(argv)
    proc = subprocess.run(cmd, env=env or job_env(), capture_output=True, text=True,
                          timeout=timeout, cwd=str(tmp_path))
    docs = glob.glob(str(out / "job" / "memory_usage.json"))
    assert docs, "no memory_usage.json; stderr:\n%s" % proc.stderr[-4000:]
    with open(docs[0]) as f:
        return json.load(f), proc


def printed(proc, tag):
    """The JSON value a job printed on its line ``TAG value``."""
    line = [l for l in proc.stdout.splitlines() if l.startswith(tag + " ")]
    assert line, proc.stdout[-2000:]
    return json.loads(line[0][len(tag) + 1:])


def events(doc):
    return [e for e in doc["detailed_log"] if e["operation"] != "timer"]


def step_spans(doc):
    """(iteration, labels) of every ``train``/``step`` span's begin."""
    return [(e.get("iteration"), e.get("labels", {})) for e in events(doc)
            if e["component"] == "train" and e["operation"] == "before_step"]


def stages(doc, name):
    return [s for s in doc["stages"] if s["name"] == name]
