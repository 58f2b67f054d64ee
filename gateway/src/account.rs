//! A task's account as its socket sees it: [`TaskAccount`], the handle [`crate::proxy`]
//! receives, and [`Admission`], an admitted request's reservation that settles exactly once.
//!
//! The task table lives in [`crate::gateway`], which implements [`Accounts`]; the proxy knows
//! only this module, so the two never import each other.
//!
//! What an admission bills (the meter never counts less than the upstream bills, as far as the
//! gateway can know it):
//! - a complete answer: the upstream's own usage;
//! - a stream cut after its head (client gone mid-stream, upstream broke, the background
//!   drain's time limit), or complete without ever reporting usage (a chat stream without its
//!   usage chunk, a translated stream whose usage the bridge estimated; an error that ended a
//!   stream after its first delta counts as unreported too): the metered usage, output at
//!   least the deltas that were read ([`MeterReport::billable_usage`]), input at least the
//!   reservation's input estimate when the upstream never reported its input;
//! - a whole (non-stream) answer whose usage the meter could not read (cut, unparseable, past
//!   the meter's bound, without `usage`, or with a usage the bridge made up because the
//!   provider reported none, `agentbox_wire::anthropic::ESTIMATE_MARK`): the reservation's
//!   input estimate and its whole output, because the upstream generated all of it before the
//!   head, and billed it. A client that hangs up during such a body does not get there: the
//!   rest is read in the background and billed as the upstream reported it
//!   (`agentbox_llm::Answer::read_rest_with`);
//! - the upstream refused the request (an error status) or could not be reached: nothing,
//!   unless the error says the model may have run it (`agentbox_llm::RAN_HEADER`: the bridge's
//!   provider timed out or answered garbage), which bills as below;
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
        if let Some(r) = &self.reservation {
            // An error body or event that ended the answer bills what was metered, no more,
            // unless the model had begun answering: then it read the prompt.
            let unreported = report.error.is_none() || !report.complete || report.delta_events > 0;
            if !report.saw_usage && unreported {
                usage.input_tokens = usage.input_tokens.max(r.input_tokens);
            }
            if report.whole_body
                && (!report.complete || !report.saw_usage)
                && report.error.is_none()
            {
                usage.output_tokens = usage
                    .output_tokens
                    .max(r.tokens.saturating_sub(r.input_tokens));
            }
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::Mutex;

    use agentbox_wire::anthropic::{ErrorDetail, ErrorType};

    use super::*;

    /// Records what each admission settles with.
    #[derive(Default)]
    struct Books(Mutex<Vec<MeteredUsage>>);

    impl Accounts for Books {
        fn check_token(&self, _: &Tid, _: &[u8]) -> Result<(), AccountError> {
            Ok(())
        }
        fn model_of(&self, _: &Tid) -> Result<Model, AccountError> {
            Err(AccountError::TaskClosed)
        }
        fn admit(&self, _: &Tid, _: Reservation) -> Result<(), AccountError> {
            Ok(())
        }
        fn settle(&self, _: &Tid, _: Reservation, usage: &MeteredUsage) {
            self.0.lock().unwrap().push(*usage);
        }
    }

    /// What `report` settles to, for a request reserved as 40 input and 1,000 output tokens.
    fn billed(report: &MeterReport) -> (u64, u64) {
        let books = Arc::new(Books::default());
        let account = TaskAccount::new(books.clone(), Tid::parse("t1").unwrap());
        let mut admission = account
            .admit(Reservation::for_request(40, 1000, None))
            .unwrap();
        admission.sent();
        admission.settle(report);
        let usage = books.0.lock().unwrap()[0];
        (usage.input_tokens, usage.output_tokens)
    }

    fn usage(input: u64, output: u64) -> MeteredUsage {
        MeteredUsage {
            input_tokens: input,
            output_tokens: output,
            ..MeteredUsage::default()
        }
    }

    #[test]
    fn what_each_kind_of_answer_bills() {
        let complete = MeterReport {
            usage: usage(7, 9),
            saw_usage: true,
            complete: true,
            ..MeterReport::default()
        };
        assert_eq!(billed(&complete), (7, 9));
        let whole = MeterReport {
            whole_body: true,
            ..complete.clone()
        };
        assert_eq!(billed(&whole), (7, 9));
        // A stream cut after its `message_start` and 300 bytes of text.
        let cut = MeterReport {
            usage: usage(7, 1),
            saw_usage: true,
            delta_events: 3,
            delta_text_bytes: 300,
            ..MeterReport::default()
        };
        assert_eq!(billed(&cut), (7, 100));
        // Cut before anything reported its input: the estimate.
        let blind = MeterReport {
            delta_events: 1,
            delta_text_bytes: 30,
            ..MeterReport::default()
        };
        assert_eq!(billed(&blind), (40, 10));
        // A chat stream complete without its usage chunk: the same floors.
        let silent = MeterReport {
            complete: true,
            ..blind.clone()
        };
        assert_eq!(billed(&silent), (40, 10));
        // A whole answer the meter could not read: generated whole, so the whole reservation.
        let unread = MeterReport {
            whole_body: true,
            malformed: 1,
            ..MeterReport::default()
        };
        assert_eq!(billed(&unread), (40, 1000));
        // An error the upstream answered with (a complete error body): nothing.
        let error = MeterReport {
            whole_body: true,
            complete: true,
            error: Some(ErrorDetail::new(ErrorType::ApiError, "x")),
            ..MeterReport::default()
        };
        assert_eq!(billed(&error), (0, 0));
        // A whole answer whose usage the bridge made up (the provider reported none): as if
        // it had none.
        let estimated = MeterReport {
            usage: usage(10, 3),
            whole_body: true,
            complete: true,
            ..MeterReport::default()
        };
        assert_eq!(billed(&estimated), (40, 1000));
        // An error event after the model began answering (vLLM ends with one, then `[DONE]`):
        // the prompt was read.
        let broke = MeterReport {
            complete: true,
            error: Some(ErrorDetail::new(ErrorType::ApiError, "x")),
            delta_events: 5,
            delta_text_bytes: 300,
            ..MeterReport::default()
        };
        assert_eq!(billed(&broke), (40, 100));
    }
}
