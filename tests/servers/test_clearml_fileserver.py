"""Self-tests for tests/servers/clearml_fileserver.py (the strict fileserver stand-in).

Run: python3 -m pytest -q tests/servers/test_clearml_fileserver.py
"""

import http.client
import json
import os
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SERVER = os.path.join(HERE, "clearml_fileserver.py")


@pytest.fixture
def port(tmp_path):
    port_file = str(tmp_path / "port.json")
    proc = subprocess.Popen([sys.executable, SERVER, "--port-file", port_file],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 10
    while not os.path.exists(port_file):
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "no port file"
        time.sleep(0.02)
    with open(port_file) as fh:
        yield json.load(fh)["port"]
    proc.kill()
    proc.wait()


def request(port, method, path, body=b"", headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request(method, path, body=body, headers=headers or {})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data


def multipart(name, data, boundary="B0undary"):
    body = (("--%s\r\nContent-Disposition: form-data; name=\"%s\"; filename=\"%s\"\r\n"
             "Content-Type: application/json\r\n\r\n") % (boundary, name, name)).encode()
    body += data + ("\r\n--%s--\r\n" % boundary).encode()
    return body, "multipart/form-data; boundary=%s" % boundary


def state(port):
    return json.loads(request(port, "GET", "/__state")[1])


def test_an_upload_as_the_sdk_sends_it_is_stored_and_served(port):
    body, ctype = multipart("proj/t.abc/artifacts/m/memory_usage.json", b'{"a": 1}')
    status, data = request(port, "POST", "/", body,
                           {"Content-Type": ctype, "Authorization": "Bearer tok"})
    assert status == 200, data
    assert json.loads(data) == ["proj/t.abc/artifacts/m/memory_usage.json"]
    status, data = request(port, "GET", "/proj/t.abc/artifacts/m/memory_usage.json")
    assert (status, data) == (200, b'{"a": 1}')
    # Into a folder: the field name is relative to it.
    body, ctype = multipart("x.json", b"{}")
    status, _ = request(port, "POST", "/dir/sub", body,
                        {"Content-Type": ctype, "Authorization": "Bearer tok"})
    assert status == 200
    assert request(port, "GET", "/dir/sub/x.json") == (200, b"{}")
    assert state(port)["violations"] == []


@pytest.mark.parametrize("headers,body,code", [
    ({"Content-Type": "application/json", "Authorization": "Bearer t"}, b"{}", 400),
    ({"Content-Type": "multipart/form-data; boundary=B0undary"}, None, 401),
    ({"Content-Type": "multipart/form-data; boundary=other", "Authorization": "Bearer t"}, None, 400),
])
def test_anything_else_is_refused_and_recorded(port, headers, body, code):
    if body is None:
        body, _ = multipart("a.json", b"{}")
    status, _ = request(port, "POST", "/", body, headers)
    assert status == code
    assert len(state(port)["violations"]) == 1
    assert state(port)["uploads"] == []


def test_a_path_climbing_out_is_refused(port):
    body, ctype = multipart("../etc/passwd", b"x")
    status, _ = request(port, "POST", "/", body,
                        {"Content-Type": ctype, "Authorization": "Bearer t"})
    assert status == 400
    assert state(port)["violations"]
