//! A deterministic in-process [`SlotBackend`] for the pool's unit tests only (the integration
//! test `tests/tests/pool.rs` runs the real launcher and gateway).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex as StdMutex};

use agentbox_api::launcher::{
    SlotExecRequest, SlotExecResult, SlotFile, SlotReadRequest, SlotWriteRequest, SlotWriteResult,
};
use agentbox_policy::id::Tid;

use crate::backend::{BackendError, Health, SlotBackend, Started, slot_tid};
use crate::forward::Forwarder;

#[derive(Debug, Default)]
pub(crate) struct FakeState {
    pub(crate) health: StdMutex<HashMap<String, Health>>,
    pub(crate) fail_starts: AtomicU32,
    pub(crate) stop_gate: StdMutex<Option<Arc<tokio::sync::Semaphore>>>,
    pub(crate) started: StdMutex<Vec<String>>,
    pub(crate) stopped: StdMutex<Vec<String>>,
    pub(crate) execs: StdMutex<Vec<(String, SlotExecRequest)>>,
    /// Ports another process holds: exposing a slot on one fails as `bind` would.
    pub(crate) taken_ports: StdMutex<Vec<u16>>,
}

#[derive(Debug, Clone, Default)]
pub(crate) struct Fake(pub(crate) Arc<FakeState>);

impl SlotBackend for Fake {
    async fn start(&self, slot: u32, generation: u64) -> Result<Started, BackendError> {
        if self
            .0
            .fail_starts
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(BackendError::Failed("start refused".into()));
        }
        let tid = slot_tid(slot, generation)?;
        self.0.started.lock().unwrap().push(tid.to_string());
        Ok(Started {
            socket: format!("/nonexistent/{tid}.sock").into(),
            tid,
        })
    }

    async fn stop(&self, tid: &Tid) -> Result<(), BackendError> {
        let gate = self.0.stop_gate.lock().unwrap().clone();
        if let Some(g) = gate {
            let _ = g.acquire().await;
        }
        self.0.stopped.lock().unwrap().push(tid.to_string());
        Ok(())
    }

    async fn health(&self, started: &Started) -> Health {
        self.0
            .health
            .lock()
            .unwrap()
            .get(started.tid.as_str())
            .cloned()
            .unwrap_or(Health::Alive)
    }

    async fn exec(&self, tid: &Tid, req: &SlotExecRequest) -> Result<SlotExecResult, BackendError> {
        self.0
            .execs
            .lock()
            .unwrap()
            .push((tid.to_string(), req.clone()));
        Ok(SlotExecResult {
            stdout: format!("ran {}", req.command),
            stderr: String::new(),
            returncode: Some(0),
            timed_out: false,
            truncated: false,
            duration_s: 0.0,
        })
    }

    async fn read(&self, _tid: &Tid, req: &SlotReadRequest) -> Result<SlotFile, BackendError> {
        if req.path.contains("..") {
            return Err(BackendError::Refused {
                status: 400,
                code: "bad_path".into(),
                message: "escapes".into(),
            });
        }
        Ok(SlotFile {
            path: req.path.clone(),
            content_base64: "aGk=".into(),
            size: 2,
            truncated: false,
        })
    }

    async fn write(
        &self,
        _tid: &Tid,
        req: &SlotWriteRequest,
    ) -> Result<SlotWriteResult, BackendError> {
        Ok(SlotWriteResult {
            path: req.path.clone(),
            bytes: 2,
            append: req.append,
        })
    }

    fn expose(&self, addr: SocketAddr, _started: &Started) -> std::io::Result<Forwarder> {
        if self.0.taken_ports.lock().unwrap().contains(&addr.port()) {
            return Err(std::io::ErrorKind::AddrInUse.into());
        }
        Ok(Forwarder::inert())
    }
}
