//! The per-task gateway (`agentbox-gateway`): one unix socket per task, task-token auth, model
//! rewrite, server-side tool stripping, metering and budgets.
//!
//! Empty until issue 4 lands it. Its request sanitizer already lives in `agentbox-policy`.
