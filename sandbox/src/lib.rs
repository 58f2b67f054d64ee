//! The sandbox engine (`agentbox-sandbox`): everything that touches the host on behalf of a
//! privileged program, and the only crate of the workspace with `unsafe` code.
//!
//! It knows nothing about HTTP, requests or the data directory's layout: callers pass
//! validated descriptors and paths in, and get typed errors back.
//!
//! # Modules
//! - [`walk`]: the fd-based hand-over and hand-back of a directory tree (owner changes that
//!   never follow a name).
//! - [`stage`]: mount by descriptor: validated directories bind-mounted onto root-only paths
//!   for bwrap.
//! - [`bwrap`]: the bubblewrap argument list, the sandbox environment, and the spawn.
//! - [`disk`]: per-run disk limits: project quotas where the filesystem enforces them, else a
//!   watcher that measures the tree by descriptor.
//! - [`seccomp`]: the BPF filters.
//! - [`cgroup`]: per-run cgroups (v1 and v2): limits, kill, OOM.
//! - [`proc`]: child processes: the one `pre_exec` setup (cgroup join, identity drop,
//!   parent-death signal, descriptor hygiene) that allocates nothing, run after std's `fork` or
//!   a `clone(CLONE_VM | CLONE_VFORK)` that copies nothing (bwrap), capped output capture,
//!   process-group termination, and the few host-process knobs a daemon needs at startup.
//! - [`reaper`]: a supervisor's adoption of the orphans its agents leave (child subreaper),
//!   reaping only those, and killing them when the agent stops.

pub mod bwrap;
pub mod cgroup;
pub mod disk;
pub mod proc;
pub mod reaper;
pub mod seccomp;
pub mod stage;
pub mod walk;
