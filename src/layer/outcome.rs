//! The store's answer turned into where a request goes: on to the inner
//! service with its headers (and a refund, for policies that count some
//! responses only), a `429`, or the fail mode (`503`, open, or the local
//! limit). Every outcome is counted and traced here.

use std::cmp::Reverse;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Response};

use crate::layer::Shared;
use crate::layer::body::Leases;
use crate::layer::delay::{Delayed, Slot, Unpassed};
use crate::layer::local_fallback::LocalChecks;
use crate::layer::reject::{Reply, reject};
use crate::layer::roles::{HeaderSource, Refund, Roles};
use crate::metrics::{self, Outcome, Timer};
use crate::policy::cost::Checks;
use crate::policy::plan::Plan;
use crate::policy::{Algorithm, Count};
use crate::response::headers::{RateHeaders, closest_to_denying};
use crate::response::problem::Denial;
use crate::store::{Check, CheckOutcome, Decision, Decisions, Store, StoreError, index_of_min};
use crate::throttle::STORE_FAILURES;

/// Where a request goes once it is decided.
pub(crate) enum Next {
    /// On to the inner service, with these rate-limit headers, the units
    /// to refund if its response should not count, and the concurrency
    /// leases its response body holds.
    Call(Option<RateHeaders>, Option<Box<Refund>>, Option<Leases>),
    /// Back to the client with the limiter's answer.
    Answer(Response<Bytes>),
    /// Admitted once it has waited (see [`hold`](super::hold)). Only a
    /// request's continuation sees it.
    Delay(Box<Delayed>),
}

impl Next {
    /// On to the inner service untouched.
    pub(crate) const PASS: Self = Self::Call(None, None, None);
}

/// What goes from sending a request's checks to its outcome.
pub(crate) struct Sent {
    /// The checks, enforced ones first (see [`Roles`]).
    pub(crate) checks: Checks,
    /// What the checks do beyond counting, when any does.
    pub(crate) roles: Option<Box<Roles>>,
    /// When the checks went to the store.
    pub(crate) at: SentAt,
    /// Whether a store failure answers `503`.
    pub(crate) fail_closed: bool,
}

/// When a request's checks went to the store: on the deny cache's clock
/// (0 without one), and timed for the metrics and the `rate_limit` span.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SentAt {
    pub(crate) deny_clock: u64,
    pub(crate) timer: Timer,
}

/// Where the store's answer to `sent` leads, for a client of `tier` under
/// `plan`: the inner service with the rate-limit headers, a `429`, or,
/// when the store failed, the fail mode. Shadow checks (see [`Roles`])
/// never deny.
pub(crate) fn outcome(
    shared: &Shared,
    parts: &Parts,
    plan: &Plan,
    tier: Option<&str>,
    sent: &Sent,
    outcome: CheckOutcome,
) -> Next {
    let Sent {
        checks,
        roles,
        at: sent_at,
        fail_closed,
    } = sent;
    let (checks, roles) = (&checks[..], roles.as_deref());
    let took = sent_at.timer.elapsed();
    metrics::store_answered(took, &outcome);
    let enforced = roles.map_or(checks.len(), |roles| roles.shadow_from);
    let decisions = outcome.and_then(|decisions| {
        // Without the shadow checks' decisions when the enforced ones deny.
        let partial = enforced > 0 && decisions.len() == enforced;
        if decisions.len() == checks.len() || partial {
            Ok(decisions)
        } else {
            Err(StoreError::Protocol(format!(
                "{} decisions for {} checks",
                decisions.len(),
                checks.len()
            )))
        }
    });
    match decisions {
        Ok(decisions) => {
            let decided = &checks[..decisions.len()];
            let enforced = enforced.min(decisions.len());
            let admitted = decisions[..enforced].iter().all(|d| d.admitted);
            let local_refund = roles
                .filter(|_| admitted)
                .and_then(Roles::local)
                .and_then(|local| shared.local.record(local));
            let ietf_policy =
                ietf_policy(plan, tier, checks, roles).filter(|_| decided.len() == checks.len());
            settle(
                shared,
                parts,
                Answered {
                    store: &shared.store,
                    checks: decided,
                    decisions: &decisions,
                    enforced,
                    counts: roles.map(Roles::counts),
                    ietf_policy,
                    deny_clock: Some(sent_at.deny_clock),
                    took,
                    local_refund,
                },
            )
        }
        // `held_back`: failures since the last line, which were not logged.
        Err(error) if *fail_closed => {
            report_all(checks, Outcome::FailedClosed, took);
            if let Some(held_back) = STORE_FAILURES.admit() {
                tracing::error!(%error, held_back, "rate-limit store unavailable; failing closed");
            }
            Next::Answer(reject(shared, parts, Reply::StoreUnavailable(&error)))
        }
        Err(error) => {
            if let Some(next) = roles.and_then(|roles| fall_back(shared, parts, roles, took)) {
                if let Some(held_back) = STORE_FAILURES.admit() {
                    tracing::warn!(%error, held_back, "rate-limit store unavailable; enforcing local limits");
                }
                return next;
            }
            report_all(checks, Outcome::FailedOpen, took);
            if let Some(held_back) = STORE_FAILURES.admit() {
                tracing::warn!(%error, held_back, "rate-limit store unavailable; failing open");
            }
            Next::PASS
        }
    }
}

/// `RateLimit-Policy` as `plan` has it for `tier`, when every policy
/// counts the request (`checks` holds one check per policy) in the plan's
/// order.
pub(crate) fn ietf_policy<'a>(
    plan: &'a Plan,
    tier: Option<&str>,
    checks: &[Check],
    roles: Option<&Roles>,
) -> Option<&'a HeaderValue> {
    let in_order = roles.is_none_or(|roles| !roles.reordered(checks.len()));
    (checks.len() == plan.policies().len() && in_order)
        .then(|| plan.tier(tier).ietf_policy.as_ref())
        .flatten()
}

/// A batch's decisions, as one store gave them.
struct Answered<'a> {
    store: &'a Arc<dyn Store>,
    checks: &'a [Check],
    /// One per check of `checks`: enforced ones before `enforced`, shadow
    /// ones after.
    decisions: &'a [Decision],
    enforced: usize,
    /// What each check counts, when some count some responses only.
    counts: Option<&'a [Count]>,
    ietf_policy: Option<&'a HeaderValue>,
    /// When the batch was sent, on the deny cache's clock; `None` for the
    /// local limit's decisions.
    deny_clock: Option<u64>,
    took: Option<Duration>,
    /// The units the local counts recorded of the store's admission, to
    /// take back with the store's.
    local_refund: Option<Box<Refund>>,
}

/// Admits or denies a request by the decisions `answered` holds: a shadow
/// check's denial is traced and lets the request pass. A store's denial is
/// remembered in the deny cache.
fn settle(shared: &Shared, parts: &Parts, answered: Answered<'_>) -> Next {
    let Answered {
        store,
        checks,
        decisions,
        enforced,
        counts,
        ietf_policy,
        deny_clock,
        took,
        local_refund,
    } = answered;
    let options = shared.options;
    if decisions.is_empty() {
        return Next::Call(None, None, None);
    }
    if decisions[..enforced].iter().all(|d| d.admitted) {
        // Admitted once it has waited, in a place of the layer's.
        let wait = decisions[..enforced]
            .iter()
            .filter_map(|d| d.delayed_for)
            .max()
            .filter(|wait| !wait.is_zero());
        let slot = match wait {
            Some(wait) => match Slot::take(
                &shared.delayed,
                options.max_delayed,
                options.max_delayed_bytes,
                parts,
            ) {
                Some(slot) => Some((wait, slot)),
                None => return unheld(shared, parts, store, checks, decisions, enforced, wait),
            },
            None => None,
        };
        let admitted = if deny_clock.is_some() {
            Outcome::Admitted
        } else {
            Outcome::Local
        };
        let mut outcome = admitted;
        // Without metrics, only shadow checks need a look.
        let from = if cfg!(feature = "metrics") {
            0
        } else {
            enforced
        };
        for (check, decision) in checks.iter().zip(decisions).skip(from) {
            if decision.admitted {
                metrics::decided(&check.policy, admitted);
                metrics::near_limit(check, decision);
            } else {
                // A shadow check (the enforced ones all admitted), of a
                // batch that would have been denied; counted against the
                // policies that did not fit, as a denial is.
                outcome = Outcome::ShadowDenied;
                if decision.retry_after.is_some() {
                    metrics::decided(&check.policy, Outcome::ShadowDenied);
                    tracing::debug!(
                        policy = &*check.policy,
                        "shadow policy would have denied the request"
                    );
                }
            }
        }
        let reported = closest_to_denying(decisions);
        trace_decision(&checks[reported].policy, outcome, took);
        // The headers are read once the request has waited.
        let shifted: Option<Decisions> = wait.map(|wait| {
            decisions
                .iter()
                .map(|d| Decision {
                    reset: d.reset.saturating_sub(wait),
                    ..*d
                })
                .collect()
        });
        let headers = RateHeaders::new(
            checks,
            shifted.as_deref().unwrap_or(decisions),
            reported,
            None,
            ietf_policy,
            options.header_style,
            options.reset_format,
        );
        let refund = counts.and_then(|counts| {
            Refund::of(store, checks, decisions, counts, || {
                (!headers.is_empty()).then(|| HeaderSource {
                    checks: checks.iter().cloned().collect(),
                    decisions: decisions.iter().copied().collect(),
                    decided: std::time::Instant::now(),
                    ietf_policy: ietf_policy.cloned(),
                    style: options.header_style,
                    reset_format: options.reset_format,
                })
            })
        });
        // The local counts give units back when the store's are sent back.
        let refund = refund.map(|refund| refund.with_local(local_refund));
        let leases = Leases::of(store, checks, decisions);
        let call = Next::Call(Some(headers), refund, leases);
        return match slot {
            Some((wait, slot)) => {
                let unpassed = Unpassed::of(store, checks, decisions);
                Next::Delay(Delayed::new(wait, call, slot, unpassed))
            }
            None => call,
        };
    }
    let (checks, decisions) = (&checks[..enforced], &decisions[..enforced]);
    for (check, decision) in checks.iter().zip(decisions) {
        if decision.retry_after.is_some() {
            metrics::decided(&check.policy, Outcome::Denied);
        }
    }
    if let (Some(cache), Some(sent_at)) = (&shared.deny_cache, deny_clock) {
        // A refund may free a policy that counts some responses only
        // before its denial's retry time, and a lease may end at any
        // moment: those denials are cached only while a block holds them.
        let lasting = |index: usize| {
            counts.is_none_or(|counts| counts[index] == Count::All)
                && checks[index].algorithm != Algorithm::Concurrency
        };
        cache.remember(checks, decisions, sent_at, lasting);
    }
    // The policy that frees last is the one the client waits for.
    let denied = index_of_min(decisions, |d| Reverse(d.retry_after));
    trace_decision(&checks[denied].policy, Outcome::Denied, took);
    Next::Answer(reject(
        shared,
        parts,
        Reply::Limited(Denial {
            checks,
            decisions,
            denied,
            body: None,
        }),
    ))
}

/// Answers `429` to a request the store admitted after `wait` but the
/// layer has no room to hold: its units are given back (its leases
/// released), unless a policy of its blocks, where they stay counted, so
/// that a flood that fills the layer still reaches its block.
fn unheld(
    shared: &Shared,
    parts: &Parts,
    store: &Arc<dyn Store>,
    checks: &[Check],
    decisions: &[Decision],
    enforced: usize,
    wait: Duration,
) -> Next {
    drop(Leases::of(store, checks, decisions));
    let unpassed = Unpassed::of(store, checks, decisions);
    if checks[..enforced]
        .iter()
        .any(|check| check.block_micros > 0)
    {
        unpassed.keep();
    }
    let (checks, decisions) = (&checks[..enforced], &decisions[..enforced]);
    let denials: Decisions = decisions
        .iter()
        .map(|d| Decision {
            admitted: false,
            retry_after: Some(wait),
            delayed_for: None,
            recorded_at: None,
            ..*d
        })
        .collect();
    for check in checks {
        metrics::decided(&check.policy, Outcome::Denied);
    }
    trace_decision(&checks[0].policy, Outcome::Denied, None);
    Next::Answer(reject(
        shared,
        parts,
        Reply::Limited(Denial {
            checks,
            decisions: &denials,
            denied: 0,
            body: None,
        }),
    ))
}

/// Counts `outcome` for every check of a request, and traces it.
fn report_all(checks: &[Check], outcome: Outcome, took: Option<Duration>) {
    for check in checks {
        metrics::decided(&check.policy, outcome);
    }
    if let Some(check) = checks.first() {
        trace_decision(&check.policy, outcome, took);
    }
}

/// The debug-level `rate_limit` span of a decided request: the policy
/// reported (or that denied), the outcome, and the store's time.
pub(crate) fn trace_decision(policy: &str, outcome: Outcome, took: Option<Duration>) {
    // Checked first: a span costs a few hundred instructions even when no
    // one listens (tracing's `log` fallback).
    if !tracing::enabled!(tracing::Level::DEBUG) {
        return;
    }
    let store_us = took.map(|took| u64::try_from(took.as_micros()).unwrap_or(u64::MAX));
    tracing::debug_span!("rate_limit", policy, outcome = outcome.label(), store_us).in_scope(
        || {
            tracing::debug!("rate-limit decision");
        },
    );
}

/// Decides the checks that fall back to a local limit, while the store
/// is unavailable; `None` when no check does (the request then fails
/// open).
fn fall_back(
    shared: &Shared,
    parts: &Parts,
    roles: &Roles,
    took: Option<Duration>,
) -> Option<Next> {
    let local = roles.local()?;
    let decisions = shared.local.decide(local)?;
    Some(settle_locally(shared, parts, local, &decisions, took))
}

/// Denies a request the local counts refuse within a window of the
/// store's last failure, before the store is asked (see
/// [`LocalLimits`](super::local_fallback::LocalLimits)); `None` to ask the store.
pub(crate) fn refused_locally(shared: &Shared, parts: &Parts, roles: &Roles) -> Option<Next> {
    let local = roles.local()?;
    let decisions = shared.local.refuses(local)?;
    Some(settle_locally(shared, parts, local, &decisions, None))
}

fn settle_locally(
    shared: &Shared,
    parts: &Parts,
    local: &LocalChecks,
    decisions: &[Decision],
    took: Option<Duration>,
) -> Next {
    settle(
        shared,
        parts,
        Answered {
            store: shared.local.store(),
            checks: &local.checks,
            decisions,
            enforced: local.checks.len(),
            counts: Some(&local.counts),
            ietf_policy: None,
            deny_clock: None,
            took,
            local_refund: None,
        },
    )
}
