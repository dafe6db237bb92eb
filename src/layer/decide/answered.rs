//! A request's decisions as a store gave them ([`Answered`]), and the
//! `429`s they make: a denial (remembered in the deny cache), a client
//! holding its most reservations unsettled, a denial the deny cache
//! answers; each counted and traced.

use std::cmp::Reverse;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Response};

use crate::layer::Shared;
use crate::layer::after::owed::{Owed, Places};
use crate::layer::decide::delay::unheld;
use crate::layer::decide::reject::reject;
use crate::layer::future::Next;
use crate::layer::remembered::deny_cache::Denied;
use crate::metrics::{self, Outcome};
use crate::policy::{Algorithm, Count, Settlement};
use crate::rejection::Rejection;
use crate::rejection::limited::Limited;
use crate::store::{Check, Decision, Decisions, Store, index_of_min};
use crate::store::{UNSET, optional_micros};

/// A request's decisions, as one store gave them.
pub(crate) struct Answered<'a> {
    pub(crate) store: &'a Arc<dyn Store>,
    pub(crate) checks: &'a [Check],
    /// One per check of `checks`: enforced ones before `enforced`, shadow
    /// ones after.
    pub(crate) decisions: &'a [Decision],
    pub(crate) enforced: usize,
    /// What each check counts, when some count some responses only.
    pub(crate) counts: Option<&'a [Count]>,
    /// How each check's cost is settled, when some check's is after the
    /// response.
    pub(crate) settlements: Option<&'a [Option<Settlement>]>,
    /// The client's tier, for a settlement to find its policy as it is
    /// when it lands.
    pub(crate) tier: Option<&'a str>,
    /// The instances the limits are shared by, for local counts (1 for
    /// the store's): a settlement counts that share of the cost reported.
    pub(crate) share: u32,
    pub(crate) ietf_policy: Option<&'a HeaderValue>,
    /// When the checks were sent, on the deny cache's clock; `None` for the
    /// local limit's decisions.
    pub(crate) deny_clock: Option<u64>,
    pub(crate) took: Option<Duration>,
    /// What the local counts recorded of the store's admission, to take
    /// back with the store's units.
    pub(crate) local: Option<Owed>,
}

/// A place (see [`Unsettled`](crate::layer::after::max_unsettled::Unsettled)) for each
/// admitted enforced check (`checks`) that `settlements` settles after
/// the response, in order (`None` for the others; a shadow check never
/// denies, so takes none); or the index of the first check whose client
/// holds as many reservations as its policy allows.
pub(crate) fn unsettled_places(
    shared: &Shared,
    checks: &[Check],
    decisions: &[Decision],
    settlements: &[Option<Settlement>],
) -> Result<Places, usize> {
    checks
        .iter()
        .zip(decisions)
        .zip(settlements)
        .enumerate()
        .map(|(index, ((check, decision), settlement))| {
            match (settlement, decision.recorded_at()) {
                (Some(settlement), Some(_)) => shared
                    .unsettled
                    .take(check, settlement.max_unsettled)
                    .map(Some)
                    .ok_or(index),
                _ => Ok(None),
            }
        })
        .collect()
}

/// A `429` for a request whose client holds as many reservations of the
/// policy of `answered`'s check at `full` as it allows, unsettled: its
/// units are given back (and its leases), and it may try again in a
/// second, when a reservation may have been settled.
pub(crate) fn holds_its_most(
    shared: &Shared,
    parts: &Parts,
    answered: &Answered<'_>,
    full: usize,
) -> Next {
    let &Answered {
        store,
        checks,
        decisions,
        enforced,
        ..
    } = answered;
    unheld(store, checks, decisions, enforced, Duration::ZERO, false);
    let checks = &checks[..enforced];
    let denials: Decisions = decisions[..enforced]
        .iter()
        .enumerate()
        .map(|(index, decision)| Decision {
            admitted: false,
            remaining: if index == full {
                0
            } else {
                decision.remaining()
            },
            retry_after_us: optional_micros((index == full).then_some(UNSETTLED_RETRY)),
            recorded_at_us: UNSET,
            delayed_for_us: UNSET,
            ..*decision
        })
        .collect();
    metrics::decided(checks[full].policy(), Outcome::Denied);
    trace_decision(checks[full].policy(), Outcome::Denied, None);
    let limited = Limited::new(checks, &denials, full, None);
    Next::Answer(reject(shared, parts, Rejection::Limited(&limited)))
}

/// When a client that holds its most reservations, unsettled, may try
/// again: they end with their requests, which no one knows in advance.
const UNSETTLED_RETRY: Duration = Duration::from_secs(1);

/// A `429` for the decisions `answered` holds, some enforced one of which
/// denies. A store's denial is remembered in the deny cache.
pub(crate) fn denied_by(shared: &Shared, parts: &Parts, answered: &Answered<'_>) -> Next {
    let &Answered {
        checks,
        decisions,
        enforced,
        counts,
        settlements,
        deny_clock,
        took,
        ..
    } = answered;
    let (checks, decisions) = (&checks[..enforced], &decisions[..enforced]);
    for (check, decision) in checks.iter().zip(decisions) {
        if decision.retry_after().is_some() {
            metrics::decided(check.policy(), Outcome::Denied);
        }
    }
    if let (Some(cache), Some(sent_at)) = (&shared.deny_cache, deny_clock) {
        // A refund may free a policy that counts some responses only
        // before its denial's retry time, and so may a settlement below
        // its reservation; a lease may end at any moment: those denials
        // are cached only while a block holds them.
        let lasting = |index: usize| {
            counts.is_none_or(|counts| counts[index] == Count::All)
                && settlements.is_none_or(|settled| settled[index].is_none())
                && checks[index].algorithm() != Algorithm::Concurrency
        };
        cache.remember(checks, decisions, sent_at, lasting);
    }
    // The policy that frees last is the one the client waits for.
    let denied = index_of_min(decisions, |d| Reverse(d.retry_after()));
    trace_decision(checks[denied].policy(), Outcome::Denied, took);
    let limited = Limited::new(checks, decisions, denied, None);
    Next::Answer(reject(shared, parts, Rejection::Limited(&limited)))
}

/// Counts `outcome` for every check of a request, and traces it.
pub(crate) fn decided_all(checks: &[Check], outcome: Outcome, took: Option<Duration>) {
    for check in checks {
        metrics::decided(check.policy(), outcome);
    }
    if let Some(check) = checks.first() {
        trace_decision(check.policy(), outcome, took);
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

/// A `429` from the deny cache, for checks it knows to be denied.
pub(crate) fn cached_denial(shared: &Shared, parts: &Parts, denied: &Denied) -> Response<Bytes> {
    for check in denied.checks.iter() {
        metrics::decided(check.policy(), Outcome::DenyCache);
    }
    let index = index_of_min(&denied.decisions, |d| Reverse(d.retry_after()));
    trace_decision(denied.checks[index].policy(), Outcome::DenyCache, None);
    let limited = Limited::new(
        &denied.checks,
        &denied.decisions,
        index,
        Some(&denied.bodies[index]),
    );
    reject(shared, parts, Rejection::Limited(&limited))
}
