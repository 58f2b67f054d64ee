"""The per-node Ray actor: one per Ray node, pinned to it, talking to that node's
``agentbox-pool`` over its unix socket.

The socket path comes from ``AGENTBOX_POOL_SOCKET`` in the actor's own environment, which is
the environment ``ray start`` ran in on that node (the actor is created without a
``runtime_env``), so each host names its own pool.

It is a threaded actor (plain methods, ``max_concurrency`` threads): each call is one blocking
HTTP request on its own connection, bounded by the client's timeout (a command: by how long
the manager waits for it).
"""

from __future__ import annotations

import os
import re
import socket
from typing import Any, Dict, Optional

import ray

from .pool_client import PoolClient, socket_from_env

NODE_ACTOR_PREFIX = "agentbox_pool_node_"
NODE_ACTOR_CONCURRENCY = 256


def safe_actor_name(name: str) -> str:
    """The reference's rule: characters outside ``[A-Za-z0-9._-]`` become ``_``."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def node_actor_name(node_id: str) -> str:
    return safe_actor_name(f"{NODE_ACTOR_PREFIX}{node_id[:20]}")


class AgentboxNode:
    """The node actor's body (Ray wraps it with ``ray.remote``; see :data:`AgentboxNodeActor`)."""

    def __init__(self, node_id: str, timeout_s: float = 30.0,
                 socket_path: Optional[str] = None):
        self.node_id = node_id
        self.client = PoolClient(socket_path or socket_from_env(), timeout=timeout_s)

    def identity(self) -> Dict[str, Any]:
        """Where this actor runs and which pool it talks to (to check placement)."""
        ray_node = ray.get_runtime_context().get_node_id()
        return {"node_id": self.node_id, "ray_node_id": ray_node,
                "socket": self.client.socket_path, "hostname": socket.gethostname(),
                "pid": os.getpid()}

    def status(self) -> Dict[str, Any]:
        return self.client.status()

    def acquire(self, trajectory_id: str, env_type: Optional[str] = None,
                env_args: Optional[Any] = None) -> Dict[str, Any]:
        return self.client.acquire(trajectory_id, env_type, env_args)

    def release(self, lease_id: Optional[str], trajectory_id: Optional[str],
                reason: Optional[str]) -> Dict[str, Any]:
        # By lease id when known: a stale release must not hit a newer lease of the trajectory.
        if lease_id is not None:
            return self.client.release(lease_id=lease_id, reason=reason)
        return self.client.release(trajectory_id=trajectory_id, reason=reason)

    def run_command(self, request: Dict[str, Any]) -> Dict[str, Any]:
        # `reply_timeout`: how long the manager waits for this answer. The HTTP read waits as
        # long (not this actor's RPC timeout), so a command that outlasts the RPC timeout is
        # not taken for a pool that stopped answering, and the thread is freed once the
        # manager has given up.
        return self.client.run_command(
            request["command"], trajectory_id=request.get("trajectory_id"),
            lease_id=request.get("lease_id"), cwd=request.get("cwd"),
            env=request.get("env"), timeout=request.get("timeout"),
            stdin=request.get("stdin"), reply_timeout=request.get("reply_timeout"))

    def read_file(self, request: Dict[str, Any]) -> Dict[str, Any]:
        return self.client.read_file(
            request["path"], trajectory_id=request.get("trajectory_id"),
            lease_id=request.get("lease_id"), max_bytes=request.get("max_bytes"))

    def write_file(self, request: Dict[str, Any]) -> Dict[str, Any]:
        return self.client.write_file(
            request["path"], request["content"], trajectory_id=request.get("trajectory_id"),
            lease_id=request.get("lease_id"), encoding=request.get("encoding") or "utf-8",
            append=bool(request.get("append", False)))

    def drain(self) -> Dict[str, Any]:
        return self.client.drain()

    def undrain(self) -> Dict[str, Any]:
        return self.client.undrain()

    def shutdown(self) -> Dict[str, Any]:
        # The pool is a system service and outlives the Ray cluster: nothing to stop here.
        return {"node_id": self.node_id, "pool_left_running": True}


# Detached, zero CPUs, pinned to its node by the manager (`NodeAffinitySchedulingStrategy`).
AgentboxNodeActor = ray.remote(num_cpus=0, max_concurrency=NODE_ACTOR_CONCURRENCY)(AgentboxNode)
