//! The lease logic against a deterministic in-process [`SlotBackend`] (no sandboxes: the
//! integration test `tests/tests/pool.rs` runs the real launcher and gateway).

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use super::*;
use crate::testing::Fake;

pub(crate) fn options(slots: u32) -> PoolOptions {
    PoolOptions {
        slots,
        node_id: "node-abcdefghijklmnop".into(),
        node_ip: "10.0.0.7".into(),
        hostname: "host".into(),
        listen_host: "127.0.0.1".parse().unwrap(),
        advertise_host: "10.0.0.7".into(),
        port_base: 31000,
        health_interval: Duration::from_secs(3600),
        lease_ttl: None,
        retry_backoff: Duration::ZERO,
        control_uids: vec![],
    }
}

fn pool(opts: PoolOptions) -> (Arc<Pool<Fake>>, Fake) {
    let fake = Fake::default();
    let p = Pool::new(opts, fake.clone(), CancellationToken::new());
    p.start();
    (p, fake)
}

async fn until(what: &str, mut f: impl FnMut() -> bool) {
    for _ in 0..2000 {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("timed out waiting for {what}");
}

fn slot_of(p: &Arc<Pool<Fake>>, id: u32) -> SlotView {
    p.status()
        .slots
        .into_iter()
        .find(|s| s.slot_id == id)
        .unwrap()
}

async fn all_ready(p: &Arc<Pool<Fake>>) {
    let n = p.options().slots;
    until("all slots ready", || p.status().ready == n).await;
}

fn acq(t: &str) -> AcquireRequest {
    AcquireRequest {
        trajectory_id: t.into(),
        env_type: None,
        env_args: None,
    }
}

fn by_traj(t: &str) -> LeaseRef {
    LeaseRef {
        trajectory_id: Some(t.into()),
        lease_id: None,
        reason: None,
    }
}

fn cmd(t: &str, c: Command) -> RunCommandRequest {
    RunCommandRequest {
        lease: by_traj(t),
        command: c,
        cwd: None,
        env: BTreeMap::new(),
        timeout: None,
        stdin: None,
    }
}

#[test]
fn lease_ids_have_the_reference_format() {
    let long = "t".repeat(40);
    assert_eq!(
        lease_id("node-abcdefghijklmnop", 3, 2, &long, "0123abcd"),
        format!("lease-node-abcdefg-0003-gen2-{}-0123abcd", "t".repeat(32))
    );
    // Cut by characters, never inside one.
    assert_eq!(
        lease_id("né", 0, 1, "ü", "00000000"),
        "lease-né-0000-gen1-ü-00000000"
    );
}

#[test]
fn argv_is_joined_with_shell_quoting() {
    let v = |a: &[&str]| a.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    assert_eq!(shell_join(&v(&["ls", "-la", "/tmp"])), "ls -la /tmp");
    assert_eq!(
        shell_join(&v(&["echo", "a b", "it's", ""])),
        r#"echo 'a b' 'it'"'"'s' ''"#
    );
    assert_eq!(shell_join(&v(&["x;rm", "$(id)"])), "'x;rm' '$(id)'");
}

#[tokio::test]
async fn acquire_is_idempotent_and_takes_the_lowest_ready_slot() {
    let (p, _) = pool(options(3));
    all_ready(&p).await;
    let a = p.acquire(&acq("traj-1")).unwrap();
    assert_eq!((a.slot_id, a.port, a.generation), (0, 31000, 1));
    assert_eq!(a.sandbox_url.as_deref(), Some("http://10.0.0.7:31000"));
    assert_eq!((a.status, a.ready), (LeaseStatus::Active, true));
    assert_eq!(a.node_id, "node-abcdefghijklmnop");
    assert_eq!(a.node_ip, "10.0.0.7");
    let prefix = "lease-node-abcdefg-0000-gen1-traj-1-";
    assert!(a.lease_id.starts_with(prefix), "{}", a.lease_id);
    let tail = &a.lease_id[prefix.len()..];
    assert!(tail.len() == 8 && tail.bytes().all(|b| b.is_ascii_hexdigit()));
    assert_eq!(p.acquire(&acq("traj-1")).unwrap(), a);
    let b = p.acquire(&acq("traj-2")).unwrap();
    assert_eq!((b.slot_id, b.port), (1, 31001));
    let s = p.status();
    assert_eq!((s.leased, s.ready, s.capacity), (2, 1, 3));
    assert_eq!(
        slot_of(&p, 0).lease_id.as_deref(),
        Some(a.lease_id.as_str())
    );
    assert!(matches!(p.acquire(&acq("")), Err(PoolError::BadRequest(_))));
    assert!(matches!(
        p.acquire(&acq("a\nb")),
        Err(PoolError::BadRequest(_))
    ));
}

/// A slot whose port another process holds is passed over: the next READY slot is leased, and
/// the held one says why in its status.
#[tokio::test]
async fn a_slot_whose_port_is_taken_is_passed_over() {
    let (p, fake) = pool(options(3));
    *fake.0.taken_ports.lock().unwrap() = vec![31000];
    all_ready(&p).await;
    let a = p.acquire(&acq("traj-1")).unwrap();
    assert_eq!(a.slot_id, 1, "{a:?}");
    let held = slot_of(&p, 0);
    assert!(
        held.last_error
            .as_deref()
            .is_some_and(|e| e.contains("cannot listen")),
        "{held:?}"
    );
    assert_eq!(p.acquire(&acq("traj-2")).unwrap().slot_id, 2);
    // Every free slot refused: the refusal says why.
    assert!(matches!(
        p.acquire(&acq("traj-3")),
        Err(PoolError::SlotFailed(_))
    ));
    fake.0.taken_ports.lock().unwrap().clear();
    assert_eq!(p.acquire(&acq("traj-3")).unwrap().slot_id, 0);
    assert!(slot_of(&p, 0).last_error.is_none());
}

#[tokio::test]
async fn no_free_slot_and_drain() {
    let (p, _) = pool(options(1));
    all_ready(&p).await;
    p.set_draining(true);
    assert!(matches!(p.acquire(&acq("t1")), Err(PoolError::Draining)));
    assert!(p.status().draining);
    p.set_draining(false);
    let a = p.acquire(&acq("t1")).unwrap();
    assert!(matches!(p.acquire(&acq("t2")), Err(PoolError::NoFreeSlot)));
    // Draining refuses new leases only: the holder still gets its own back.
    p.set_draining(true);
    assert_eq!(p.acquire(&acq("t1")).unwrap(), a);
}

#[tokio::test]
async fn release_replies_queued_then_releasing_then_released_and_resets_the_slot() {
    let (p, fake) = pool(options(2));
    all_ready(&p).await;
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    *fake.0.stop_gate.lock().unwrap() = Some(gate.clone());
    let a = p.acquire(&acq("traj")).unwrap();
    let old_tid = slot_of(&p, 0).tid.unwrap();
    let r1 = p.release(&by_traj("traj")).unwrap();
    assert!(r1.released && r1.release_queued && !r1.already_releasing && !r1.already_released);
    assert_eq!(r1.lease_id.as_deref(), Some(a.lease_id.as_str()));
    assert_eq!((r1.slot_id, r1.generation), (Some(0), Some(1)));
    assert!(!r1.slot_reusable);
    assert_eq!(slot_of(&p, 0).status, SlotState::Releasing);
    // Commands on a releasing lease: not found.
    assert!(matches!(
        p.run_command(&cmd("traj", Command::Shell("true".into())))
            .await,
        Err(PoolError::LeaseNotFound(_))
    ));
    // By the lease id this time: the same lease, already releasing.
    let r2 = p
        .release(&LeaseRef {
            trajectory_id: None,
            lease_id: Some(a.lease_id.clone()),
            reason: Some("paddock_terminate".into()),
        })
        .unwrap();
    assert!(r2.released && r2.release_queued && r2.already_releasing && !r2.already_released);
    gate.add_permits(100);
    until("slot 0 ready again", || {
        let s = slot_of(&p, 0);
        s.status == SlotState::Ready && s.generation == 2
    })
    .await;
    let s = slot_of(&p, 0);
    assert!(s.lease_id.is_none() && s.trajectory_id.is_none());
    assert_ne!(s.tid.as_deref(), Some(old_tid.as_str()));
    assert!(fake.0.stopped.lock().unwrap().contains(&old_tid));
    let r3 = p.release(&by_traj("traj")).unwrap();
    assert!(r3.released && r3.already_released && !r3.release_queued);
    assert_eq!(r3.slot_id, None);
    // A new lease of the reset slot carries the new generation.
    let b = p.acquire(&acq("traj")).unwrap();
    assert_eq!((b.slot_id, b.generation), (0, 2));
    assert_ne!(b.lease_id, a.lease_id);
    assert!(matches!(
        p.release(&LeaseRef::default()),
        Err(PoolError::BadRequest(_))
    ));
}

#[tokio::test]
async fn a_dead_leased_slot_loses_its_lease_and_a_dead_ready_one_is_reset() {
    let (p, fake) = pool(options(3));
    all_ready(&p).await;
    let a = p.acquire(&acq("traj")).unwrap();
    let tid0 = slot_of(&p, 0).tid.unwrap();
    let tid1 = slot_of(&p, 1).tid.unwrap();
    {
        let mut h = fake.0.health.lock().unwrap();
        h.insert(tid0.clone(), Health::Dead("gone".into()));
        h.insert(tid1.clone(), Health::Unhealthy("500".into()));
    }
    p.tick().await;
    let s = p.status();
    assert_eq!(s.lost, 1);
    assert_eq!(
        slot_of(&p, 1).status,
        SlotState::Ready,
        "one failed probe is not death"
    );
    assert!(matches!(
        p.run_command(&cmd("traj", Command::Shell("true".into()))).await,
        Err(PoolError::LeaseLost(l)) if l == a.lease_id
    ));
    assert!(matches!(
        p.read_file(&ReadFileRequest {
            lease: by_traj("traj"),
            path: "x".into(),
            max_bytes: None
        })
        .await,
        Err(PoolError::LeaseLost(_))
    ));
    p.tick().await;
    until("slot 1 reset", || slot_of(&p, 1).generation == 2).await;
    assert!(fake.0.stopped.lock().unwrap().contains(&tid1));
    // The trajectory acquires again: a new slot, and the lost one is reset behind it.
    let b = p.acquire(&acq("traj")).unwrap();
    assert_ne!(b.slot_id, 0);
    assert_eq!(b.status, LeaseStatus::Active);
    until("slot 0 reset", || {
        let s = slot_of(&p, 0);
        s.status == SlotState::Ready && s.generation == 2
    })
    .await;
    assert!(fake.0.stopped.lock().unwrap().contains(&tid0));
    let out = p
        .run_command(&cmd("traj", Command::Shell("true".into())))
        .await
        .unwrap();
    assert_eq!(out.lease_id, b.lease_id);
}

#[tokio::test]
async fn leases_past_their_ttl_are_taken_back() {
    let mut o = options(1);
    o.lease_ttl = Some(Duration::from_millis(50));
    let (p, _) = pool(o);
    all_ready(&p).await;
    let a = p.acquire(&acq("traj")).unwrap();
    let deadline = a.deadline_ts.unwrap();
    assert!((deadline - a.acquired_ts - 0.05).abs() < 1e-6);
    tokio::time::sleep(Duration::from_millis(80)).await;
    // The sweep runs on status (and acquire, and the health loop).
    let s = p.status();
    assert_eq!(s.leased, 0);
    assert!(matches!(
        p.run_command(&cmd("traj", Command::Shell("true".into())))
            .await,
        Err(PoolError::LeaseNotFound(_))
    ));
    until("slot reset", || slot_of(&p, 0).generation == 2).await;
}

#[tokio::test]
async fn failed_starts_are_retried() {
    let fake = Fake::default();
    fake.0.fail_starts.store(1, Ordering::SeqCst);
    let p = Pool::new(options(1), fake.clone(), CancellationToken::new());
    p.start();
    until("slot failed", || slot_of(&p, 0).status == SlotState::Failed).await;
    assert!(p.status().last_error.unwrap().contains("start refused"));
    assert!(matches!(p.acquire(&acq("t")), Err(PoolError::NoFreeSlot)));
    p.tick().await;
    until("slot ready", || slot_of(&p, 0).status == SlotState::Ready).await;
    assert_eq!(slot_of(&p, 0).generation, 2);
}

#[tokio::test]
async fn commands_reach_the_leased_slot_with_the_reference_keys() {
    let (p, fake) = pool(options(2));
    all_ready(&p).await;
    let a = p.acquire(&acq("traj")).unwrap();
    let tid = slot_of(&p, 0).tid.unwrap();
    let mut req = cmd("traj", Command::Argv(vec!["echo".into(), "a b".into()]));
    req.cwd = Some("sub".into());
    req.timeout = Some(1.5);
    let out = p.run_command(&req).await.unwrap();
    assert_eq!(out.cmd, "echo 'a b'");
    assert_eq!(out.stdout, "ran echo 'a b'");
    assert_eq!((out.returncode, out.timed_out), (Some(0), false));
    assert_eq!(
        (out.slot_id, out.lease_id.as_str()),
        (0, a.lease_id.as_str())
    );
    assert_eq!(
        (out.node_id.as_str(), out.node_ip.as_str()),
        ("node-abcdefghijklmnop", "10.0.0.7")
    );
    let (t, sent) = fake.0.execs.lock().unwrap()[0].clone();
    assert_eq!(t, tid);
    assert_eq!(
        (sent.cwd.as_deref(), sent.timeout_s),
        (Some("sub"), Some(2))
    );
    for bad in [0.0, -1.0, f64::NAN] {
        let mut r = cmd("traj", Command::Shell("true".into()));
        r.timeout = Some(bad);
        assert!(matches!(
            p.run_command(&r).await,
            Err(PoolError::BadRequest(_))
        ));
    }
    assert!(matches!(
        p.run_command(&cmd("traj", Command::Shell("  ".into())))
            .await,
        Err(PoolError::BadRequest(_))
    ));
    assert!(matches!(
        p.run_command(&cmd("other", Command::Shell("true".into())))
            .await,
        Err(PoolError::LeaseNotFound(_))
    ));
    let f = p
        .read_file(&ReadFileRequest {
            lease: by_traj("traj"),
            path: "a.txt".into(),
            max_bytes: None,
        })
        .await
        .unwrap();
    assert_eq!(
        (f.content_base64.as_str(), f.lease_id.as_str()),
        ("aGk=", a.lease_id.as_str())
    );
    let refused = p
        .read_file(&ReadFileRequest {
            lease: by_traj("traj"),
            path: "../x".into(),
            max_bytes: None,
        })
        .await;
    assert!(matches!(
        refused,
        Err(PoolError::Refused { status: 400, .. })
    ));
    let w = p
        .write_file(&WriteFileRequest {
            lease: by_traj("traj"),
            path: "a.txt".into(),
            content_base64: "aGk=".into(),
            append: true,
        })
        .await
        .unwrap();
    assert_eq!(
        (w.bytes, w.append, w.trajectory_id.as_str()),
        (2, true, "traj")
    );
}

#[tokio::test]
async fn shutdown_stops_every_generation_and_refuses_requests() {
    let (p, fake) = pool(options(3));
    all_ready(&p).await;
    p.acquire(&acq("a")).unwrap();
    p.acquire(&acq("b")).unwrap();
    p.release(&by_traj("b")).unwrap();
    p.shutdown().await;
    let mut started = fake.0.started.lock().unwrap().clone();
    let mut stopped = fake.0.stopped.lock().unwrap().clone();
    started.sort();
    stopped.sort();
    stopped.dedup();
    assert_eq!(started, stopped);
    let s = p.status();
    assert!(s.closed);
    assert_eq!(s.empty, 3);
    assert!(
        s.slots
            .iter()
            .all(|v| v.tid.is_none() && v.lease_id.is_none())
    );
    assert!(matches!(p.acquire(&acq("c")), Err(PoolError::ShuttingDown)));
}
