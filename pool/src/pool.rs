//! The pool: N slots, their leases, the health loop and shutdown, over a [`SlotBackend`].
//!
//! All state is one [`Inner`] behind one mutex, held only to read or apply a transition;
//! everything slow (starting, stopping, health probes, commands) runs outside it, in tasks
//! tracked by the pool's [`TaskTracker`], and re-checks the slot's generation when it comes
//! back (a slot that moved on meanwhile is left alone). Lease rules follow the reference's
//! node supervisor: lookups by trajectory first, then lease id; a trajectory with an ACTIVE
//! lease gets that lease again; a release is answered at once and the reset runs behind it
//! (`release_queued`, then `already_releasing`, then `already_released` once the old
//! generation is gone). Unlike the reference, FAILED starts are retried with a backoff.

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use agentbox_api::launcher::{SlotExecRequest, SlotReadRequest, SlotWriteRequest};
use agentbox_api::pool::{
    AcquireRequest, Command, CommandReply, FileReply, Lease, LeaseRef, LeaseStatus, PoolStatus,
    ReadFileRequest, ReleaseReply, RunCommandRequest, SlotState, SlotView, WriteFileRequest,
    WriteReply,
};
use agentbox_policy::id::Tid;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::backend::{Health, SlotBackend, Started, random_hex};
use crate::error::PoolError;
use crate::forward::Forwarder;
use crate::slot::{self, Event};

/// Longest trajectory id accepted.
const MAX_TRAJECTORY_LEN: usize = 256;
/// Consecutive failed `/health` probes that make a running slot dead.
const UNHEALTHY_LIMIT: u32 = 2;
/// The longest wait before a FAILED slot is tried again.
const MAX_RETRY_BACKOFF: Duration = Duration::from_secs(300);

/// The pool's settings (from `[pool]`).
#[derive(Debug, Clone)]
pub struct PoolOptions {
    pub slots: u32,
    pub node_id: String,
    pub node_ip: String,
    pub hostname: String,
    pub listen_host: IpAddr,
    pub advertise_host: String,
    pub port_base: u16,
    pub health_interval: Duration,
    pub lease_ttl: Option<Duration>,
    /// The first retry of a FAILED slot waits this long, doubling up to five minutes.
    pub retry_backoff: Duration,
    /// Uids allowed on `pool.sock` besides root.
    pub control_uids: Vec<u32>,
}

#[derive(Debug)]
struct Slot {
    id: u32,
    state: SlotState,
    generation: u64,
    started: Option<Started>,
    lease: Option<Lease>,
    forwarder: Option<Forwarder>,
    unhealthy: u32,
    failures: u32,
    retry_at: Option<Instant>,
    last_error: Option<String>,
    /// One command (or file operation) at a time per slot, as in the reference.
    commands: Arc<tokio::sync::Mutex<()>>,
}

impl Slot {
    fn apply(&mut self, event: Event) -> Result<(), PoolError> {
        match slot::next(self.state, event) {
            Ok(s) => {
                self.state = s;
                Ok(())
            }
            Err(e) => {
                tracing::error!(slot = self.id, error = %e, "refused slot transition");
                Err(PoolError::Internal(format!("slot {}: {e}", self.id)))
            }
        }
    }

    fn view(&self, port: Option<u16>) -> SlotView {
        SlotView {
            slot_id: self.id,
            status: self.state,
            generation: self.generation,
            port: self.forwarder.as_ref().and(port),
            tid: self.started.as_ref().map(|s| s.tid.to_string()),
            lease_id: self.lease.as_ref().map(|l| l.lease_id.clone()),
            trajectory_id: self.lease.as_ref().map(|l| l.trajectory_id.clone()),
            last_error: self.last_error.clone(),
        }
    }
}

#[derive(Debug)]
struct Inner {
    slots: Vec<Slot>,
    draining: bool,
    closed: bool,
    last_error: Option<String>,
}

/// One host's pool of slots.
#[derive(Debug)]
pub struct Pool<B> {
    opts: PoolOptions,
    backend: Arc<B>,
    inner: Mutex<Inner>,
    tasks: TaskTracker,
    shutdown: CancellationToken,
}

/// Seconds since the epoch.
fn now_ts() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// The first `n` characters of `s`.
fn prefix(s: &str, n: usize) -> &str {
    match s.char_indices().nth(n) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

/// `lease-<node_id[:12]>-<slot:04d>-gen<gen>-<trajectory_id[:32]>-<8 hex>`.
pub fn lease_id(
    node_id: &str,
    slot: u32,
    generation: u64,
    trajectory_id: &str,
    hex8: &str,
) -> String {
    format!(
        "lease-{}-{slot:04}-gen{generation}-{}-{hex8}",
        prefix(node_id, 12),
        prefix(trajectory_id, 32)
    )
}

/// `shlex.join`: each word as is when it is plainly safe, else single-quoted.
pub fn shell_join(argv: &[String]) -> String {
    let quote = |w: &String| {
        let safe = !w.is_empty()
            && w.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"@%+=:,./-_".contains(&b));
        if safe {
            w.clone()
        } else {
            format!("'{}'", w.replace('\'', "'\"'\"'"))
        }
    };
    argv.iter().map(quote).collect::<Vec<_>>().join(" ")
}

fn check_trajectory(t: &str) -> Result<(), PoolError> {
    if t.is_empty() {
        return Err(PoolError::BadRequest("trajectory_id is empty".into()));
    }
    if t.len() > MAX_TRAJECTORY_LEN {
        return Err(PoolError::BadRequest(format!(
            "trajectory_id is longer than {MAX_TRAJECTORY_LEN} bytes"
        )));
    }
    if t.chars().any(char::is_control) {
        return Err(PoolError::BadRequest(
            "trajectory_id contains a control character".into(),
        ));
    }
    Ok(())
}

fn selector(r: &LeaseRef) -> String {
    match (&r.trajectory_id, &r.lease_id) {
        (Some(t), _) => format!("trajectory {t:?}"),
        (None, Some(l)) => format!("lease {l:?}"),
        (None, None) => "nothing".into(),
    }
}

/// The slot holding the lease `r` selects: by trajectory first (an ACTIVE lease before a
/// LOST one before a RELEASING one), then by lease id.
fn find(inner: &Inner, r: &LeaseRef) -> Option<usize> {
    let rank = |s: LeaseStatus| match s {
        LeaseStatus::Active => 0,
        LeaseStatus::Lost => 1,
        LeaseStatus::Releasing => 2,
    };
    if let Some(t) = &r.trajectory_id {
        let found = inner
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.lease.as_ref().map(|l| (i, l)))
            .filter(|(_, l)| &l.trajectory_id == t)
            .min_by_key(|(_, l)| rank(l.status))
            .map(|(i, _)| i);
        if found.is_some() {
            return found;
        }
    }
    let l = r.lease_id.as_ref()?;
    inner
        .slots
        .iter()
        .position(|s| s.lease.as_ref().is_some_and(|x| &x.lease_id == l))
}

/// A checked-out active lease, for one command.
struct Active {
    slot: usize,
    generation: u64,
    tid: Tid,
    lease: Lease,
    commands: Arc<tokio::sync::Mutex<()>>,
}

impl<B: SlotBackend> Pool<B> {
    /// A pool of `opts.slots` EMPTY slots; [`Pool::start`] fills them.
    pub fn new(opts: PoolOptions, backend: B, shutdown: CancellationToken) -> Arc<Self> {
        let slots = (0..opts.slots)
            .map(|id| Slot {
                id,
                state: SlotState::Empty,
                generation: 0,
                started: None,
                lease: None,
                forwarder: None,
                unhealthy: 0,
                failures: 0,
                retry_at: None,
                last_error: None,
                commands: Arc::new(tokio::sync::Mutex::new(())),
            })
            .collect();
        Arc::new(Pool {
            opts,
            backend: Arc::new(backend),
            inner: Mutex::new(Inner {
                slots,
                draining: false,
                closed: false,
                last_error: None,
            }),
            tasks: TaskTracker::new(),
            shutdown,
        })
    }

    /// The settings.
    pub fn options(&self) -> &PoolOptions {
        &self.opts
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts every slot and the health loop.
    pub fn start(self: &Arc<Self>) {
        {
            let mut inner = self.lock();
            for i in 0..inner.slots.len() {
                if let Err(e) = self.begin_start(&mut inner, i, Event::Start) {
                    tracing::error!(error = %e, "cannot start slot {i}");
                }
            }
        }
        let me = self.clone();
        self.tasks.spawn(async move { me.health_loop().await });
    }

    /// `event` (`Start` from EMPTY/FAILED, `Stopped` after a reset) moves slot `i` to STARTING
    /// of its next generation, started in a task.
    fn begin_start(
        self: &Arc<Self>,
        inner: &mut Inner,
        i: usize,
        event: Event,
    ) -> Result<(), PoolError> {
        let slot = &mut inner.slots[i];
        slot.apply(event)?;
        slot.generation += 1;
        slot.started = None;
        slot.lease = None;
        slot.retry_at = None;
        slot.unhealthy = 0;
        let (id, generation) = (slot.id, slot.generation);
        let me = self.clone();
        self.tasks
            .spawn(async move { me.run_start(i, id, generation).await });
        Ok(())
    }

    async fn run_start(self: Arc<Self>, i: usize, id: u32, generation: u64) {
        let result = self.backend.start(id, generation).await;
        let leftover = {
            let mut guard = self.lock();
            let inner = &mut *guard;
            let closed = inner.closed;
            let slot = &mut inner.slots[i];
            if slot.generation != generation || slot.state != SlotState::Starting {
                result.ok()
            } else {
                match result {
                    Ok(started) if !closed => {
                        if slot.apply(Event::Started).is_ok() {
                            slot.started = Some(started);
                            slot.failures = 0;
                            slot.last_error = None;
                            tracing::info!(slot = id, generation, "slot ready");
                            None
                        } else {
                            Some(started)
                        }
                    }
                    Ok(started) => {
                        // Shutting down: it never becomes READY; shutdown empties FAILED slots.
                        let _ = slot.apply(Event::StartFailed);
                        Some(started)
                    }
                    Err(e) => {
                        let _ = slot.apply(Event::StartFailed);
                        slot.failures = slot.failures.saturating_add(1);
                        let backoff = self
                            .opts
                            .retry_backoff
                            .saturating_mul(1 << slot.failures.min(16).saturating_sub(1))
                            .min(MAX_RETRY_BACKOFF);
                        slot.retry_at = Some(Instant::now() + backoff);
                        let msg = format!("slot {id} generation {generation}: {e}");
                        tracing::warn!(retry_in = ?backoff, "{msg}");
                        slot.last_error = Some(e.to_string());
                        inner.last_error = Some(msg);
                        None
                    }
                }
            }
        };
        if let Some(s) = leftover
            && let Err(e) = self.backend.stop(&s.tid).await
        {
            tracing::warn!(tid = %s.tid, error = %e, "cannot stop an unused slot");
        }
    }

    /// Slot `i` (LEASED or LOST) gives its lease up: RELEASING, its endpoint closed and the
    /// old generation stopped in a task, then the next generation started.
    fn begin_release(
        self: &Arc<Self>,
        inner: &mut Inner,
        i: usize,
        reason: &str,
    ) -> Result<(), PoolError> {
        let slot = &mut inner.slots[i];
        slot.apply(Event::Release)?;
        if let Some(l) = slot.lease.as_mut() {
            l.status = LeaseStatus::Releasing;
            l.ready = false;
            tracing::info!(slot = slot.id, lease = %l.lease_id, reason, "releasing");
        }
        let forwarder = slot.forwarder.take();
        let started = slot.started.clone();
        let generation = slot.generation;
        let me = self.clone();
        self.tasks
            .spawn(async move { me.run_reset(i, generation, started, forwarder).await });
        Ok(())
    }

    /// A dead READY slot is replaced.
    fn begin_reset(self: &Arc<Self>, inner: &mut Inner, i: usize) -> Result<(), PoolError> {
        let slot = &mut inner.slots[i];
        slot.apply(Event::Reset)?;
        let started = slot.started.clone();
        let generation = slot.generation;
        let forwarder = slot.forwarder.take();
        let me = self.clone();
        self.tasks
            .spawn(async move { me.run_reset(i, generation, started, forwarder).await });
        Ok(())
    }

    async fn run_reset(
        self: Arc<Self>,
        i: usize,
        generation: u64,
        started: Option<Started>,
        forwarder: Option<Forwarder>,
    ) {
        if let Some(f) = forwarder {
            f.close().await;
        }
        let stopped = match &started {
            Some(s) => self.backend.stop(&s.tid).await,
            None => Ok(()),
        };
        let mut guard = self.lock();
        let inner = &mut *guard;
        let closed = inner.closed;
        let slot = &mut inner.slots[i];
        if slot.generation != generation {
            return;
        }
        if let Err(e) = stopped {
            // The next generation has a new tid, directories and token: nothing is shared with
            // a sandbox that failed to stop, so the slot goes on; the error is reported.
            let msg = format!("slot {} generation {generation}: cannot stop: {e}", slot.id);
            tracing::error!("{msg}");
            slot.last_error = Some(e.to_string());
            inner.last_error = Some(msg);
        }
        let slot = &mut inner.slots[i];
        if closed {
            if slot.apply(Event::Shutdown).is_ok() {
                slot.started = None;
                slot.lease = None;
            }
            return;
        }
        if let Err(e) = self.begin_start(inner, i, Event::Stopped) {
            tracing::error!(error = %e, "cannot restart slot {i}");
        }
    }

    async fn health_loop(self: Arc<Self>) {
        loop {
            tokio::select! {
                () = self.shutdown.cancelled() => return,
                () = tokio::time::sleep(self.opts.health_interval) => {}
            }
            self.tick().await;
        }
    }

    /// One pass of the health loop: the TTL sweep, FAILED slots due for a retry, and a
    /// health check of every READY and LEASED slot (concurrently, so one slow slot does not
    /// delay the others past the interval).
    pub async fn tick(self: &Arc<Self>) {
        let checks: Vec<(usize, u64, SlotState, Started)> = {
            let mut inner = self.lock();
            if inner.closed {
                return;
            }
            self.sweep_ttl(&mut inner);
            let now = Instant::now();
            for i in 0..inner.slots.len() {
                let slot = &inner.slots[i];
                let due = slot.state == SlotState::Failed && slot.retry_at.is_none_or(|t| t <= now);
                if due && let Err(e) = self.begin_start(&mut inner, i, Event::Start) {
                    tracing::error!(error = %e, "cannot retry slot {i}");
                }
            }
            inner
                .slots
                .iter()
                .enumerate()
                .filter(|(_, s)| matches!(s.state, SlotState::Ready | SlotState::Leased))
                .filter_map(|(i, s)| s.started.clone().map(|st| (i, s.generation, s.state, st)))
                .collect()
        };
        let results = futures_util::future::join_all(
            checks
                .iter()
                .map(|(_, _, _, started)| self.backend.health(started)),
        )
        .await;
        let mut inner = self.lock();
        if inner.closed {
            return;
        }
        for ((i, generation, state, _), health) in checks.into_iter().zip(results) {
            let slot = &mut inner.slots[i];
            if slot.generation != generation || slot.state != state {
                continue;
            }
            let reason = match health {
                Health::Alive => {
                    slot.unhealthy = 0;
                    continue;
                }
                Health::Dead(r) => r,
                Health::Unhealthy(r) => {
                    slot.unhealthy += 1;
                    if slot.unhealthy < UNHEALTHY_LIMIT {
                        continue;
                    }
                    r
                }
            };
            self.died(&mut inner, i, &reason);
        }
    }

    /// The health loop found slot `i`'s server dead.
    fn died(self: &Arc<Self>, inner: &mut Inner, i: usize, reason: &str) {
        let slot = &mut inner.slots[i];
        let was = slot.state;
        if slot.apply(Event::Died).is_err() {
            return;
        }
        let msg = format!(
            "slot {} generation {}: server dead: {reason}",
            slot.id, slot.generation
        );
        tracing::warn!("{msg}");
        slot.last_error = Some(reason.to_owned());
        match was {
            SlotState::Leased => {
                if let Some(l) = slot.lease.as_mut() {
                    l.status = LeaseStatus::Lost;
                    l.ready = false;
                }
                if let Some(f) = slot.forwarder.take() {
                    self.tasks.spawn(f.close());
                }
                inner.last_error = Some(msg);
            }
            SlotState::Ready => {
                inner.last_error = Some(msg);
                if let Err(e) = self.begin_reset(inner, i) {
                    tracing::error!(error = %e, "cannot reset slot {i}");
                }
            }
            SlotState::Empty
            | SlotState::Starting
            | SlotState::Releasing
            | SlotState::Restarting
            | SlotState::Failed
            | SlotState::Dead
            | SlotState::Lost => {}
        }
    }

    /// Leases past their deadline are released (`lease_ttl_expired`).
    fn sweep_ttl(self: &Arc<Self>, inner: &mut Inner) {
        let now = now_ts();
        for i in 0..inner.slots.len() {
            let slot = &inner.slots[i];
            let expired = matches!(slot.state, SlotState::Leased | SlotState::Lost)
                && slot
                    .lease
                    .as_ref()
                    .and_then(|l| l.deadline_ts)
                    .is_some_and(|d| d <= now);
            if expired && let Err(e) = self.begin_release(inner, i, "lease_ttl_expired") {
                tracing::error!(error = %e, "cannot expire the lease of slot {i}");
            }
        }
    }

    /// `POST /acquire`.
    ///
    /// # Errors
    /// `draining`, `no_free_slot`, a bad trajectory id, a port that cannot be bound.
    pub fn acquire(self: &Arc<Self>, req: &AcquireRequest) -> Result<Lease, PoolError> {
        check_trajectory(&req.trajectory_id)?;
        let mut guard = self.lock();
        let inner = &mut *guard;
        if inner.closed {
            return Err(PoolError::ShuttingDown);
        }
        self.sweep_ttl(inner);
        let t = &req.trajectory_id;
        let mine = |s: &Slot| s.lease.as_ref().is_some_and(|l| &l.trajectory_id == t);
        if let Some(l) = inner
            .slots
            .iter()
            .filter(|s| mine(s))
            .filter_map(|s| s.lease.as_ref())
            .find(|l| l.status == LeaseStatus::Active)
        {
            return Ok(l.clone());
        }
        if inner.draining {
            return Err(PoolError::Draining);
        }
        // A lost lease of this trajectory is given up now: it acquires a new slot.
        let lost: Vec<usize> = (0..inner.slots.len())
            .filter(|&i| inner.slots[i].state == SlotState::Lost && mine(&inner.slots[i]))
            .collect();
        for i in lost {
            self.begin_release(inner, i, "reacquired")?;
        }
        // The lowest READY slot whose port can be listened on: one whose port another process
        // holds is passed over (and says why in its status), never left to refuse every
        // acquire while other slots sit idle.
        let mut refused = None;
        let mut found = None;
        for i in 0..inner.slots.len() {
            let slot = &mut inner.slots[i];
            let Some(started) = slot
                .started
                .as_ref()
                .filter(|_| slot.state == SlotState::Ready)
            else {
                continue;
            };
            let port = u16::try_from(u32::from(self.opts.port_base) + slot.id)
                .map_err(|_| PoolError::Internal(format!("slot {} has no port", slot.id)))?;
            let addr = SocketAddr::new(self.opts.listen_host, port);
            match self.backend.expose(addr, started) {
                Ok(forwarder) => {
                    found = Some((i, port, forwarder));
                    break;
                }
                Err(e) => {
                    let msg = format!("slot {}: cannot listen on {addr}: {e}", slot.id);
                    tracing::warn!("{msg}");
                    slot.last_error = Some(msg.clone());
                    refused = Some(msg);
                }
            }
        }
        let Some((i, port, forwarder)) = found else {
            return Err(refused.map_or(PoolError::NoFreeSlot, PoolError::SlotFailed));
        };
        let slot = &mut inner.slots[i];
        slot.last_error = None;
        let acquired_ts = now_ts();
        let lease = Lease {
            lease_id: lease_id(
                &self.opts.node_id,
                slot.id,
                slot.generation,
                t,
                &random_hex(4)?,
            ),
            trajectory_id: t.clone(),
            node_id: self.opts.node_id.clone(),
            node_ip: self.opts.node_ip.clone(),
            slot_id: slot.id,
            port,
            sandbox_url: Some(format!("http://{}:{port}", self.opts.advertise_host)),
            acquired_ts,
            deadline_ts: self.opts.lease_ttl.map(|d| acquired_ts + d.as_secs_f64()),
            generation: slot.generation,
            status: LeaseStatus::Active,
            ready: true,
        };
        slot.apply(Event::Lease)?;
        slot.lease = Some(lease.clone());
        slot.forwarder = Some(forwarder);
        tracing::info!(slot = slot.id, lease = %lease.lease_id, "leased");
        Ok(lease)
    }

    /// `POST /release`.
    ///
    /// # Errors
    /// A request naming neither a trajectory nor a lease.
    pub fn release(self: &Arc<Self>, r: &LeaseRef) -> Result<ReleaseReply, PoolError> {
        if r.trajectory_id.is_none() && r.lease_id.is_none() {
            return Err(PoolError::BadRequest(
                "name a trajectory_id or a lease_id".into(),
            ));
        }
        let mut guard = self.lock();
        let inner = &mut *guard;
        if inner.closed {
            return Err(PoolError::ShuttingDown);
        }
        let mut reply = ReleaseReply {
            released: true,
            already_released: false,
            release_queued: false,
            already_releasing: false,
            lease_id: r.lease_id.clone(),
            trajectory_id: r.trajectory_id.clone(),
            slot_id: None,
            node_id: self.opts.node_id.clone(),
            node_ip: self.opts.node_ip.clone(),
            slot_reusable: false,
            generation: None,
        };
        let Some(i) = find(inner, r) else {
            reply.already_released = true;
            return Ok(reply);
        };
        let slot = &inner.slots[i];
        if let Some(l) = &slot.lease {
            reply.lease_id = Some(l.lease_id.clone());
            reply.trajectory_id = Some(l.trajectory_id.clone());
        }
        reply.slot_id = Some(slot.id);
        reply.generation = Some(slot.generation);
        reply.release_queued = true;
        match slot.state {
            SlotState::Releasing => reply.already_releasing = true,
            SlotState::Leased | SlotState::Lost => {
                let reason = r.reason.as_deref().unwrap_or("manager_release");
                self.begin_release(inner, i, reason)?;
            }
            SlotState::Empty
            | SlotState::Starting
            | SlotState::Ready
            | SlotState::Restarting
            | SlotState::Failed
            | SlotState::Dead => {
                return Err(PoolError::Internal(format!(
                    "slot {} holds a lease in state {:?}",
                    slot.id, slot.state
                )));
            }
        }
        Ok(reply)
    }

    /// The active lease `r` selects, checked out for one command.
    fn active(&self, r: &LeaseRef) -> Result<Active, PoolError> {
        let inner = self.lock();
        if inner.closed {
            return Err(PoolError::ShuttingDown);
        }
        let Some(i) = find(&inner, r) else {
            return Err(PoolError::LeaseNotFound(selector(r)));
        };
        let slot = &inner.slots[i];
        let (Some(lease), Some(started)) = (&slot.lease, &slot.started) else {
            return Err(PoolError::LeaseNotFound(selector(r)));
        };
        match lease.status {
            LeaseStatus::Active => Ok(Active {
                slot: i,
                generation: slot.generation,
                tid: started.tid.clone(),
                lease: lease.clone(),
                commands: slot.commands.clone(),
            }),
            LeaseStatus::Lost => Err(PoolError::LeaseLost(lease.lease_id.clone())),
            LeaseStatus::Releasing => Err(PoolError::LeaseNotFound(selector(r))),
        }
    }

    /// [`Pool::active`], then waits for the slot's command lock and checks the lease is still
    /// the same active one (it may have been released or lost while waiting).
    async fn checkout(
        &self,
        r: &LeaseRef,
    ) -> Result<(Active, tokio::sync::OwnedMutexGuard<()>), PoolError> {
        let a = self.active(r)?;
        let guard = a.commands.clone().lock_owned().await;
        let again = self.active(&LeaseRef {
            trajectory_id: None,
            lease_id: Some(a.lease.lease_id.clone()),
            reason: None,
        })?;
        if again.slot != a.slot || again.generation != a.generation {
            return Err(PoolError::LeaseNotFound(selector(r)));
        }
        Ok((a, guard))
    }

    /// `POST /run_command`.
    ///
    /// # Errors
    /// No such lease (404), a lost one (410), bad input, the launcher's refusal or failure.
    pub async fn run_command(&self, req: &RunCommandRequest) -> Result<CommandReply, PoolError> {
        let cmd = match &req.command {
            Command::Shell(s) => s.clone(),
            Command::Argv(v) => shell_join(v),
        };
        if cmd.trim().is_empty() {
            return Err(PoolError::BadRequest("command is empty".into()));
        }
        let timeout_s = match req.timeout {
            None => None,
            Some(t) if t.is_finite() && t > 0.0 && t <= u64::MAX as f64 => Some(t.ceil() as u64),
            Some(t) => {
                return Err(PoolError::BadRequest(format!(
                    "timeout must be a positive number of seconds, not {t}"
                )));
            }
        };
        let (a, _guard) = self.checkout(&req.lease).await?;
        let out = self
            .backend
            .exec(
                &a.tid,
                &SlotExecRequest {
                    command: cmd.clone(),
                    cwd: req.cwd.clone(),
                    env: req.env.clone(),
                    timeout_s,
                    stdin: req.stdin.clone(),
                },
            )
            .await?;
        Ok(CommandReply {
            cmd,
            stdout: out.stdout,
            stderr: out.stderr,
            returncode: out.returncode,
            timed_out: out.timed_out,
            lease_id: a.lease.lease_id,
            trajectory_id: a.lease.trajectory_id,
            slot_id: a.lease.slot_id,
            node_id: self.opts.node_id.clone(),
            node_ip: self.opts.node_ip.clone(),
        })
    }

    /// `POST /read_file`.
    ///
    /// # Errors
    /// As [`Pool::run_command`].
    pub async fn read_file(&self, req: &ReadFileRequest) -> Result<FileReply, PoolError> {
        let (a, _guard) = self.checkout(&req.lease).await?;
        let f = self
            .backend
            .read(
                &a.tid,
                &SlotReadRequest {
                    path: req.path.clone(),
                    max_bytes: req.max_bytes,
                },
            )
            .await?;
        Ok(FileReply {
            path: f.path,
            content_base64: f.content_base64,
            size: f.size,
            truncated: f.truncated,
            lease_id: a.lease.lease_id,
            trajectory_id: a.lease.trajectory_id,
        })
    }

    /// `POST /write_file`.
    ///
    /// # Errors
    /// As [`Pool::run_command`].
    pub async fn write_file(&self, req: &WriteFileRequest) -> Result<WriteReply, PoolError> {
        let (a, _guard) = self.checkout(&req.lease).await?;
        let w = self
            .backend
            .write(
                &a.tid,
                &SlotWriteRequest {
                    path: req.path.clone(),
                    content_base64: req.content_base64.clone(),
                    append: req.append,
                },
            )
            .await?;
        Ok(WriteReply {
            path: w.path,
            bytes: w.bytes,
            append: w.append,
            lease_id: a.lease.lease_id,
            trajectory_id: a.lease.trajectory_id,
        })
    }

    /// `POST /drain` (`true`) and `/undrain` (`false`).
    pub fn set_draining(self: &Arc<Self>, draining: bool) -> PoolStatus {
        self.lock().draining = draining;
        self.status()
    }

    /// `GET /status` (after the TTL sweep).
    pub fn status(self: &Arc<Self>) -> PoolStatus {
        let mut inner = self.lock();
        if !inner.closed {
            self.sweep_ttl(&mut inner);
        }
        let count = |st: SlotState| {
            u32::try_from(inner.slots.iter().filter(|s| s.state == st).count()).unwrap_or(u32::MAX)
        };
        PoolStatus {
            node_id: self.opts.node_id.clone(),
            node_ip: self.opts.node_ip.clone(),
            hostname: self.opts.hostname.clone(),
            closed: inner.closed,
            draining: inner.draining,
            capacity: self.opts.slots,
            ready: count(SlotState::Ready),
            leased: count(SlotState::Leased),
            releasing: count(SlotState::Releasing),
            starting: count(SlotState::Starting),
            restarting: count(SlotState::Restarting),
            failed: count(SlotState::Failed),
            dead: count(SlotState::Dead),
            lost: count(SlotState::Lost),
            empty: count(SlotState::Empty),
            last_error: inner.last_error.clone(),
            slots: inner
                .slots
                .iter()
                .map(|s| {
                    let port = u16::try_from(u32::from(self.opts.port_base) + s.id).ok();
                    s.view(port)
                })
                .collect(),
        }
    }

    /// Stops everything: no new requests, endpoints closed, starts and resets in flight
    /// finished, every slot's sandbox deleted and gateway task closed. Call after the server
    /// stopped (and with the shutdown token cancelled, so the health loop has ended).
    pub async fn shutdown(self: &Arc<Self>) {
        let forwarders: Vec<Forwarder> = {
            let mut inner = self.lock();
            inner.closed = true;
            inner
                .slots
                .iter_mut()
                .filter_map(|s| s.forwarder.take())
                .collect()
        };
        self.shutdown.cancel();
        for f in forwarders {
            f.close().await;
        }
        self.tasks.close();
        self.tasks.wait().await;
        let to_stop: Vec<Tid> = {
            let mut inner = self.lock();
            inner
                .slots
                .iter_mut()
                .filter_map(|s| {
                    let tid = s.started.take().map(|st| st.tid);
                    if slot::may_run(s.state) || s.state == SlotState::Failed {
                        let _ = s.apply(Event::Shutdown);
                    }
                    s.lease = None;
                    tid
                })
                .collect()
        };
        let stops = futures_util::future::join_all(to_stop.iter().map(|t| self.backend.stop(t)));
        for (tid, r) in to_stop.iter().zip(stops.await) {
            if let Err(e) = r {
                tracing::error!(%tid, error = %e, "cannot stop slot at shutdown");
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests;
