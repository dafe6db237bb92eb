//! The store's answer turned into where a request goes: on to the inner
//! service with its headers (and a refund, for policies that count some
//! responses only), a `429`, or the fail mode (`503`, open, or the local
//! limit). Every outcome is counted and traced here.

use std::time::{Duration, Instant};

use http::HeaderValue;
use http::request::Parts;

use crate::headers::RateHeaders;
use crate::layer::Shared;
use crate::layer::after::owed::{HeaderSource, Owed, Settlements};
use crate::layer::decide::answered::{
    Answered, decided_all, denied_by, holds_its_most, trace_decision, unsettled_places,
};
use crate::layer::decide::checks::{Modes, SentChecks};
use crate::layer::decide::delay::{Delayed, Hold, Unpassed, unheld};
use crate::layer::decide::reject::reject;
use crate::layer::future::Next;
use crate::layer::remembered::local_fallback::LocalChecks;
use crate::log_lines::{STORE_FAILURES, STORE_FULL};
use crate::metrics::{self, Outcome};
use crate::policy::plan::Plan;
use crate::rejection::Rejection;
use crate::rejection::limited::Limited;
use crate::store::Soon;
use crate::store::closest_to_denying;
use crate::store::micros;
use crate::store::{Check, CheckOutcome, Decision, Decisions, StoreError};

/// Where the store's answer to `sent` leads, for a client of `tier` under
/// `plan`: the inner service with the rate-limit headers (once it has
/// waited, for a request the store delayed), a `429`, or, when the store
/// failed, the fail mode. Shadow checks (see [`Modes`]) never deny.
pub(crate) fn outcome(
    shared: &Shared,
    parts: &Parts,
    plan: &Plan,
    tier: Option<&str>,
    sent: &SentChecks,
    outcome: CheckOutcome,
) -> Soon<Next> {
    let (checks, modes) = (&sent.checks[..], sent.modes.as_deref());
    let took = sent.timer.elapsed();
    metrics::store_answered(took, &outcome);
    let enforced = modes.map_or(checks.len(), |modes| modes.shadow_from);
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
            let admitted = decisions[..enforced].iter().all(|d| d.admitted());
            let local = modes
                .filter(|_| admitted)
                .and_then(Modes::local)
                .and_then(|local| shared.local.record(local));
            let ietf_policy =
                ietf_policy(plan, tier, checks, modes).filter(|_| decided.len() == checks.len());
            decided_by(
                shared,
                parts,
                Answered {
                    store: shared.store(),
                    checks: decided,
                    decisions: &decisions,
                    enforced,
                    counts: modes.map(Modes::counts),
                    settlements: modes.and_then(Modes::settlements),
                    tier,
                    share: 1,
                    ietf_policy,
                    deny_clock: Some(sent.deny_clock),
                    took,
                    local,
                },
            )
        }
        // `held_back`: failures since the last line, which were not logged.
        Err(error) if sent.fail_closed => {
            decided_all(checks, Outcome::FailedClosed, took);
            if let Some(held_back) = STORE_FAILURES.admit() {
                tracing::error!(%error, held_back, "rate-limit store unavailable; failing closed");
            }
            let rejection = Rejection::StoreUnavailable(&error);
            Soon::ready(Next::Answer(reject(shared, parts, rejection)))
        }
        Err(error) => {
            // Every policy of a request a full store does not track is
            // limited locally, whatever its fail mode but closed.
            if matches!(error, StoreError::Full(_))
                && let Some(next) = full_locally(shared, parts, sent, enforced, took)
            {
                if let Some(held_back) = STORE_FULL.admit() {
                    tracing::warn!(%error, held_back, "rate-limit store full; a client it does not track is limited locally");
                }
                return next;
            }
            if let Some(next) = modes.and_then(|modes| fall_back(shared, parts, modes, took)) {
                if let Some(held_back) = STORE_FAILURES.admit() {
                    tracing::warn!(%error, held_back, "rate-limit store unavailable; enforcing local limits");
                }
                return next;
            }
            decided_all(checks, Outcome::FailedOpen, took);
            if let Some(held_back) = STORE_FAILURES.admit() {
                tracing::warn!(%error, held_back, "rate-limit store unavailable; failing open");
            }
            // An upgraded connection still takes its leases, once the
            // store answers its renewals.
            let leases = Owed::untaken_leases(shared.store(), checks, parts);
            Soon::ready(Next::Call(None, leases))
        }
    }
}

/// `RateLimit-Policy` as `plan` has it for `tier`, when every policy
/// counts the request (`checks` holds one check per policy) in the plan's
/// order.
fn ietf_policy<'a>(
    plan: &'a Plan,
    tier: Option<&str>,
    checks: &[Check],
    modes: Option<&Modes>,
) -> Option<&'a HeaderValue> {
    let in_order = modes.is_none_or(|modes| !modes.reordered(checks.len()));
    (checks.len() == plan.policies.len() && in_order)
        .then(|| plan.tier(tier).ietf_policy.as_ref())
        .flatten()
}

/// Admits or denies a request by the decisions `answered` holds: a shadow
/// check's denial is traced and lets the request pass. A store's denial is
/// remembered in the deny cache.
fn decided_by(shared: &Shared, parts: &Parts, answered: Answered<'_>) -> Soon<Next> {
    let Answered {
        store,
        checks,
        decisions,
        enforced,
        counts,
        ietf_policy,
        deny_clock,
        took,
        ..
    } = answered;
    if decisions.is_empty() {
        return Soon::ready(Next::PASS);
    }
    if !decisions[..enforced].iter().all(|d| d.admitted()) {
        return Soon::ready(denied_by(shared, parts, &answered));
    }
    // A place for each reservation settled after the response; a client
    // that holds its most is denied, its units given back.
    let places = match answered.settlements {
        Some(settlements) => {
            match unsettled_places(shared, &checks[..enforced], decisions, settlements) {
                Ok(places) => Some(places),
                Err(full) => return Soon::ready(holds_its_most(shared, parts, &answered, full)),
            }
        }
        None => None,
    };
    let settings = shared.settings;
    // Admitted once it has waited, in a place of the layer's.
    let wait = decisions[..enforced]
        .iter()
        .filter_map(|d| d.delayed_for())
        .max()
        .filter(|wait| !wait.is_zero());
    let hold = match wait {
        Some(wait) => match Hold::take(
            &shared.delayed,
            settings.max_delayed,
            settings.max_delayed_bytes,
            parts,
        ) {
            Some(hold) => Some((wait, hold)),
            // A layer that holds no request denies it, as its policies
            // would without a delay.
            None if settings.max_delayed == 0 => {
                let denials = unheld(store, checks, decisions, enforced, wait, true);
                let checks = &checks[..enforced];
                for check in checks {
                    metrics::decided(check.policy(), Outcome::Denied);
                }
                trace_decision(checks[0].policy(), Outcome::Denied, None);
                let limited = Limited::new(checks, &denials, 0, None);
                let answer = reject(shared, parts, Rejection::Limited(&limited));
                return Soon::ready(Next::Answer(answer));
            }
            // A layer full of other requests: not the client's doing.
            None => {
                unheld(store, checks, decisions, enforced, wait, false);
                for check in &checks[..enforced] {
                    metrics::decided(check.policy(), Outcome::DelayFull);
                }
                trace_decision(checks[0].policy(), Outcome::DelayFull, None);
                let rejection = Rejection::DelayFull { retry_after: wait };
                return Soon::ready(Next::Answer(reject(shared, parts, rejection)));
            }
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
        if decision.admitted() {
            metrics::decided(check.policy(), admitted);
            metrics::near_limit(check, decision);
        } else {
            // A shadow check (the enforced ones all admitted), of a
            // request that would have been denied; counted against the
            // policies that did not fit, as a denial is.
            outcome = Outcome::ShadowDenied;
            if decision.retry_after().is_some() {
                metrics::decided(check.policy(), Outcome::ShadowDenied);
                tracing::debug!(
                    policy = &**check.policy(),
                    "shadow policy would have denied the request"
                );
            }
        }
    }
    let reported = closest_to_denying(checks, decisions);
    trace_decision(checks[reported].policy(), outcome, took);
    // The headers are read once the request has waited.
    let shifted: Option<Decisions> = wait.map(|wait| {
        decisions
            .iter()
            .map(|d| Decision {
                reset_us: micros(d.reset().saturating_sub(wait)),
                ..*d
            })
            .collect()
    });
    let format = settings.header_format;
    let shown = shifted.as_deref().unwrap_or(decisions);
    let headers = RateHeaders::admitted(checks, shown, reported, ietf_policy, format);
    let settlements = answered.settlements.map(|of| Settlements {
        of,
        policies: &shared.policies,
        tier: answered.tier,
        places: places.unwrap_or_default(),
        share: answered.share,
    });
    let debts = (counts, settlements);
    let mut owed = Owed::of(store, checks, decisions, debts, answered.local, || {
        (!headers.is_empty()).then(|| HeaderSource {
            checks: checks.iter().cloned().collect(),
            decisions: decisions.iter().copied().collect(),
            decided: Instant::now(),
            ietf_policy: ietf_policy.cloned(),
            format,
        })
    });
    if let Some(owed) = &mut owed {
        owed.for_upgrade(parts);
    }
    let call = Next::Call(Some(headers), owed);
    match hold {
        Some((wait, hold)) => {
            let unpassed = Unpassed::of(store, checks, decisions);
            Soon::new(Delayed::new(wait, call, hold, unpassed).pass())
        }
        None => Soon::ready(call),
    }
}

/// Decides the checks that fall back to a local limit, while the store
/// is unavailable; `None` when no check does (the request then fails
/// open).
fn fall_back(
    shared: &Shared,
    parts: &Parts,
    modes: &Modes,
    took: Option<Duration>,
) -> Option<Soon<Next>> {
    let local = modes.local()?;
    let decisions = shared.local.decide(local)?;
    Some(decided_by(
        shared,
        parts,
        locally(shared, local, &decisions, took),
    ))
}

/// Decides a request the store is too full to track (it would need new
/// state: a new client, or one whose counts expired) in the local counts,
/// every enforced check at its share of its limit: failing open would
/// admit such clients without any limit while Redis is full (a lease is
/// taken in the local counts, and given back there). `None` when the
/// request has no enforced check.
fn full_locally(
    shared: &Shared,
    parts: &Parts,
    sent: &SentChecks,
    enforced: usize,
    took: Option<Duration>,
) -> Option<Soon<Next>> {
    let modes = sent.modes.as_deref();
    let local = LocalChecks::all(
        &sent.checks[..enforced],
        modes.map(Modes::counts),
        modes.and_then(Modes::settlements),
        shared.settings.local_share,
    );
    if local.is_empty() {
        return None;
    }
    let decisions = shared.local.decide(&local)?;
    Some(decided_by(
        shared,
        parts,
        locally(shared, &local, &decisions, took),
    ))
}

/// Denies a request the local counts refuse within a window of the
/// store's last failure, before the store is asked (see
/// [`LocalLimits`](crate::layer::remembered::local_fallback::LocalLimits)); `None` to ask
/// the store.
pub(crate) fn refused_locally(shared: &Shared, parts: &Parts, local: &LocalChecks) -> Option<Next> {
    let decisions = shared.local.refuses(local)?;
    Some(denied_by(
        shared,
        parts,
        &locally(shared, local, &decisions, None),
    ))
}

/// The local counts' `decisions` on `local`.
fn locally<'a>(
    shared: &'a Shared,
    local: &'a LocalChecks,
    decisions: &'a [Decision],
    took: Option<Duration>,
) -> Answered<'a> {
    Answered {
        store: shared.local.store(),
        checks: &local.checks,
        decisions,
        enforced: local.checks.len(),
        counts: Some(&local.counts),
        settlements: local.settlements(),
        tier: None,
        share: local.share,
        ietf_policy: None,
        deny_clock: None,
        took,
        local: None,
    }
}
