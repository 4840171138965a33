#!/usr/bin/env python3
"""Strict local stand-in for the ClearML REST API, for memtrack's tests.

It speaks the ClearML REST API as the real server does (server 2.3.0, API up
to 2.34), answers every request the way the real server would, and records
each breach of the rules memtrack must follow in a ``violations`` list so
that a test can assert that memtrack never broke them.

It also serves the ClearML Python SDK (``X-ClearML-Client: clearml-…``):
``Task.init`` → reporting → ``task.close()``. The SDK's requests get the real
server's answers, but the rules written for memtrack (POST only, its
headers, scalar events only, …) are not held against it; what it did is in
``sdk_notes``. For every task the state records who created it
(``task_creators``), who changed its status (``status_log``) and the task's
status when each artifact was registered (``artifact_log``), each naming the
client: ``memtrack`` or ``sdk``.  A second, ADMIN listener reads the state
and injects faults (connection refused, HTTP 5xx/429, expired tokens, partial
event failures, slow replies).  Python 3.8+, standard library only.

    python3 tests/servers/clearml_server.py --port-file ports.json \
        [--host 127.0.0.1] [--port 0] [--admin-port 0] \
        [--access-key K --secret-key S] [--token-ttl SECONDS] \
        [--state-file FILE] [--gzip-min-bytes N] [--verbose]

Once both listeners accept connections the port file holds
``{"api": PORT, "admin": PORT, "pid": PID}`` (written atomically).
See the bottom of this file (``ADMIN_HELP``) for the admin API.
"""

import argparse
import base64
import binascii
import gzip
import hashlib
import hmac
import json
import math
import os
import re
import signal
import socket
import sys
import threading
import time
import uuid
from collections import OrderedDict
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

SERVER_VERSION = "2.3.0"
MIN_API = (2, 1)
MAX_API = (2, 34)
MAX_API_STR = "%d.%d" % MAX_API

DEFAULT_ACCESS_KEY = "memtrack-test-key"
DEFAULT_SECRET_KEY = "memtrack-test-secret"
DEFAULT_TOKEN_TTL = 3600

TASK_TYPES = (
    "training", "testing", "inference", "data_processing", "application",
    "monitor", "controller", "optimizer", "service", "qc", "custom",
)
TASK_STATUSES = (
    "created", "queued", "in_progress", "stopped", "closed", "failed",
    "publishing", "published", "completed",
)
# apiserver/bll/task/utils.py: state_machine (same-status transitions are allowed,
# "force": true skips the check).
STATE_MACHINE = {
    "created": {"queued", "in_progress"},
    "queued": {"created", "in_progress", "stopped"},
    "in_progress": {"stopped", "failed", "created", "completed"},
    "stopped": {"closed", "created", "failed", "queued", "in_progress",
                "published", "publishing", "completed"},
    "closed": {"created", "failed", "published", "publishing", "stopped"},
    "failed": {"created", "stopped", "published", "queued"},
    "publishing": {"published"},
    "published": set(),
    "completed": {"published", "in_progress", "created"},
}
LOCKED_STATUSES = ("publishing", "published")
EVENT_TYPES = ("training_stats_scalar", "training_stats_vector",
               "training_debug_image", "plot", "log")
SCALAR = "training_stats_scalar"
NO_ITERATION_METRICS = (":monitor:machine", ":monitor:gpu")
ARTIFACT_MODES = ("input", "output")
ARTIFACT_FIELDS = ("key", "type", "mode", "uri", "content_size", "hash",
                   "timestamp", "type_data", "display_data")
INDEX_ERROR = "Error when indexing events batch"
MAX_LONG = 2 ** 63 - 1
MAX_CALLS_KEPT = 20000

# endpoint -> minimal API version (apiserver/services/*.py min_version)
ENDPOINT_MIN_VERSION = {
    "tasks.completed": (2, 2),
    "tasks.add_or_update_artifacts": (2, 10),
}
# endpoints callable without a token
NO_AUTH_ENDPOINTS = ("auth.login", "debug.ping")

HTTP_REASONS = {
    400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
    415: "Unsupported Media Type", 429: "Too Many Requests",
    500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable",
    504: "Gateway Timeout",
}


def _now_iso():
    return datetime.now(timezone.utc).isoformat()


def _b64url(data):
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64url_decode(text):
    pad = "=" * (-len(text) % 4)
    return base64.urlsafe_b64decode(text + pad)


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _json_default(obj):
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    return str(obj)


def _dumps(obj):
    return json.dumps(obj, default=_json_default, allow_nan=True)


class ApiError(Exception):
    """An error answered with the ClearML envelope."""

    def __init__(self, code, subcode, msg, error_data=None, violation=None):
        Exception.__init__(self, msg)
        self.code = code
        self.subcode = subcode
        self.msg = msg
        self.error_data = error_data or {}
        # (rule, message) to record, or None when the error is no contract breach
        self.violation = violation


def literal_of_anchored_regex(pattern):
    """Return (ok, literal_or_reason) for a '^<escaped literal>$' pattern."""
    if not isinstance(pattern, str) or len(pattern) < 2:
        return False, "not a '^...$' pattern"
    if not pattern.startswith("^"):
        return False, "pattern is not anchored with '^'"
    if not pattern.endswith("$"):
        return False, "pattern is not anchored with '$'"
    inner = pattern[1:-1]
    out = []
    i = 0
    while i < len(inner):
        c = inner[i]
        if c == "\\":
            if i + 1 >= len(inner):
                return False, "trailing backslash escapes the closing '$'"
            n = inner[i + 1]
            if n.isalnum():
                return False, "escape \\%s is not a literal character" % n
            out.append(n)
            i += 2
            continue
        if c in ".^$*+?()[]{}|":
            return False, "unescaped regex metacharacter %r in the name" % c
        out.append(c)
        i += 1
    return True, "".join(out)


class Fault(object):
    """A counted or timed fault: status or delay."""

    def __init__(self, kind, value, count=None, for_s=None, endpoints=None, **extra):
        self.kind = kind
        self.value = value
        self.remaining = count
        self.deadline = (time.monotonic() + float(for_s)) if for_s is not None else None
        self.endpoints = endpoints
        self.extra = extra
        self.hits = 0

    def expired(self, now):
        if self.remaining is not None and self.remaining <= 0:
            return True
        return self.deadline is not None and now >= self.deadline

    def matches(self, endpoint):
        return not self.endpoints or endpoint in self.endpoints

    def describe(self, now):
        d = {
            "kind": self.kind,
            "status" if self.kind == "status" else "delay_ms": self.value,
            "remaining": self.remaining,
            "remaining_s": (round(max(0.0, self.deadline - now), 3)
                            if self.deadline is not None else None),
            "endpoint": sorted(self.endpoints) if self.endpoints else None,
            "hits": self.hits,
        }
        d.update(self.extra)
        return d


class Ctx(object):
    """One API request as parsed by the handler."""

    def __init__(self):
        self.n = 0
        self.method = "POST"
        self.path = "/"
        self.query = {}
        self.headers = {}
        self.body = b""
        self.endpoint = None          # "service.action" or None
        self.requested_version = MAX_API_STR
        self.version = MAX_API
        self.version_error = None     # ApiError raised before dispatch
        self.content_type = ""
        self.auth_identity = None
        self.client = "unknown"       # "memtrack", "sdk" or "unknown"


class App(object):
    """State, contract enforcement and fault injection (one lock around state)."""

    def __init__(self, args):
        self.args = args
        self.host = args.host
        self.access_key = args.access_key
        self.secret_key = args.secret_key
        self.token_ttl = int(args.token_ttl)
        self.gzip_min = int(args.gzip_min_bytes)
        self.verbose = bool(args.verbose)
        self.state_file = args.state_file
        self.lock = threading.RLock()
        self.listener_lock = threading.RLock()
        self.secret = os.urandom(32)
        self.valid_jtis = set()
        self.blocked_jtis = set()
        self._reset_data()
        self._reset_faults()
        self.api_server = None
        self.api_thread = None
        self.api_port = int(args.port)
        self.admin_port = None
        self.generation = 0
        self.conns = set()
        self.conns_lock = threading.Lock()
        self.refuse_deadline = None
        self.refuse_timer = None
        self.dirty = False
        if self.state_file and os.path.exists(self.state_file):
            self._load_state()

    # ------------------------------------------------------------------ state
    def _reset_data(self):
        self.tasks = OrderedDict()
        self.projects = OrderedDict()
        self.points = OrderedDict()   # (task, iter, metric, variant) -> point
        self.violations = []
        self.sdk_notes = []
        self.task_creators = {}
        self.status_log = []
        self.artifact_log = []
        self.calls = []
        self.logins = 0
        self.login_kinds = {"basic": 0, "bearer": 0}
        self.auth_failures = 0
        self.requests = 0
        self.events_received = 0
        self.resends = 0

    def _reset_faults(self):
        self.status_faults = []
        self.delay_faults = []
        self.partial_errors = 0

    def mark_dirty(self):
        self.dirty = True

    def snapshot(self):
        with self.lock:
            now = time.monotonic()
            return {
                "tasks": {tid: self._task_view(t) for tid, t in self.tasks.items()},
                "projects": {pid: dict(p) for pid, p in self.projects.items()},
                "points": [dict(p) for p in self.points.values()],
                "violations": list(self.violations),
                "sdk_notes": list(self.sdk_notes),
                "task_creators": dict(self.task_creators),
                "status_log": list(self.status_log),
                "artifact_log": list(self.artifact_log),
                "logins": self.logins,
                "login_kinds": dict(self.login_kinds),
                "auth_failures": self.auth_failures,
                "requests": self.requests,
                "events_received": self.events_received,
                "resends": self.resends,
                "tokens_valid": len(self.valid_jtis),
                "faults": self._faults_view(now),
                "ports": {"api": self.api_port, "admin": self.admin_port},
            }

    def _faults_view(self, now):
        self._prune(now)
        return {
            "refusing": self.api_server is None,
            "refuse_remaining_s": (round(max(0.0, self.refuse_deadline - now), 3)
                                   if self.refuse_deadline is not None else None),
            "status": [f.describe(now) for f in self.status_faults],
            "delay": [f.describe(now) for f in self.delay_faults],
            "partial_errors": self.partial_errors,
        }

    def _task_view(self, t):
        v = {k: val for k, val in t.items() if k != "artifacts"}
        v["artifacts"] = sorted((dict(a) for a in t["artifacts"].values()),
                                key=lambda a: (a.get("key", ""), a.get("mode", "")))
        return v

    def _persistable(self):
        return {
            "secret": binascii.hexlify(self.secret).decode("ascii"),
            "valid_jtis": sorted(self.valid_jtis),
            "blocked_jtis": sorted(self.blocked_jtis),
            "tasks": self.tasks,
            "projects": self.projects,
            "points": list(self.points.values()),
            "violations": self.violations,
            "calls": self.calls,
            "logins": self.logins,
            "login_kinds": self.login_kinds,
            "auth_failures": self.auth_failures,
            "requests": self.requests,
            "events_received": self.events_received,
            "resends": self.resends,
        }

    def save_state(self):
        if not self.state_file:
            return
        with self.lock:
            if not self.dirty:
                return
            data = _dumps(self._persistable())
            self.dirty = False
        tmp = "%s.tmp.%d" % (self.state_file, os.getpid())
        with open(tmp, "w") as fh:
            fh.write(data)
        os.replace(tmp, self.state_file)

    def _load_state(self):
        with open(self.state_file) as fh:
            data = json.load(fh)
        with self.lock:
            self.secret = binascii.unhexlify(data.get("secret", "")) or self.secret
            self.valid_jtis = set(data.get("valid_jtis", []))
            self.blocked_jtis = set(data.get("blocked_jtis", []))
            self.tasks = OrderedDict(data.get("tasks", {}))
            self.projects = OrderedDict(data.get("projects", {}))
            self.points = OrderedDict()
            for p in data.get("points", []):
                self.points[(p["task"], p["iter"], p["metric"], p["variant"])] = p
            self.violations = list(data.get("violations", []))
            self.calls = list(data.get("calls", []))
            for k in ("logins", "auth_failures", "requests", "events_received", "resends"):
                setattr(self, k, int(data.get(k, 0)))
            self.login_kinds = dict(data.get("login_kinds", self.login_kinds))

    # -------------------------------------------------------------- violations
    def violate(self, ctx, rule, message):
        with self.lock:
            if ctx is not None and ctx.client == "sdk":
                # The rules are memtrack's; the SDK's requests are only noted.
                self.sdk_notes.append({"rule": rule, "endpoint": ctx.endpoint,
                                       "message": message})
                del self.sdk_notes[:-200]
                self.mark_dirty()
                return
            self.violations.append({
                "n": len(self.violations) + 1,
                "request": ctx.n if ctx else None,
                "time": time.time(),
                "rule": rule,
                "endpoint": ctx.endpoint if ctx else None,
                "path": ctx.path if ctx else None,
                "message": message,
            })
            self.mark_dirty()

    # ------------------------------------------------------------------ tokens
    def issue_token(self, ttl=None):
        now = int(time.time())
        ttl = self.token_ttl if ttl is None else int(ttl)
        jti = uuid.uuid4().hex
        header = {"alg": "HS256", "typ": "JWT"}
        payload = {
            "identity": {
                "company": "memtrack-test-company", "company_name": "memtrack-test",
                "user": "memtrack-test-user", "user_name": "memtrack test",
                "role": "user",
            },
            "env": "test",
            "api_version": MAX_API_STR,
            "server_version": SERVER_VERSION,
            "iat": now,
            "exp": now + ttl,
            "jti": jti,
        }
        signing_input = (_b64url(json.dumps(header, separators=(",", ":")).encode())
                         + "." + _b64url(json.dumps(payload, separators=(",", ":")).encode()))
        sig = hmac.new(self.secret, signing_input.encode("ascii"), hashlib.sha256).digest()
        with self.lock:
            self.valid_jtis.add(jti)
            self.mark_dirty()
        return signing_input + "." + _b64url(sig)

    def check_token(self, token):
        """Return the payload or raise ApiError 401/30 (31 when blocked)."""
        bad = ApiError(401, 30, "Invalid token")
        parts = token.split(".")
        if len(parts) != 3:
            raise bad
        signing_input = (parts[0] + "." + parts[1]).encode("ascii", "replace")
        try:
            sig = _b64url_decode(parts[2])
            payload = json.loads(_b64url_decode(parts[1]).decode("utf-8"))
        except (ValueError, binascii.Error, UnicodeDecodeError):
            raise bad
        good = hmac.new(self.secret, signing_input, hashlib.sha256).digest()
        if not hmac.compare_digest(sig, good) or not isinstance(payload, dict):
            raise bad
        exp = payload.get("exp")
        if not _is_number(exp) or time.time() >= exp:
            raise ApiError(401, 30, "Token expired")
        jti = payload.get("jti")
        with self.lock:
            if jti in self.blocked_jtis:
                raise ApiError(401, 31, "Blocked token")
            if jti not in self.valid_jtis:
                raise ApiError(401, 30, "Invalid token (revoked)")
        return payload

    # ------------------------------------------------------------------ faults
    def _prune(self, now):
        self.status_faults = [f for f in self.status_faults if not f.expired(now)]
        self.delay_faults = [f for f in self.delay_faults if not f.expired(now)]

    def _take(self, faults, endpoint):
        now = time.monotonic()
        self._prune(now)
        for f in faults:
            if f.matches(endpoint):
                if f.remaining is not None:
                    f.remaining -= 1
                f.hits += 1
                return f
        return None

    def take_delay(self, endpoint):
        with self.lock:
            f = self._take(self.delay_faults, endpoint)
            return f.value if f else 0

    def take_status_fault(self, endpoint):
        with self.lock:
            f = self._take(self.status_faults, endpoint)
            if f is None:
                return None
            return {"status": f.value, "retry_after": f.extra.get("retry_after"),
                    "raw": f.extra.get("raw", False), "applied": f.extra.get("applied", False)}

    def take_partial_errors(self):
        with self.lock:
            n = self.partial_errors
            self.partial_errors = 0
            return n

    def apply_fault(self, body):
        """Admin POST /fault. Returns the fault view or raises ValueError."""
        if not isinstance(body, dict):
            raise ValueError("body must be a JSON object")
        known = {"refuse_for_s", "reopen", "status", "count", "for_s", "endpoint",
                 "retry_after", "raw", "applied", "expire_tokens", "block_tokens",
                 "partial_errors", "delay_ms", "publish_task", "set_task_status",
                 "clear"}
        unknown = sorted(set(body) - known)
        if unknown:
            raise ValueError("unknown fault keys: %s" % ", ".join(unknown))
        count = body.get("count")
        for_s = body.get("for_s")
        if count is not None and (not _is_int(count) or count < 0):
            raise ValueError("count must be an integer >= 0")
        if for_s is not None and (not _is_number(for_s) or for_s < 0):
            raise ValueError("for_s must be a number >= 0")
        if count is None and for_s is None:
            count = 1
        endpoints = body.get("endpoint")
        if isinstance(endpoints, str):
            endpoints = {endpoints}
        elif endpoints is not None:
            endpoints = set(endpoints)

        if body.get("clear"):
            with self.lock:
                self._reset_faults()
            self.reopen()
        if body.get("reopen"):
            self.reopen()
        with self.lock:
            if "status" in body:
                status = body["status"]
                if not _is_int(status) or not 100 <= status <= 599:
                    raise ValueError("status must be an HTTP status code")
                self.status_faults.append(Fault(
                    "status", status, count=count, for_s=for_s, endpoints=endpoints,
                    retry_after=body.get("retry_after"), raw=bool(body.get("raw", False)),
                    applied=bool(body.get("applied", False))))
            if "delay_ms" in body:
                d = body["delay_ms"]
                if not _is_number(d) or d < 0:
                    raise ValueError("delay_ms must be a number >= 0")
                self.delay_faults.append(Fault("delay", d, count=count, for_s=for_s,
                                               endpoints=endpoints))
            if body.get("expire_tokens"):
                self.valid_jtis.clear()
                self.mark_dirty()
            if body.get("block_tokens"):
                self.blocked_jtis.update(self.valid_jtis)
                self.mark_dirty()
            if "partial_errors" in body:
                n = body["partial_errors"]
                if not _is_int(n) or n < 0:
                    raise ValueError("partial_errors must be an integer >= 0")
                self.partial_errors = n
            if "publish_task" in body:
                self._admin_set_status(body["publish_task"], "published")
            if "set_task_status" in body:
                sts = body["set_task_status"]
                if not isinstance(sts, dict):
                    raise ValueError('set_task_status must be {"task": ID, "status": S}')
                self._admin_set_status(sts.get("task"), sts.get("status"))
        if "refuse_for_s" in body:
            s = body["refuse_for_s"]
            if not _is_number(s) or s < 0:
                raise ValueError("refuse_for_s must be a number >= 0")
            self.refuse(float(s))
        with self.lock:
            return self._faults_view(time.monotonic())

    def _admin_set_status(self, task_id, status):
        if task_id not in self.tasks:
            raise ValueError("unknown task %r" % (task_id,))
        if status not in TASK_STATUSES:
            raise ValueError("unknown status %r" % (status,))
        t = self.tasks[task_id]
        self.status_log.append({"task": task_id, "from": t["status"], "to": status,
                                "by": "admin", "endpoint": None, "time": _now_iso()})
        t["status"] = status
        t["status_changed"] = t["last_update"] = _now_iso()
        if status == "published":
            t["published"] = t["status_changed"]
        self.mark_dirty()

    def admin_create_task(self, body):
        if not isinstance(body, dict):
            raise ValueError("body must be a JSON object")
        with self.lock:
            project = body.get("project")
            if project is not None and project not in self.projects:
                # a project name: find or create it
                found = [p for p in self.projects.values() if p["name"] == project]
                project = found[0]["id"] if found else self._create_project(project)["id"]
            task = self._create_task(body.get("name", "memtrack test task"),
                                     body.get("type", "training"), project)
            status = body.get("status")
            if status:
                self._admin_set_status(task["id"], status)
            return {"id": task["id"], "project": project}

    def reset(self):
        with self.lock:
            self._reset_data()
            self._reset_faults()
            self.mark_dirty()
        self.reopen()

    # -------------------------------------------------------- listener control
    def register_conn(self, conn):
        with self.conns_lock:
            self.conns.add(conn)

    def unregister_conn(self, conn):
        with self.conns_lock:
            self.conns.discard(conn)

    def start_api(self, port):
        last = None
        for _ in range(200):
            try:
                srv = _ApiServer((self.host, port), ApiHandler, self)
                break
            except OSError as exc:  # port still held by a dying socket
                last = exc
                time.sleep(0.05)
        else:
            raise last
        self.api_server = srv
        self.api_port = srv.server_address[1]
        self.api_thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05},
                                           name="clearml-api", daemon=True)
        self.api_thread.start()

    def refuse(self, seconds):
        with self.listener_lock:
            if self.refuse_timer is not None:
                self.refuse_timer.cancel()
                self.refuse_timer = None
            srv = self.api_server
            if srv is not None:
                self.api_server = None
                self.generation += 1
                srv.shutdown()
                srv.server_close()
                with self.conns_lock:
                    conns = list(self.conns)
                for c in conns:  # drop keep-alive and in-flight connections
                    try:
                        c.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
            self.refuse_deadline = time.monotonic() + seconds
            self.refuse_timer = threading.Timer(seconds, self.reopen)
            self.refuse_timer.daemon = True
            self.refuse_timer.start()

    def reopen(self):
        with self.listener_lock:
            if self.refuse_timer is not None:
                self.refuse_timer.cancel()
                self.refuse_timer = None
            self.refuse_deadline = None
            if self.api_server is None:
                self.start_api(self.api_port)

    def stop(self):
        with self.listener_lock:
            if self.refuse_timer is not None:
                self.refuse_timer.cancel()
            if self.api_server is not None:
                self.api_server.shutdown()
                self.api_server.server_close()
                self.api_server = None

    # ------------------------------------------------------------- API request
    def begin(self, handler, body):
        """Parse the request line/headers; record transport-level violations."""
        ctx = Ctx()
        parts = urlsplit(handler.path)
        ctx.method = handler.command
        ctx.path = parts.path
        ctx.query = parse_qs(parts.query)
        ctx.headers = handler.headers
        ctx.body = body
        ctx.content_type = (handler.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        with self.lock:
            self.requests += 1
            ctx.n = self.requests
            self.mark_dirty()

        m = re.match(r"^/v(\d+)\.(\d+)/([A-Za-z0-9_]+)\.([A-Za-z0-9_]+)/?$", ctx.path)
        if m:
            ctx.version = (int(m.group(1)), int(m.group(2)))
            ctx.requested_version = "%s.%s" % (m.group(1), m.group(2))
            ctx.endpoint = "%s.%s" % (m.group(3), m.group(4))
            if not MIN_API <= ctx.version <= MAX_API:
                ctx.version_error = ApiError(
                    400, 2, "Request path has invalid version",
                    {"version": ctx.requested_version, "max_version": MAX_API_STR},
                    ("version_range", "API version v%s is outside v2.1..v%s"
                     % (ctx.requested_version, MAX_API_STR)))
        else:
            m = re.match(r"^/([A-Za-z0-9_]+)\.([A-Za-z0-9_]+)/?$", ctx.path)
            if m:
                ctx.endpoint = "%s.%s" % (m.group(1), m.group(2))
                if ctx.endpoint not in NO_AUTH_ENDPOINTS:
                    self.violate(ctx, "version_prefix",
                                 "URL %s has no /v{X.Y}/ version prefix (pin one, e.g. /v2.23/)"
                                 % ctx.path)

        client = handler.headers.get("X-ClearML-Client") or ""
        ctx.client = ("memtrack" if client.startswith("memtrack-")
                      else "sdk" if client.startswith("clearml-") else "unknown")
        if ctx.method != "POST":
            self.violate(ctx, "method", "HTTP method %s used; memtrack must POST a JSON body"
                         % ctx.method)
        worker = handler.headers.get("X-ClearML-Worker")
        if not worker or not worker.strip():
            self.violate(ctx, "worker_header", "missing X-ClearML-Worker header")
        client = handler.headers.get("X-ClearML-Client")
        if not client:
            self.violate(ctx, "client_header", "missing X-ClearML-Client header")
        elif not client.startswith("memtrack-"):
            self.violate(ctx, "client_header",
                         "X-ClearML-Client %r does not start with 'memtrack-'" % client)
        return ctx

    def log_call(self, ctx, status, subcode, fault=None):
        with self.lock:
            self.calls.append({
                "n": ctx.n, "time": time.time(), "method": ctx.method, "path": ctx.path,
                "endpoint": ctx.endpoint, "status": status, "subcode": subcode,
                "fault": fault,
            })
            if len(self.calls) > MAX_CALLS_KEPT:
                del self.calls[: len(self.calls) - MAX_CALLS_KEPT]
            self.mark_dirty()

    def envelope(self, ctx, code, subcode, msg, data, error_data=None):
        return {
            "meta": {
                "id": uuid.uuid4().hex,
                "trx": uuid.uuid4().hex,
                "endpoint": {
                    "name": ctx.endpoint or ctx.path.lstrip("/"),
                    "requested_version": ctx.requested_version,
                    "actual_version": ctx.requested_version if ctx.version_error is None
                    else MAX_API_STR,
                },
                "result_code": code,
                "result_subcode": subcode,
                "result_msg": msg,
                "error_stack": None,
                "error_data": error_data or {},
            },
            "data": data if data is not None else {},
        }

    def handle(self, ctx):
        """Return (status, subcode, envelope_dict) for an API request."""
        if "Content-Encoding" in ctx.headers:
            self.violate(ctx, "content_encoding",
                         "request has Content-Encoding: %s; request bodies must not be compressed"
                         % ctx.headers.get("Content-Encoding"))
            return 415, 0, self.envelope(ctx, 415, 0, "Content encoding is not supported", {})
        try:
            data = self._dispatch(ctx)
            return 200, 0, self.envelope(ctx, 200, 0, "OK", data)
        except ApiError as err:
            if err.violation:
                self.violate(ctx, err.violation[0], err.violation[1])
            return err.code, err.subcode, self.envelope(ctx, err.code, err.subcode, err.msg, {},
                                                        err.error_data)

    def _dispatch(self, ctx):
        if ctx.endpoint is None:
            raise ApiError(400, 1, "Endpoint is not supported", {"path": ctx.path},
                           ("unknown_endpoint", "malformed API path %s" % ctx.path))
        if ctx.version_error is not None:
            raise ctx.version_error
        fn = getattr(self, "ep_" + ctx.endpoint.replace(".", "__"), None)
        if fn is None:
            raise ApiError(400, 1, "Endpoint is not supported", {"endpoint": ctx.endpoint},
                           ("unknown_endpoint", "unknown endpoint %s" % ctx.endpoint))
        min_v = ENDPOINT_MIN_VERSION.get(ctx.endpoint)
        if min_v and ctx.version < min_v:
            raise ApiError(400, 1, "Endpoint is not supported in requested version",
                           {"endpoint": ctx.endpoint, "min_version": "%d.%d" % min_v},
                           ("version_range", "%s needs API >= %d.%d, requested %s"
                            % ((ctx.endpoint,) + min_v + (ctx.requested_version,))))
        if ctx.endpoint == "auth.login":
            return self.ep_auth__login(ctx)
        if ctx.endpoint not in NO_AUTH_ENDPOINTS:
            self._authorize(ctx)
        if ctx.endpoint == "events.add_batch":
            return fn(ctx)
        return fn(ctx, self._json_body(ctx))

    # -------------------------------------------------------------- auth
    def _parse_authorization(self, ctx):
        """Return ('basic', (key, secret)) | ('bearer', token); raise 401/20, 401/21."""
        value = ctx.headers.get("Authorization")
        if not value or not value.strip():
            raise ApiError(401, 20, "Unauthorized (missing credentials)", {},
                           ("auth_missing", "no Authorization header on %s" % ctx.endpoint))
        scheme, _, rest = value.strip().partition(" ")
        rest = rest.strip()
        if scheme.lower() == "basic" and rest:
            try:
                decoded = base64.b64decode(rest.encode("ascii"), validate=True).decode("utf-8")
            except (ValueError, binascii.Error, UnicodeError):
                decoded = None
            if decoded is None or ":" not in decoded:
                raise ApiError(401, 21, "Unauthorized (malformed credentials)", {},
                               ("auth_malformed", "Basic credentials are not base64(key:secret)"))
            key, _, secret = decoded.partition(":")
            return "basic", (key, secret)
        if scheme.lower() == "bearer" and rest:
            return "bearer", rest
        raise ApiError(401, 21, "Unauthorized (malformed credentials)", {},
                       ("auth_malformed", "unsupported Authorization header %r" % value[:40]))

    def _check_basic(self, key, secret):
        ok = (hmac.compare_digest(key.encode(), self.access_key.encode())
              and hmac.compare_digest(secret.encode(), self.secret_key.encode()))
        if not ok:
            with self.lock:
                self.auth_failures += 1
                self.mark_dirty()
            raise ApiError(401, 22, "Unauthorized (invalid credentials)")

    def _authorize(self, ctx):
        kind, cred = self._parse_authorization(ctx)
        if kind == "bearer":
            try:
                ctx.auth_identity = self.check_token(cred)
            except ApiError:
                with self.lock:
                    self.auth_failures += 1
                    self.mark_dirty()
                raise
            return
        self._check_basic(*cred)
        self.violate(ctx, "auth_scheme",
                     "Basic credentials sent to %s; log in once and use the Bearer token"
                     % ctx.endpoint)

    def ep_auth__login(self, ctx):
        body = self._json_body(ctx, allow_empty=True)
        kind, cred = self._parse_authorization(ctx)
        if kind == "basic":
            self._check_basic(*cred)
        else:
            try:
                self.check_token(cred)
            except ApiError:
                with self.lock:
                    self.auth_failures += 1
                    self.mark_dirty()
                raise
        exp = None
        if "expiration_sec" in ctx.query:
            raw = ctx.query["expiration_sec"][-1]
            try:
                exp = int(raw)
            except ValueError:
                raise ApiError(400, 12, "Validation error (expiration_sec must be an integer)",
                               {}, ("invalid_request", "expiration_sec=%r" % raw))
        elif "expiration_sec" in body:
            exp = body["expiration_sec"]
            if not _is_int(exp):
                raise ApiError(400, 12, "Validation error (expiration_sec must be an integer)",
                               {}, ("invalid_request", "expiration_sec=%r" % (exp,)))
        if exp is not None and exp <= 0:
            raise ApiError(400, 12, "Validation error (expiration_sec must be positive)", {},
                           ("invalid_request", "expiration_sec=%r" % exp))
        token = self.issue_token(exp)
        with self.lock:
            self.logins += 1
            self.login_kinds[kind] += 1
            self.mark_dirty()
        return {"token": token}

    def ep_debug__ping(self, ctx, body):
        return {"msg": "ClearML server"}

    # -------------------------------------------------------------- body helpers
    def _json_body(self, ctx, allow_empty=False):
        if not ctx.body.strip():
            if not allow_empty:
                self.violate(ctx, "json_body", "%s called without a JSON body" % ctx.endpoint)
            return {}
        if ctx.content_type != "application/json":
            self.violate(ctx, "content_type", "%s body sent as %r, expected application/json"
                         % (ctx.endpoint, ctx.content_type or None))
        try:
            data = json.loads(ctx.body.decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, 12, "Validation error (invalid JSON body)", {"error": str(exc)},
                           ("json_body", "invalid JSON body: %s" % exc))
        if not isinstance(data, dict):
            raise ApiError(400, 12, "Validation error (request body must be a JSON object)", {},
                           ("json_body", "request body is a JSON %s, not an object"
                            % type(data).__name__))
        return data

    @staticmethod
    def _require(body, endpoint, fields):
        missing = [f for f in fields if body.get(f) in (None, "")]
        if missing:
            raise ApiError(400, 11, "Missing required fields", {"missing": missing},
                           ("invalid_request", "%s missing required field(s) %s"
                            % (endpoint, ", ".join(missing))))
        for f in fields:
            if not isinstance(body[f], str):
                raise ApiError(400, 12, "Validation error (%s must be a string)" % f, {},
                               ("invalid_request", "%s.%s must be a string, got %r"
                                % (endpoint, f, body[f])))

    def _task(self, ctx, task_id):
        t = self.tasks.get(task_id)
        if t is None:
            raise ApiError(400, 101, "Invalid task id", {"id": task_id},
                           ("unknown_task", "%s on unknown task id %r" % (ctx.endpoint, task_id)))
        return t

    # -------------------------------------------------------------- projects
    def _create_project(self, name, description=""):
        pid = uuid.uuid4().hex
        now = _now_iso()
        p = {"id": pid, "name": name, "basename": name.rsplit("/", 1)[-1],
             "description": description, "created": now, "last_update": now,
             "tags": [], "system_tags": [], "company": "memtrack-test-company",
             "user": "memtrack-test-user"}
        self.projects[pid] = p
        self.mark_dirty()
        return p

    @staticmethod
    def _only(obj, only_fields):
        if not only_fields:
            return dict(obj)
        out = {"id": obj["id"]}
        for f in only_fields:
            if f in obj:
                out[f] = obj[f]
        return out

    def ep_projects__get_all(self, ctx, body):
        only = body.get("only_fields")
        if only is not None and (not isinstance(only, list)
                                 or not all(isinstance(f, str) for f in only)):
            raise ApiError(400, 12, "Validation error (only_fields must be a list of strings)",
                           {}, ("invalid_request", "only_fields=%r" % (only,)))
        pattern = body.get("name")
        rx = None
        if pattern is not None:
            if not isinstance(pattern, str):
                raise ApiError(400, 12, "Validation error (name must be a string)", {},
                               ("invalid_request", "projects.get_all name=%r" % (pattern,)))
            ok, why = literal_of_anchored_regex(pattern)
            if not ok:
                self.violate(ctx, "project_name_regex",
                             "projects.get_all name %r is not an anchored, escaped literal "
                             "'^<escaped name>$': %s" % (pattern, why))
            try:
                rx = re.compile(pattern)
            except re.error as exc:
                raise ApiError(400, 21, "Malformed regular expression", {"error": str(exc)},
                               ("project_name_regex", "invalid regex %r: %s" % (pattern, exc)))
        ids = body.get("id")
        with self.lock:
            found = [p for p in self.projects.values()
                     if (rx is None or rx.search(p["name"]))
                     and (not ids or p["id"] in ids)]
            return {"projects": [self._only(p, only) for p in found]}

    def ep_projects__get_by_id(self, ctx, body):
        self._require(body, ctx.endpoint, ["project"])
        with self.lock:
            p = self.projects.get(body["project"])
            if p is None:
                raise ApiError(400, 401, "Invalid project id", {"id": body["project"]},
                               ("unknown_project", "unknown project id %r" % body["project"]))
            return {"project": dict(p)}

    def ep_projects__create(self, ctx, body):
        self._require(body, ctx.endpoint, ["name"])
        name = self.tidy_project_name(body["name"])
        self._check_name(ctx, "project", name)
        with self.lock:
            if any(p["name"] == name for p in self.projects.values()):
                raise ApiError(400, 801, "Value combination already exists (unique field already "
                               "contains this value)", {"name": name},
                               ("project_duplicate",
                                "projects.create for existing project %r (look it up first)"
                                % name))
            return {"id": self._create_project(name, body.get("description") or "")["id"]}

    # -------------------------------------------------------------- tasks
    def _create_task(self, name, ttype, project, client="admin", comment="", output_dest=None):
        tid = uuid.uuid4().hex
        now = _now_iso()
        t = {"id": tid, "name": name, "type": ttype, "project": project,
             "status": "created", "status_reason": "", "status_message": "",
             "status_changed": now, "created": now, "started": None, "completed": None,
             "published": None, "last_update": now, "last_iteration": 0,
             "company": "memtrack-test-company", "user": "memtrack-test-user",
             "comment": comment, "tags": [], "system_tags": [], "artifacts": OrderedDict(),
             # The server's Task model defaults its `output` to an empty
             # embedded document; `tasks.create`'s `output_dest` and
             # `tasks.edit`'s `output` set `output.destination`, where the
             # task's artifacts and models go (`Task.init(output_uri=...)`).
             "output": {"destination": output_dest} if output_dest else {}}
        self.tasks[tid] = t
        self.task_creators[tid] = client
        self.mark_dirty()
        return t

    @staticmethod
    def tidy_project_name(name):
        """Project names are stored tidied: parts stripped, '/' runs collapsed."""
        return "/".join(p.strip() for p in name.split("/") if p.strip())

    def _check_name(self, ctx, what, name):
        if len(name.strip()) < 3:
            raise ApiError(400, 800, "Validation error (%s name must be at least 3 characters)"
                           % what, {"name": name},
                           ("name_length", "%s with %s name %r (under 3 characters once "
                            "stripped)" % (ctx.endpoint, what, name)))

    def ep_tasks__create(self, ctx, body):
        self._require(body, ctx.endpoint, ["name", "type"])
        self._check_name(ctx, "task", body["name"])
        if body["type"] not in TASK_TYPES:
            raise ApiError(400, 12, "Validation error (invalid task type %r)" % body["type"],
                           {"type": body["type"], "allowed": list(TASK_TYPES)},
                           ("invalid_request", "tasks.create type %r not in %s"
                            % (body["type"], ", ".join(TASK_TYPES))))
        project = body.get("project")
        if project is None:
            self.violate(ctx, "invalid_request", "tasks.create without a project")
        elif not isinstance(project, str):
            raise ApiError(400, 12, "Validation error (project must be a string)", {},
                           ("invalid_request", "tasks.create project=%r" % (project,)))
        with self.lock:
            if project is not None and project not in self.projects:
                raise ApiError(400, 401, "Invalid project id", {"id": project},
                               ("unknown_project", "tasks.create with unknown project id %r"
                                % project))
            comment = body.get("comment") if isinstance(body.get("comment"), str) else ""
            dest = body.get("output_dest")
            if dest is not None and not isinstance(dest, str):
                raise ApiError(400, 12, "Validation error (output_dest must be a string)", {},
                               ("invalid_request", "tasks.create output_dest=%r" % (dest,)))
            return {"id": self._create_task(body["name"], body["type"], project, ctx.client,
                                            comment, dest)["id"]}

    def _task_public(self, t, only=None):
        v = {k: val for k, val in t.items() if k not in ("artifacts", "execution")}
        v["execution"] = dict(t.get("execution") or {})
        v["execution"]["artifacts"] = self._task_view(t)["artifacts"]
        return self._only(v, only) if only else v

    def ep_tasks__get_by_id(self, ctx, body):
        self._require(body, ctx.endpoint, ["task"])
        with self.lock:
            return {"task": self._task_public(self._task(ctx, body["task"]))}

    def ep_tasks__get_all(self, ctx, body):
        ids = body.get("id")
        names = body.get("name")
        projects = body.get("project")
        only = body.get("only_fields")
        rx = None
        if isinstance(names, str):
            try:
                rx = re.compile(names)
            except re.error as exc:
                raise ApiError(400, 21, "Malformed regular expression", {"error": str(exc)},
                               ("invalid_request", "tasks.get_all name regex %r" % names))
        with self.lock:
            out = []
            for t in self.tasks.values():
                if ids and t["id"] not in ids:
                    continue
                if rx and not rx.search(t["name"]):
                    continue
                if projects and t["project"] not in projects:
                    continue
                out.append(self._task_public(t, only))
            return {"tasks": out}

    def _change_status(self, ctx, body, new_status, **fields):
        self._require(body, ctx.endpoint, ["task"])
        force = bool(body.get("force", False))
        for f in ("status_reason", "status_message"):
            if f in body and not isinstance(body[f], str):
                raise ApiError(400, 12, "Validation error (%s must be a string)" % f, {},
                               ("invalid_request", "%s.%s=%r" % (ctx.endpoint, f, body[f])))
        with self.lock:
            t = self._task(ctx, body["task"])
            cur = t["status"]
            if not force and new_status != cur and new_status not in STATE_MACHINE[cur]:
                raise ApiError(400, 110, "Invalid task status (Invalid status change)",
                               {"current_status": cur, "new_status": new_status},
                               ("task_status", "%s: illegal transition %s -> %s for task %s"
                                % (ctx.endpoint, cur, new_status, t["id"])))
            now = _now_iso()
            self.status_log.append({"task": t["id"], "from": cur, "to": new_status,
                                    "by": ctx.client, "endpoint": ctx.endpoint, "time": now})
            t["status"] = new_status
            t["status_reason"] = body.get("status_reason", "") or ""
            t["status_message"] = body.get("status_message", "") or ""
            t["status_changed"] = t["last_update"] = now
            for k in fields:
                if k == "started" and t.get("started"):
                    continue
                t[k] = now
            self.mark_dirty()
            return {"updated": 1, "fields": {
                "status": new_status, "status_reason": t["status_reason"],
                "status_message": t["status_message"], "status_changed": now,
                "last_update": now}}

    def ep_tasks__started(self, ctx, body):
        res = self._change_status(ctx, body, "in_progress", started=True)
        res["started"] = 1
        return res

    def ep_tasks__completed(self, ctx, body):
        return self._change_status(ctx, body, "completed", completed=True)

    def ep_tasks__stopped(self, ctx, body):
        return self._change_status(ctx, body, "stopped", completed=True)

    def ep_tasks__failed(self, ctx, body):
        return self._change_status(ctx, body, "failed")

    # Fields tasks.edit may change (the SDK stores its script, runtime
    # properties, hyperparameters and configuration this way).
    EDITABLE = ("name", "comment", "tags", "system_tags", "script", "runtime", "execution",
                "hyperparams", "configuration", "container", "models", "output", "parent",
                "type")

    def ep_tasks__edit(self, ctx, body):
        self._require(body, ctx.endpoint, ["task"])
        with self.lock:
            t = self._task(ctx, body["task"])
            if t["status"] != "created" and not body.get("force"):
                raise ApiError(400, 110, "Invalid task status (task is not in created state)",
                               {"status": t["status"]},
                               ("task_status", "tasks.edit on %s task %s without force"
                                % (t["status"], t["id"])))
            if t["status"] in LOCKED_STATUSES:
                raise ApiError(400, 110, "Invalid task status (task is published)",
                               {"status": t["status"]},
                               ("task_status", "tasks.edit on published task %s" % t["id"]))
            fields = {}
            for k, val in body.items():
                if k in self.EDITABLE:
                    if k == "execution" and isinstance(val, dict):
                        val = {a: b for a, b in val.items() if a != "artifacts"}
                    if k == "name":
                        self._check_name(ctx, "task", val if isinstance(val, str) else "")
                    t[k] = val
                    fields[k] = val
            # `output_dest` is stored as `output.destination` (the SDK's
            # `Task.init(output_uri=...)` sends it this way).
            if "output_dest" in body:
                dest = body["output_dest"]
                if dest is not None and not isinstance(dest, str):
                    raise ApiError(400, 12, "Validation error (output_dest must be a string)",
                                   {}, ("invalid_request", "tasks.edit output_dest=%r" % (dest,)))
                out = dict(t.get("output") or {})
                if dest:
                    out["destination"] = dest
                else:
                    out.pop("destination", None)
                t["output"] = out
                fields["output"] = out
            t["last_update"] = _now_iso()
            self.mark_dirty()
        return {"updated": 1, "fields": fields}

    def ep_tasks__set_requirements(self, ctx, body):
        self._require(body, ctx.endpoint, ["task"])
        with self.lock:
            t = self._task(ctx, body["task"])
            t.setdefault("script", {})
            if isinstance(t["script"], dict):
                t["script"]["requirements"] = body.get("requirements") or {}
            t["last_update"] = _now_iso()
            self.mark_dirty()
        return {"updated": 1, "fields": {}}

    def ep_tasks__ping(self, ctx, body):
        self._require(body, ctx.endpoint, ["task"])
        with self.lock:
            t = self._task(ctx, body["task"])
            t["last_update"] = _now_iso()
            self.mark_dirty()
        return {}

    def _validate_artifact(self, ctx, a, i):
        where = "artifacts[%d]" % i

        def bad(msg):
            return ApiError(400, 12, "Validation error (%s: %s)" % (where, msg), {},
                            ("artifact_fields", "%s %s" % (where, msg)))

        if not isinstance(a, dict):
            raise bad("must be an object")
        missing = [f for f in ("key", "type") if a.get(f) in (None, "")]
        if missing:
            raise ApiError(400, 11, "Missing required fields", {"missing": missing},
                           ("artifact_fields", "%s missing %s" % (where, ", ".join(missing))))
        for f in ("key", "type", "mode", "uri", "hash"):
            if f in a and not isinstance(a[f], str):
                raise bad("%s must be a string" % f)
        if a.get("mode", "output") not in ARTIFACT_MODES:
            raise bad("mode must be one of %s" % ", ".join(ARTIFACT_MODES))
        for f in ("content_size", "timestamp"):
            if f in a and not _is_int(a[f]):
                raise bad("%s must be an integer, got %r" % (f, a[f]))
        if "type_data" in a:
            td = a["type_data"]
            if not isinstance(td, dict):
                raise bad("type_data must be an object")
            for f in ("preview", "content_type", "data_hash"):
                if f in td and not isinstance(td[f], str):
                    raise bad("type_data.%s must be a string" % f)
        # accepted by the server, but the contract expects more from memtrack
        notes = []
        for f in ("mode", "uri", "content_size", "hash", "timestamp"):
            if f not in a:
                notes.append("missing %s" % f)
        if not (isinstance(a.get("type_data"), dict) and a["type_data"].get("content_type")):
            notes.append("missing type_data.content_type")
        if _is_int(a.get("content_size")) and a["content_size"] < 0:
            notes.append("negative content_size")
        h = a.get("hash")
        if isinstance(h, str) and not re.match(r"^[0-9a-f]{64}$", h):
            notes.append("hash %r is not a lowercase hex sha256" % h)
        ts = a.get("timestamp")
        if _is_int(ts) and ts >= 10 ** 11:
            notes.append("timestamp %d looks like milliseconds (expected Unix seconds)" % ts)
        unknown = sorted(set(a) - set(ARTIFACT_FIELDS))
        if unknown:
            notes.append("unknown field(s) %s" % ", ".join(unknown))
        for n in notes:
            self.violate(ctx, "artifact_fields", "%s %s" % (where, n))

    def ep_tasks__add_or_update_artifacts(self, ctx, body):
        self._require(body, ctx.endpoint, ["task"])
        arts = body.get("artifacts")
        if not isinstance(arts, list) or not arts:
            raise ApiError(400, 11, "Missing required fields", {"missing": ["artifacts"]},
                           ("artifact_fields", "artifacts must be a non-empty list"))
        for i, a in enumerate(arts):
            self._validate_artifact(ctx, a, i)
        force = bool(body.get("force", False))
        with self.lock:
            t = self._task(ctx, body["task"])
            allowed = ("created", "in_progress") if force else ("created",)
            if t["status"] not in allowed:
                raise ApiError(400, 110, "Invalid task status",
                               {"expected": "created", "status": t["status"]},
                               ("artifact_status",
                                "add_or_update_artifacts refused on %s task %s (force=%s)"
                                % (t["status"], t["id"], force)))
            for a in arts:
                a = dict(a)
                a.setdefault("mode", "output")
                t["artifacts"]["%s|%s" % (a["key"], a["mode"])] = a
                self.artifact_log.append({"task": t["id"], "key": a["key"], "uri": a.get("uri"),
                                          "task_status": t["status"], "by": ctx.client,
                                          "time": _now_iso()})
            t["last_update"] = _now_iso()
            self.mark_dirty()
        return {"updated": 1}

    # -------------------------------------------------------------- events
    def _parse_batch(self, ctx):
        raw = ctx.body
        if ctx.content_type != "application/json-lines":
            self.violate(ctx, "event_content_type",
                         "events.add_batch sent as %r; it must be application/json-lines"
                         % (ctx.content_type or None))
            if not raw.strip():
                raise ApiError(400, 17, "Batch request contains no items", {},
                               ("empty_batch", "events.add_batch with an empty body"))
            try:
                obj = json.loads(raw.decode("utf-8"))
            except (ValueError, UnicodeDecodeError) as exc:
                raise ApiError(400, 12, "Validation error (invalid JSON body)",
                               {"error": str(exc)}, ("json_body", "invalid JSON: %s" % exc))
            if not isinstance(obj, dict):
                raise ApiError(400, 12, "Validation error (request body must be a JSON object, "
                               "got %s)" % type(obj).__name__, {},
                               ("json_body", "events.add_batch body is a JSON %s; send one "
                                "event per line as application/json-lines"
                                % type(obj).__name__))
            # a single object is no batch for the real server
            raise ApiError(400, 17, "Batch request contains no items", {},
                           ("empty_batch", "events.add_batch body was one JSON object, "
                            "not json-lines"))
        events = []
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ApiError(400, 12, "Validation error (body is not UTF-8)", {},
                           ("json_body", "events.add_batch body is not UTF-8: %s" % exc))
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                ev = json.loads(line)
            except ValueError as exc:
                raise ApiError(400, 12, "Validation error (invalid JSON on line %d)" % lineno,
                               {"line": lineno},
                               ("json_body", "add_batch line %d is not JSON: %s" % (lineno, exc)))
            if not isinstance(ev, dict):
                raise ApiError(400, 12, "Validation error (line %d is not an object)" % lineno,
                               {"line": lineno},
                               ("json_body", "add_batch line %d is a JSON %s"
                                % (lineno, type(ev).__name__)))
            events.append(ev)
        if not events:
            raise ApiError(400, 17, "Batch request contains no items", {},
                           ("empty_batch", "events.add_batch with no events"))
        return events

    def ep_events__add_batch(self, ctx):
        events = self._parse_batch(ctx)
        for i, ev in enumerate(events):
            it = ev.get("iter")
            if _is_number(it) and abs(it) > MAX_LONG:
                # The store cannot index it: the whole batch fails.
                raise ApiError(500, 0, "General data error (%s)" % INDEX_ERROR, {},
                               ("event_iter", "event %d iter=%r is beyond the signed 64-bit "
                                "range; the whole batch fails" % (i, it)))
        inject = self.take_partial_errors()
        errors = OrderedDict()

        def err(reason):
            errors[reason] = errors.get(reason, 0) + 1

        added = 0
        with self.lock:
            self.events_received += len(events)
            touched = {}
            for i, ev in enumerate(events):
                tag = "event %d" % i
                if i < inject:
                    err(INDEX_ERROR)
                    continue
                etype = ev.get("type")
                if etype is None:
                    err("Event must have a 'type' field")
                    self.violate(ctx, "event_type", "%s has no 'type'" % tag)
                    continue
                if not isinstance(etype, str) or etype.replace(" ", "_") not in EVENT_TYPES:
                    err("Invalid event type %s" % (etype,))
                    self.violate(ctx, "event_type", "%s has invalid type %r" % (tag, etype))
                    continue
                if etype != SCALAR:
                    self.violate(ctx, "event_type", "%s has type %r; memtrack sends only %s"
                                 % (tag, etype, SCALAR))
                model_event = ev.get("model_event", False)
                if not isinstance(model_event, bool):
                    self.violate(ctx, "event_model_event",
                                 "%s model_event=%r is not a boolean" % (tag, model_event))
                    model_event = bool(model_event)
                task_id = ev.get("task")
                if task_id is None:
                    err("Event must have a 'task' field")
                    self.violate(ctx, "event_task", "%s has no 'task'" % tag)
                    continue
                if model_event:
                    err("Invalid model id %s" % (task_id,))
                    self.violate(ctx, "event_model_event",
                                 "%s is a model event (model_event=true); memtrack reports "
                                 "task scalars" % tag)
                    continue
                t = self.tasks.get(task_id) if isinstance(task_id, str) else None
                if t is None or t["status"] in LOCKED_STATUSES:
                    err("Invalid task id %s" % (task_id,))
                    if t is None:
                        self.violate(ctx, "event_task", "%s for unknown task id %r"
                                     % (tag, task_id))
                    continue
                metric, variant = ev.get("metric"), ev.get("variant")
                for name, val in (("metric", metric), ("variant", variant)):
                    if not isinstance(val, str) or not val:
                        self.violate(ctx, "event_metric", "%s %s=%r must be a non-empty string"
                                     % (tag, name, val))
                metric = metric if isinstance(metric, str) else ("" if metric is None else str(metric))
                variant = variant if isinstance(variant, str) else ("" if variant is None else str(variant))
                value = ev.get("value")
                if etype == SCALAR and (not _is_number(value) or not math.isfinite(value)):
                    err(INDEX_ERROR)
                    self.violate(ctx, "event_value", "%s %s/%s value=%r is not a finite number"
                                 % (tag, metric, variant, value))
                    continue
                it = ev.get("iter")
                if it is None:
                    self.violate(ctx, "event_iter", "%s %s/%s has no 'iter'" % (tag, metric, variant))
                else:
                    if not _is_int(it):
                        self.violate(ctx, "event_iter", "%s %s/%s iter=%r is not an integer"
                                     % (tag, metric, variant, it))
                        try:
                            it = int(it)
                        except (TypeError, ValueError):
                            err(INDEX_ERROR)
                            continue
                    if abs(it) > MAX_LONG:  # refused before the loop; kept for safety
                        err(INDEX_ERROR)
                        continue
                    if it < 0:
                        self.violate(ctx, "event_iter", "%s %s/%s iter=%d is negative"
                                     % (tag, metric, variant, it))
                ts = ev.get("timestamp")
                if ts is None:
                    self.violate(ctx, "event_timestamp", "%s %s/%s has no 'timestamp'"
                                 % (tag, metric, variant))
                    ts = int(time.time() * 1000)
                elif not _is_number(ts):
                    self.violate(ctx, "event_timestamp", "%s timestamp=%r is not a number"
                                 % (tag, ts))
                else:
                    if not _is_int(ts):
                        self.violate(ctx, "event_timestamp",
                                     "%s timestamp=%r is a float; send integer Unix milliseconds"
                                     % (tag, ts))
                    if ts < 10 ** 11:
                        self.violate(ctx, "event_timestamp",
                                     "%s timestamp=%r looks like seconds; send Unix milliseconds"
                                     % (tag, ts))
                    elif ts >= 10 ** 14:
                        self.violate(ctx, "event_timestamp",
                                     "%s timestamp=%r is beyond Unix milliseconds (micro/nanos?)"
                                     % (tag, ts))
                    if _is_number(ts) and math.isfinite(ts):
                        ts = int(ts)
                added += 1
                if etype != SCALAR:
                    continue
                key = (task_id, it, metric, variant)
                point = {"task": task_id, "metric": metric, "variant": variant, "iter": it,
                         "value": value, "timestamp": ts, "model_event": False,
                         "request": ctx.n}
                old = self.points.get(key)
                if old is None:
                    self.points[key] = point
                elif old["value"] == value and old["timestamp"] == ts:
                    self.resends += 1  # an identical resend (a retry) is harmless
                else:
                    self.violate(ctx, "duplicate_point",
                                 "%s repeats (task=%s, iter=%r, %s/%s): first value %r at %r, "
                                 "now %r at %r; the real server would overwrite the first point"
                                 % (tag, task_id, it, metric, variant, old["value"],
                                    old["timestamp"], value, ts))
                touched.setdefault(task_id, None)
                if it is not None and metric not in NO_ITERATION_METRICS:
                    cur = touched[task_id]
                    touched[task_id] = it if cur is None else max(cur, it)
            now = _now_iso()
            for task_id, it in touched.items():
                t = self.tasks[task_id]
                t["last_update"] = now
                if it is not None and it > t["last_iteration"]:
                    t["last_iteration"] = it
            self.mark_dirty()
        if not added:
            raise ApiError(400, 131, "Events not added", dict(errors))
        return {"added": added, "errors": sum(errors.values()), "errors_info": dict(errors)}


# ---------------------------------------------------------------- HTTP plumbing
class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, addr, handler, app):
        self.app = app
        ThreadingHTTPServer.__init__(self, addr, handler)

    def handle_error(self, request, client_address):
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, OSError)):
            return  # dropped connections are part of the fault model
        ThreadingHTTPServer.handle_error(self, request, client_address)


class _ApiServer(_QuietServer):
    pass


class _AdminServer(_QuietServer):
    pass


class _BaseHandler(BaseHTTPRequestHandler):
    server_version = "clearml-strict-test/" + SERVER_VERSION
    sys_version = ""

    def version_string(self):
        return self.server_version

    def log_message(self, fmt, *args):
        if self.server.app.verbose:
            sys.stderr.write("[%s] %s\n" % (type(self).__name__, fmt % args))

    def _read_body(self):
        te = (self.headers.get("Transfer-Encoding") or "").lower()
        if "chunked" in te:
            chunks = []
            while True:
                line = self.rfile.readline(65537)
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline(65537)
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def _send(self, status, body, content_type="application/json", headers=None):
        extra = dict(headers or {})
        accept = (self.headers.get("Accept-Encoding") or "").lower()
        if body and self._accepts_gzip(accept) and len(body) >= self.server.app.gzip_min:
            body = gzip.compress(body)
            extra["Content-Encoding"] = "gzip"
            extra["Vary"] = "Accept-Encoding"
        self.send_response(status, HTTP_REASONS.get(status))
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in extra.items():
            self.send_header(k, str(v))
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()

    @staticmethod
    def _accepts_gzip(accept):
        for item in accept.split(","):
            name, _, params = item.strip().partition(";")
            if name.strip() in ("gzip", "*"):
                q = re.search(r"q\s*=\s*([0-9.]+)", params)
                return not (q and float(q.group(1)) == 0)
        return False


class ApiHandler(_BaseHandler):
    protocol_version = "HTTP/1.1"

    def setup(self):
        _BaseHandler.setup(self)
        self.app = self.server.app
        self.gen = self.app.generation
        self.app.register_conn(self.connection)

    def finish(self):
        try:
            _BaseHandler.finish(self)
        finally:
            self.app.unregister_conn(self.connection)

    def _handle(self):
        app = self.app
        try:
            body = self._read_body()
        except (ValueError, OSError):
            self.close_connection = True
            return
        ctx = app.begin(self, body)
        delay = app.take_delay(ctx.endpoint or ctx.path)
        if delay:
            time.sleep(delay / 1000.0)
        if app.generation != self.gen:  # the listener was closed meanwhile: drop it
            app.log_call(ctx, None, None, "dropped")
            self.close_connection = True
            return
        fault = app.take_status_fault(ctx.endpoint or ctx.path)
        if fault is not None and fault["applied"]:
            # A gateway that gave up while the server did the work: the
            # request takes effect, the client sees only the fault.
            app.handle(ctx)
        if fault is not None:
            status = fault["status"]
            headers = {}
            if fault["retry_after"] is not None:
                headers["Retry-After"] = fault["retry_after"]
            reason = HTTP_REASONS.get(status, "Error")
            if fault["raw"]:
                html = ("<html>\r\n<head><title>%d %s</title></head>\r\n<body>\r\n<center><h1>"
                        "%d %s</h1></center>\r\n<hr><center>nginx</center>\r\n</body>\r\n"
                        "</html>\r\n" % (status, reason, status, reason)).encode()
                app.log_call(ctx, status, None, "status")
                self._send(status, html, "text/html", headers)
                return
            env = app.envelope(ctx, status, 0, "%s (injected fault)" % reason, {})
            app.log_call(ctx, status, 0, "status")
            self._send(status, _dumps(env).encode(), headers=headers)
            return
        status, subcode, env = app.handle(ctx)
        app.log_call(ctx, status, subcode)
        if app.generation != self.gen:
            self.close_connection = True
            return
        self._send(status, _dumps(env).encode())

    do_POST = do_GET = do_PUT = do_DELETE = do_PATCH = _handle


class AdminHandler(_BaseHandler):
    protocol_version = "HTTP/1.0"

    def _json(self, status, obj):
        self._send(status, json.dumps(obj, default=_json_default).encode())

    def _body(self):
        raw = self._read_body()
        if not raw.strip():
            return {}
        return json.loads(raw.decode("utf-8"))

    def do_GET(self):
        app = self.server.app
        path = urlsplit(self.path).path.rstrip("/") or "/"
        q = parse_qs(urlsplit(self.path).query)
        if path == "/state":
            self._json(200, app.snapshot())
        elif path == "/violations":
            with app.lock:
                self._json(200, {"violations": list(app.violations)})
        elif path == "/points":
            with app.lock:
                pts = [dict(p) for p in app.points.values()
                       if "task" not in q or p["task"] in q["task"]]
            self._json(200, {"points": pts})
        elif path == "/calls":
            with app.lock:
                self._json(200, {"calls": list(app.calls)})
        elif path in ("/healthz", "/"):
            self._json(200, {"ok": True, "api": app.api_port, "admin": app.admin_port,
                             "pid": os.getpid(), "help": ADMIN_HELP})
        else:
            self._json(404, {"error": "unknown admin path %s" % path})

    def do_POST(self):
        app = self.server.app
        path = urlsplit(self.path).path.rstrip("/")
        try:
            body = self._body()
            if path == "/fault":
                self._json(200, {"ok": True, "faults": app.apply_fault(body)})
            elif path == "/reset":
                app.reset()
                self._json(200, {"ok": True})
            elif path in ("/task", "/tasks"):
                self._json(200, dict(ok=True, **app.admin_create_task(body)))
            elif path == "/token":
                exp = body.get("expiration_sec") if isinstance(body, dict) else None
                self._json(200, {"ok": True, "token": app.issue_token(exp)})
            else:
                self._json(404, {"ok": False, "error": "unknown admin path %s" % path})
        except ValueError as exc:
            self._json(400, {"ok": False, "error": str(exc)})
        finally:
            if app.state_file:
                app.save_state()


ADMIN_HELP = {
    "GET /state": "tasks, projects, points, violations, logins, requests, faults, ...",
    "GET /violations": "{violations: [...]}",
    "GET /points?task=ID": "{points: [...]}",
    "GET /calls": "{calls: [{n, method, path, endpoint, status, subcode, fault}]}",
    "POST /fault": "refuse_for_s | reopen | status+count/for_s[+endpoint,retry_after,raw] | "
                   "[+applied: the request takes effect first] | "
                   "expire_tokens | block_tokens | partial_errors | delay_ms+count/for_s"
                   "[+endpoint] | publish_task | set_task_status | clear",
    "POST /reset": "clear all state and faults",
    "POST /task": "{name, project (name or id), type, status} -> {id, project}",
    "POST /token": "{expiration_sec} -> {token}",
}


def _write_port_file(path, data):
    tmp = "%s.tmp.%d" % (path, os.getpid())
    with open(tmp, "w") as fh:
        json.dump(data, fh)
    os.replace(tmp, path)


def main(argv=None):
    ap = argparse.ArgumentParser(description="Strict local ClearML API server for memtrack tests")
    ap.add_argument("--port-file", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="API port (0 = ephemeral)")
    ap.add_argument("--admin-port", type=int, default=0, help="admin port (0 = ephemeral)")
    ap.add_argument("--access-key", default=DEFAULT_ACCESS_KEY)
    ap.add_argument("--secret-key", default=DEFAULT_SECRET_KEY)
    ap.add_argument("--token-ttl", type=int, default=DEFAULT_TOKEN_TTL,
                    help="token lifetime in seconds when auth.login gets no expiration_sec")
    ap.add_argument("--state-file", default=None,
                    help="load state from FILE at start, save it there as it changes")
    ap.add_argument("--gzip-min-bytes", type=int, default=0,
                    help="gzip responses of at least this size when the client accepts gzip")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)

    app = App(args)
    app.start_api(args.port)
    admin = _AdminServer((args.host, args.admin_port), AdminHandler, app)
    app.admin_port = admin.server_address[1]
    threading.Thread(target=admin.serve_forever, kwargs={"poll_interval": 0.1},
                     name="clearml-admin", daemon=True).start()

    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    _write_port_file(args.port_file, {"api": app.api_port, "admin": app.admin_port,
                                      "pid": os.getpid()})
    if args.verbose:
        sys.stderr.write("clearml test server: api=%d admin=%d\n" % (app.api_port, app.admin_port))
    while not stop.wait(0.2):
        if app.state_file:
            try:
                app.save_state()
            except OSError as exc:
                sys.stderr.write("state save failed: %s\n" % exc)
    if app.state_file:
        app.dirty = True
        app.save_state()
    app.stop()
    admin.shutdown()
    admin.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
