//! A task's account as its socket sees it: [`TaskAccount`], the handle [`crate::proxy`]
//! receives, and [`Admission`], an admitted request's reservation that settles exactly once.
//!
//! The task table lives in [`crate::gateway`], which implements [`Accounts`]; the proxy knows
//! only this module, so the two never import each other.
//!
//! What an admission bills (the meter never counts less than the upstream bills, as far as the
//! gateway can know it):
//! - a complete answer: the upstream's own usage;
//! - an answer cut after its head (client gone mid-stream, upstream broke, the background
//!   drain's time limit): the metered usage, output at least the deltas that were read
//!   ([`MeterReport::billable_usage`]), input at least the reservation's input estimate when
//!   the upstream never reported its input;
//! - the upstream refused the request (an error status) or could not be reached: nothing;
//! - an admission dropped after it was sent upstream without any of the above (an upstream
//!   that timed out, a task cancelled at shutdown): its whole reservation, because the
//!   upstream may have run the request and nobody saw its usage.

use std::sync::Arc;

use agentbox_policy::config::Model;
use agentbox_policy::id::Tid;
use agentbox_wire::usage::{MeterReport, MeteredUsage};

use crate::ledger::{Refusal, Reservation};

/// Why the account refused.
#[derive(Debug, thiserror::Error)]
pub enum AccountError {
    /// No task token, or the wrong one.
    #[error("invalid task token")]
    Unauthorized,
    /// The task was closed (or never opened).
    #[error("task is closed")]
    TaskClosed,
    /// The budget is spent: refused before any upstream call.
    #[error("{0}; the task's budget is exhausted")]
    Budget(Refusal),
}

/// The task table's operations a task socket needs.
pub trait Accounts: Send + Sync {
    /// Whether `presented` is the open task's token (constant time).
    fn check_token(&self, tid: &Tid, presented: &[u8]) -> Result<(), AccountError>;
    /// The task's model entry.
    fn model_of(&self, tid: &Tid) -> Result<Model, AccountError>;
    /// Admits a request that may cost up to `r`, or refuses it with nothing changed.
    fn admit(&self, tid: &Tid, r: Reservation) -> Result<(), AccountError>;
    /// Books a finished (or abandoned) request's real usage and releases its reservation.
    fn settle(&self, tid: &Tid, r: Reservation, usage: &MeteredUsage);
}

/// One task's account.
#[derive(Clone)]
pub struct TaskAccount {
    accounts: Arc<dyn Accounts>,
    tid: Tid,
}

impl std::fmt::Debug for TaskAccount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TaskAccount")
            .field("tid", &self.tid)
            .finish_non_exhaustive()
    }
}

impl TaskAccount {
    /// The account of `tid` in `accounts`.
    pub fn new(accounts: Arc<dyn Accounts>, tid: Tid) -> Self {
        TaskAccount { accounts, tid }
    }

    /// The task.
    pub fn tid(&self) -> &Tid {
        &self.tid
    }

    /// Whether `presented` is the task's token.
    pub fn check_token(&self, presented: &[u8]) -> Result<(), AccountError> {
        self.accounts.check_token(&self.tid, presented)
    }

    /// The task's model entry.
    pub fn model(&self) -> Result<Model, AccountError> {
        self.accounts.model_of(&self.tid)
    }

    /// Reserves `r`; the [`Admission`] settles it.
    pub fn admit(&self, r: Reservation) -> Result<Admission, AccountError> {
        self.accounts.admit(&self.tid, r)?;
        Ok(Admission {
            account: self.clone(),
            reservation: Some(r),
            sent: false,
        })
    }
}

/// An admitted request's reservation. It settles exactly once, with what the module doc says
/// the request is billed: via [`Admission::settle`] (a metered answer), [`Admission::refund`]
/// (refused or unreachable upstream), or, if dropped first, with nothing when it never went
/// upstream and with its whole reservation when it did ([`Admission::sent`]).
#[derive(Debug)]
pub struct Admission {
    account: TaskAccount,
    reservation: Option<Reservation>,
    /// The request was handed to the upstream client.
    sent: bool,
}

impl Admission {
    /// Marks the request as handed to the upstream: from now on, dropping the admission bills
    /// its whole reservation.
    pub fn sent(&mut self) {
        self.sent = true;
    }

    /// Books a metered answer (see the module doc) and releases the reservation.
    pub fn settle(mut self, report: &MeterReport) {
        let mut usage = report.billable_usage();
        if !report.complete
            && !report.saw_usage
            && let Some(r) = &self.reservation
        {
            usage.input_tokens = usage.input_tokens.max(r.input_tokens);
        }
        self.settle_once(&usage);
    }

    /// The upstream answered with an error status or could not be reached: nothing is billed.
    pub fn refund(mut self) {
        self.settle_once(&MeteredUsage::default());
    }

    fn settle_once(&mut self, usage: &MeteredUsage) {
        if let Some(r) = self.reservation.take() {
            self.account.accounts.settle(&self.account.tid, r, usage);
        }
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        let usage = match (&self.reservation, self.sent) {
            (Some(r), true) => MeteredUsage {
                input_tokens: r.input_tokens,
                output_tokens: r.tokens.saturating_sub(r.input_tokens),
                ..MeteredUsage::default()
            },
            (Some(_), false) | (None, _) => MeteredUsage::default(),
        };
        self.settle_once(&usage);
    }
}
