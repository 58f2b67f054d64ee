"""The cluster manager's logic, without Ray: which node a trajectory's slot comes from, the
lease records and their life (ACTIVE -> RELEASING -> dropped, or LOST), node health, TTL,
drain and shutdown.

Nodes are reached through :class:`NodeClient` (in Ray, a node actor; in the unit tests, an
in-memory fake), so this module is pure asyncio and is tested without a cluster.

The manager lock (``self._lock``) guards only in-memory state and is never held across an
``await`` on a node. That is how the reference's weakness (its global lock held across a
supervisor call of up to 30 s, with no RPC timeout) is avoided here:

* an acquire decides under the lock (existing lease? which node?), *reserves* a slot in that
  node's cached counts and registers itself as the trajectory's in-flight acquire, releases
  the lock, calls the node with a timeout, and takes the lock again only to record the result;
* a second acquire for the same trajectory while the first is in flight waits for it (no
  second node call, so a trajectory never holds two slots);
* health refreshes call every node concurrently, each with a timeout, outside the lock, and
  apply the answers under it; releases and TTL force-releases run as tracked tasks.

A lease the manager lets go of without its pool's word (released while its node was lost, a
release call that failed, a LOST lease acquired again or past its TTL) is not forgotten: its
release is *owed* to the node and tried again after each good status of that node.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from enum import Enum
from typing import (Any, Awaitable, Callable, Dict, Iterable, List, Mapping, Optional,
                    Protocol, Tuple)

from .pool_client import (
    Draining,
    LeaseLost,
    LeaseNotFound,
    NoFreeSlot,
    PoolError,
    PoolRequestError,
    PoolUnavailable,
    SlotFailed,
    decode_content,
)

POOL_MODE = "blackbox"

# A node's answer that proves it is healthy even though it refused the call (a failed slot
# included: one slot's launcher or gateway call failed, the pool answered).
_REFUSALS = (LeaseNotFound, LeaseLost, NoFreeSlot, Draining, SlotFailed, PoolRequestError,
             ValueError)

# How many failed attempts an owed release gets (each after a good status of its node) before
# it is given up; the pool's own lease TTL is the backstop then.
MAX_RELEASE_ATTEMPTS = 5


class NodeClient(Protocol):
    """How the manager reaches one node's pool. Every method may raise a
    :mod:`agentbox_ray.pool_client` error; anything else (a timeout, a dead actor) means the
    node is lost."""

    async def status(self) -> Dict[str, Any]: ...

    async def acquire(self, trajectory_id: str, env_type: Optional[str],
                      env_args: Optional[Any]) -> Dict[str, Any]: ...

    async def release(self, lease_id: Optional[str], trajectory_id: Optional[str],
                      reason: str) -> Dict[str, Any]: ...

    async def force_release(self, slot_id: int, lease_id: str, reason: str) -> Dict[str, Any]: ...

    async def run_command(self, request: Dict[str, Any]) -> Dict[str, Any]: ...

    async def read_file(self, request: Dict[str, Any]) -> Dict[str, Any]: ...

    async def write_file(self, request: Dict[str, Any]) -> Dict[str, Any]: ...

    async def drain(self) -> Dict[str, Any]: ...

    async def undrain(self) -> Dict[str, Any]: ...

    async def shutdown(self) -> Dict[str, Any]: ...


def _env_float(names: Tuple[str, ...], default: float,
               environ: Optional[Mapping[str, str]] = None) -> float:
    """The first of ``names`` set in the environment, as a number; an invalid value falls back
    to the default (as the reference's parsing does)."""
    env = os.environ if environ is None else environ
    for name in names:
        raw = env.get(name)
        if raw is None or raw.strip() == "":
            continue
        try:
            return float(raw)
        except ValueError:
            return default
    return default


@dataclass
class ManagerConfig:
    """Timings, in seconds. Environment names: ours (``AGENTBOX_RAY_*``) first, then the
    reference's, so an existing Dressage deployment keeps its settings."""

    acquire_timeout_s: float = 1800.0
    acquire_poll_s: float = 0.25
    status_refresh_s: float = 2.0
    health_interval_s: float = 5.0
    rpc_timeout_s: float = 10.0
    # How long init_pool waits for a node actor it just created to start (a new Ray worker
    # process on that node) before its first status call, which then gets rpc_timeout_s like
    # every other: an actor still starting is not a pool that fails to answer.
    actor_start_timeout_s: float = 120.0
    node_acquire_timeout_s: float = 30.0
    lease_ttl_s: float = 2100.0
    release_timeout_s: float = 600.0

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "ManagerConfig":
        d = cls()

        def f(ours: str, theirs: Optional[str], default: float) -> float:
            names = (ours,) if theirs is None else (ours, theirs)
            return _env_float(names, default, environ)

        return cls(
            acquire_timeout_s=f("AGENTBOX_RAY_ACQUIRE_TIMEOUT_SEC",
                                "DRESSAGE_BLACKBOX_ACQUIRE_TIMEOUT_SEC", d.acquire_timeout_s),
            acquire_poll_s=f("AGENTBOX_RAY_ACQUIRE_POLL_SEC",
                             "DRESSAGE_BLACKBOX_ACQUIRE_POLL_SEC", d.acquire_poll_s),
            status_refresh_s=f("AGENTBOX_RAY_STATUS_REFRESH_SEC",
                               "DRESSAGE_BLACKBOX_STATUS_REFRESH_SEC", d.status_refresh_s),
            health_interval_s=f("AGENTBOX_RAY_HEALTH_INTERVAL_SEC", None, d.health_interval_s),
            rpc_timeout_s=f("AGENTBOX_RAY_RPC_TIMEOUT_SEC", None, d.rpc_timeout_s),
            actor_start_timeout_s=f("AGENTBOX_RAY_ACTOR_START_TIMEOUT_SEC", None,
                                    d.actor_start_timeout_s),
            node_acquire_timeout_s=f("AGENTBOX_RAY_NODE_ACQUIRE_TIMEOUT_SEC",
                                     "DRESSAGE_BLACKBOX_NODE_ACQUIRE_TIMEOUT_SEC",
                                     d.node_acquire_timeout_s),
            lease_ttl_s=f("AGENTBOX_RAY_LEASE_TTL_SEC", "DRESSAGE_BLACKBOX_LEASE_TTL_SEC",
                          d.lease_ttl_s),
            release_timeout_s=f("AGENTBOX_RAY_RELEASE_TIMEOUT_SEC",
                                "DRESSAGE_BLACKBOX_BACKGROUND_RELEASE_TIMEOUT_SEC",
                                d.release_timeout_s),
        )


class LeaseState(Enum):
    ACTIVE = "ACTIVE"
    RELEASING = "RELEASING"
    LOST = "LOST"


@dataclass
class LeaseRecord:
    lease_id: str
    trajectory_id: str
    node_id: str
    node_ip: str
    slot_id: int
    port: int
    sandbox_url: Optional[str]
    acquired_ts: float
    deadline_ts: Optional[float]
    generation: int
    state: LeaseState = LeaseState.ACTIVE

    def to_dict(self) -> Dict[str, Any]:
        return {
            "lease_id": self.lease_id,
            "trajectory_id": self.trajectory_id,
            "node_id": self.node_id,
            "node_ip": self.node_ip,
            "slot_id": self.slot_id,
            "port": self.port,
            "sandbox_url": self.sandbox_url,
            "acquired_ts": self.acquired_ts,
            "deadline_ts": self.deadline_ts,
            "generation": self.generation,
            "status": self.state.value,
            "ready": self.state is LeaseState.ACTIVE,
        }


@dataclass
class OwedRelease:
    """A lease the manager no longer holds whose pool has not confirmed its release. Kept per
    node and tried after each good status of that node, so a pool that was unreachable gets
    its slot back instead of keeping it leased to nobody. The pool's release is idempotent by
    lease id (an unknown lease answers ``already_released``), so a repeat is harmless. Bounded:
    only leases the manager held on that node are owed, and each one is dropped once the pool
    answers or after :data:`MAX_RELEASE_ATTEMPTS` failures."""

    lease: LeaseRecord
    reason: str
    force: bool = False  # a TTL expiry: by slot and lease id, as the reference's force release
    attempts: int = 0
    inflight: bool = False


@dataclass
class NodeRecord:
    node_id: str
    node_ip: str
    hostname: str
    capacity: int
    client: NodeClient
    alive: bool = True
    draining: bool = False  # the manager's flag (drain_node)
    pool_draining: bool = False  # the pool's own (`agentbox pool drain` on the host)
    ready: int = 0
    leased: int = 0
    releasing: int = 0
    starting: int = 0
    restarting: int = 0
    failed: int = 0
    lost: int = 0
    reserved: int = 0  # acquires in flight to this node, not yet answered
    last_heartbeat_ts: Optional[float] = None
    last_refresh_ts: float = 0.0
    last_error: Optional[str] = None

    @property
    def used(self) -> int:
        return self.leased + self.releasing + self.starting + self.restarting + self.reserved

    @property
    def free(self) -> int:
        return max(0, self.ready - self.reserved) if self.alive else 0

    def schedulable(self) -> bool:
        return self.alive and not self.draining and not self.pool_draining and self.free > 0

    def sort_key(self) -> Tuple[float, int, str]:
        cap = self.capacity if self.capacity > 0 else 1
        return (self.used / cap, -self.free, self.node_id)

    def mark_lost(self, error: str) -> None:
        self.alive = False
        self.ready = 0
        self.last_error = error

    def apply_status(self, st: Mapping[str, Any], now: float) -> None:
        self.alive = not bool(st.get("closed", False))
        self.capacity = int(st.get("capacity", self.capacity))
        self.ready = int(st.get("ready", 0))
        self.leased = int(st.get("leased", 0))
        self.releasing = int(st.get("releasing", 0))
        self.starting = int(st.get("starting", 0))
        self.restarting = int(st.get("restarting", 0))
        self.failed = int(st.get("failed", 0)) + int(st.get("dead", 0))
        self.lost = int(st.get("lost", 0))
        self.pool_draining = bool(st.get("draining", False))
        self.hostname = str(st.get("hostname") or self.hostname)
        self.last_heartbeat_ts = now
        self.last_error = st.get("last_error") if self.alive else "pool closed"

    def to_dict(self) -> Dict[str, Any]:
        return {
            "node_id": self.node_id,
            "node_ip": self.node_ip,
            "hostname": self.hostname,
            "capacity": self.capacity,
            "alive": self.alive,
            "ready": self.ready if self.alive else 0,
            "leased": self.leased,
            "used": self.used,
            "free": self.free,
            "resetting": self.releasing + self.starting,
            "restarting": self.restarting,
            "failed": self.failed,
            "lost": self.lost,
            "draining": self.draining or self.pool_draining,
            "last_heartbeat_ts": self.last_heartbeat_ts,
            "last_error": self.last_error,
        }


class ClusterManagerCore:
    """The manager's state and rules. ``clock`` is injectable so TTL tests need no sleeping."""

    def __init__(self, config: Optional[ManagerConfig] = None,
                 clock: Callable[[], float] = time.time):
        self.config = config or ManagerConfig()
        self.clock = clock
        self.closed = False
        self.nodes: Dict[str, NodeRecord] = {}
        self.leases: Dict[str, LeaseRecord] = {}  # by trajectory id
        self._lock = asyncio.Lock()
        self._inflight: Dict[str, "asyncio.Future[Dict[str, Any]]"] = {}
        self._refreshing: Optional["asyncio.Task[None]"] = None
        self._tasks: "set[asyncio.Task[Any]]" = set()
        self._health_task: Optional["asyncio.Task[None]"] = None
        # Releases owed to pools: node id -> lease id -> OwedRelease.
        self._owed: Dict[str, Dict[str, OwedRelease]] = {}

    # -- nodes ----------------------------------------------------------------------------

    def add_node(self, node_id: str, node_ip: str, hostname: str, capacity: int,
                 client: NodeClient) -> NodeRecord:
        """Registers a node (or replaces its client, when ``init_pool`` runs again)."""
        if self.closed:
            raise RuntimeError("agentbox cluster manager is shut down")
        rec = self.nodes.get(node_id)
        if rec is None:
            rec = NodeRecord(node_id, node_ip, hostname, int(capacity), client)
            self.nodes[node_id] = rec
        else:
            rec.client = client
            rec.node_ip = node_ip
            rec.last_refresh_ts = 0.0
        return rec

    def _node(self, node_id: str) -> NodeRecord:
        rec = self.nodes.get(node_id)
        if rec is None:
            raise KeyError(f"unknown node {node_id!r}")
        return rec

    async def _call(self, coro: Awaitable[Dict[str, Any]], timeout: float) -> Dict[str, Any]:
        return await asyncio.wait_for(coro, timeout)

    def _lose_node(self, rec: NodeRecord, error: str) -> None:
        """Under the lock: the node is lost, and so are its leases."""
        rec.mark_lost(error)
        for lease in self.leases.values():
            if lease.node_id == rec.node_id and lease.state is not LeaseState.LOST:
                lease.state = LeaseState.LOST

    async def lose_absent(self, present: "set[str]", why: str) -> None:
        """Nodes not in ``present`` (gone from the cluster) are lost, with their leases."""
        async with self._lock:
            for node_id, rec in self.nodes.items():
                if node_id not in present:
                    self._lose_node(rec, why)

    async def refresh(self, force: bool = False) -> None:
        """Asks every node (stale ones only, unless ``force``) for its status, concurrently,
        each with the RPC timeout; a failure marks that node lost. Concurrent callers share
        one refresh."""
        running = self._refreshing
        if running is not None and not running.done():
            await asyncio.shield(running)
            if not force:
                return
        task = asyncio.ensure_future(self._refresh(force))
        self._refreshing = task
        await asyncio.shield(task)

    async def _refresh(self, force: bool) -> None:
        now = self.clock()
        targets = [
            rec for rec in list(self.nodes.values())
            if force or now - rec.last_refresh_ts >= self.config.status_refresh_s
        ]
        if not targets:
            return
        started = self.clock()
        results = await asyncio.gather(
            *(self._call(rec.client.status(), self.config.rpc_timeout_s) for rec in targets),
            return_exceptions=True,
        )
        async with self._lock:
            for rec, res in zip(targets, results):
                rec.last_refresh_ts = self.clock()
                if isinstance(res, BaseException):
                    if isinstance(res, asyncio.CancelledError):
                        raise res
                    self._lose_node(rec, f"health: {_describe(res)}")
                    continue
                if self.nodes.get(rec.node_id) is not rec:
                    continue
                rec.apply_status(res, self.clock())
                if not rec.alive:
                    self._lose_node(rec, "pool closed")
                    continue
                self._apply_slot_views(rec, res, started)
            # The nodes that answered get the releases they are owed.
            due = self._take_owed(rec.node_id for rec in targets)
        self._pay_later(due)

    def _apply_slot_views(self, rec: NodeRecord, st: Mapping[str, Any], started: float) -> None:
        """Leases whose slot the pool reports LOST, or no longer knows (the pool restarted),
        become LOST. A lease acquired after the status was asked for is not judged by it."""
        slots = st.get("slots")
        if not isinstance(slots, list):
            return
        by_lease = {s.get("lease_id"): s for s in slots if isinstance(s, dict)}
        for lease in self.leases.values():
            if lease.node_id != rec.node_id or lease.state is not LeaseState.ACTIVE:
                continue
            if lease.acquired_ts >= started:
                continue
            view = by_lease.get(lease.lease_id)
            if view is None or view.get("status") == "LOST":
                lease.state = LeaseState.LOST

    # -- health loop ----------------------------------------------------------------------

    def start_health_loop(self) -> None:
        """Starts the periodic health refresh (idempotent; needs a running event loop)."""
        if self._health_task is None or self._health_task.done():
            self._health_task = asyncio.ensure_future(self._health_loop())

    async def _health_loop(self) -> None:
        while not self.closed:
            try:
                await self.refresh(force=True)
                await self.reconcile()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - one bad round must not end the loop
                pass
            await asyncio.sleep(self.config.health_interval_s)

    def _spawn(self, coro: Awaitable[Any]) -> "asyncio.Task[Any]":
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- TTL ------------------------------------------------------------------------------

    def _sweep_ttl(self) -> Tuple[int, List[Tuple[NodeRecord, OwedRelease]]]:
        """Under the lock: drops expired ACTIVE and LOST leases (a LOST one would otherwise
        stay until its trajectory comes back) and owes their pools a force release. Returns
        how many expired and the releases to try now (see :meth:`_take_owed`)."""
        if self.config.lease_ttl_s <= 0:
            return 0, []
        now = self.clock()
        expired: List[LeaseRecord] = []
        for traj, lease in list(self.leases.items()):
            if (lease.state in (LeaseState.ACTIVE, LeaseState.LOST)
                    and lease.deadline_ts is not None and now >= lease.deadline_ts):
                del self.leases[traj]
                self._owe_release(lease, "lease_ttl_expired", force=True)
                expired.append(lease)
        return len(expired), self._take_owed(lease.node_id for lease in expired)

    async def reconcile(self) -> Dict[str, Any]:
        """The TTL sweep (expired leases are dropped and force-released)."""
        async with self._lock:
            expired, due = self._sweep_ttl()
        self._pay_later(due)
        return {"expired": expired, "leases": self._lease_counts()}

    # -- releases owed to pools -------------------------------------------------------------

    def _owe_release(self, lease: LeaseRecord, reason: str, force: bool = False) -> None:
        """Under the lock: ``lease``'s pool is owed its release (once per lease id). A lease
        without an id (released by trajectory) is not owed: a later release by trajectory
        could hit a newer lease of it."""
        if not lease.lease_id or lease.node_id not in self.nodes:
            return
        self._owed.setdefault(lease.node_id, {}).setdefault(
            lease.lease_id, OwedRelease(lease, reason, force))

    def _take_owed(self, node_ids: Iterable[str]) -> List[Tuple[NodeRecord, OwedRelease]]:
        """Under the lock: the owed releases of those nodes to try now: on alive nodes only,
        each at most once at a time (marked in flight)."""
        due: List[Tuple[NodeRecord, OwedRelease]] = []
        if self.closed:
            return due
        for node_id in set(node_ids):
            rec = self.nodes.get(node_id)
            if rec is None or not rec.alive:
                continue
            for owed in self._owed.get(node_id, {}).values():
                if not owed.inflight:
                    owed.inflight = True
                    due.append((rec, owed))
        return due

    def _find_owed(self, trajectory_id: Optional[str],
                   lease_id: Optional[str]) -> Optional[OwedRelease]:
        for by_lease in self._owed.values():
            for owed in by_lease.values():
                if ((trajectory_id is not None and owed.lease.trajectory_id == trajectory_id)
                        or (lease_id is not None and owed.lease.lease_id == lease_id)):
                    return owed
        return None

    def _settle_owed(self, lease: LeaseRecord, owed: Optional[OwedRelease] = None) -> None:
        """Under the lock: the pool has ``lease`` back (only ``owed``'s entry, if given)."""
        by_lease = self._owed.get(lease.node_id)
        if by_lease is None or lease.lease_id not in by_lease:
            return
        if owed is not None and by_lease[lease.lease_id] is not owed:
            return
        del by_lease[lease.lease_id]
        if not by_lease:
            del self._owed[lease.node_id]

    def _pay_later(self, due: List[Tuple[NodeRecord, OwedRelease]]) -> None:
        for rec, owed in due:
            self._spawn(self._pay(rec, owed))

    async def _pay(self, rec: NodeRecord, owed: OwedRelease) -> None:
        """One attempt at an owed release. Any answer settles it (released, already
        releasing or released, or a refusal: the pool no longer holds the lease); a failure
        is the node's, as for every release, and counts against the attempts."""
        lease = owed.lease
        try:
            if owed.force:
                call = rec.client.force_release(lease.slot_id, lease.lease_id, owed.reason)
            else:
                call = rec.client.release(lease.lease_id, lease.trajectory_id, owed.reason)
            await self._call(call, self.config.rpc_timeout_s)
        except asyncio.CancelledError:
            owed.inflight = False
            raise
        except _REFUSALS:
            pass
        except Exception as err:  # noqa: BLE001 - anything else is the node's failure
            async with self._lock:
                owed.inflight = False
                owed.attempts += 1
                if owed.attempts >= MAX_RELEASE_ATTEMPTS:
                    self._settle_owed(lease, owed)  # given up: the pool's TTL is the backstop
                self._lose_node(rec, f"release: {_describe(err)}")
            return
        async with self._lock:
            self._settle_owed(lease, owed)

    # -- acquire --------------------------------------------------------------------------

    async def acquire(self, trajectory_id: str, env_type: Optional[str] = None,
                      env_args: Optional[Any] = None) -> Dict[str, Any]:
        """A lease for ``trajectory_id``: its ACTIVE one if it holds one (no node call),
        else a slot on the least-loaded schedulable node, retried until the acquire
        timeout."""
        if not trajectory_id:
            raise ValueError("trajectory_id is required")
        trajectory_id = str(trajectory_id)
        deadline = self.clock() + self.config.acquire_timeout_s
        while True:
            wait_for: Optional["asyncio.Future[Dict[str, Any]]"] = None
            rec: Optional[NodeRecord] = None
            async with self._lock:
                if self.closed:
                    raise RuntimeError("agentbox cluster manager is shut down")
                _, due = self._sweep_ttl()
                lease = self.leases.get(trajectory_id)
                if lease is not None and lease.state is LeaseState.ACTIVE:
                    self._pay_later(due)
                    return lease.to_dict()
                if lease is not None and lease.state is LeaseState.LOST:
                    # Its slot died, or its node is lost: the pool is owed the dead lease,
                    # now if it answers, else once it does.
                    del self.leases[trajectory_id]
                    self._owe_release(lease, "lease_lost")
                    due += self._take_owed([lease.node_id])
                    lease = None
                inflight = self._inflight.get(trajectory_id)
                if inflight is not None:
                    wait_for = inflight
                elif lease is None:
                    rec = self._pick()
                    if rec is not None:
                        rec.reserved += 1
                        fut: "asyncio.Future[Dict[str, Any]]" = (
                            asyncio.get_running_loop().create_future())
                        self._inflight[trajectory_id] = fut
                # else: RELEASING — wait for the background release to drop it.
            self._pay_later(due)

            if wait_for is not None:
                try:
                    return dict(await asyncio.shield(wait_for))
                except Exception:  # noqa: BLE001 - the other acquire failed; try ourselves
                    continue
            if rec is not None:
                result = await self._acquire_on(rec, trajectory_id, env_type, env_args)
                if result is not None:
                    return result
                continue  # the node refused or was lost: choose again at once

            if self.clock() >= deadline:
                raise TimeoutError(f"no agentbox {POOL_MODE} slot available")
            await self.refresh()
            await asyncio.sleep(self.config.acquire_poll_s)

    def _pick(self) -> Optional[NodeRecord]:
        candidates = [r for r in self.nodes.values() if r.schedulable()]
        if not candidates:
            return None
        return min(candidates, key=NodeRecord.sort_key)

    async def _acquire_on(self, rec: NodeRecord, trajectory_id: str, env_type: Optional[str],
                          env_args: Optional[Any]) -> Optional[Dict[str, Any]]:
        """The node call of an acquire, outside the lock; ``None`` to choose again."""
        fut = self._inflight[trajectory_id]
        try:
            raw = await self._call(rec.client.acquire(trajectory_id, env_type, env_args),
                                   self.config.node_acquire_timeout_s)
        except BaseException as err:  # noqa: BLE001 - every outcome must settle the future
            async with self._lock:
                rec.reserved -= 1
                del self._inflight[trajectory_id]
                if isinstance(err, (NoFreeSlot, Draining, LeaseLost, LeaseNotFound,
                                    SlotFailed)):
                    # Our cached counts were stale (or the pool still holds a dead lease of
                    # this trajectory, or the slot it chose failed): nothing free there until
                    # the next refresh, so the retry goes elsewhere or waits instead of
                    # spinning on this node.
                    rec.ready = 0
                    rec.pool_draining = rec.pool_draining or isinstance(err, Draining)
                    rec.last_refresh_ts = 0.0
                    if isinstance(err, LeaseLost):
                        self._spawn(self._release_quietly(
                            rec, LeaseRecord("", trajectory_id, rec.node_id, rec.node_ip, 0, 0,
                                             None, 0.0, None, 0), "lease_lost"))
                elif isinstance(err, asyncio.CancelledError):
                    pass
                elif not isinstance(err, _REFUSALS):
                    self._lose_node(rec, f"acquire: {_describe(err)}")
            fut.set_exception(err if isinstance(err, Exception) else RuntimeError("cancelled"))
            fut.exception()  # retrieved: nobody may be waiting
            if isinstance(err, asyncio.CancelledError):
                raise
            if isinstance(err, (PoolRequestError, ValueError)):
                raise
            return None

        release_back = owed_back = False
        due: List[Tuple[NodeRecord, OwedRelease]] = []
        async with self._lock:
            rec.reserved -= 1
            del self._inflight[trajectory_id]
            now = self.clock()
            ttl = self.config.lease_ttl_s
            lease = LeaseRecord(
                lease_id=str(raw["lease_id"]),
                trajectory_id=trajectory_id,
                node_id=rec.node_id,
                node_ip=str(raw.get("node_ip") or rec.node_ip),
                slot_id=int(raw["slot_id"]),
                port=int(raw["port"]),
                sandbox_url=raw.get("sandbox_url"),
                acquired_ts=now,
                deadline_ts=(now + ttl) if ttl > 0 else None,
                generation=int(raw.get("generation", 0)),
            )
            if self.closed or not rec.alive:
                release_back = True
                if not self.closed:
                    self._owe_release(lease, "node_lost")  # paid once the node answers
            elif lease.lease_id in self._owed.get(rec.node_id, {}):
                # The pool still held the trajectory's old lease, whose release we owe it, and
                # answered with it: the release would take it from the caller. Not handed out;
                # chosen again (not on this node until its next refresh) once it is paid.
                owed_back = True
                rec.ready = 0
                rec.last_refresh_ts = 0.0
                due = self._take_owed([rec.node_id])
            else:
                self.leases[trajectory_id] = lease
                rec.ready = max(0, rec.ready - 1)
                rec.leased += 1
        if owed_back:
            self._pay_later(due)
            fut.set_exception(RuntimeError(f"lease {lease.lease_id} is being released"))
            fut.exception()
            return None
        if release_back:
            # Shut down or lost while we waited: the slot must not stay leased to nobody
            # (a lost node's is owed above; a closed manager tries once).
            if self.closed:
                self._spawn(self._release_quietly(rec, lease, "manager_closed"))
            err = RuntimeError("agentbox cluster manager is shut down")
            fut.set_exception(err)
            fut.exception()
            if self.closed:
                raise err
            return None
        result = lease.to_dict()
        fut.set_result(result)
        return dict(result)

    async def _release_quietly(self, rec: NodeRecord, lease: LeaseRecord, reason: str) -> None:
        try:
            await self._call(rec.client.release(lease.lease_id or None, lease.trajectory_id,
                                                reason),
                             self.config.rpc_timeout_s)
        except Exception:  # noqa: BLE001 - best effort; the pool's TTL is the backstop
            pass

    # -- release --------------------------------------------------------------------------

    def _find(self, trajectory_id: Optional[str], lease_id: Optional[str]) -> Optional[LeaseRecord]:
        if trajectory_id is not None:
            lease = self.leases.get(str(trajectory_id))
            if lease is not None:
                return lease
        if lease_id is not None:
            for lease in self.leases.values():
                if lease.lease_id == lease_id:
                    return lease
        return None

    async def release(self, trajectory_id: Optional[str] = None, lease_id: Optional[str] = None,
                      reason: Optional[str] = None) -> Dict[str, Any]:
        """Queues the release of a lease (by trajectory first, then lease id) and answers at
        once; the node call runs as a background task."""
        reason = reason or "manager_release"
        async with self._lock:
            lease = self._find(trajectory_id, lease_id)
            if lease is None:
                owed = self._find_owed(trajectory_id, lease_id)
                if owed is not None:  # let go of, its pool not told yet: on its way back
                    return {"released": True, "release_queued": True, "already_releasing": True,
                            "already_released": False, "slot_reusable": False,
                            **_ids(owed.lease)}
                return {"released": True, "already_released": True,
                        "trajectory_id": trajectory_id, "lease_id": lease_id}
            ids = _ids(lease)
            if self.closed:
                self.leases.pop(lease.trajectory_id, None)
                return {"released": True, "manager_closed": True, "already_released": False,
                        "slot_reusable": False, **ids}
            if lease.state is LeaseState.RELEASING:
                return {"released": True, "release_queued": True, "already_releasing": True,
                        "already_released": False, "slot_reusable": False, **ids}
            rec = self.nodes.get(lease.node_id)
            if rec is None or not rec.alive:
                # The caller is done with it; its pool gets it back once it answers again.
                self.leases.pop(lease.trajectory_id, None)
                self._owe_release(lease, reason)
                return {"released": True, "node_lost": True, "already_released": False,
                        "slot_reusable": False, **ids}
            lease.state = LeaseState.RELEASING
        self._spawn(self._background_release(rec, lease, reason))
        return {"released": True, "release_queued": True, "already_released": False,
                "slot_reusable": False, **ids}

    async def _background_release(self, rec: NodeRecord, lease: LeaseRecord, reason: str) -> None:
        """Hands the lease back to its pool. The pool answers once the slot is queued for its
        reset and never leases it before the reset is done, so the lease is dropped as soon
        as the pool has it (no polling for READY, hence no release race). A failed call loses
        the node and leaves the release owed to it (the caller has let go of the lease)."""
        try:
            await self._call(rec.client.release(lease.lease_id, lease.trajectory_id, reason),
                             self.config.release_timeout_s)
        except asyncio.CancelledError:
            raise
        except _REFUSALS:
            pass  # the pool no longer holds it: released all the same
        except Exception as err:  # noqa: BLE001 - anything else is the node's failure
            async with self._lock:
                if self.leases.get(lease.trajectory_id) is lease:
                    del self.leases[lease.trajectory_id]
                self._owe_release(lease, reason)
                self._lose_node(rec, f"release: {_describe(err)}")
            return
        async with self._lock:
            if self.leases.get(lease.trajectory_id) is lease:
                del self.leases[lease.trajectory_id]
            self._settle_owed(lease)  # owed meanwhile (lost, acquired again): paid all the same
            rec.leased = max(0, rec.leased - 1)
            rec.releasing += 1  # until the next refresh says the slot is READY again

    # -- commands and files -----------------------------------------------------------------

    async def _active(self, trajectory_id: Optional[str],
                      lease_id: Optional[str]) -> Tuple[NodeRecord, LeaseRecord]:
        if trajectory_id is None and lease_id is None:
            raise ValueError("trajectory_id or lease_id is required")
        async with self._lock:
            lease = self._find(trajectory_id, lease_id)
            if lease is None or lease.state is not LeaseState.ACTIVE:
                raise LeaseNotFound("active agentbox lease not found", "lease_not_found", 404)
            rec = self.nodes.get(lease.node_id)
            if rec is None or not rec.alive:
                raise RuntimeError(f"node {lease.node_id} of lease {lease.lease_id} is lost")
            return rec, lease

    async def _on_lease(self, trajectory_id: Optional[str], lease_id: Optional[str],
                        call: Callable[[NodeClient, Dict[str, Any]], Awaitable[Dict[str, Any]]],
                        request: Dict[str, Any], timeout: float) -> Dict[str, Any]:
        rec, lease = await self._active(trajectory_id, lease_id)
        request = {"trajectory_id": lease.trajectory_id, "lease_id": lease.lease_id, **request}
        try:
            return await self._call(call(rec.client, request), timeout)
        except LeaseLost as err:
            async with self._lock:
                lease.state = LeaseState.LOST
            raise LeaseNotFound(f"agentbox lease lost: {err.message}", "lease_lost", 410) from err
        except _REFUSALS:
            raise
        except Exception as err:
            async with self._lock:
                self._lose_node(rec, f"{getattr(call, '__name__', 'call')}: {_describe(err)}")
            raise RuntimeError(f"node {rec.node_id} failed: {_describe(err)}") from err

    async def run_command(self, *, command: Any, trajectory_id: Optional[str] = None,
                          lease_id: Optional[str] = None, cwd: Optional[str] = None,
                          env: Optional[Mapping[str, str]] = None,
                          timeout: Optional[float] = None,
                          stdin: Optional[str] = None) -> Dict[str, Any]:
        rpc_timeout = self.config.rpc_timeout_s + (float(timeout) if timeout else
                                                    self.config.release_timeout_s)
        # The node waits for the pool's answer as long as we wait for the node: its own RPC
        # timeout would cut a command that outlasts it and make a busy node look lost.
        req: Dict[str, Any] = {"command": command, "cwd": cwd, "env": dict(env or {}),
                               "timeout": timeout, "stdin": stdin,
                               "reply_timeout": rpc_timeout}
        reply = await self._on_lease(trajectory_id, lease_id,
                                     lambda c, r: c.run_command(r), req, rpc_timeout)
        return reply

    async def read_file(self, *, path: str, trajectory_id: Optional[str] = None,
                        lease_id: Optional[str] = None, encoding: Optional[str] = "utf-8",
                        max_bytes: Optional[int] = None) -> Any:
        reply = await self._on_lease(trajectory_id, lease_id, lambda c, r: c.read_file(r),
                                     {"path": path, "max_bytes": max_bytes},
                                     self.config.rpc_timeout_s)
        return decode_content(reply, encoding)

    async def write_file(self, *, path: str, content: Any, trajectory_id: Optional[str] = None,
                         lease_id: Optional[str] = None, encoding: str = "utf-8",
                         append: bool = False) -> Dict[str, Any]:
        return await self._on_lease(
            trajectory_id, lease_id, lambda c, r: c.write_file(r),
            {"path": path, "content": content, "encoding": encoding, "append": append},
            self.config.rpc_timeout_s)

    # -- status, drain ----------------------------------------------------------------------

    def _lease_counts(self) -> Dict[str, int]:
        states = [lease.state for lease in self.leases.values()]
        return {
            "active": states.count(LeaseState.ACTIVE),
            "releasing": states.count(LeaseState.RELEASING),
            "tracked": len(states),
            "expired": 0,  # expired leases are dropped at once
            "lost": states.count(LeaseState.LOST),
        }

    def snapshot(self) -> Dict[str, Any]:
        nodes = [rec.to_dict() for rec in sorted(self.nodes.values(), key=lambda r: r.node_id)]
        alive = [n for n in nodes if n["alive"]]
        return {
            "closed": self.closed,
            "pool_mode": POOL_MODE,
            "total_capacity": sum(n["capacity"] for n in alive),
            "total_ready": sum(n["free"] for n in alive),
            "total_leased": sum(n["leased"] for n in alive),
            "total_resetting": sum(n["resetting"] for n in alive),
            "total_restarting": sum(n["restarting"] for n in alive),
            "total_failed": sum(n["failed"] for n in alive),
            "total_lost": sum(n["lost"] for n in nodes) + sum(1 for n in nodes if not n["alive"]),
            "nodes": nodes,
            "leases": self._lease_counts(),
        }

    async def status(self) -> Dict[str, Any]:
        """TTL sweep, a forced health refresh, then the totals and the node table."""
        if not self.closed:
            await self.reconcile()
            await self.refresh(force=True)
        async with self._lock:
            return self.snapshot()

    async def wait_ready(self, timeout_s: float = 600.0) -> Dict[str, Any]:
        """Polls the status every second until every alive node's slots are ready."""
        deadline = self.clock() + float(timeout_s)
        while True:
            st = await self.status()
            if st["nodes"] and st["total_capacity"] > 0 and (
                    st["total_ready"] + st["total_leased"] >= st["total_capacity"]):
                return st
            if self.clock() >= deadline:
                raise TimeoutError(
                    f"agentbox pool not ready: {st['total_ready']}/{st['total_capacity']}")
            await asyncio.sleep(1.0)

    async def drain_node(self, node_id: str) -> Dict[str, Any]:
        """No new leases on the node (the manager's flag, and the pool's, best effort)."""
        return await self._set_drain(node_id, True)

    async def undrain_node(self, node_id: str) -> Dict[str, Any]:
        return await self._set_drain(node_id, False)

    async def _set_drain(self, node_id: str, drain: bool) -> Dict[str, Any]:
        async with self._lock:
            rec = self._node(node_id)
            rec.draining = drain
        try:
            st = await self._call(rec.client.drain() if drain else rec.client.undrain(),
                                  self.config.rpc_timeout_s)
            async with self._lock:
                rec.apply_status(st, self.clock())
        except Exception as err:  # noqa: BLE001 - the manager's flag holds regardless
            async with self._lock:
                rec.last_error = f"{'drain' if drain else 'undrain'}: {_describe(err)}"
        async with self._lock:
            return rec.to_dict()

    async def restart_node_pool(self, node_id: str) -> Dict[str, Any]:
        """The pool restarts dead slots itself; this asks it again now, which also brings a
        lost node back once its pool answers."""
        async with self._lock:
            rec = self._node(node_id)
            rec.last_refresh_ts = 0.0
        await self.refresh(force=True)
        async with self._lock:
            return rec.to_dict()

    # -- shutdown ---------------------------------------------------------------------------

    async def shutdown(self) -> Dict[str, Any]:
        """Closes the manager (acquire fails from now on), cancels background work, tells each
        node, and drops every lease as LOST. Safe to call again."""
        async with self._lock:
            was_closed = self.closed
            self.closed = True
            for lease in self.leases.values():
                lease.state = LeaseState.LOST
            nodes = list(self.nodes.values())
        tasks = list(self._tasks)
        if self._health_task is not None:
            tasks.append(self._health_task)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        results: Dict[str, Any] = {}
        if not was_closed:
            replies = await asyncio.gather(
                *(self._call(rec.client.shutdown(), self.config.rpc_timeout_s) for rec in nodes),
                return_exceptions=True,
            )
            for rec, res in zip(nodes, replies):
                results[rec.node_id] = (
                    {"stopped": False, "error": _describe(res)}
                    if isinstance(res, BaseException) else {"stopped": True, **res})
        async with self._lock:
            for rec in nodes:
                rec.ready = rec.leased = rec.releasing = rec.starting = rec.restarting = 0
                rec.reserved = 0
            self.leases.clear()
            self._owed.clear()  # closed: nothing is tried again; the pools' TTL is the backstop
        return {"stopped": True, "closed": True, "already_closed": was_closed,
                "nodes": results}


def _ids(lease: LeaseRecord) -> Dict[str, Any]:
    """The lease's identity in a release reply."""
    return {"trajectory_id": lease.trajectory_id, "lease_id": lease.lease_id,
            "slot_id": lease.slot_id, "node_id": lease.node_id, "node_ip": lease.node_ip}


def _describe(err: BaseException) -> str:
    if isinstance(err, asyncio.TimeoutError):
        return "timed out"
    text = str(err)
    return f"{err.__class__.__name__}: {text}" if text else err.__class__.__name__


__all__ = [
    "POOL_MODE", "NodeClient", "ManagerConfig", "LeaseState", "LeaseRecord", "NodeRecord",
    "ClusterManagerCore", "PoolError", "PoolUnavailable",
]
