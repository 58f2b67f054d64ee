//! Least privilege for the daemons' own processes (issue 9, hole 12), with the `caps` crate
//! (safe code: `capget`/`capset`/`prctl` behind a typed interface).
//!
//! - The launcher runs as root but keeps only the capabilities it uses
//!   ([`restrict_to`]): the others leave the bounding set (so no program it runs as root can
//!   regain them), and the effective, permitted, inheritable and ambient sets hold the kept
//!   ones at most (inheritable and ambient hold none: nothing it runs inherits capabilities
//!   across `execve`).
//! - The gateway and the bridge hold none ([`require_none`], called by
//!   [`crate::start_daemon`]): as a service user they refuse to start if they were given any;
//!   run as root (the tests do), they drop every capability instead, so the process is as
//!   powerless as in production even though its uid is 0.
//!
//! Capability sets are per thread and inherited by threads created later, so both must run
//! before any thread is started (before the async runtime).

use std::collections::BTreeSet;

use agentbox_api::caps::Capabilities;
pub use caps::Capability;
use caps::{CapSet, CapsHashSet};

/// Why the capability sets could not be read or changed, or why a daemon refuses them.
#[derive(Debug, thiserror::Error)]
pub enum PrivsError {
    #[error("cannot {what}: {source}")]
    Caps {
        what: &'static str,
        #[source]
        source: caps::errors::CapsError,
    },
    #[error("capabilities still held after dropping them: {0}")]
    NotDropped(String),
    #[error(
        "holds capabilities it must not have (effective: {effective}; permitted: {permitted}); run it as the service user without capabilities (CapabilityBoundingSet= in its unit)"
    )]
    Refused {
        effective: String,
        permitted: String,
    },
}

fn caps_err(what: &'static str) -> impl FnOnce(caps::errors::CapsError) -> PrivsError {
    move |source| PrivsError::Caps { what, source }
}

fn names(set: &CapsHashSet) -> Vec<String> {
    set.iter()
        .map(ToString::to_string)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect()
}

/// This thread's capability sets (all threads share them when [`restrict_to`] and
/// [`require_none`] ran before any thread was started).
pub fn current() -> Result<Capabilities, PrivsError> {
    let read = |set| caps::read(None, set).map_err(caps_err("read the capability sets"));
    Ok(Capabilities {
        effective: names(&read(CapSet::Effective)?),
        permitted: names(&read(CapSet::Permitted)?),
        inheritable: names(&read(CapSet::Inheritable)?),
        ambient: names(&read(CapSet::Ambient)?),
        bounding: names(&read(CapSet::Bounding)?),
    })
}

/// Reduces every set of the calling thread to `keep` (inheritable and ambient to nothing), then
/// checks that the kernel agrees. Capabilities not held are not gained.
pub fn restrict_to(keep: &[Capability]) -> Result<(), PrivsError> {
    let keep: CapsHashSet = keep.iter().copied().collect();
    // The bounding set first: dropping from it needs CAP_SETPCAP, which may be dropped below.
    let bounding = caps::read(None, CapSet::Bounding).map_err(caps_err("read the bounding set"))?;
    for cap in bounding.difference(&keep) {
        caps::drop(None, CapSet::Bounding, *cap).map_err(caps_err("drop from the bounding set"))?;
    }
    caps::clear(None, CapSet::Ambient).map_err(caps_err("clear the ambient set"))?;
    caps::clear(None, CapSet::Inheritable).map_err(caps_err("clear the inheritable set"))?;
    // Effective before permitted: the kernel refuses an effective set larger than permitted.
    for set in [CapSet::Effective, CapSet::Permitted] {
        let held = caps::read(None, set).map_err(caps_err("read the capability sets"))?;
        let kept: CapsHashSet = held.intersection(&keep).copied().collect();
        caps::set(None, set, &kept).map_err(caps_err("set the capability sets"))?;
    }
    let now = current()?;
    let allowed: BTreeSet<String> = keep.iter().map(ToString::to_string).collect();
    let extra: Vec<&String> = [
        &now.effective,
        &now.permitted,
        &now.bounding,
        &now.inheritable,
        &now.ambient,
    ]
    .into_iter()
    .flatten()
    .filter(|c| !allowed.contains(*c))
    .collect();
    if extra.is_empty() && now.inheritable.is_empty() && now.ambient.is_empty() {
        Ok(())
    } else {
        Err(PrivsError::NotDropped(format!("{extra:?}")))
    }
}

/// What [`require_none`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoCaps {
    /// Not root, and no capability was held.
    Held,
    /// Root: every capability was dropped (the tests run the daemons as root).
    DroppedAsRoot,
}

/// For daemons that need no privilege: as root, drops every capability (bounding set
/// included); otherwise refuses unless the effective and permitted sets are empty (the ambient
/// set is a subset of permitted, so it is empty too).
pub fn require_none() -> Result<NoCaps, PrivsError> {
    if rustix::process::geteuid().is_root() {
        restrict_to(&[])?;
        return Ok(NoCaps::DroppedAsRoot);
    }
    let now = current()?;
    if now.effective.is_empty() && now.permitted.is_empty() {
        Ok(NoCaps::Held)
    } else {
        Err(PrivsError::Refused {
            effective: now.effective.join(","),
            permitted: now.permitted.join(","),
        })
    }
}
