"""Shared helpers: the client on sys.path, short socket paths, and a fake
daemon (a Python Unix listener that records lines) for unit tests."""

import json
import os
import selectors
import shutil
import socket
import struct
import sys
import tempfile
import threading
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
CLIENT_SRC = os.path.normpath(os.path.join(HERE, "..", "src"))
REPO = os.path.normpath(os.path.join(HERE, "..", "..", ".."))
if CLIENT_SRC not in sys.path:
    sys.path.insert(0, CLIENT_SRC)


@pytest.fixture
def sockdir():
    """A short directory for sockets (AF_UNIX paths are limited to 107
    bytes, which pytest's tmp_path can exceed)."""
    d = tempfile.mkdtemp(prefix="mt-", dir="/tmp")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("MEMTRACK_SOCKET", "MEMTRACK_TIMEOUT", "MEMTRACK_DISABLE"):
        monkeypatch.delenv(name, raising=False)


def peer_pid(conn):
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[0]


class FakeDaemon:
    """Records every line per connection (with the peer's pid), answers ack
    messages / status / cleanup / subscribe like docs/protocol.md, and can
    push notices to subscribers. ``reading=False`` accepts but never reads
    (a stuck daemon) until ``resume()``.

    ``responder(obj, pid)`` may return a reply dict (or a list of raw lines
    to send) instead of the default one."""

    def __init__(self, path, reading=True, responder=None, read_size=1 << 16, read_delay=0.0):
        self.path = path
        self.responder = responder
        self.read_size = read_size
        self.read_delay = read_delay
        self.lines = []  # (pid, conn_no, raw bytes)
        self.garbled = []
        self.subscribers = []
        self.conns = 0
        self.closed_with_partial = 0
        self._reading = threading.Event()
        if reading:
            self._reading.set()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._srv.bind(path)
        self._srv.listen(128)
        self._accepted = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    # -- inspection ----------------------------------------------------------

    def objects(self):
        with self._lock:
            out = []
            for pid, conn_no, raw in self.lines:
                obj = json.loads(raw)
                obj["_pid"] = pid
                obj["_conn"] = conn_no
                out.append(obj)
            return out

    def wait_lines(self, n, timeout=5.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if len(self.lines) >= n:
                    return True
            time.sleep(0.01)
        return False

    def wait_subscribers(self, n=1, timeout=5.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if len(self.subscribers) >= n:
                    return True
            time.sleep(0.01)
        return False

    def settle(self, quiet=0.2, timeout=10.0):
        """Wait until no new line arrived for ``quiet`` seconds."""
        deadline = time.monotonic() + timeout
        last = -1
        while time.monotonic() < deadline:
            with self._lock:
                n = len(self.lines)
            if n == last:
                return n
            last = n
            time.sleep(quiet)
        return last

    # -- control ---------------------------------------------------------------

    def resume(self):
        self._reading.set()

    def push(self, notice):
        data = (json.dumps(notice) + "\n").encode()
        with self._lock:
            subs = list(self.subscribers)
        for conn in subs:
            try:
                conn.sendall(data)
            except OSError:
                pass

    def close(self):
        self._stop.set()
        self._reading.set()
        self._thread.join(5)
        for conn in self._accepted:
            try:
                conn.close()
            except OSError:
                pass
        try:
            self._srv.close()
        except OSError:
            pass
        try:
            os.unlink(self.path)
        except OSError:
            pass

    # -- the server thread -----------------------------------------------------

    def _reply(self, conn, obj, pid):
        if self.responder is not None:
            custom = self.responder(obj, pid)
            if custom is not None:
                lines = custom if isinstance(custom, list) else [custom]
                for item in lines:
                    raw = item if isinstance(item, bytes) else (json.dumps(item) + "\n").encode()
                    conn.sendall(raw)
                return
        kind = obj.get("type", "mark")
        reply = None
        if kind == "subscribe":
            reply = {"ok": True, "type": "subscribed"}
            with self._lock:
                self.subscribers.append(conn)
        elif kind == "status":
            reply = {"ok": True, "type": "status", "processes": 1, "counters": {}}
        elif kind == "cleanup":
            with self._lock:
                n = len(self.subscribers)
            reply = {"ok": True, "type": "cleanup", "notified": n}
            self.push({"type": "cleanup", "reason": "socket", "timestamp": time.time()})
        elif obj.get("ack"):
            entry = {
                "component": obj.get("component", "stage"),
                "operation": obj.get("operation", obj.get("name")),
                "cpu_ram_used_mb": 12.5,
                "pid": pid,
                "kind": "event",
            }
            reply = {"ok": True, "type": "recorded", "entry": entry}
        if reply is not None:
            if "id" in obj:
                reply["id"] = obj["id"]
            conn.sendall((json.dumps(reply) + "\n").encode())

    def _run(self):
        sel = selectors.DefaultSelector()
        sel.register(self._srv, selectors.EVENT_READ, None)
        state = {}
        while not self._stop.is_set():
            for key, _ in sel.select(0.05):
                if key.data is None:
                    conn, _ = self._srv.accept()
                    self._accepted.append(conn)
                    with self._lock:
                        self.conns += 1
                        conn_no = self.conns
                    state[conn] = [peer_pid(conn), conn_no, b""]
                    sel.register(conn, selectors.EVENT_READ, conn_no)
                    continue
                if not self._reading.is_set():
                    time.sleep(0.01)
                    continue
                conn = key.fileobj
                try:
                    data = conn.recv(self.read_size)
                except OSError:
                    data = b""
                st = state[conn]
                if not data:
                    if st[2]:
                        self.closed_with_partial += 1
                    sel.unregister(conn)
                    conn.close()
                    with self._lock:
                        if conn in self.subscribers:
                            self.subscribers.remove(conn)
                    continue
                st[2] += data
                while True:
                    cut = st[2].find(b"\n")
                    if cut < 0:
                        break
                    raw, st[2] = st[2][:cut], st[2][cut + 1 :]
                    try:
                        obj = json.loads(raw)
                    except ValueError:
                        with self._lock:
                            self.garbled.append(raw)
                        continue
                    with self._lock:
                        self.lines.append((st[0], st[1], raw))
                    try:
                        self._reply(conn, obj, st[0])
                    except OSError:
                        pass
                if self.read_delay:
                    time.sleep(self.read_delay)
        sel.close()


@pytest.fixture
def fake(sockdir):
    daemons = []

    def start(**kw):
        d = FakeDaemon(os.path.join(sockdir, "d.sock"), **kw)
        daemons.append(d)
        return d

    yield start
    for d in daemons:
        d.close()
