#!/usr/bin/env python3
"""Strict local stand-in for the ClearML fileserver, for memtrack's tests.

The ClearML fileserver (clearml-server's ``fileserver``) stores what the SDK
uploads: a multipart/form-data POST to ``/`` or ``/<folder>`` whose file
fields are named after each object's path (relative to the folder), and
serves each object back with GET ``/<path>``. The SDK sends the API
server's bearer token with it (``Authorization: Bearer …``).

This stand-in takes exactly that and records every other request as a
violation (wrong method, no multipart body or boundary, a part that is not a
named file, a compressed or chunked body, no bearer token, a path that
climbs out with ``..``), answering it as the real server would refuse it.

    python3 tests/servers/clearml_fileserver.py --port-file ports.json [--host 127.0.0.1]

Once it accepts connections the port file holds ``{"port": PORT, "pid": PID}``.
``GET /__state`` answers ``{"uploads": [...], "violations": [...]}`` (each
upload: path, size, sha256, content_type, authorization seen). Python 3.8+,
standard library only.
"""

import argparse
import hashlib
import json
import os
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

MAX_BODY = 64 << 20


class State:
    def __init__(self):
        self.lock = threading.Lock()
        self.files = {}
        self.uploads = []
        self.violations = []

    def violation(self, what):
        with self.lock:
            self.violations.append(what)


def safe_path(path):
    """The object path, or None when it is empty or climbs out."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if not parts or any(p == ".." for p in parts):
        return None
    return "/".join(parts)


def parse_disposition(value):
    """form-data; name="…"; filename="…" → dict, or None."""
    if not value.lower().startswith("form-data"):
        return None
    out = {}
    for m in re.finditer(r';\s*([a-zA-Z*]+)="((?:[^"\\]|\\.)*)"', value):
        out[m.group(1).lower()] = m.group(2)
    return out


def parse_multipart(body, boundary):
    """[(headers, data)] of a multipart body; raises ValueError when malformed."""
    delim = b"--" + boundary.encode("latin-1")
    if not body.startswith(delim):
        raise ValueError("the body does not start with the boundary")
    parts = []
    rest = body[len(delim):]
    while True:
        if rest.startswith(b"--"):
            if rest[2:] not in (b"", b"\r\n"):
                raise ValueError("data after the closing boundary")
            return parts
        if not rest.startswith(b"\r\n"):
            raise ValueError("no CRLF after a boundary")
        end = rest.find(b"\r\n" + delim)
        if end < 0:
            raise ValueError("a part without a closing boundary")
        part, rest = rest[2:end], rest[end + 2 + len(delim):]
        head, sep, data = part.partition(b"\r\n\r\n")
        if not sep:
            raise ValueError("a part without headers")
        headers = {}
        for line in head.decode("utf-8").split("\r\n"):
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        parts.append((headers, data))


def make_handler(state):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def reply(self, code, body, content_type="application/json"):
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def refuse(self, code, what):
            state.violation("%s %s: %s" % (self.command, self.path, what))
            self.reply(code, {"error": what})

        def do_GET(self):
            path = unquote(urlsplit(self.path).path)
            if path == "/__state":
                with state.lock:
                    self.reply(200, {"uploads": state.uploads, "violations": state.violations})
                return
            key = safe_path(path)
            with state.lock:
                data = state.files.get(key)
            if data is None:
                self.reply(404, {"error": "no such object"})
            else:
                self.reply(200, data, "application/octet-stream")

        def do_POST(self):
            folder = safe_path(unquote(urlsplit(self.path).path)) or ""
            if ".." in self.path.split("/"):
                return self.refuse(400, "a path that climbs out")
            if self.headers.get("Transfer-Encoding"):
                return self.refuse(411, "a chunked body (send Content-Length)")
            if self.headers.get("Content-Encoding"):
                return self.refuse(415, "a compressed body")
            length = self.headers.get("Content-Length")
            if length is None or not length.isdigit() or int(length) > MAX_BODY:
                return self.refuse(411, "no usable Content-Length")
            body = self.rfile.read(int(length))
            auth = self.headers.get("Authorization", "")
            if not auth.startswith("Bearer ") or len(auth) <= len("Bearer "):
                return self.refuse(401, "no bearer token (the SDK sends the API server's)")
            ctype = self.headers.get("Content-Type", "")
            m = re.match(r'multipart/form-data;\s*boundary="?([^";]+)"?$', ctype)
            if not m:
                return self.refuse(400, "not multipart/form-data with a boundary: %r" % ctype)
            try:
                parts = parse_multipart(body, m.group(1))
            except (ValueError, UnicodeDecodeError) as e:
                return self.refuse(400, "malformed multipart body: %s" % e)
            if not parts:
                return self.refuse(400, "no file in the upload")
            stored = []
            for headers, data in parts:
                disp = parse_disposition(headers.get("content-disposition", ""))
                if disp is None or not disp.get("name") or "filename" not in disp:
                    return self.refuse(400, "a part that is not a named file: %r" % headers)
                name = safe_path(disp["name"])
                if name is None:
                    return self.refuse(400, "a file name that climbs out or is empty")
                key = folder + "/" + name if folder else name
                with state.lock:
                    state.files[key] = data
                    state.uploads.append({
                        "path": key,
                        "size": len(data),
                        "sha256": hashlib.sha256(data).hexdigest(),
                        "content_type": headers.get("content-type", ""),
                        "authorization": auth.split(" ", 1)[0],
                    })
                stored.append(key)
            self.reply(200, stored)

        def refuse_method(self):
            self.refuse(405, "method not allowed")

        do_PUT = refuse_method
        do_PATCH = refuse_method

    return Handler


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port-file", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    state = State()
    server = ThreadingHTTPServer((args.host, args.port), make_handler(state))
    tmp = args.port_file + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"port": server.server_address[1], "pid": os.getpid()}, f)
    os.replace(tmp, args.port_file)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
