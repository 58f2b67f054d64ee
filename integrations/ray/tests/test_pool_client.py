"""The pool client over a real unix socket, against a small HTTP server that answers with the
pool's envelope: the routes and bodies it sends, and the mapping of every error class."""

from __future__ import annotations

import base64
import json
import os
import socketserver
import tempfile
import threading
from http.server import BaseHTTPRequestHandler

import pytest

from agentbox_ray.pool_client import (
    Draining,
    LeaseLost,
    LeaseNotFound,
    NoFreeSlot,
    PoolClient,
    PoolRequestError,
    PoolUnavailable,
    decode_content,
    socket_from_env,
)


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def address_string(self):
        return "unix"

    def _reply(self, status, body):
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self):
        self.server.seen.append(("GET", self.path, None))
        self._reply(200, {"capacity": 4, "ready": 4})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append(("POST", self.path, body))
        answer = self.server.answers.get(self.path)
        if answer is None:
            self._reply(200, {"ok": True, **body})
        else:
            self._reply(*answer)


@pytest.fixture()
def pool():
    d = tempfile.mkdtemp()
    path = os.path.join(d, "pool.sock")
    srv = _Server(path, _Handler)
    srv.seen, srv.answers = [], {}
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv, PoolClient(path, timeout=5)
    srv.shutdown()
    srv.server_close()


def _err(code, status):
    return (status, {"error": {"code": code, "message": f"{code} happened"}})


def test_routes_and_bodies(pool):
    srv, client = pool
    assert client.status() == {"capacity": 4, "ready": 4}
    client.acquire("t1", env_type="swe", env_args={"a": 1})
    client.release(trajectory_id="t1", lease_id="L", reason="paddock_terminate")
    client.run_command(["echo", "a b"], lease_id="L", cwd="sub", env={"X": 1}, timeout=3)
    client.write_file("f", "é", trajectory_id="t1", append=True)
    client.read_file("f", trajectory_id="t1", max_bytes=10)
    client.drain()
    client.undrain()
    assert srv.seen == [
        ("GET", "/status", None),
        ("POST", "/acquire", {"trajectory_id": "t1", "env_type": "swe", "env_args": {"a": 1}}),
        ("POST", "/release", {"trajectory_id": "t1", "lease_id": "L",
                              "reason": "paddock_terminate"}),
        ("POST", "/run_command", {"lease_id": "L", "command": ["echo", "a b"], "cwd": "sub",
                                  "env": {"X": "1"}, "timeout": 3.0}),
        ("POST", "/write_file", {"trajectory_id": "t1", "path": "f",
                                 "content_base64": base64.b64encode("é".encode()).decode(),
                                 "append": True}),
        ("POST", "/read_file", {"trajectory_id": "t1", "path": "f", "max_bytes": 10}),
        ("POST", "/drain", {}),
        ("POST", "/undrain", {}),
    ]
    with pytest.raises(ValueError):
        client.release()


@pytest.mark.parametrize("code,status,cls", [
    ("lease_not_found", 404, LeaseNotFound),
    ("lease_lost", 410, LeaseLost),
    ("no_free_slot", 503, NoFreeSlot),
    ("draining", 409, Draining),
    ("bad_request", 400, PoolRequestError),
    ("internal", 500, PoolUnavailable),
])
def test_errors_are_typed(pool, code, status, cls):
    srv, client = pool
    srv.answers["/acquire"] = _err(code, status)
    with pytest.raises(cls) as info:
        client.acquire("t")
    assert info.value.code == code and info.value.status == status
    assert code in str(info.value)


def test_lease_not_found_is_a_key_error_and_pickles(pool):
    import pickle

    srv, client = pool
    srv.answers["/read_file"] = _err("lease_not_found", 404)
    with pytest.raises(KeyError):
        client.read_file("x", lease_id="L")
    err = pickle.loads(pickle.dumps(LeaseNotFound("gone", "lease_not_found", 404)))
    assert isinstance(err, KeyError) and err.code == "lease_not_found" and str(err) == "gone"


def test_not_the_pools_api_is_unavailable(pool):
    srv, client = pool
    srv.answers["/acquire"] = (200, b"<html>")
    with pytest.raises(PoolUnavailable, match="not JSON"):
        client.acquire("t")
    srv.answers["/acquire"] = (502, {"detail": "x"})
    with pytest.raises(PoolUnavailable, match="without an error body"):
        client.acquire("t")


def test_missing_socket_is_unavailable():
    client = PoolClient("/nonexistent/agentbox/pool.sock", timeout=1)
    with pytest.raises(PoolUnavailable, match="FileNotFoundError"):
        client.status()


def test_socket_from_env_and_decode():
    assert socket_from_env({}) == "/var/lib/agentbox/run/pool.sock"
    assert socket_from_env({"AGENTBOX_POOL_SOCKET": "/x.sock"}) == "/x.sock"
    reply = {"content_base64": base64.b64encode(b"\xffab").decode()}
    assert decode_content(reply, None) == b"\xffab"
    with pytest.raises(UnicodeDecodeError):
        decode_content(reply, "utf-8")
