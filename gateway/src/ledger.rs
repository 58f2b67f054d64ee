//! The money: per-task usage, budgets and in-flight reservations, as plain data with explicit
//! transitions, so admission and settlement can be tested without sockets.
//!
//! **Guarantee: a task's spend exceeds its budget by at most one lone request's reservation plus
//! what upstream bills beyond the reservations of the requests it admitted**, in each dimension
//! (tokens and, when set, USD): `spent < budget + r_lone + sum over admitted requests of
//! max(0, billed - reserved)`, where `r_lone` is the reservation of the last request admitted
//! with nothing else in flight. When every reservation is an upper bound of its bill the
//! overshoot is at most one request; when an estimate is wrong, at most the errors of the
//! requests in flight, never a multiple of the budget from many requests racing past the check.
//!
//! Admission rule, for a request reserving `r` while `reserved` is in flight:
//! - nothing in flight (`reserved == 0`): admitted while `spent < budget`, so a task can always
//!   use what is left of its budget with one request at a time (Claude Code reserves its whole
//!   `max_tokens`, 32k and more: a rule demanding that it fit would strand the last ~60k of
//!   every budget and refuse small budgets outright);
//! - otherwise: admitted only if `spent + reserved + r <= budget`: concurrent requests must fit
//!   whole, which is what bounds a race.
//!
//! A request reserves an upper bound of what it can cost: its input estimate, biased high with
//! media counted conservatively ([`crate::estimate`]), plus its whole `max_tokens`. It settles
//! on the real usage the response reported.

use std::collections::BTreeMap;

use agentbox_policy::config::Prices;
use agentbox_wire::usage::MeteredUsage;
use serde::{Deserialize, Serialize};

/// A task's budget (`None` parts are unlimited) and whether its socket is served: the control
/// API's shapes, persisted as they are.
pub use agentbox_api::gateway::{Budget, TaskState};

/// What a task has consumed.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Spent {
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cache_read_input_tokens: u64,
    pub cache_creation_input_tokens: u64,
    /// Requests sent upstream.
    pub requests: u64,
    /// Cost in USD, when the model has prices.
    pub cost_usd: f64,
}

impl Spent {
    /// All tokens, in the budget's unit.
    pub fn tokens(&self) -> u64 {
        self.input_tokens
            .saturating_add(self.output_tokens)
            .saturating_add(self.cache_read_input_tokens)
            .saturating_add(self.cache_creation_input_tokens)
    }

    fn add(&mut self, u: &MeteredUsage, prices: Option<&Prices>) {
        self.input_tokens = self.input_tokens.saturating_add(u.input_tokens);
        self.output_tokens = self.output_tokens.saturating_add(u.output_tokens);
        self.cache_read_input_tokens = self
            .cache_read_input_tokens
            .saturating_add(u.cache_read_input_tokens);
        self.cache_creation_input_tokens = self
            .cache_creation_input_tokens
            .saturating_add(u.cache_creation_input_tokens);
        self.requests = self.requests.saturating_add(1);
        if let Some(p) = prices {
            let hour = u.cache_creation_1h_input_tokens;
            self.cost_usd += p.cost_usd(
                u.input_tokens,
                u.output_tokens,
                u.cache_read_input_tokens,
                u.cache_creation_input_tokens.saturating_sub(hour),
            ) + Prices {
                cache_write_per_mtok: p.cache_write_1h_per_mtok(),
                ..*p
            }
            .cost_usd(0, 0, 0, hour);
        }
    }
}

/// The worst case of one request, held while it is in flight.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct Reservation {
    /// Input estimate plus the output allowed.
    pub tokens: u64,
    pub usd: f64,
    /// The input estimate alone, billed when an upstream never reports its input.
    pub input_tokens: u64,
}

impl Reservation {
    /// The reservation for a request with `input_estimate` input tokens (biased high) that may
    /// generate up to `max_output` tokens.
    pub fn for_request(input_estimate: u64, max_output: u64, prices: Option<&Prices>) -> Self {
        let usd = prices.map_or(0.0, |p| {
            // Input may turn out to be cache writes, the dearest input kind.
            let input_price = p
                .input_per_mtok
                .max(p.cache_write_1h_per_mtok())
                .max(p.cache_read_per_mtok);
            Prices {
                input_per_mtok: input_price,
                ..*p
            }
            .cost_usd(input_estimate, max_output, 0, 0)
        });
        Reservation {
            tokens: input_estimate.saturating_add(max_output),
            usd,
            input_tokens: input_estimate,
        }
    }
}

/// Why a request was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
pub enum Refusal {
    /// The token budget has no room for the request (spent plus in-flight reservations plus
    /// this request's own).
    #[error(
        "token budget exhausted: {spent} spent and {reserved} reserved of {budget}, and this \
         request reserves {request}"
    )]
    Tokens {
        spent: u64,
        reserved: u64,
        budget: u64,
        request: u64,
    },
    /// The cost budget has no room for the request.
    #[error(
        "cost budget exhausted: ${spent:.6} spent and ${reserved:.6} reserved of ${budget:.6}, \
         and this request reserves ${request:.6}"
    )]
    Usd {
        spent: f64,
        reserved: f64,
        budget: f64,
        request: f64,
    },
}

/// One task's account.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Account {
    pub budget: Budget,
    pub spent: Spent,
    pub reserved: Reservation,
    /// Requests currently in flight.
    pub in_flight: u32,
}

impl Account {
    /// Admits a request reserving `r`, or refuses it without changing anything.
    pub fn admit(&mut self, r: Reservation) -> Result<(), Refusal> {
        if let Some(budget) = self.budget.tokens {
            let spent = self.spent.tokens();
            let fits = if self.reserved.tokens == 0 {
                spent < budget
            } else {
                spent
                    .saturating_add(self.reserved.tokens)
                    .saturating_add(r.tokens)
                    <= budget
            };
            if !fits {
                return Err(Refusal::Tokens {
                    spent,
                    reserved: self.reserved.tokens,
                    budget,
                    request: r.tokens,
                });
            }
        }
        if let Some(budget) = self.budget.usd {
            let spent = self.spent.cost_usd;
            // Not `>=`: a request must still be refused once the budget is reached even if it
            // reserves nothing (no prices for a part of it).
            let fits = if self.reserved.usd == 0.0 {
                spent < budget
            } else {
                spent + self.reserved.usd + r.usd <= budget
            };
            if !fits || spent >= budget {
                return Err(Refusal::Usd {
                    spent,
                    reserved: self.reserved.usd,
                    budget,
                    request: r.usd,
                });
            }
        }
        self.reserved.tokens = self.reserved.tokens.saturating_add(r.tokens);
        self.reserved.usd += r.usd;
        self.in_flight = self.in_flight.saturating_add(1);
        Ok(())
    }

    /// Releases reservation `r` and books the real usage.
    pub fn settle(&mut self, r: Reservation, usage: &MeteredUsage, prices: Option<&Prices>) {
        self.reserved.tokens = self.reserved.tokens.saturating_sub(r.tokens);
        self.reserved.usd = (self.reserved.usd - r.usd).max(0.0);
        if self.in_flight <= 1 {
            // Float drift must not leave a phantom reservation once nothing is in flight.
            self.reserved = Reservation::default();
        }
        self.in_flight = self.in_flight.saturating_sub(1);
        self.spent.add(usage, prices);
    }

    /// What is left: `None` for an unlimited dimension.
    pub fn remaining(&self) -> (Option<u64>, Option<f64>) {
        (
            self.budget
                .tokens
                .map(|b| b.saturating_sub(self.spent.tokens())),
            self.budget.usd.map(|b| (b - self.spent.cost_usd).max(0.0)),
        )
    }
}

/// What is persisted per task (the token only as its SHA-256: no secret on disk).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskRecord {
    pub model: String,
    pub token_sha256: String,
    pub budget: Budget,
    pub spent: Spent,
    pub state: TaskState,
}

/// The whole persisted state of the gateway.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Snapshot {
    pub version: u32,
    pub tasks: BTreeMap<String, TaskRecord>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An account with a token budget and no cost budget.
    fn tokens_budget(tokens: u64) -> Account {
        Account {
            budget: Budget {
                tokens: Some(tokens),
                usd: None,
            },
            ..Account::default()
        }
    }

    /// A reservation of `tokens` and no cost.
    fn tokens(tokens: u64) -> Reservation {
        Reservation {
            tokens,
            ..Reservation::default()
        }
    }

    fn usage(i: u64, o: u64) -> MeteredUsage {
        MeteredUsage {
            input_tokens: i,
            output_tokens: o,
            ..MeteredUsage::default()
        }
    }

    #[test]
    fn unlimited_admits_everything() {
        let mut a = Account::default();
        for _ in 0..100 {
            a.admit(Reservation {
                tokens: 1 << 40,
                usd: 1e9,
                ..Reservation::default()
            })
            .unwrap();
        }
        assert_eq!(a.in_flight, 100);
    }

    #[test]
    fn refuses_once_spent_reaches_the_budget() {
        let mut a = tokens_budget(100);
        let r = tokens(100);
        a.admit(r).unwrap();
        a.settle(r, &usage(80, 20), None);
        assert_eq!(a.spent.tokens(), 100);
        assert!(matches!(
            a.admit(r),
            Err(Refusal::Tokens {
                spent: 100,
                reserved: 0,
                budget: 100,
                request: 100,
            })
        ));
        assert_eq!(a.remaining(), (Some(0), None));
    }

    #[test]
    fn reservations_in_flight_block_new_requests() {
        let mut a = tokens_budget(1000);
        let r = tokens(400);
        a.admit(r).unwrap();
        a.admit(r).unwrap(); // 400 + 400 <= 1000: admitted; now 800 reserved.
        assert!(a.admit(r).is_err()); // 800 + 400 > 1000.
        a.settle(r, &usage(10, 10), None);
        a.settle(r, &usage(10, 10), None);
        assert_eq!(a.reserved, Reservation::default());
        assert_eq!(a.spent.tokens(), 40);
        a.admit(r).unwrap();
    }

    #[test]
    fn overshoot_is_bounded_by_reservations_in_flight() {
        // Many concurrent requests, each settling at most its reservation: whatever the
        // interleaving, spent <= budget + the largest reservation total seen at admission.
        let budget = 10_000;
        let mut a = tokens_budget(budget);
        let r = tokens(700);
        let mut admitted = 0;
        let mut max_reserved = 0;
        while a.admit(r).is_ok() {
            admitted += 1;
            max_reserved = max_reserved.max(a.reserved.tokens);
        }
        for _ in 0..admitted {
            a.settle(r, &usage(600, 100), None);
        }
        assert!(a.spent.tokens() <= budget + max_reserved);
        // With nothing in flight, lone requests use what is left, one at a time.
        while a.spent.tokens() < budget {
            a.admit(r).unwrap();
            a.settle(r, &usage(600, 100), None);
        }
        assert!(a.spent.tokens() < budget + r.tokens);
        assert!(a.admit(r).is_err());
    }

    #[test]
    fn admits_only_what_fits_whole() {
        let mut a = tokens_budget(1000);
        // Nothing in flight: a lone request is admitted while anything is left, however much
        // it reserves; with it in flight, no other fits.
        a.admit(tokens(1001)).unwrap();
        assert!(matches!(
            a.admit(tokens(1)),
            Err(Refusal::Tokens {
                request: 1,
                reserved: 1001,
                ..
            })
        ));
        a.settle(tokens(1001), &usage(0, 0), None);
        a.admit(tokens(600)).unwrap();
        assert!(a.admit(tokens(401)).is_err());
        a.admit(tokens(400)).unwrap(); // exactly the budget
        assert_eq!(a.reserved.tokens, 1000);
        assert!(a.admit(tokens(1)).is_err());
    }

    #[test]
    fn overshoot_is_at_most_what_is_billed_beyond_reservations() {
        // Twenty racing requests whose estimates are wrong by 10x: only what fits is admitted,
        // so the spend passes the budget by at most the admitted requests' errors.
        let budget = 10_000;
        let mut a = tokens_budget(budget);
        let r = tokens(3_000);
        let admitted = (0..20).filter(|_| a.admit(r).is_ok()).count() as u64;
        assert_eq!(admitted, 3);
        for _ in 0..admitted {
            a.settle(r, &usage(29_000, 1_000), None);
        }
        assert!(a.spent.tokens() <= budget + admitted * (30_000 - 3_000));
        assert!(a.admit(r).is_err());
    }

    #[test]
    fn cost_budget_uses_prices() {
        let prices = Prices {
            input_per_mtok: 3.0,
            output_per_mtok: 15.0,
            cache_read_per_mtok: 0.3,
            cache_write_per_mtok: 3.75,
        };
        let mut a = Account {
            budget: Budget {
                tokens: None,
                usd: Some(0.01),
            },
            ..Account::default()
        };
        let r = Reservation::for_request(1000, 1000, Some(&prices));
        // Input may all be hour-long cache writes, at twice the input price.
        assert!((r.usd - (1000.0 * 6.0 + 1000.0 * 15.0) / 1e6).abs() < 1e-12);
        a.admit(r).unwrap();
        a.settle(r, &usage(1000, 1000), Some(&prices));
        assert!((a.spent.cost_usd - 0.018).abs() < 1e-12);
        assert!(matches!(a.admit(r), Err(Refusal::Usd { .. })));
    }

    /// Hour-long cache writes cost twice the input price (five-minute ones 1.25 times): a
    /// configured five-minute price does not make them cheaper.
    #[test]
    fn hour_long_cache_writes_cost_twice_the_input() {
        let prices = Prices {
            input_per_mtok: 3.0,
            output_per_mtok: 15.0,
            cache_read_per_mtok: 0.3,
            cache_write_per_mtok: 3.75,
        };
        let mut a = Account::default();
        let r = Reservation::for_request(1, 1, Some(&prices));
        a.admit(r).unwrap();
        let u = MeteredUsage {
            cache_creation_input_tokens: 150_000,
            cache_creation_1h_input_tokens: 100_000,
            ..MeteredUsage::default()
        };
        a.settle(r, &u, Some(&prices));
        let want = (50_000.0 * 3.75 + 100_000.0 * 6.0) / 1e6;
        assert!(
            (a.spent.cost_usd - want).abs() < 1e-12,
            "{}",
            a.spent.cost_usd
        );
    }

    #[test]
    fn snapshot_round_trips_and_refuses_unknown_fields() {
        let mut s = Snapshot {
            version: 1,
            ..Snapshot::default()
        };
        s.tasks.insert(
            "t1".into(),
            TaskRecord {
                model: "m".into(),
                token_sha256: "00".into(),
                budget: Budget {
                    tokens: Some(5),
                    usd: None,
                },
                spent: Spent {
                    input_tokens: 3,
                    requests: 1,
                    ..Spent::default()
                },
                state: TaskState::Open,
            },
        );
        let text = serde_json::to_string(&s).unwrap();
        assert_eq!(serde_json::from_str::<Snapshot>(&text).unwrap(), s);
        assert!(serde_json::from_str::<Snapshot>(r#"{"version":1,"tasks":{},"x":1}"#).is_err());
    }
}
