"""Self-tests for tests/servers/clearml_server.py (the strict ClearML stand-in).

Run: python3 -m pytest -q tests/servers/test_clearml_server.py
"""

import base64
import gzip
import http.client
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SERVER = os.path.join(HERE, "clearml_server.py")
KEY, SECRET = "memtrack-test-key", "memtrack-test-secret"
HEADERS = {"X-ClearML-Worker": "test-host", "X-ClearML-Client": "memtrack-0.1.0"}


def start_server(tmp_path, *extra):
    port_file = str(tmp_path / ("ports-%d.json" % time.monotonic_ns()))
    proc = subprocess.Popen([sys.executable, SERVER, "--port-file", port_file] + list(extra),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if os.path.exists(port_file):
            with open(port_file) as fh:
                return proc, json.load(fh)
        if proc.poll() is not None:
            raise RuntimeError("server exited: %s" % proc.stderr.read().decode())
        time.sleep(0.02)
    proc.kill()
    raise RuntimeError("server did not write its port file")


def wait_until(what, cond, timeout=5.0):
    """Polls `cond` until it holds; fails naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting for " + what
        time.sleep(0.01)


def stop_server(proc):
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Client(object):
    def __init__(self, ports):
        self.api = ports["api"]
        self.admin_port = ports["admin"]
        self.token = None

    # ---- API
    def raw(self, path, body=b"", method="POST", headers=None, timeout=5):
        req = urllib.request.Request("http://127.0.0.1:%d%s" % (self.api, path),
                                     data=body if method != "GET" or body else None,
                                     method=method)
        for k, v in (headers or {}).items():
            if v is not None:
                req.add_header(k, v)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, dict(resp.headers), resp.read()
        except urllib.error.HTTPError as err:
            return err.code, dict(err.headers), err.read()

    def call(self, endpoint, body=None, version="2.23", token="default", auth=None,
             content_type="application/json", headers=None, method="POST", query="",
             data=None):
        path = ("/v%s/%s" % (version, endpoint) if version else "/" + endpoint) + query
        h = dict(HEADERS)
        h["Content-Type"] = content_type
        if auth is not None:
            h["Authorization"] = auth
        elif token == "default" and self.token:
            h["Authorization"] = "Bearer " + self.token
        elif token not in ("default", None):
            h["Authorization"] = "Bearer " + token
        h.update(headers or {})
        if data is None:
            data = json.dumps(body if body is not None else {}).encode()
        status, rh, raw = self.raw(path, data, method=method, headers=h)
        if rh.get("Content-Encoding") == "gzip":
            raw = gzip.decompress(raw)
        env = json.loads(raw.decode()) if raw and raw[:1] == b"{" else raw
        if isinstance(env, dict):
            assert env["meta"]["result_code"] == status, env
        return status, env, rh

    def ok(self, endpoint, body=None, **kw):
        status, env, _ = self.call(endpoint, body, **kw)
        assert status == 200, env
        return env["data"]

    def login(self, **kw):
        auth = "Basic " + base64.b64encode(("%s:%s" % (KEY, SECRET)).encode()).decode()
        status, env, _ = self.call("auth.login", version=None, auth=auth, data=b"", **kw)
        assert status == 200, env
        self.token = env["data"]["token"]
        return self.token

    def batch(self, events, content_type="application/json-lines"):
        data = "\n".join(json.dumps(e) for e in events).encode()
        return self.call("events.add_batch", content_type=content_type, data=data)

    # ---- admin
    def admin(self, path, body=None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request("http://127.0.0.1:%d%s" % (self.admin_port, path),
                                     data=data, method="GET" if body is None else "POST")
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                return json.loads(resp.read().decode())
        except urllib.error.HTTPError as err:
            return json.loads(err.read().decode())

    def state(self):
        return self.admin("/state")

    def fault(self, **kw):
        res = self.admin("/fault", kw)
        assert res.get("ok"), res
        return res

    def rules(self):
        return [v["rule"] for v in self.state()["violations"]]

    # ---- helpers
    def new_task(self, status=None):
        pid = self.ok("projects.create", {"name": "proj-%d" % time.monotonic_ns()})["id"]
        tid = self.ok("tasks.create", {"name": "task", "type": "training", "project": pid})["id"]
        if status == "in_progress":
            self.ok("tasks.started", {"task": tid})
        return tid


def scalar(task, it, value=1.0, metric="memory/model", variant="gpu_ram_used_mb", ts=None):
    return {"type": "training_stats_scalar", "task": task, "metric": metric, "variant": variant,
            "value": value, "iter": it, "timestamp": ts or 1733000000000 + it,
            "model_event": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc, ports = start_server(tmp_path_factory.mktemp("clearml"))
    yield proc, ports
    stop_server(proc)


@pytest.fixture
def c(server):
    client = Client(server[1])
    client.admin("/reset", {})
    client.login()
    client.admin("/reset", {})  # start each test with zero counters
    return client


# ------------------------------------------------------------------ basics
def test_port_file_and_envelope(server, c):
    proc, ports = server
    assert ports["pid"] == proc.pid and ports["api"] != ports["admin"]
    status, env, _ = c.call("tasks.get_all", {})
    assert status == 200
    meta = env["meta"]
    for k in ("id", "trx", "endpoint", "result_code", "result_subcode", "result_msg",
              "error_stack", "error_data"):
        assert k in meta
    assert meta["endpoint"] == {"name": "tasks.get_all", "requested_version": "2.23",
                                "actual_version": "2.23"}
    assert env["data"] == {"tasks": []}
    s = c.state()
    assert s["requests"] == 1 and s["violations"] == []


def test_login_ok_bad_missing_malformed(c):
    tok = c.login()
    header, payload, sig = tok.split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    assert {"exp", "iat", "identity"} <= set(claims) and claims["exp"] > time.time()
    assert json.loads(base64.urlsafe_b64decode(header + "==="))["alg"] == "HS256"

    bad = "Basic " + base64.b64encode(b"memtrack-test-key:wrong").decode()
    status, env, _ = c.call("auth.login", version=None, auth=bad, data=b"")
    assert (status, env["meta"]["result_subcode"]) == (401, 22)
    status, env, _ = c.call("auth.login", version=None, token=None, data=b"")
    assert (status, env["meta"]["result_subcode"]) == (401, 20)
    status, env, _ = c.call("auth.login", version=None, auth="Basic !!notbase64", data=b"")
    assert (status, env["meta"]["result_subcode"]) == (401, 21)
    s = c.state()
    assert s["logins"] == 1 and s["auth_failures"] == 1
    assert [v["rule"] for v in s["violations"]] == ["auth_missing", "auth_malformed"]


def test_login_expiration_and_bearer_refresh(c):
    tok = c.login(query="?expiration_sec=120")
    claims = json.loads(base64.urlsafe_b64decode(tok.split(".")[1] + "==="))
    assert claims["exp"] - claims["iat"] == 120
    status, env, _ = c.call("auth.login", version=None, token=tok, data=b"")
    assert status == 200 and env["data"]["token"] != tok
    s = c.state()
    assert s["logins"] == 2 and s["login_kinds"] == {"basic": 1, "bearer": 1}
    assert s["violations"] == []


def test_token_expires(c):
    tok = c.login(query="?expiration_sec=1")
    exp = json.loads(base64.urlsafe_b64decode(tok.split(".")[1] + "==="))["exp"]
    time.sleep(max(0.0, exp - time.time()) + 0.05)
    status, env, _ = c.call("tasks.get_all", {})
    assert (status, env["meta"]["result_subcode"]) == (401, 30)
    assert c.rules() == []  # an expired token is no contract violation


def test_bearer_required(c):
    status, env, _ = c.call("tasks.get_all", {}, token=None)
    assert (status, env["meta"]["result_subcode"]) == (401, 20)
    status, env, _ = c.call("tasks.get_all", {}, token="abc.def.ghi")
    assert (status, env["meta"]["result_subcode"]) == (401, 30)
    basic = "Basic " + base64.b64encode(("%s:%s" % (KEY, SECRET)).encode()).decode()
    status, env, _ = c.call("tasks.get_all", {}, auth=basic)
    assert status == 200  # the real server accepts it, but memtrack must use the token
    assert c.rules() == ["auth_missing", "auth_scheme"]


def test_version_prefix(c):
    assert c.ok("tasks.get_all", {}, version=None) == {"tasks": []}
    assert c.rules() == ["version_prefix"]
    status, env, _ = c.call("tasks.get_all", {}, version="2.99")
    assert (status, env["meta"]["result_subcode"]) == (400, 2)
    status, env, _ = c.call("tasks.add_or_update_artifacts", {"task": "x", "artifacts": []},
                            version="2.5")
    assert (status, env["meta"]["result_subcode"]) == (400, 1)
    assert c.rules() == ["version_prefix", "version_range", "version_range"]
    c.login()  # auth.login without a prefix is fine
    assert len(c.rules()) == 3


def test_headers_method_content_type_and_unknown_endpoint(c):
    c.ok("tasks.get_all", {}, headers={"X-ClearML-Worker": None, "X-ClearML-Client": None})
    c.ok("tasks.get_all", {}, headers={"X-ClearML-Client": "python-requests/2"})
    c.ok("tasks.get_all", {}, method="PUT")
    c.ok("tasks.get_all", {}, content_type="text/plain")
    status, env, _ = c.call("tasks.frobnicate", {})
    assert (status, env["meta"]["result_subcode"]) == (400, 1)
    status, env, _ = c.call("tasks.get_all", data=b"[1,2]")
    assert (status, env["meta"]["result_subcode"]) == (400, 12)
    assert c.rules() == ["worker_header", "client_header", "client_header", "method",
                         "content_type", "unknown_endpoint", "json_body"]


def test_content_encoding_is_415(c):
    status, env, _ = c.call("tasks.get_all", data=gzip.compress(b"{}"),
                            headers={"Content-Encoding": "gzip"})
    assert status == 415 and env["meta"]["result_code"] == 415
    assert c.rules() == ["content_encoding"]


def test_gzip_responses(c):
    status, headers, raw = c.raw("/v2.23/tasks.get_all", b"{}", headers=dict(
        HEADERS, **{"Content-Type": "application/json", "Authorization": "Bearer " + c.token,
                    "Accept-Encoding": "gzip, deflate"}))
    assert status == 200 and headers["Content-Encoding"] == "gzip"
    assert json.loads(gzip.decompress(raw))["data"] == {"tasks": []}
    status, headers, raw = c.raw("/v2.23/tasks.get_all", b"{}", headers=dict(
        HEADERS, **{"Content-Type": "application/json", "Authorization": "Bearer " + c.token}))
    assert "Content-Encoding" not in headers and json.loads(raw)["meta"]["result_code"] == 200


# ------------------------------------------------------------------ projects/tasks
def test_projects_lookup_and_create(c):
    pid = c.ok("projects.create", {"name": "memtrack/run.1"})["id"]
    found = c.ok("projects.get_all", {"name": "^memtrack/run\\.1$", "only_fields": ["id"]})
    assert found == {"projects": [{"id": pid}]}
    assert c.rules() == []
    c.ok("projects.get_all", {"name": "memtrack/run\\.1"})      # not anchored
    c.ok("projects.get_all", {"name": "^memtrack/run.1$"})      # '.' not escaped
    status, env, _ = c.call("projects.create", {"name": "memtrack/run.1"})
    assert (status, env["meta"]["result_subcode"]) == (400, 801)
    assert c.rules() == ["project_name_regex", "project_name_regex", "project_duplicate"]


def test_task_create_and_get(c):
    pid = c.ok("projects.create", {"name": "proj"})["id"]
    status, env, _ = c.call("tasks.create", {"name": "task", "type": "bogus", "project": pid})
    assert (status, env["meta"]["result_subcode"]) == (400, 12)
    tid = c.ok("tasks.create", {"name": "task", "type": "monitor", "project": pid})["id"]
    task = c.ok("tasks.get_by_id", {"task": tid})["task"]
    assert (task["status"], task["name"], task["project"], task["last_iteration"]) == \
        ("created", "task", pid, 0)
    status, env, _ = c.call("tasks.get_by_id", {"task": "nope"})
    assert (status, env["meta"]["result_subcode"]) == (400, 101)
    assert c.rules() == ["invalid_request", "unknown_task"]


def test_status_transitions(c):
    tid = c.new_task()
    for ep in ("tasks.completed", "tasks.stopped", "tasks.failed"):
        status, env, _ = c.call(ep, {"task": tid})   # not legal from 'created'
        assert (status, env["meta"]["result_subcode"]) == (400, 110), ep
    c.ok("tasks.started", {"task": tid})
    c.ok("tasks.ping", {"task": tid})
    c.ok("tasks.completed", {"task": tid, "status_reason": "completed"})
    task = c.ok("tasks.get_by_id", {"task": tid})["task"]
    assert task["status"] == "completed" and task["status_reason"] == "completed"
    status, env, _ = c.call("tasks.failed", {"task": tid})
    assert (status, env["meta"]["result_subcode"]) == (400, 110)
    assert c.rules() == ["task_status"] * 4
    t2 = c.new_task("in_progress")
    c.ok("tasks.stopped", {"task": t2})
    c.ok("tasks.failed", {"task": t2})   # stopped -> failed is legal
    t3 = c.new_task()
    c.ok("tasks.stopped", {"task": t3, "force": True})   # force skips the state machine
    c.fault(publish_task=t2)
    status, env, _ = c.call("tasks.started", {"task": t2})
    assert (status, env["meta"]["result_subcode"]) == (400, 110)
    st = c.state()["tasks"]
    assert (st[tid]["status"], st[t2]["status"], st[t3]["status"]) == \
        ("completed", "published", "stopped")


def test_artifacts(c):
    tid = c.new_task("in_progress")
    art = {"key": "memory_usage", "type": "custom", "mode": "output",
           "uri": "s3://bucket/p/run/artifacts/memory_usage/memory_usage.json",
           "content_size": 1234, "hash": "ab" * 32, "timestamp": 1733000000,
           "type_data": {"content_type": "application/json"}}
    status, env, _ = c.call("tasks.add_or_update_artifacts", {"task": tid, "artifacts": [art]})
    assert (status, env["meta"]["result_subcode"]) == (400, 110)  # in_progress needs force
    c.ok("tasks.add_or_update_artifacts", {"task": tid, "force": True, "artifacts": [art]})
    art2 = dict(art, content_size=999)
    c.ok("tasks.add_or_update_artifacts", {"task": tid, "force": True, "artifacts": [art2]})
    arts = c.ok("tasks.get_by_id", {"task": tid})["task"]["execution"]["artifacts"]
    assert len(arts) == 1 and arts[0]["content_size"] == 999   # matched by (key, mode)
    status, env, _ = c.call("tasks.add_or_update_artifacts", {
        "task": tid, "force": True, "artifacts": [dict(art, content_size="1k")]})
    assert (status, env["meta"]["result_subcode"]) == (400, 12)
    c.ok("tasks.add_or_update_artifacts", {"task": tid, "force": True,
                                           "artifacts": [dict(art, timestamp=1733000000000)]})
    c.ok("tasks.completed", {"task": tid})
    status, env, _ = c.call("tasks.add_or_update_artifacts",
                            {"task": tid, "force": True, "artifacts": [art]})
    assert (status, env["meta"]["result_subcode"]) == (400, 110)
    assert c.rules() == ["artifact_status", "artifact_fields", "artifact_fields",
                         "artifact_status"]
    assert c.state()["tasks"][tid]["artifacts"][0]["key"] == "memory_usage"


# ------------------------------------------------------------------ events
def test_events_json_lines_accepted(c):
    tid = c.new_task("in_progress")
    status, env, _ = c.batch([scalar(tid, 3), scalar(tid, 7, variant="cpu_ram_used_mb"),
                              scalar(tid, 50, metric=":monitor:gpu", variant="gpu_0")])
    assert status == 200
    assert env["data"] == {"added": 3, "errors": 0, "errors_info": {}}
    s = c.state()
    assert s["violations"] == [] and len(s["points"]) == 3
    assert s["tasks"][tid]["last_iteration"] == 7   # :monitor:* titles do not move it
    p = s["points"][0]
    assert (p["task"], p["metric"], p["variant"], p["iter"], p["value"]) == \
        (tid, "memory/model", "gpu_ram_used_mb", 3, 1.0)


def test_events_plain_json_rejected(c):
    tid = c.new_task("in_progress")
    status, env, _ = c.call("events.add_batch", [scalar(tid, 1)])  # a JSON array
    assert status == 400 and env["meta"]["result_subcode"] == 12
    status, env, _ = c.call("events.add_batch", scalar(tid, 1))    # one object
    assert (status, env["meta"]["result_subcode"]) == (400, 17)
    status, env, _ = c.batch([])                                   # empty json-lines
    assert (status, env["meta"]["result_subcode"]) == (400, 17)
    assert c.rules() == ["event_content_type", "json_body", "event_content_type",
                         "empty_batch", "empty_batch"]
    assert c.state()["points"] == []


def test_events_non_finite_values(c):
    tid = c.new_task("in_progress")
    data = (json.dumps(scalar(tid, 1)) + "\n" + json.dumps(scalar(tid, 2, value=None)) + "\n"
            + json.dumps(scalar(tid, 3, value=float("nan")))).encode()   # NaN literal
    status, env, _ = c.call("events.add_batch", content_type="application/json-lines", data=data)
    assert status == 200
    assert env["data"]["added"] == 1 and env["data"]["errors"] == 2
    assert sum(env["data"]["errors_info"].values()) == 2
    status, env, _ = c.batch([scalar(tid, 4, value="inf"), scalar(tid, 5, value=None)])
    assert (status, env["meta"]["result_subcode"]) == (400, 131)
    assert sum(env["meta"]["error_data"].values()) == 2
    assert c.rules() == ["event_value"] * 4
    assert [p["iter"] for p in c.state()["points"]] == [1]


def test_events_timestamp_and_iter_checks(c):
    tid = c.new_task("in_progress")
    status, env, _ = c.batch([scalar(tid, 1, ts=1733000000),            # seconds
                              scalar(tid, 2, ts=1733000000000.5),       # float
                              dict(scalar(tid, 0), iter=None)])          # no iter
    assert status == 200 and env["data"]["added"] == 3
    assert c.rules() == ["event_timestamp", "event_timestamp", "event_iter"]


def test_duplicate_iter_flagged(c):
    tid = c.new_task("in_progress")
    c.batch([scalar(tid, 5, value=10.0)])
    status, env, _ = c.batch([scalar(tid, 5, value=20.0, ts=1733000009999)])
    assert status == 200 and env["data"]["added"] == 1    # the real server overwrites
    s = c.state()
    assert [v["rule"] for v in s["violations"]] == ["duplicate_point"]
    assert [p["value"] for p in s["points"]] == [10.0]     # the first value is kept
    c.batch([scalar(tid, 5, value=10.0)])                  # identical resend (a retry)
    s = c.state()
    assert len(s["violations"]) == 1 and s["resends"] == 1


def test_events_for_published_and_unknown_tasks(c):
    tid = c.new_task("in_progress")
    c.fault(publish_task=tid)
    status, env, _ = c.batch([scalar(tid, 1)])
    assert (status, env["meta"]["result_subcode"]) == (400, 131)
    assert env["meta"]["error_data"] == {"Invalid task id %s" % tid: 1}
    assert c.rules() == []          # memtrack cannot know: no violation
    status, env, _ = c.batch([scalar("no-such-task", 1)])
    assert status == 400 and c.rules() == ["event_task"]


# ------------------------------------------------------------------ faults
def test_fault_refuse_then_reopen_same_port(c):
    port = c.api
    keep = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    keep.request("POST", "/v2.23/tasks.get_all", body=b"{}", headers=dict(
        HEADERS, **{"Content-Type": "application/json", "Authorization": "Bearer " + c.token}))
    assert keep.getresponse().read()
    c.fault(refuse_for_s=1.0)
    assert c.state()["faults"]["refusing"] is True
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    with pytest.raises((http.client.HTTPException, OSError)):   # keep-alive conn was dropped
        keep.request("POST", "/v2.23/tasks.get_all", body=b"{}", headers=HEADERS)
        keep.getresponse().read()
    keep.close()
    deadline = time.monotonic() + 5
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
            break
        except ConnectionRefusedError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert c.ok("tasks.get_all", {}) == {"tasks": []}
    assert c.state()["faults"]["refusing"] is False
    c.fault(refuse_for_s=30)
    c.fault(reopen=True)            # ends a refusal early
    assert c.ok("tasks.get_all", {}) == {"tasks": []}


def test_fault_status_count_and_for_s(c):
    c.fault(status=503, count=2)
    for _ in range(2):
        status, env, _ = c.call("tasks.get_all", {})
        assert status == 503 and env["meta"]["result_code"] == 503
    assert c.call("tasks.get_all", {})[0] == 200
    c.fault(status=429, count=1, retry_after=2, endpoint="events.add_batch")
    assert c.call("tasks.get_all", {})[0] == 200     # other endpoints unaffected
    status, env, headers = c.batch([scalar("x", 1)])
    assert status == 429 and headers["Retry-After"] == "2"
    c.fault(status=502, for_s=0.8, raw=True)
    status, body, headers = c.call("tasks.get_all", {})
    assert status == 502 and headers["Content-Type"] == "text/html"
    assert b"502 Bad Gateway" in body
    wait_until("the timed fault to end", lambda: c.state()["faults"]["status"] == [])
    assert c.call("tasks.get_all", {})[0] == 200
    calls = c.admin("/calls")["calls"]
    assert [x["status"] for x in calls] == [503, 503, 200, 200, 429, 502, 200]


def test_fault_expire_tokens_then_relogin(c):
    c.fault(expire_tokens=True)
    status, env, _ = c.call("tasks.get_all", {})
    assert (status, env["meta"]["result_subcode"]) == (401, 30)
    status, env, _ = c.call("auth.login", version=None, data=b"")   # bearer refresh: also dead
    assert (status, env["meta"]["result_subcode"]) == (401, 30)
    c.login()
    assert c.ok("tasks.get_all", {}) == {"tasks": []}
    c.fault(block_tokens=True)
    status, env, _ = c.call("tasks.get_all", {})
    assert (status, env["meta"]["result_subcode"]) == (401, 31)
    assert c.state()["logins"] == 1 and c.rules() == []


def test_fault_partial_errors(c):
    tid = c.new_task("in_progress")
    c.fault(partial_errors=2)
    status, env, _ = c.batch([scalar(tid, 1), scalar(tid, 2), scalar(tid, 3)])
    assert status == 200
    assert env["data"]["added"] == 1 and env["data"]["errors"] == 2
    assert list(env["data"]["errors_info"].values()) == [2]
    assert [p["iter"] for p in c.state()["points"]] == [3]
    status, env, _ = c.batch([scalar(tid, 1), scalar(tid, 2)])   # one batch only
    assert env["data"] == {"added": 2, "errors": 0, "errors_info": {}}
    assert c.rules() == []


def test_fault_delay(c):
    c.fault(delay_ms=500, count=1)
    t0 = time.monotonic()
    assert c.call("tasks.get_all", {})[0] == 200
    assert time.monotonic() - t0 >= 0.5
    assert c.state()["faults"]["delay"] == []       # count=1 is used up
    t0 = time.monotonic()
    assert c.call("tasks.get_all", {})[0] == 200
    assert time.monotonic() - t0 < 0.45


def test_fault_refuse_drops_requests_in_flight(c):
    import threading
    c.fault(delay_ms=700, count=1, endpoint="tasks.create")
    pid = c.ok("projects.create", {"name": "proj"})["id"]
    outcome = {}

    def slow():
        try:
            outcome["res"] = c.call("tasks.create", {"name": "task", "type": "training",
                                                     "project": pid})
        except Exception as exc:  # noqa: BLE001 - any connection error is the point
            outcome["exc"] = exc

    th = threading.Thread(target=slow)
    th.start()
    # In flight: its handler took the delay and sleeps.
    wait_until("the request to take its delay", lambda: c.state()["faults"]["delay"] == [])
    c.fault(refuse_for_s=0.2)
    th.join(5)
    assert "exc" in outcome, outcome          # no reply for the request in flight
    # The delayed handler wakes up and drops it; the refusal ends.
    wait_until("the request to be dropped",
               lambda: any(x["fault"] == "dropped" for x in c.admin("/calls")["calls"]))
    wait_until("the refusal to end", lambda: c.state()["faults"]["refusing"] is False)
    s = c.state()
    assert s["tasks"] == {}                   # and it was never processed
    assert s["faults"]["refusing"] is False
    assert [x["fault"] for x in c.admin("/calls")["calls"]] == [None, "dropped"]


def test_fault_clear_and_reset(c):
    tid = c.new_task()
    c.fault(status=500, count=5, delay_ms=10)
    c.fault(partial_errors=3)
    f = c.state()["faults"]
    assert len(f["status"]) == 1 and len(f["delay"]) == 1 and f["partial_errors"] == 3
    c.fault(clear=True)
    f = c.state()["faults"]
    assert f["status"] == [] and f["delay"] == [] and f["partial_errors"] == 0
    assert c.call("tasks.get_all", {})[0] == 200
    assert c.admin("/fault", {"bogus": 1})["ok"] is False
    c.admin("/reset", {})
    s = c.state()
    assert s["tasks"] == {} and s["requests"] == 0 and tid not in s["tasks"]
    assert c.call("tasks.get_all", {})[0] == 200    # tokens survive a reset


def test_admin_task_and_token(c):
    res = c.admin("/task", {"name": "agent task", "project": "agents", "status": "in_progress"})
    tid = res["id"]
    token = c.admin("/token", {"expiration_sec": 60})["token"]
    task = c.ok("tasks.get_by_id", {"task": tid}, token=token)["task"]
    assert task["status"] == "in_progress" and task["project"] == res["project"]
    assert c.ok("projects.get_all", {"name": "^agents$"})["projects"][0]["id"] == res["project"]


def test_state_file_survives_restart(tmp_path):
    state = str(tmp_path / "state.json")
    proc, ports = start_server(tmp_path, "--state-file", state)
    try:
        cl = Client(ports)
        cl.login()
        tid = cl.new_task("in_progress")
        cl.batch([scalar(tid, 1)])
    finally:
        stop_server(proc)
    proc, ports = start_server(tmp_path, "--state-file", state)
    try:
        cl2 = Client(ports)
        cl2.token = cl.token          # the token is still valid after a restart
        assert cl2.ok("tasks.get_by_id", {"task": tid})["task"]["last_iteration"] == 1
        assert len(cl2.state()["points"]) == 1
    finally:
        stop_server(proc)


# ------------------------------------------------------- server rules, the SDK
def test_short_names_are_refused_and_project_names_tidied(c):
    status, env, _ = c.call("projects.create", {"name": "  ab "})
    assert (status, env["meta"]["result_subcode"]) == (400, 800)
    pid = c.ok("projects.create", {"name": " team / mem//x "})["id"]
    assert c.state()["projects"][pid]["name"] == "team/mem/x"
    found = c.ok("projects.get_all", {"name": "^team/mem/x$", "only_fields": ["id"]})
    assert found == {"projects": [{"id": pid}]}
    status, env, _ = c.call("projects.create", {"name": "team/mem/ x"})   # the same, tidied
    assert (status, env["meta"]["result_subcode"]) == (400, 801)
    status, env, _ = c.call("tasks.create", {"name": " t ", "type": "training", "project": pid})
    assert (status, env["meta"]["result_subcode"]) == (400, 800)
    assert c.rules() == ["name_length", "project_duplicate", "name_length"]


def test_an_iteration_beyond_i64_fails_the_whole_batch(c):
    tid = c.new_task("in_progress")
    status, env, _ = c.batch([scalar(tid, 1), scalar(tid, 2 ** 63)])
    assert status == 500
    assert c.state()["points"] == []
    assert c.rules() == ["event_iter"]
    c.batch([scalar(tid, 2 ** 63 - 1)])
    assert [p["iter"] for p in c.state()["points"]] == [2 ** 63 - 1]


def test_an_applied_fault_takes_effect_behind_the_error(c):
    pid = c.ok("projects.create", {"name": "proj"})["id"]
    c.fault(status=504, count=1, endpoint="tasks.create", applied=True)
    status, _, _ = c.call("tasks.create", {"name": "task", "type": "training", "project": pid})
    assert status == 504
    assert len(c.state()["tasks"]) == 1    # created all the same


def test_sdk_requests_are_served_and_attributed(c):
    sdk = {"X-ClearML-Client": "clearml-2.1.12"}
    pid = c.ok("projects.create", {"name": "proj"}, headers=sdk, method="GET")["id"]
    tid = c.ok("tasks.create", {"name": "job", "type": "training", "project": pid},
               headers=sdk)["id"]
    c.ok("tasks.edit", {"task": tid, "force": True, "script": {"entry_point": "job.py"},
                        "runtime": {"progress": "0"}}, headers=sdk)
    c.ok("tasks.set_requirements", {"task": tid, "requirements": {"pip": "x"}}, headers=sdk)
    c.ok("tasks.started", {"task": tid}, headers=sdk)
    log = {"type": "log", "task": tid, "msg": "hello", "level": "info",
           "timestamp": 1733000000000}
    status, env, _ = c.batch([log, scalar(tid, 3, metric="loss", variant="train")])
    assert status == 200 and env["data"]["added"] == 2
    art = {"key": "memory_usage", "type": "custom", "mode": "output", "uri": "s3://b/k",
           "content_size": 1, "hash": "ab" * 32, "timestamp": 1733000000,
           "type_data": {"content_type": "application/json"}}
    c.ok("tasks.add_or_update_artifacts", {"task": tid, "force": True, "artifacts": [art]})
    c.ok("tasks.completed", {"task": tid}, headers=sdk)
    s = c.state()
    # The SDK's GETs and headers are noted, not held against memtrack; the
    # log event memtrack itself sent is.
    assert [v["rule"] for v in s["violations"]] == ["event_type", "event_metric",
                                                    "event_metric", "event_iter"]
    assert {n["rule"] for n in s["sdk_notes"]} >= {"method", "client_header"}
    assert s["task_creators"] == {tid: "sdk"}
    assert [(e["to"], e["by"]) for e in s["status_log"]] == \
        [("in_progress", "sdk"), ("completed", "sdk")]
    assert [(a["key"], a["task_status"], a["by"]) for a in s["artifact_log"]] == \
        [("memory_usage", "in_progress", "memtrack")]
    task = c.ok("tasks.get_by_id", {"task": tid})["task"]
    assert task["script"]["entry_point"] == "job.py"
    assert task["script"]["requirements"] == {"pip": "x"}
    assert isinstance(task["user"], str) and isinstance(task["company"], str)
