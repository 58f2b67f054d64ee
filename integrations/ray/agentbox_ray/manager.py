"""The cluster manager as a named, detached async Ray actor, under the reference manager's name
and namespace, so the paddock's existing ``local_bwrap`` provider finds it unchanged
(``ray.get_actor(name, namespace=ns)``) and calls the same methods with the same payloads.

The logic is :class:`agentbox_ray.core.ClusterManagerCore`; this module adds what needs Ray:
finding the nodes that offer slots (``agentbox_slots``, or the reference's
``local_bwrap_slots``), one :data:`AgentboxNodeActor` per node pinned there, and the
:class:`RayNode` adapter that turns actor calls into the core's node interface.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Dict, List, Optional

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .core import POOL_MODE, ClusterManagerCore, ManagerConfig
from .node_actor import AgentboxNodeActor, node_actor_name

MANAGER_NAME_ENV = "DRESSAGE_LOCAL_BWRAP_MANAGER_NAME"
NAMESPACE_ENV = "DRESSAGE_LOCAL_BWRAP_RAY_NAMESPACE"
DEFAULT_MANAGER_NAME = "dressage_local_bwrap_manager"
DEFAULT_NAMESPACE = "dressage"
# The custom resource a node advertises its slots with; the reference's is accepted too.
SLOT_RESOURCES = ("agentbox_slots", "local_bwrap_slots")


def manager_name() -> str:
    return os.environ.get(MANAGER_NAME_ENV) or DEFAULT_MANAGER_NAME


def namespace() -> str:
    return os.environ.get(NAMESPACE_ENV) or DEFAULT_NAMESPACE


def normalize_pool_mode(mode: Optional[str]) -> str:
    """The reference's spellings; only ``blackbox`` pools exist here."""
    text = str(mode or POOL_MODE).strip().lower().replace("-", "_")
    if text == "blackbox":
        return POOL_MODE
    if text in ("command", "commands", "commandonly", "command_only"):
        raise ValueError("agentbox slots are blackbox pools; command_only is not offered")
    raise ValueError(f"unknown pool_mode {mode!r}; expected blackbox")


def slot_nodes(nodes: Optional[List[Dict[str, Any]]] = None) -> List[Dict[str, Any]]:
    """The alive Ray nodes that offer slots: ``{node_id, node_ip, hostname, capacity}``."""
    found = []
    for n in ray.nodes() if nodes is None else nodes:
        if not n.get("Alive"):
            continue
        res = n.get("Resources") or {}
        capacity = next((res[r] for r in SLOT_RESOURCES if res.get(r, 0) > 0), 0)
        if capacity <= 0:
            continue
        found.append({"node_id": n["NodeID"], "node_ip": n.get("NodeManagerAddress", ""),
                      "hostname": n.get("NodeManagerHostname", ""),
                      "capacity": int(capacity)})
    return sorted(found, key=lambda d: d["node_id"])


class RayNode:
    """The core's node interface over a node actor. A task error is unwrapped to the error the
    actor raised (a pool refusal stays a refusal); anything else (the actor died, the node
    left) propagates and the core marks the node lost."""

    def __init__(self, handle: Any):
        self.handle = handle

    async def _await(self, ref: Any) -> Dict[str, Any]:
        try:
            return await ref
        except ray.exceptions.RayTaskError as err:
            cause = getattr(err, "cause", None)
            if isinstance(cause, BaseException):
                raise cause from None
            raise

    async def status(self) -> Dict[str, Any]:
        return await self._await(self.handle.status.remote())

    async def acquire(self, trajectory_id, env_type, env_args):
        return await self._await(self.handle.acquire.remote(trajectory_id, env_type, env_args))

    async def release(self, lease_id, trajectory_id, reason):
        return await self._await(self.handle.release.remote(lease_id, trajectory_id, reason))

    async def force_release(self, slot_id, lease_id, reason):
        # The pool releases by lease id: a no-op if that slot has been leased again since.
        return await self._await(self.handle.release.remote(lease_id, None, reason))

    async def run_command(self, request):
        return await self._await(self.handle.run_command.remote(request))

    async def read_file(self, request):
        return await self._await(self.handle.read_file.remote(request))

    async def write_file(self, request):
        return await self._await(self.handle.write_file.remote(request))

    async def drain(self):
        return await self._await(self.handle.drain.remote())

    async def undrain(self):
        return await self._await(self.handle.undrain.remote())

    async def shutdown(self):
        return await self._await(self.handle.shutdown.remote())


class AgentboxClusterManager:
    """The manager actor's body. The constructor takes the reference's keyword arguments
    (``total_servers``, ``base_port`` and ``proxy_url`` are accepted for the start script's
    sake: the pools own their slot counts and ports)."""

    def __init__(self, total_servers: Optional[int] = None, base_port: Optional[int] = None,
                 proxy_url: Optional[str] = None, pool_mode: Optional[str] = POOL_MODE):
        self._mode = normalize_pool_mode(pool_mode)
        self.total_servers = total_servers
        self.config = ManagerConfig.from_env()
        self.core = ClusterManagerCore(self.config)
        self.namespace = namespace()
        self.node_actors: Dict[str, Any] = {}

    def _check_open(self) -> None:
        if self.core.closed:
            raise RuntimeError("agentbox cluster manager is shut down")

    async def pool_mode(self) -> str:
        return self._mode

    async def init_pool(self) -> Dict[str, Any]:
        """Finds the slot nodes, creates (or finds) each one's node actor pinned to it, and
        refreshes their health; a node gone from Ray is marked lost. Run it again to pick up
        nodes that joined later."""
        self._check_open()
        found = slot_nodes()
        handles = []
        for n in found:
            handle = AgentboxNodeActor.options(
                name=node_actor_name(n["node_id"]), namespace=self.namespace,
                lifetime="detached", get_if_exists=True,
                scheduling_strategy=NodeAffinitySchedulingStrategy(n["node_id"], soft=False),
            ).remote(n["node_id"], self.config.rpc_timeout_s)
            self.node_actors[n["node_id"]] = handle
            self.core.add_node(n["node_id"], n["node_ip"], n["hostname"], n["capacity"],
                               RayNode(handle))
            handles.append(handle)
        # Each actor started first (see ManagerConfig.actor_start_timeout_s); one that does not
        # start in time is left to the refresh, which marks its node lost with the reason.
        await asyncio.gather(*(self._started(h) for h in handles))
        await self.core.refresh(force=True)
        await self.core.lose_absent({n["node_id"] for n in found},
                                    "not an alive Ray node with slots")
        self.core.start_health_loop()
        return await self.status()

    async def _started(self, handle: Any) -> None:
        try:
            await asyncio.wait_for(_ready(handle), self.config.actor_start_timeout_s)
        except Exception:  # noqa: BLE001 - the refresh that follows reports the node's state
            pass

    async def init_cluster(self) -> Dict[str, Any]:
        return await self.init_pool()

    async def wait_ready(self, timeout_s: float = 600.0) -> Dict[str, Any]:
        return await self.core.wait_ready(timeout_s)

    async def acquire(self, trajectory_id: str, env_type: Optional[str] = None,
                      env_args: Optional[Any] = None) -> Dict[str, Any]:
        return await self.core.acquire(trajectory_id, env_type, env_args)

    async def release(self, trajectory_id: Optional[str] = None, lease_id: Optional[str] = None,
                      reason: Optional[str] = None) -> Dict[str, Any]:
        return await self.core.release(trajectory_id, lease_id, reason)

    async def run_command(self, *, command: Any, trajectory_id: Optional[str] = None,
                          lease_id: Optional[str] = None, cwd: Optional[str] = None,
                          env: Optional[Dict[str, str]] = None, timeout: Optional[float] = None,
                          stdin: Any = None) -> Dict[str, Any]:
        if isinstance(stdin, (bytes, bytearray)):
            stdin = bytes(stdin).decode("utf-8")
        return await self.core.run_command(command=command, trajectory_id=trajectory_id,
                                           lease_id=lease_id, cwd=cwd, env=env,
                                           timeout=timeout, stdin=stdin)

    async def read_file(self, *, path: str, trajectory_id: Optional[str] = None,
                        lease_id: Optional[str] = None, encoding: Optional[str] = "utf-8",
                        max_bytes: Optional[int] = None) -> Any:
        return await self.core.read_file(path=path, trajectory_id=trajectory_id,
                                         lease_id=lease_id, encoding=encoding,
                                         max_bytes=max_bytes)

    async def write_file(self, *, path: str, content: Any, trajectory_id: Optional[str] = None,
                         lease_id: Optional[str] = None, encoding: Optional[str] = "utf-8",
                         append: bool = False) -> Dict[str, Any]:
        return await self.core.write_file(path=path, content=content,
                                          trajectory_id=trajectory_id, lease_id=lease_id,
                                          encoding=encoding or "utf-8", append=append)

    async def status(self) -> Dict[str, Any]:
        return await self.core.status()

    async def reconcile(self) -> Dict[str, Any]:
        return await self.core.reconcile()

    async def drain_node(self, node_id: str) -> Dict[str, Any]:
        return await self.core.drain_node(node_id)

    async def undrain_node(self, node_id: str) -> Dict[str, Any]:
        return await self.core.undrain_node(node_id)

    async def restart_node_pool(self, node_id: str) -> Dict[str, Any]:
        return await self.core.restart_node_pool(node_id)

    async def node_actor_identities(self) -> Dict[str, Any]:
        """Where each node actor runs (its Ray node) and which pool socket it uses."""
        out = {}
        for node_id, handle in self.node_actors.items():
            try:
                out[node_id] = await handle.identity.remote()
            except Exception as err:  # noqa: BLE001 - reported, not raised
                out[node_id] = {"error": str(err)}
        return out

    async def shutdown(self, destroy_supervisors: Optional[bool] = None) -> Dict[str, Any]:
        """Closes the manager (idempotent). With ``destroy_supervisors`` (default: true) the
        node actors are killed too; the pools themselves keep running (system services)."""
        result = await self.core.shutdown()
        if destroy_supervisors is None:
            destroy_supervisors = True
        if destroy_supervisors:
            destroyed: Dict[str, bool] = {}
            errors: Dict[str, str] = {}
            for node_id, handle in list(self.node_actors.items()):
                try:
                    ray.kill(handle, no_restart=True)
                    destroyed[node_id] = True
                except Exception as err:  # noqa: BLE001 - reported per node
                    destroyed[node_id] = False
                    errors[node_id] = str(err)
            self.node_actors.clear()
            result["supervisor_actors_destroyed"] = destroyed
            result["destroy_errors"] = errors
        return result


# The reference's options: detached and async with a high concurrency; 0.2 CPU so it fits on
# any node.
AgentboxClusterManagerActor = ray.remote(num_cpus=0.2, max_concurrency=4096)(
    AgentboxClusterManager)


def connect(address: Optional[str] = None) -> None:
    """``ray.init`` the way the reference's provider does, if not yet initialised."""
    if not ray.is_initialized():
        ray.init(address=address or os.environ.get("DRESSAGE_LOCAL_BWRAP_RAY_ADDRESS")
                 or os.environ.get("DRESSAGE_RAY_ADDRESS", "auto"),
                 namespace=namespace(), ignore_reinit_error=True,
                 log_to_driver=False)


def get_manager() -> Any:
    """The running manager actor (``ValueError`` when there is none)."""
    return ray.get_actor(manager_name(), namespace=namespace())


def create_manager(**kwargs: Any) -> Any:
    """A new detached manager actor under the configured name and namespace."""
    return AgentboxClusterManagerActor.options(
        name=manager_name(), namespace=namespace(), lifetime="detached",
        get_if_exists=False).remote(**kwargs)


async def _ready(handle: Any) -> None:
    """Resolves once the actor behind ``handle`` runs (Ray's built-in ``__ray_ready__``)."""
    await handle.__ray_ready__.remote()
