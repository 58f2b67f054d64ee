//! The Linux capability sets a daemon holds, as `GET /status` reports them: the launcher keeps
//! only the few it uses, the gateway and the bridge hold none, and anyone can check.

use serde::{Deserialize, Serialize};

/// A process's capability sets, each a sorted list of names such as `CAP_CHOWN`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Capabilities {
    pub effective: Vec<String>,
    pub permitted: Vec<String>,
    pub inheritable: Vec<String>,
    pub ambient: Vec<String>,
    /// The most any program this process executes can ever hold.
    pub bounding: Vec<String>,
}
