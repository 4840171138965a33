"""End to end: jobs using the client under the real daemon
(`memtrack run --interval 100ms --output TMP -- python3 JOB`), asserting on
the memory_usage.json it writes.

The binary is $MEMTRACK_BIN, default <repo>/target/debug/memtrack; these
tests fail (they never skip) when it is missing or has no event socket."""

import glob
import json
import os
import subprocess
import textwrap

import pytest

from conftest import CLIENT_SRC, REPO

BIN = os.environ.get("MEMTRACK_BIN") or os.path.join(REPO, "target", "debug", "memtrack")


def _daemon_problem():
    if not os.access(BIN, os.X_OK):
        return "no memtrack binary at %s (build it, or set MEMTRACK_BIN)" % BIN
    try:
        out = subprocess.run([BIN, "--help"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return "%s --help failed: %s" % (BIN, exc)
    if "\n  mark " not in out:
        return "%s has no event socket (no `mark` command)" % BIN
    return None


_PROBLEM = _daemon_problem()


@pytest.fixture(autouse=True)
def _daemon_available():
    # A missing daemon is a broken setup, not a reason to skip: skipped
    # tests would hide a broken client in CI (scripts/test builds it first).
    if _PROBLEM:
        pytest.fail(_PROBLEM)

PRELUDE = textwrap.dedent(
    """\
    import json, os, sys, time
    import memtrack
    RESULT = os.environ["MT_RESULT"]
    def report(**kw):
        with open(RESULT, "w") as f:
            json.dump(kw, f)
    """
)


def run_job(tmp_path, body, timeout=60, extra_args=()):
    """Run ``body`` (Python, after PRELUDE) under memtrack; returns
    (memory_usage.json as a dict, what the job reported, the process)."""
    script = tmp_path / "job.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    out = tmp_path / "out"
    result = tmp_path / "result.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = CLIENT_SRC + os.pathsep + env.get("PYTHONPATH", "")
    env["MT_RESULT"] = str(result)
    # memtrack rejects MEMTRACK_* variables it does not know (exit 2), and
    # MEMTRACK_BIN is this suite's: the job gets the binary as MT_BIN.
    for name in [k for k in env if k.startswith("MEMTRACK_")]:
        del env[name]
    env["MT_BIN"] = BIN
    cmd = [BIN, "run", "--interval", "100ms", "--output", str(out)]
    cmd += list(extra_args) + ["--", "python3", str(script)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, "job failed (%d)\nstdout:\n%s\nstderr:\n%s" % (
        proc.returncode,
        proc.stdout,
        proc.stderr,
    )
    runs = glob.glob(str(out / "*" / "memory_usage.json"))
    assert len(runs) == 1, runs
    with open(runs[0]) as f:
        doc = json.load(f)
    reported = json.loads(result.read_text()) if result.exists() else {}
    return doc, reported, proc


def events(doc, **match):
    return [
        e
        for e in doc["detailed_log"]
        if e.get("kind") == "event" and all(e.get(k) == v for k, v in match.items())
    ]


def test_marks_are_recorded_with_the_senders_pid_and_ack_returns_the_entry(tmp_path):
    doc, rep, _ = run_job(
        tmp_path,
        """
        for i in range(100):
            memtrack.mark("data", "batch", iteration=i, labels={"rank": 0})
        entry = memtrack.mark("model", "after_load", ack=True)
        report(pid=os.getpid(), entry=entry, dropped=memtrack.dropped())
        """,
    )
    assert rep["dropped"] == 0
    entry = rep["entry"]
    assert entry["cpu_ram_used_mb"] > 0
    assert (entry["component"], entry["operation"], entry["pid"]) == ("model", "after_load", rep["pid"])
    batches = events(doc, component="data", operation="batch")
    assert [e["iteration"] for e in batches] == list(range(100))
    assert {e["pid"] for e in batches} == {rep["pid"]}
    assert batches[0]["labels"] == {"rank": "0"}
    assert len(events(doc, operation="after_load")) == 1
    assert doc["counters"]["protocol_errors"] == 0


def test_span_peak_counts_for_its_component(tmp_path):
    doc, rep, _ = run_job(
        tmp_path,
        """
        MIB = 1 << 20
        time.sleep(0.2)
        def model_peak():
            peaks = (memtrack.status() or {}).get("peaks_by_component", {})
            return peaks.get("model", {}).get("cpu_ram_used_mb", 0)
        with memtrack.span("model", "generate"):
            buf = bytearray(500 * MIB)
            for i in range(0, len(buf), 4096):
                buf[i] = 1
            # Held until memtrack has sampled it (its status says so),
            # however late a loaded machine's ticks come.
            deadline = time.time() + 30
            while model_peak() < 500 and time.time() < deadline:
                time.sleep(0.05)
            del buf
        time.sleep(0.2)
        report(dropped=memtrack.dropped())
        """,
    )
    assert rep["dropped"] == 0
    peak = doc["peaks_by_component"]["model"]["cpu_ram_used_mb"]
    assert peak >= 500, doc["peaks_by_component"]
    (before,) = events(doc, component="model", operation="before_generate")
    (after,) = events(doc, component="model", operation="after_generate")
    assert before["cpu_ram_used_mb"] < 200 and after["cpu_ram_used_mb"] < 200, (before, after)
    assert peak - max(before["cpu_ram_used_mb"], after["cpu_ram_used_mb"]) >= 400
    in_span = [e for e in doc["detailed_log"] if e.get("kind") == "timer" and e.get("span") == "model/generate"]
    assert in_span and all(e["component"] == "model" for e in in_span)


def test_stages_report_success_and_failure(tmp_path):
    doc, rep, _ = run_job(
        tmp_path,
        """
        MIB = 1 << 20
        def hold(mib, seconds):
            buf = bytearray(mib * MIB)
            for i in range(0, len(buf), 4096):
                buf[i] = 1
            time.sleep(seconds)

        with memtrack.stage("load_data"):
            hold(50, 0.3)
        try:
            with memtrack.stage("train_small", labels={"lr": 0.1}):
                hold(150, 0.3)
                raise ValueError("loss is NaN")
        except ValueError:
            pass
        @memtrack.stage("evaluate")
        def evaluate():
            hold(100, 0.3)
        evaluate()
        report(dropped=memtrack.dropped())
        """,
    )
    assert rep["dropped"] == 0
    stages = doc["stages"]
    assert [(s["name"], s["status"]) for s in stages] == [
        ("load_data", "SUCCESS"),
        ("train_small", "FAILED"),
        ("evaluate", "SUCCESS"),
    ]
    for s in stages:
        assert s["duration_s"] >= 0.25 and s["end"] > s["start"]
        assert s["peak"]["cpu_ram_used_mb"] > 0
    assert "ValueError" in stages[1]["message"] and "loss is NaN" in stages[1]["message"]
    assert stages[1]["labels"] == {"lr": "0.1"}
    assert stages[1]["peak"]["cpu_ram_used_mb"] >= 150
    assert stages[1]["peak"]["cpu_ram_used_mb"] > stages[0]["peak"]["cpu_ram_used_mb"]
    ops = [e["operation"] for e in events(doc, component="stage")]
    assert ops == [
        "load_data/begin",
        "load_data/end",
        "train_small/begin",
        "train_small/end",
        "evaluate/begin",
        "evaluate/end",
    ]


N_MARKS = 2000


def test_four_processes_every_mark_recorded(tmp_path):
    # The workers exit right after their last fire-and-forget send and the
    # job right after them, with no ack as a barrier: every line already
    # accepted by the daemon's socket must still be in the log
    # (docs/protocol.md: "every message that reached the daemon ... is in
    # the log").
    doc, rep, _ = run_job(
        tmp_path,
        """
        N = %d
        memtrack.mark("parent", "before_fork")  # the parent's connection exists before the forks
        r, w = os.pipe()
        kids = []
        for k in range(4):
            pid = os.fork()
            if pid == 0:
                os.close(r)
                for i in range(N):
                    memtrack.mark("worker", "step", iteration=i)
                os.write(w, ("%%d %%d\\n" %% (os.getpid(), memtrack.dropped())).encode())
                os._exit(0)
            kids.append(pid)
        os.close(w)
        for pid in kids:
            os.waitpid(pid, 0)
        lines = os.fdopen(r).read().split()
        report(kids=kids, dropped={lines[i]: int(lines[i + 1]) for i in range(0, len(lines), 2)})
        """
        % N_MARKS,
    )
    # A client drops (and counts) what it cannot hand to a daemon that fell
    # behind; everything it did hand over must be in the log, in order.
    steps = events(doc, component="worker", operation="step")
    dropped = sum(rep["dropped"].values())
    assert len(steps) + dropped == 4 * N_MARKS, (len(steps), rep)
    by_pid = {}
    for e in steps:
        by_pid.setdefault(e["pid"], []).append(e["iteration"])
    assert set(by_pid) <= set(rep["kids"])
    for pid, its in by_pid.items():
        assert its == sorted(set(its)), "in order, no duplicates"
        assert len(its) + rep["dropped"][str(pid)] == N_MARKS
    assert doc["counters"]["protocol_errors"] == 0
    assert doc["counters"]["dropped_events"] == 0


def test_fork_safety(tmp_path):
    doc, rep, _ = run_job(
        tmp_path,
        """
        memtrack.mark("parent", "before_fork", ack=True)
        pid = os.fork()
        who = "child" if pid == 0 else "parent"
        for i in range(500):
            memtrack.mark(who, "step", iteration=i, labels={"pad": "x" * 200})
        entry = memtrack.mark(who, "done", ack=True)
        if pid == 0:
            os._exit(0 if entry and entry["pid"] == os.getpid() else 3)
        _, status = os.waitpid(pid, 0)
        report(parent=os.getpid(), child=pid, child_status=status, entry_pid=entry["pid"])
        """,
    )
    assert rep["child_status"] == 0 and rep["entry_pid"] == rep["parent"]
    parent = events(doc, component="parent")
    child = events(doc, component="child")
    assert len(parent) == 502 and len(child) == 501
    assert {e["pid"] for e in parent} == {rep["parent"]}
    assert {e["pid"] for e in child} == {rep["child"]}
    assert doc["counters"]["protocol_errors"] == 0


def test_thread_safety(tmp_path):
    doc, rep, _ = run_job(
        tmp_path,
        """
        import threading
        def work(t):
            for i in range(500):
                memtrack.mark("thread%d" % t, "step", iteration=i)
        threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
        for t in threads: t.start()
        for t in threads: t.join()
        report(pid=os.getpid(), dropped=memtrack.dropped())
        """,
    )
    recorded = 0
    for t in range(8):
        its = [e["iteration"] for e in events(doc, component="thread%d" % t)]
        assert its == sorted(set(its)), "each thread's marks in order, none garbled"
        recorded += len(its)
    # Drops happen only when the daemon falls behind; they are counted.
    assert recorded + rep["dropped"] == 8 * 500
    assert {e["pid"] for e in events(doc, operation="step")} == {rep["pid"]}
    assert doc["counters"]["protocol_errors"] == 0


def test_cleanup_notice_runs_handlers_and_clear_memory_is_marked(tmp_path):
    doc, rep, _ = run_job(
        tmp_path,
        """
        import subprocess, threading
        sock = os.environ["MEMTRACK_SOCKET"]
        got = threading.Event()
        notices = []
        @memtrack.on_cleanup
        def handler(notice):
            notices.append(notice)
            got.set()
        subscribed = memtrack.wait_subscribed(10)
        cli = subprocess.run([os.environ["MT_BIN"], "cleanup", "--socket", sock],
                             capture_output=True, text=True, timeout=20)
        ran = got.wait(10)
        memtrack.clear_memory("data")
        # Automatic clearing on a cleanup notice (a clear_memory mark by "system").
        memtrack.enable_auto_cleanup("critical")
        notified = memtrack.cleanup()
        deadline = time.time() + 10
        while time.time() < deadline and len(notices) < 2:
            time.sleep(0.02)
        # The automatic clear is marked by "system": wait until memtrack has
        # it (its status lists the component) rather than for a fixed time.
        deadline = time.time() + 20
        while time.time() < deadline and "system" not in (memtrack.status() or {}).get("peaks_by_component", {}):
            time.sleep(0.02)
        report(subscribed=subscribed, cli_rc=cli.returncode, cli_out=cli.stdout + cli.stderr,
               ran=ran, notices=notices, notified=notified, dropped=memtrack.dropped())
        """,
    )
    assert rep["subscribed"], rep
    assert rep["cli_rc"] == 0, rep["cli_out"]
    assert rep["ran"], rep
    assert rep["notices"][0]["type"] == "cleanup"
    assert rep["notified"] == 1
    assert len(rep["notices"]) == 2
    assert len(events(doc, component="data", operation="clear_memory")) == 1
    assert len(events(doc, component="system", operation="clear_memory")) == 1
    assert rep["dropped"] == 0


def test_cuda_oom_is_reported_with_the_memory_summary(tmp_path):
    # A worker (a child of the job) dies of an uncaught CUDA OOM. torch is
    # faked (no GPU here): the hook only looks at an already-imported torch.
    doc, rep, _ = run_job(
        tmp_path,
        '''
        import subprocess
        child = """
        import sys, types, memtrack
        torch = types.ModuleType("torch")
        class OutOfMemoryError(RuntimeError):
            pass
        torch.OutOfMemoryError = OutOfMemoryError
        torch.cuda = types.SimpleNamespace(
            is_initialized=lambda: True, current_device=lambda: 0, OutOfMemoryError=OutOfMemoryError,
            memory_allocated=lambda: 5 << 30, memory_reserved=lambda: 6 << 30, max_memory_allocated=lambda: 6 << 30,
            memory_summary=lambda: "|  PyTorch CUDA memory summary, device ID 0  |\\\\n| Allocated memory | 5.00 GiB |")
        sys.modules["torch"] = torch
        memtrack.install_oom_hook()
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.00 GiB")
        """
        proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True)
        report(child_status=proc.returncode, child_stderr=proc.stderr[-500:])
        ''',
    )
    assert rep["child_status"] == 1, rep
    assert "OutOfMemoryError" in rep["child_stderr"], "Python's own handling still ran"
    oom = events(doc, component="cuda", operation="out_of_memory")
    assert len(oom) == 1
    assert "Tried to allocate 6.00 GiB" in oom[0]["labels"]["error"]
    # The allocator's figures at the error fill the entry's GPU fields.
    assert oom[0]["gpu_source"] == "allocator", oom[0]
    assert oom[0]["gpu_ram_used_mb"] == 5 * 1024
    assert oom[0]["reserved_gpu_ram_mb"] == 6 * 1024
    windows = [w for w in doc.get("flight_recorder", []) if w["reason"] == "cuda_oom"]
    assert len(windows) == 1, doc.get("flight_recorder")
    assert "PyTorch CUDA memory summary" in windows[0]["cuda_summary"]
    assert windows[0]["points"], "the seconds before the OOM"


def test_fast_steps_are_held_back_yet_recorded_when_they_happened(tmp_path):
    # The framework hooks hold back steps that come less than 10 ms apart and
    # send them together; each says how long ago it happened, so the log
    # keeps every step, in order, at its own moment, and a mark sent after
    # them still comes after them.
    doc, rep, _ = run_job(
        tmp_path,
        """
        from memtrack.frameworks import _Steps
        steps = _Steps()
        steps.labels = {"batch_size": "4"}
        began = []
        for i in range(1, 301):
            began.append(time.time())
            steps.begin(i)
            time.sleep(0.002)
            steps.end()
            if i == 150:
                memtrack.mark("eval", "start")
        report(began=began, dropped=memtrack.dropped())
        # The last steps are still held: the client sends them as it exits.
        """,
    )
    assert rep["dropped"] == 0
    log = doc["detailed_log"]
    begins = events(doc, component="train", operation="before_step")
    ends = events(doc, component="train", operation="after_step")
    assert [e["iteration"] for e in begins] == list(range(1, 301))
    assert [e["iteration"] for e in ends] == list(range(1, 301))
    (mark,) = events(doc, component="eval", operation="start")
    assert log.index(ends[149]) < log.index(mark) < log.index(begins[150])
    stamps = [e["timestamp"] for e in begins]
    assert stamps == sorted(stamps)
    # Held back, the steps of one batch arrive together: stamped on arrival
    # they would share one moment. Their gaps are the job's own.
    job_gaps = [b - a for a, b in zip(rep["began"], rep["began"][1:])]
    log_gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    errors = sorted(abs(x - y) for x, y in zip(job_gaps, log_gaps))
    assert errors[len(errors) // 2] < 0.0005, errors[len(errors) // 2]
    assert doc["counters"]["protocol_errors"] == 0


def test_the_embedded_client_loads_without_adding_to_sys_path(tmp_path):
    # With no client installed, `memtrack run` gives the job a copy of it
    # beside its own sitecustomize. The job's sys.path must end up as it would
    # be without memtrack: every import of a missing module (libraries make
    # them on their hot paths) looks in each folder of sys.path. The hooks
    # are installed all the same, in the job and in the processes it starts.
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(
        """\
        import json, os, subprocess, sys
        hooked = "memtrack.hooks" in sys.modules
        import memtrack.frameworks
        child = subprocess.run([sys.executable, "-c",
                                "import sys; print('memtrack.hooks' in sys.modules)"],
                               capture_output=True, text=True, check=True).stdout.strip()
        with open(os.environ["MT_RESULT"], "w") as f:
            json.dump({"path": sys.path, "hooked": hooked, "child": child,
                       "client": os.path.dirname(memtrack.__file__)}, f)
        """))
    result = tmp_path / "result.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMTRACK_") and k != "PYTHONPATH"}
    env["MT_RESULT"] = str(result)
    bare = subprocess.run(["python3", "-c", "import json, sys; print(json.dumps(sys.path))"],
                          cwd=str(tmp_path), env=env, capture_output=True, text=True, check=True)
    proc = subprocess.run([BIN, "run", "--output", str(tmp_path / "out"), "--", "python3", str(script)],
                          cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(result.read_text())
    assert rep["hooked"] and rep["child"] == "True", rep
    assert not rep["client"].startswith(CLIENT_SRC), "the test needs the embedded client"
    # The script's own folder comes first instead of the cwd; the rest is equal.
    assert rep["path"][1:] == json.loads(bare.stdout)[1:], (rep["path"], bare.stdout)
