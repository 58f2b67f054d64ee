"""The cluster manager's rules with in-memory nodes (no Ray): the behaviours of the reference's
``test_ray_blackbox_scheduler.py``, plus node loss, timeouts and the lock discipline."""

from __future__ import annotations

import asyncio
import time

import pytest
from fakes import Clock, FakeNode

from agentbox_ray.core import ClusterManagerCore, LeaseState, ManagerConfig


def fast_config(**kw) -> ManagerConfig:
    base = dict(acquire_timeout_s=2.0, acquire_poll_s=0.01, status_refresh_s=0.0,
                health_interval_s=0.05, rpc_timeout_s=0.5, node_acquire_timeout_s=0.5,
                lease_ttl_s=0.0, release_timeout_s=2.0)
    base.update(kw)
    return ManagerConfig(**base)


async def manager(*nodes: FakeNode, config=None, clock=time.time) -> ClusterManagerCore:
    core = ClusterManagerCore(config or fast_config(), clock=clock)
    for n in nodes:
        core.add_node(n.node_id, n.ip, n.node_id, n.capacity, n)
    await core.refresh(force=True)
    return core


async def settle(core: ClusterManagerCore) -> None:
    while core._tasks:
        await asyncio.gather(*list(core._tasks), return_exceptions=True)


def run(coro):
    return asyncio.run(coro)


def test_defaults_are_the_references():
    c = ManagerConfig()
    assert c.acquire_timeout_s == 1800
    assert c.acquire_poll_s == 0.25
    assert c.lease_ttl_s == 2100
    env = {"DRESSAGE_BLACKBOX_ACQUIRE_TIMEOUT_SEC": "60", "AGENTBOX_RAY_LEASE_TTL_SEC": "5",
           "DRESSAGE_BLACKBOX_LEASE_TTL_SEC": "9", "AGENTBOX_RAY_RPC_TIMEOUT_SEC": "nope"}
    c = ManagerConfig.from_env(env)
    assert (c.acquire_timeout_s, c.lease_ttl_s, c.rpc_timeout_s) == (60, 5, 10)


def test_least_loaded_node_wins_ties_go_to_more_free():
    async def body():
        a, b = FakeNode("node-a", 4), FakeNode("node-b", 8)
        core = await manager(a, b)
        # Both at 0 used: the tie on used/capacity goes to b (more free).
        first = await core.acquire("t0")
        assert first["node_id"] == "node-b"
        # b at 1/8, a at 0/4: a is less loaded.
        second = await core.acquire("t1")
        assert second["node_id"] == "node-a"
        # 12 leases in all spread by load: a ends with 4, b with 8.
        for i in range(2, 12):
            await core.acquire(f"t{i}")
        by_node = {}
        for lease in core.leases.values():
            by_node[lease.node_id] = by_node.get(lease.node_id, 0) + 1
        assert by_node == {"node-a": 4, "node-b": 8}
        st = core.snapshot()
        assert st["total_capacity"] == 12 and st["total_ready"] == 0
        assert st["total_leased"] == 12
    run(body())


def test_lease_dict_has_the_references_fields():
    async def body():
        a = FakeNode("node-a", 1, ip="10.0.0.12")
        core = await manager(a, config=fast_config(lease_ttl_s=100))
        lease = await core.acquire("traj-1", env_type="swe", env_args={"x": 1})
        assert set(lease) == {"lease_id", "trajectory_id", "node_id", "node_ip", "slot_id",
                              "port", "sandbox_url", "acquired_ts", "deadline_ts",
                              "generation", "status", "ready"}
        assert lease["status"] == "ACTIVE" and lease["ready"] is True
        assert lease["sandbox_url"] == "http://10.0.0.12:31000"
        assert lease["node_id"] == "node-a"  # the Ray node id, as drain_node takes
        assert lease["deadline_ts"] == pytest.approx(lease["acquired_ts"] + 100)
        assert lease["lease_id"].startswith("lease-node-a-0000-gen1-traj-1-")
    run(body())


def test_repeated_acquire_returns_the_same_lease_with_one_node_call():
    async def body():
        a = FakeNode("node-a", 2)
        core = await manager(a)
        one = await core.acquire("traj")
        two = await core.acquire("traj")
        assert one == two
        assert a.count("acquire") == 1
    run(body())


def test_concurrent_acquires_for_one_trajectory_make_one_node_call():
    async def body():
        a = FakeNode("node-a", 4)
        core = await manager(a)
        leases = await asyncio.gather(*(core.acquire("traj") for _ in range(10)))
        assert all(lease == leases[0] for lease in leases)
        assert a.count("acquire") == 1
        assert core.snapshot()["leases"]["active"] == 1
    run(body())


def test_release_replies_queued_then_already_releasing_then_already_released():
    async def body():
        a = FakeNode("node-a", 1)
        a.release_gate = asyncio.Event()
        core = await manager(a)
        lease = await core.acquire("traj")
        r1 = await core.release(trajectory_id="traj", reason="paddock_terminate")
        assert r1["released"] and r1["release_queued"] and not r1["already_released"]
        assert r1["slot_reusable"] is False and r1["lease_id"] == lease["lease_id"]
        r2 = await core.release(trajectory_id="traj")
        assert r2["release_queued"] and r2["already_releasing"]
        a.release_gate.set()
        await settle(core)
        r3 = await core.release(trajectory_id="traj", lease_id=lease["lease_id"])
        assert r3 == {"released": True, "already_released": True, "trajectory_id": "traj",
                      "lease_id": lease["lease_id"]}
        assert a.calls.count(("release", (lease["lease_id"], "traj", "paddock_terminate"))) == 1
    run(body())


def test_release_by_lease_id_alone():
    async def body():
        a = FakeNode("node-a", 1)
        core = await manager(a)
        lease = await core.acquire("traj")
        r = await core.release(lease_id=lease["lease_id"])
        assert r["release_queued"] and r["trajectory_id"] == "traj"
        await settle(core)
        assert core.leases == {}
    run(body())


def test_slot_reused_only_after_release_and_reset():
    async def body():
        a = FakeNode("node-a", 1)
        a.release_gate = asyncio.Event()
        core = await manager(a, config=fast_config(acquire_timeout_s=0.2))
        await core.acquire("t1")
        await core.release(trajectory_id="t1")
        st = core.snapshot()
        assert st["leases"]["releasing"] == 1 and st["total_ready"] == 0
        with pytest.raises(TimeoutError):
            await core.acquire("t2")
        a.release_gate.set()
        await settle(core)
        # Released but still resetting in the pool: not free yet.
        with pytest.raises(TimeoutError):
            await core.acquire("t2")
        a.finish_resets()
        lease = await core.acquire("t2")
        assert lease["slot_id"] == 0 and lease["generation"] == 2
    run(body())


def test_drained_node_is_skipped_and_undrain_restores_it():
    async def body():
        a, b = FakeNode("node-a", 4), FakeNode("node-b", 4)
        core = await manager(a, b)
        node = await core.drain_node("node-a")
        assert node["draining"] is True
        for i in range(4):
            lease = await core.acquire(f"t{i}")
            assert lease["node_id"] == "node-b"
        assert a.count("acquire") == 0
        await core.undrain_node("node-a")
        assert (await core.acquire("t9"))["node_id"] == "node-a"
    run(body())


def test_pool_side_draining_is_respected():
    async def body():
        a, b = FakeNode("node-a", 4), FakeNode("node-b", 2)
        core = await manager(a, b)
        a.draining = True  # drained on the host (`agentbox pool drain`), not by the manager
        await core.refresh(force=True)
        assert (await core.acquire("t0"))["node_id"] == "node-b"
        assert a.count("acquire") == 0
    run(body())


def test_stale_free_count_is_retried_elsewhere():
    async def body():
        a, b = FakeNode("node-a", 4), FakeNode("node-b", 1)
        core = await manager(a, b)
        # Someone else took a's slots behind the manager's back: its cached count is stale.
        for i in range(4):
            await a.acquire(f"other{i}", None, None)
        lease = await core.acquire("t0")
        assert lease["node_id"] == "node-b"
        assert core.nodes["node-a"].alive  # a refusal is not a node loss
    run(body())


def test_a_pool_refusing_an_acquire_is_not_retried_in_a_loop():
    async def body():
        from agentbox_ray.pool_client import LeaseLost

        a, b = FakeNode("node-a", 8), FakeNode("node-b", 1)
        core = await manager(a, b, config=fast_config(status_refresh_s=60))
        a.acquire_error = LeaseLost("lease_lost: slot died", "lease_lost", 410)
        lease = await core.acquire("traj")
        assert lease["node_id"] == "node-b"
        await settle(core)
        assert a.count("acquire") == 1 and core.nodes["node-a"].alive
        # The dead lease the pool still held for the trajectory is handed back.
        assert ("release", (None, "traj", "lease_lost")) in a.calls
    run(body())


def test_a_failed_slot_on_acquire_goes_elsewhere_and_keeps_the_node():
    async def body():
        from agentbox_ray.pool_client import SlotFailed

        a, b = FakeNode("node-a", 8), FakeNode("node-b", 1)
        core = await manager(a, b, config=fast_config(status_refresh_s=60))
        a.acquire_error = SlotFailed("slot_failed: slot 0: cannot listen", "slot_failed", 502)
        lease = await core.acquire("traj")
        assert lease["node_id"] == "node-b"
        assert a.count("acquire") == 1 and core.nodes["node-a"].alive
    run(body())


def test_ttl_expiry_force_releases_with_slot_and_lease_id():
    async def body():
        clock = Clock()
        a = FakeNode("node-a", 2)
        core = await manager(a, config=fast_config(lease_ttl_s=30), clock=clock)
        lease = await core.acquire("traj")
        clock.now += 29
        assert (await core.reconcile())["expired"] == 0
        clock.now += 2
        assert (await core.reconcile())["expired"] == 1
        await settle(core)
        assert ("force_release", (lease["slot_id"], lease["lease_id"], "lease_ttl_expired")) \
            in a.calls
        assert core.leases == {}
        assert core.snapshot()["leases"]["expired"] == 0
        # A new acquire gets a fresh lease.
        again = await core.acquire("traj")
        assert again["lease_id"] != lease["lease_id"]
    run(body())


def test_node_loss_marks_its_leases_lost_and_acquires_go_elsewhere():
    async def body():
        a, b = FakeNode("node-a", 4), FakeNode("node-b", 8)
        core = await manager(a, b)
        leases = [await core.acquire(f"t{i}") for i in range(12)]
        on_a = [lease for lease in leases if lease["node_id"] == "node-a"]
        assert len(on_a) == 4
        for i in range(12):
            await core.release(trajectory_id=f"t{i}")
        await settle(core)
        a.finish_resets()
        b.finish_resets()
        await core.refresh(force=True)
        leases = [await core.acquire(f"u{i}") for i in range(4)]
        a.down = True
        await core.refresh(force=True)
        st = core.snapshot()
        node_a = next(n for n in st["nodes"] if n["node_id"] == "node-a")
        assert node_a["alive"] is False and "connection refused" in node_a["last_error"]
        lost = [lease for lease in leases if lease["node_id"] == "node-a"]
        assert lost and st["leases"]["lost"] == len(lost)
        for lease in lost:
            assert core.leases[lease["trajectory_id"]].state is LeaseState.LOST
            with pytest.raises(KeyError):
                await core.run_command(command="true", trajectory_id=lease["trajectory_id"])
            again = await core.acquire(lease["trajectory_id"])
            assert again["node_id"] == "node-b"
        for i in range(10, 12):
            assert (await core.acquire(f"u{i}"))["node_id"] == "node-b"
        # The next good refresh brings the node back.
        a.down = False
        await core.refresh(force=True)
        assert core.nodes["node-a"].alive
    run(body())


def test_a_release_while_the_node_is_lost_is_handed_back_once_it_answers():
    async def body():
        a = FakeNode("node-a", 2)
        core = await manager(a)
        lease = await core.acquire("traj")
        a.down = True
        await core.refresh(force=True)
        r = await core.release(trajectory_id="traj", reason="paddock_terminate")
        assert r["released"] and r["node_lost"]
        # Asked again while it is owed: already on its way back, not forgotten.
        again = await core.release(lease_id=lease["lease_id"])
        assert again["already_releasing"] and not again["already_released"]
        a.down = False
        await core.refresh(force=True)
        await settle(core)
        assert a.calls.count(("release", (lease["lease_id"], "traj", "paddock_terminate"))) == 1
        assert a.slots[lease["slot_id"]] is None  # the pool has it back
        # Done once: later refreshes do not release it again.
        await core.refresh(force=True)
        await settle(core)
        assert a.count("release") == 1
        assert (await core.release(lease_id=lease["lease_id"]))["already_released"]
    run(body())


def test_a_failed_background_release_is_retried_when_the_node_answers():
    async def body():
        a = FakeNode("node-a", 1)
        core = await manager(a)
        lease = await core.acquire("traj")
        a.down = True  # not noticed yet: the release is queued, its node call fails
        assert (await core.release(trajectory_id="traj"))["release_queued"]
        await settle(core)
        assert core.nodes["node-a"].alive is False
        assert "traj" not in core.leases  # the caller let it go; the manager owes it back
        a.down = False
        await core.refresh(force=True)
        await settle(core)
        assert a.count("release") == 2 and a.slots[lease["slot_id"]] is None
        a.finish_resets()
        await core.refresh(force=True)
        assert (await core.acquire("next"))["slot_id"] == lease["slot_id"]
    run(body())


def test_a_lost_lease_acquired_again_elsewhere_is_handed_back_to_its_node():
    async def body():
        a, b = FakeNode("node-a", 2), FakeNode("node-b", 1)
        core = await manager(a, b)
        lease = await core.acquire("traj")
        assert lease["node_id"] == "node-a"
        a.down = True
        await core.refresh(force=True)
        assert (await core.acquire("traj"))["node_id"] == "node-b"
        a.down = False
        await core.refresh(force=True)
        await settle(core)
        assert ("release", (lease["lease_id"], "traj", "lease_lost")) in a.calls
        assert a.slots[lease["slot_id"]] is None
    run(body())


def test_lost_leases_expire_with_the_ttl_and_are_handed_back():
    async def body():
        clock = Clock()
        a = FakeNode("node-a", 2)
        core = await manager(a, config=fast_config(lease_ttl_s=30), clock=clock)
        lease = await core.acquire("traj")
        a.down = True
        await core.refresh(force=True)
        assert core.leases["traj"].state is LeaseState.LOST
        clock.now += 31
        assert (await core.reconcile())["expired"] == 1
        assert core.leases == {}
        a.down = False
        await core.refresh(force=True)
        await settle(core)
        assert ("force_release", (lease["slot_id"], lease["lease_id"], "lease_ttl_expired")) \
            in a.calls
        assert a.slots[lease["slot_id"]] is None
    run(body())


def test_an_owed_lease_handed_out_again_by_its_pool_is_not_taken():
    async def body():
        a = FakeNode("node-a", 2)
        core = await manager(a)
        lease = await core.acquire("traj")
        a.down = True
        await core.refresh(force=True)
        await core.release(trajectory_id="traj")  # owed: the pool still holds it
        a.down = False
        a.release_gate = asyncio.Event()  # the owed release reaches the pool, not yet done
        await core.refresh(force=True)
        # The pool answers an acquire of the trajectory with the lease it still holds, which
        # the owed release is about to take: the manager must not hand it out.
        again = asyncio.ensure_future(core.acquire("traj"))
        await asyncio.sleep(0.05)
        a.release_gate.set()
        again = await again
        await settle(core)
        assert again["lease_id"] != lease["lease_id"]
        assert any(s is not None and s[0] == again["lease_id"] for s in a.slots.values())
    run(body())


def test_release_retries_are_bounded():
    async def body():
        from agentbox_ray.core import MAX_RELEASE_ATTEMPTS
        from agentbox_ray.pool_client import PoolUnavailable

        a = FakeNode("node-a", 1)
        core = await manager(a)
        lease = await core.acquire("traj")
        # The pool answers its status but every release fails.
        a.release_error = PoolUnavailable("release: connection reset")
        await core.release(trajectory_id="traj")
        for _ in range(MAX_RELEASE_ATTEMPTS + 3):
            await core.refresh(force=True)
            await settle(core)
        assert a.count("release") == 1 + MAX_RELEASE_ATTEMPTS
        assert core.nodes["node-a"].alive  # the last refresh brought it back
        assert (await core.release(lease_id=lease["lease_id"]))["already_released"]
    run(body())


def test_a_hanging_node_times_out_is_lost_and_does_not_block_the_manager():
    async def body():
        a, b = FakeNode("node-a", 8), FakeNode("node-b", 1)
        core = await manager(a, b, config=fast_config(node_acquire_timeout_s=0.3))
        a.hang = True
        # The acquire to a hangs; meanwhile the manager answers others at once.
        slow = asyncio.ensure_future(core.acquire("slow"))
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        st = core.snapshot()
        r = await core.release(trajectory_id="nobody")
        assert r["already_released"] and time.monotonic() - t0 < 0.1
        assert st["nodes"][0]["used"] == 1  # the reserved slot counts as used
        lease = await slow
        assert lease["node_id"] == "node-b"
        assert core.nodes["node-a"].alive is False
        assert "timed out" in core.nodes["node-a"].last_error
    run(body())


def test_health_loop_detects_a_dead_pool_within_its_interval():
    async def body():
        a, b = FakeNode("node-a", 2), FakeNode("node-b", 2)
        core = await manager(a, b)
        leases = [await core.acquire(f"t{i}") for i in range(4)]
        core.start_health_loop()
        a.down = True
        await asyncio.sleep(core.config.health_interval_s * 3)
        lost = {lease["trajectory_id"] for lease in leases if lease["node_id"] == "node-a"}
        assert lost and {t for t, rec in core.leases.items()
                         if rec.state is LeaseState.LOST} == lost
        await core.shutdown()
    run(body())


def test_a_slot_the_pool_no_longer_knows_makes_its_lease_lost():
    async def body():
        a = FakeNode("node-a", 2)
        core = await manager(a)
        lease = await core.acquire("traj")
        a.slots[lease["slot_id"]] = None  # the pool restarted and forgot it
        await core.refresh(force=True)
        assert core.leases["traj"].state is LeaseState.LOST
        with pytest.raises(KeyError):
            await core.read_file(path="x", trajectory_id="traj")
    run(body())


def test_commands_and_files_go_to_the_leases_node():
    async def body():
        a, b = FakeNode("node-a", 1), FakeNode("node-b", 1)
        core = await manager(a, b)
        lease = await core.acquire("traj")
        node = a if lease["node_id"] == "node-a" else b
        out = await core.run_command(command=["echo", "hi"], trajectory_id="traj")
        assert out["returncode"] == 0 and out["lease_id"] == lease["lease_id"]
        w = await core.write_file(path="/workspace/f", content="héllo", trajectory_id="traj")
        assert w["bytes"] == len("héllo".encode())
        assert await core.read_file(path="/workspace/f", lease_id=lease["lease_id"]) == "héllo"
        raw = await core.read_file(path="/workspace/f", trajectory_id="traj", encoding=None)
        assert raw == "héllo".encode()
        assert node.count("run_command") == 1
        with pytest.raises(KeyError):
            await core.run_command(command="true", trajectory_id="unknown")
        with pytest.raises(ValueError):
            await core.run_command(command="true")
    run(body())


def test_status_dict_shape():
    async def body():
        a = FakeNode("node-a", 2)
        core = await manager(a)
        await core.acquire("traj")
        st = await core.status()
        for key in ("closed", "pool_mode", "total_capacity", "total_ready", "total_leased",
                    "total_resetting", "total_restarting", "total_failed", "total_lost"):
            assert key in st
        assert st["pool_mode"] == "blackbox"
        assert set(st["leases"]) == {"active", "releasing", "tracked", "expired", "lost"}
        assert set(st["nodes"][0]) == {
            "node_id", "node_ip", "hostname", "capacity", "alive", "ready", "leased", "used",
            "free", "resetting", "restarting", "failed", "lost", "draining",
            "last_heartbeat_ts", "last_error"}
        assert st["nodes"][0]["used"] == 1 and st["nodes"][0]["free"] == 1
    run(body())


def test_shutdown_closes_blocks_acquire_and_is_idempotent():
    async def body():
        a = FakeNode("node-a", 2)
        core = await manager(a)
        await core.acquire("traj")
        first = await core.shutdown()
        assert first["closed"] and first["stopped"] and first["nodes"]["node-a"]["stopped"]
        with pytest.raises(RuntimeError, match="shut down"):
            await core.acquire("other")
        second = await core.shutdown()
        assert second["closed"] and second["already_closed"]
        assert a.count("shutdown") == 1
        r = await core.release(trajectory_id="traj")
        assert r["already_released"]
        assert core.snapshot()["closed"] is True
    run(body())


def test_wait_ready_and_timeout():
    async def body():
        a = FakeNode("node-a", 2)
        core = await manager(a)
        st = await core.wait_ready(timeout_s=1)
        assert st["total_ready"] == 2
        a.resetting.add(0)
        with pytest.raises(TimeoutError):
            await core.wait_ready(timeout_s=0)
    run(body())
