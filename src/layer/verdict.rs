//! The store's answer turned into where a request goes: on to the inner
//! service with its headers (and a refund, for policies that count some
//! responses only), a `429`, or the fail mode (`503`, open, or the local
//! limit). Every outcome is counted and traced here.

use std::cmp::Reverse;
use std::sync::Arc;
use std::time::Duration;

use http::HeaderValue;

use crate::layer::Shared;
use crate::layer::flow::{Next, SentAt};
use crate::layer::roles::{Refund, Roles};
use crate::metrics::{self, Outcome};
use crate::policy::Count;
use crate::policy::cost::Checks;
use crate::response::headers::RateHeaders;
use crate::response::problem::{limiter_unavailable, too_many_requests};
use crate::response::rejection::{self, Rejection};
use crate::store::{Check, CheckOutcome, Decision, Decisions, Store, StoreError};
use crate::throttle::STORE_FAILURES;

/// The index of the first decision with the least `key` (0 when empty).
pub(super) fn index_of_min<K: Ord>(decisions: &[Decision], key: impl Fn(&Decision) -> K) -> usize {
    decisions
        .iter()
        .enumerate()
        .min_by_key(|(_, decision)| key(decision))
        .map_or(0, |(index, _)| index)
}

/// Where the store's answer for `checks` leads: the inner service with the
/// rate-limit headers (`RateLimit-Policy` as `ietf_policy` when the plan
/// has it), a `429`, or, when the store failed, the fail mode. Shadow
/// checks (see [`Roles`]) never deny.
pub(crate) fn decide(
    shared: &Shared,
    checks: &[Check],
    roles: Option<&Roles>,
    ietf_policy: Option<&HeaderValue>,
    fail_closed: bool,
    sent_at: SentAt,
    outcome: CheckOutcome,
) -> Next {
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
            let counts = roles.map(Roles::counts);
            let ietf_policy = ietf_policy.filter(|_| decided.len() == checks.len());
            settle(
                shared,
                &shared.store,
                decided,
                &decisions,
                enforced.min(decisions.len()),
                counts,
                ietf_policy,
                Some(sent_at.deny_clock),
                took,
            )
        }
        // `held_back`: failures since the last line, which were not logged.
        Err(error) if fail_closed => {
            report_all(checks, Outcome::FailedClosed, took);
            if let Some(held_back) = STORE_FAILURES.admit() {
                tracing::error!(%error, held_back, "rate-limit store unavailable; failing closed");
            }
            let rejection = Rejection::StoreUnavailable(&error);
            Next::Answer(rejection::answer(
                shared.on_rejection.as_ref(),
                &rejection,
                limiter_unavailable,
            ))
        }
        Err(error) => {
            if let Some(next) = roles.and_then(|roles| fall_back(shared, checks, roles, took)) {
                if let Some(held_back) = STORE_FAILURES.admit() {
                    tracing::warn!(%error, held_back, "rate-limit store unavailable; enforcing local limits");
                }
                return next;
            }
            report_all(checks, Outcome::FailedOpen, took);
            if let Some(held_back) = STORE_FAILURES.admit() {
                tracing::warn!(%error, held_back, "rate-limit store unavailable; failing open");
            }
            Next::Call(None, None)
        }
    }
}

/// Admits or denies a request by its `decisions` (one per check of
/// `checks`, enforced ones before `enforced`, shadow ones after), which
/// `store` gave: a shadow check's denial is traced and lets the request
/// pass. A denial is remembered in the deny cache, given when it was sent
/// (`deny_clock`); without it, the decisions are the local limit's.
#[allow(
    clippy::too_many_arguments,
    reason = "one step of the request, shared by the store's and the local limit's answers"
)]
fn settle(
    shared: &Shared,
    store: &Arc<dyn Store>,
    checks: &[Check],
    decisions: &[Decision],
    enforced: usize,
    counts: Option<&[Count]>,
    ietf_policy: Option<&HeaderValue>,
    deny_clock: Option<u64>,
    took: Option<Duration>,
) -> Next {
    let options = shared.options;
    if decisions.is_empty() {
        return Next::Call(None, None);
    }
    if decisions[..enforced].iter().all(|d| d.admitted) {
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
        // Report the policy closest to denying.
        let reported = index_of_min(decisions, |d| (d.remaining, Reverse(d.reset)));
        trace_decision(&checks[reported].policy, outcome, took);
        let headers = RateHeaders::new(
            checks,
            decisions,
            reported,
            None,
            ietf_policy,
            options.header_style,
            options.reset_format,
        );
        let refund = counts.and_then(|counts| Refund::of(store, checks, decisions, counts));
        return Next::Call(Some(headers), refund);
    }
    let (checks, decisions) = (&checks[..enforced], &decisions[..enforced]);
    for (check, decision) in checks.iter().zip(decisions) {
        if decision.retry_after.is_some() {
            metrics::decided(&check.policy, Outcome::Denied);
        }
    }
    if let (Some(cache), Some(sent_at)) = (&shared.deny_cache, deny_clock) {
        match counts {
            None => cache.remember(checks, decisions, sent_at),
            // A refund may free a policy that counts some responses only
            // before its denial's retry time: only the others are cached.
            Some(counts) => {
                let (cached, cached_decisions): (Checks, Decisions) = checks
                    .iter()
                    .zip(decisions)
                    .zip(counts)
                    .filter(|(_, count)| **count == Count::All)
                    .map(|((check, decision), _)| (check.clone(), *decision))
                    .unzip();
                cache.remember(&cached, &cached_decisions, sent_at);
            }
        }
    }
    // The policy that frees last is the one the client waits for.
    let denied = index_of_min(decisions, |d| Reverse(d.retry_after));
    trace_decision(&checks[denied].policy, Outcome::Denied, took);
    Next::Answer(too_many_requests(
        checks,
        decisions,
        denied,
        None,
        shared.on_rejection.as_ref(),
        options.header_style,
        options.reset_format,
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
pub(super) fn trace_decision(policy: &str, outcome: Outcome, took: Option<Duration>) {
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

/// Decides the checks that fall back to a local limit on the layer's
/// in-process store, while the store is unavailable; `None` when no check
/// does (the request then fails open).
fn fall_back(
    shared: &Shared,
    checks: &[Check],
    roles: &Roles,
    took: Option<Duration>,
) -> Option<Next> {
    let (local, counts) = roles.local(checks, shared.options.local_share);
    if local.is_empty() {
        return None;
    }
    let store = shared.local_store();
    let decisions = store.check(&local).into_ready().ok()?.ok()?;
    Some(settle(
        shared,
        &store,
        &local,
        &decisions,
        local.len(),
        Some(&counts),
        None,
        None,
        took,
    ))
}
