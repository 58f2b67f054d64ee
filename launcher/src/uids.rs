//! The agent identity range: every run (agent or check) gets a uid/gid pair of its own from
//! `agent_uid .. agent_uid + agent_uid_count` (gid at the same offset from `agent_gid`), so no
//! run can signal, trace, read the environment of, or write the files of another, and a leaked
//! identity is worth one run.
//!
//! An identity is taken when a run is reserved and given back only once the run's workspace was
//! handed back (nothing on disk is owned by it any more, and its cgroup is empty). One whose
//! hand-back failed stays taken for the life of the launcher.

use std::collections::BTreeSet;
use std::sync::{Mutex, PoisonError};

use agentbox_policy::config::Config;
use agentbox_sandbox::walk::Owner;

/// The range and which of it is taken.
#[derive(Debug)]
pub struct AgentIds {
    first: Owner,
    count: u32,
    taken: Mutex<BTreeSet<u32>>,
}

impl AgentIds {
    pub fn new(config: &Config) -> AgentIds {
        AgentIds {
            first: Owner {
                uid: config.agent_uid,
                gid: config.agent_gid,
            },
            count: config.agent_uid_count,
            taken: Mutex::new(BTreeSet::new()),
        }
    }

    /// Whether `uid` is in the range.
    pub fn contains_uid(&self, uid: u32) -> bool {
        uid.checked_sub(self.first.uid)
            .is_some_and(|off| off < self.count)
    }

    /// Whether `gid` is in the range.
    pub fn contains_gid(&self, gid: u32) -> bool {
        gid.checked_sub(self.first.gid)
            .is_some_and(|off| off < self.count)
    }

    /// The identity of `uid` (in the range).
    pub fn owner_of(&self, uid: u32) -> Option<Owner> {
        let off = uid.checked_sub(self.first.uid)?;
        (off < self.count).then(|| Owner {
            uid,
            gid: self.first.gid + off,
        })
    }

    /// The range, for messages: `first-last`.
    pub fn describe(&self) -> String {
        format!("{}-{}", self.first.uid, self.first.uid + (self.count - 1))
    }

    /// Takes the lowest free identity; `None` when every one is taken.
    pub fn take(&self) -> Option<Owner> {
        let mut taken = self.taken.lock().unwrap_or_else(PoisonError::into_inner);
        let off = (0..self.count).find(|off| !taken.contains(off))?;
        taken.insert(off);
        self.owner_of(self.first.uid + off)
    }

    /// Marks `uid` taken (a restored run whose workspace could not be handed back).
    pub fn keep(&self, uid: u32) {
        if self.contains_uid(uid) {
            self.taken
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(uid - self.first.uid);
        }
    }

    /// Gives `who` back: call only when nothing on disk or in a cgroup is owned by it.
    pub fn give_back(&self, who: Owner) {
        if self.contains_uid(who.uid) {
            self.taken
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(&(who.uid - self.first.uid));
        }
    }

    /// How many identities are taken.
    pub fn in_use(&self) -> usize {
        self.taken
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(count: u32) -> AgentIds {
        AgentIds {
            first: Owner {
                uid: 64000,
                gid: 65000,
            },
            count,
            taken: Mutex::new(BTreeSet::new()),
        }
    }

    #[test]
    fn takes_distinct_identities_and_reuses_only_what_was_given_back() {
        let ids = ids(2);
        let a = ids.take().unwrap();
        let b = ids.take().unwrap();
        assert_eq!((a.uid, a.gid), (64000, 65000));
        assert_eq!((b.uid, b.gid), (64001, 65001));
        assert!(ids.take().is_none());
        ids.give_back(a);
        assert_eq!(ids.take(), Some(a));
        assert!(ids.contains_uid(64001) && !ids.contains_uid(64002) && !ids.contains_uid(1));
        assert!(ids.contains_gid(65001) && !ids.contains_gid(64001));
        ids.give_back(b);
        ids.keep(64001);
        assert!(ids.take().is_none());
        assert_eq!(ids.in_use(), 2);
        assert_eq!(ids.describe(), "64000-64001");
    }
}
