#!/usr/bin/env python3
"""What a memtrack mark costs the job, measured against the floor.

    python3 bench/client_mark.py                      # drain server + no daemon
    python3 bench/client_mark.py --daemon-bin target/debug/memtrack
    python3 bench/client_mark.py --daemon-bin target/release/memtrack --output docs/client-cost.md
    MEMTRACK_SOCKET=/path/to/daemon.sock python3 bench/client_mark.py

Prints a Markdown table (with --output, also writes it into that file,
which clients/python/README.md quotes):

- fire-and-forget ``mark()`` per call (median of several runs of N marks)
  against the floor measured in the same run: ``json.dumps(the same
  message) + sock.send()`` on a connected Unix stream socket, both sending to
  a drain server (a separate process that reads and discards). Goal ≤ 2×.
- ``mark()`` with no daemon (nothing at the socket path). Goal ≤ 5 µs.
- ``mark()`` with MEMTRACK_DISABLE=1.
- with a daemon (``--daemon-bin`` starts ``memtrack attach --pid <this
  process>``; or ``--socket``/``$MEMTRACK_SOCKET``): ``mark(ack=True)``
  round trip p50/p99, and fire-and-forget ``mark()`` per call.
"""

import argparse
import datetime
import json
import os
import platform
import selectors
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "clients", "python", "src"))

import memtrack  # noqa: E402

COMPONENT, OPERATION = "model", "before_generate"


def drain_server(path):
    """Fork a process that accepts connections on ``path`` and discards all
    it reads; returns (pid, a pipe that yields the line count at the end)."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(64)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        sel = selectors.DefaultSelector()
        sel.register(srv, selectors.EVENT_READ)
        lines = 0
        try:
            while True:
                for key, _ in sel.select():
                    if key.fileobj is srv:
                        conn, _ = srv.accept()
                        sel.register(conn, selectors.EVENT_READ)
                        continue
                    data = key.fileobj.recv(1 << 20)
                    if not data:
                        sel.unregister(key.fileobj)
                        key.fileobj.close()
                        if len(sel.get_map()) == 1:  # only the listener: done
                            os.write(w, str(lines).encode())
                            os._exit(0)
                    lines += data.count(b"\n")
        finally:
            os._exit(1)
    os.close(w)
    srv.close()
    return pid, r


def per_call_us(fn, n):
    t0 = time.perf_counter()
    fn(n)
    return (time.perf_counter() - t0) / n * 1e6


def fmt(us):
    return "%.2f µs" % us if us < 100 else "%.0f µs" % us


def bench_drain(tmp, n, runs):
    path = os.path.join(tmp, "drain.sock")
    pid, done = drain_server(path)
    floor_sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    floor_sock.connect(path)
    client = memtrack.Client(path, disabled=False)
    msg = {"type": "mark", "component": COMPONENT, "operation": OPERATION, "iteration": 0}
    dumps, send = json.dumps, floor_sock.send

    def floor(n):
        for i in range(n):
            msg["iteration"] = i
            send((dumps(msg) + "\n").encode())

    def marks(n):
        mark = client.mark
        for i in range(n):
            mark(COMPONENT, OPERATION, iteration=i)

    marks(1000)  # connect, warm up
    floor(1000)
    floors, costs = [], []
    for _ in range(runs):
        floors.append(per_call_us(floor, n))
        costs.append(per_call_us(marks, n))
    client.close()
    floor_sock.close()
    received = int(os.read(done, 64) or b"0")
    os.waitpid(pid, 0)
    sent = (n * runs + 1000) * 2
    return statistics.median(floors), statistics.median(costs), client.dropped(), received, sent


def bench_no_daemon(tmp, n, runs):
    client = memtrack.Client(os.path.join(tmp, "nobody.sock"), disabled=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")

        def marks(n):
            mark = client.mark
            for i in range(n):
                mark(COMPONENT, OPERATION, iteration=i)

        marks(100)
        return statistics.median(per_call_us(marks, n) for _ in range(runs))


def bench_disabled(tmp, n, runs):
    client = memtrack.Client(os.path.join(tmp, "x.sock"), disabled=True)

    def marks(n):
        mark = client.mark
        for i in range(n):
            mark(COMPONENT, OPERATION, iteration=i)

    return statistics.median(per_call_us(marks, n) for _ in range(runs))


def start_daemon(binary, tmp):
    path = os.path.join(tmp, "daemon.sock")
    cmd = [binary, "attach", "--pid", str(os.getpid()), "--socket", path, "--output", os.path.join(tmp, "out")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMTRACK_")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 10
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            err = proc.stderr.read().decode(errors="replace") if proc.poll() is not None else "timeout"
            proc.kill()
            raise SystemExit("could not start %s: %s" % (" ".join(cmd), err))
        time.sleep(0.02)
    return proc, path


def bench_daemon(path, n_ack, n, runs):
    client = memtrack.Client(path, timeout=5.0, disabled=False)
    if client.mark("bench", "warmup", ack=True) is None:
        raise SystemExit("no daemon answers at %s" % path)
    rtt = []
    for i in range(n_ack):
        t0 = time.perf_counter()
        entry = client.mark("bench", "ack", iteration=i, ack=True)
        rtt.append((time.perf_counter() - t0) * 1e6)
        if entry is None:
            raise SystemExit("ack %d timed out" % i)
    rtt.sort()
    p50 = rtt[len(rtt) // 2]
    p99 = rtt[min(len(rtt) - 1, int(len(rtt) * 0.99))]

    def marks(n):
        mark = client.mark
        for i in range(n):
            mark(COMPONENT, OPERATION, iteration=i)

    costs = []
    for _ in range(runs):
        costs.append(per_call_us(marks, n))
        client.mark("bench", "barrier", ack=True)  # let the daemon catch up between runs
    dropped = client.dropped()
    client.close()
    return p50, p99, statistics.median(costs), dropped


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=20000, help="marks per run (default 20000)")
    parser.add_argument("--runs", type=int, default=7, help="runs; the median is reported (default 7)")
    parser.add_argument("--acks", type=int, default=2000, help="ack round trips (default 2000)")
    parser.add_argument("--daemon-bin", help="start `memtrack attach` from this binary for the daemon rows")
    parser.add_argument("--socket", default=os.environ.get("MEMTRACK_SOCKET"), help="a running daemon's socket")
    parser.add_argument("--output", help="also write the table into this Markdown file (docs/client-cost.md)")
    args = parser.parse_args()

    tmp = tempfile.mkdtemp(prefix="mtbench-", dir="/tmp")
    daemon = None
    try:
        floor, cost, dropped, received, sent = bench_drain(tmp, args.n, args.runs)
        none = bench_no_daemon(tmp, args.n, args.runs)
        off = bench_disabled(tmp, args.n, args.runs)
        path = args.socket
        if args.daemon_bin:
            daemon, path = start_daemon(args.daemon_bin, tmp)
        d = bench_daemon(path, args.acks, args.n, args.runs) if path else None
    finally:
        if daemon is not None:
            daemon.send_signal(signal.SIGINT)
            try:
                daemon.wait(10)
            except subprocess.TimeoutExpired:
                daemon.kill()
        shutil.rmtree(tmp, ignore_errors=True)

    out = []
    out.append(
        "memtrack client %s, Python %s on %s (%d CPUs); median of %d runs of %d marks; "
        "drain server got %d of %d lines, client dropped %d\n"
        % (
            memtrack.__version__,
            platform.python_version(),
            platform.machine(),
            os.cpu_count() or 0,
            args.runs,
            args.n,
            received,
            sent,
            dropped,
        )
    )
    out.append("| call | per call | floor | ratio | goal |")
    out.append("|---|---|---|---|---|")
    out.append(
        "| `mark()` fire-and-forget, drain server | %s | %s (`json.dumps` + `send`) | %.2f× | ≤ 2× |"
        % (fmt(cost), fmt(floor), cost / floor)
    )
    out.append("| `mark()`, no daemon | %s | | | ≤ 5 µs |" % fmt(none))
    out.append("| `mark()`, `MEMTRACK_DISABLE=1` | %s | | | |" % fmt(off))
    if d:
        p50, p99, daemon_cost, daemon_dropped = d
        out.append("| `mark(ack=True)` round trip, daemon | p50 %s, p99 %s | | | |" % (fmt(p50), fmt(p99)))
        out.append(
            "| `mark()` fire-and-forget, daemon | %s (%d dropped) | %s | %.2f× | |"
            % (fmt(daemon_cost), daemon_dropped, fmt(floor), daemon_cost / floor)
        )
    else:
        out.append("| `mark(ack=True)` round trip, daemon | skipped: no `--daemon-bin` or `--socket` | | | |")
    text = "\n".join(out)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write("# What a mark costs the job\n\n")
            try:
                with open("/proc/loadavg") as la:
                    load = la.read().split()[0]
            except OSError:
                load = "unknown"
            f.write("Generated by `bench/client_mark.py` on %s (`python3 bench/client_mark.py%s --output %s`; "
                    "1-minute load average at the end: %s, other work included). "
                    "Do not edit by hand: rerun the script.\n\n" % (
                        datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                        " --daemon-bin " + args.daemon_bin if args.daemon_bin else "", args.output, load))
            f.write(text + "\n")


if __name__ == "__main__":
    main()
