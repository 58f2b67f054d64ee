//! The JSON shapes of the launcher's HTTP API live in `agentbox-api` (the contract its clients
//! share); this module names them for the launcher's own code.

pub use agentbox_api::launcher::{
    AgentRequest, AgentStatus, BackendStartResult, BackendState, BackendStatus, BackendStopResult,
    CheckRequest, CheckResult, DeleteBranchRequest, DeleteBranchResult, DeliverRequest,
    DeliverResult, DiskMode, DiskStatus, HostCheck, HostStatus, LauncherStatus, RunState,
    RunSummary, SlotExecRequest, SlotExecResult, SlotFile, SlotReadRequest, SlotRequest,
    SlotStatus, SlotWriteRequest, SlotWriteResult, SnapshotRequest, SnapshotResult,
};
