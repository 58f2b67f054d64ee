"""The pool client over a real unix socket, against a small HTTP server that answers with the
pool's envelope: the routes and bodies it sends, and the mapping of every error class."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socketserver
import tempfile
import threading
import time
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
    SlotFailed,
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
        self._reply(*self.server.answers.get(self.path, (200, {"capacity": 4, "ready": 4})))

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append(("POST", self.path, body))
        time.sleep(self.server.delays.get(self.path, 0.0))
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
    srv.seen, srv.answers, srv.delays = [], {}, {}
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
    ("slot_failed", 502, SlotFailed),
    ("internal", 500, PoolUnavailable),
    ("shutting_down", 503, PoolUnavailable),
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


def test_a_commands_http_read_waits_for_the_command_not_the_client_timeout(pool):
    srv, _ = pool
    client = PoolClient(srv.server_address, timeout=0.2)
    srv.delays["/run_command"] = 0.5
    # Without a timeout: the command runs up to the launcher's maximum; nothing cuts it.
    assert client.run_command("sleep", lease_id="L")["ok"]
    # The command's timeout plus the client's.
    assert client.run_command("sleep", lease_id="L", timeout=0.4)["ok"]
    # The caller's own bound wins: it is how long it waits for the answer.
    with pytest.raises(PoolUnavailable, match="timed out"):
        client.run_command("sleep", lease_id="L", timeout=5, reply_timeout=0.1)


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


# -- the manager's core over the node actor's body and this client (no Ray) ------------------

_LEASE = {"lease_id": "lease-pool-0000-gen1-traj-0001", "trajectory_id": "traj",
          "node_id": "pool-a", "node_ip": "10.0.0.1", "slot_id": 0, "port": 31000,
          "sandbox_url": "http://10.0.0.1:31000", "acquired_ts": 0.0, "deadline_ts": None,
          "generation": 1, "status": "ACTIVE", "ready": True}


class _ThreadNode:
    """The node actor's body called as Ray calls it: each method in a thread of its own (the
    actor is threaded), awaited by the core."""

    def __init__(self, body):
        self.body = body

    def __getattr__(self, name):
        fn = getattr(self.body, name)

        async def call(*args):
            return await asyncio.to_thread(fn, *args)
        return call


def _core_over(srv, **config):
    """A core with one node whose actor body talks to ``srv``, the lease ``_LEASE`` held."""
    from agentbox_ray.core import ClusterManagerCore, ManagerConfig
    from agentbox_ray.node_actor import AgentboxNode

    cfg = ManagerConfig(**{"acquire_timeout_s": 2.0, "acquire_poll_s": 0.01,
                           "status_refresh_s": 60.0, "health_interval_s": 60.0,
                           "rpc_timeout_s": 0.3, "node_acquire_timeout_s": 1.0,
                           "lease_ttl_s": 0.0, "release_timeout_s": 3.0, **config})
    body = AgentboxNode("node-a", cfg.rpc_timeout_s, srv.server_address)
    core = ClusterManagerCore(cfg)
    core.add_node("node-a", "10.0.0.1", "a", 1, _ThreadNode(body))
    srv.answers["/status"] = (200, {"capacity": 1, "ready": 1, "slots": []})
    srv.answers["/acquire"] = (200, _LEASE)
    return core


def test_a_command_without_timeout_outlasting_the_rpc_timeout_is_waited_for(pool):
    # The node actor is created with the RPC timeout (0.3 s here); a command without a
    # timeout of its own may run as long as the core waits for it (RPC + release timeout),
    # so its HTTP read must not be cut at the RPC timeout, which would lose the node.
    srv, _ = pool
    srv.answers["/run_command"] = (200, {"cmd": "sleep 1", "stdout": "", "stderr": "",
                                         "returncode": 0, "timed_out": False})
    srv.delays["/run_command"] = 1.0

    async def body():
        core = _core_over(srv)
        await core.refresh(force=True)
        await core.acquire("traj")
        out = await core.run_command(command="sleep 1", trajectory_id="traj")
        assert out["returncode"] == 0
        assert core.nodes["node-a"].alive
        # With a timeout of its own, the command gets it plus the RPC timeout.
        out = await core.run_command(command="sleep 1", trajectory_id="traj", timeout=0.9)
        assert out["returncode"] == 0 and core.nodes["node-a"].alive
    asyncio.run(body())


def test_a_failed_slot_is_refused_and_its_node_kept(pool):
    # 502 `slot_failed`: the launcher or the gateway failed one slot's request. The pool
    # answered, so the node and its other leases are fine; the caller gets the refusal.
    srv, _ = pool
    srv.answers["/run_command"] = _err("slot_failed", 502)

    async def body():
        from agentbox_ray.core import LeaseState

        core = _core_over(srv)
        await core.refresh(force=True)
        await core.acquire("traj")
        with pytest.raises(SlotFailed) as info:
            await core.run_command(command="true", trajectory_id="traj")
        assert info.value.code == "slot_failed" and info.value.status == 502
        assert core.nodes["node-a"].alive
        assert core.leases["traj"].state is LeaseState.ACTIVE
    asyncio.run(body())
