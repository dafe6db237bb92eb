//! A request's checks as sent to the store: put in order under the
//! plan (enforced checks first, shadow ones after), then sent, shadow
//! checks apart; and the leases of checks the answer leaves undecided,
//! released.

use std::sync::Arc;
use std::time::Duration;

use smallvec::SmallVec;

use crate::layer::after::recorded::{Recorded, report_release};
use crate::layer::remembered::local_fallback::LocalChecks;
use crate::layer::settings::Settings;
use crate::metrics::Timer;
use crate::policy::plan::Plan;
use crate::policy::{Algorithm, Count, FailMode, Settlement};
use crate::store::Checks;
use crate::store::{Check, Decisions, Store, StoreError, StoreFuture};

/// A request's checks, as sent to the store.
pub(crate) struct SentChecks {
    /// The checks, enforced ones first (see [`Modes`]).
    pub(crate) checks: Checks,
    /// What the checks do beyond counting, when any does.
    pub(crate) modes: Option<Box<Modes>>,
    /// When the request was sent, on the deny cache's clock (0 without
    /// one): read when the cache was asked, just before the checks were
    /// built and sent, so that a denial remembered from it never outlasts
    /// the store's. `timer` times the store's answer for the metrics and
    /// the `rate_limit` span.
    pub(crate) deny_clock: u64,
    pub(crate) timer: Timer,
    /// Whether a store failure answers `503`.
    pub(crate) fail_closed: bool,
}

/// What a request's checks do beyond counting, in the order they are
/// sent: enforced checks first, shadow checks after. Shadow checks decide
/// without denying; a check may count some responses only (its units come
/// back by the response's status), or fall back to a local limit while
/// the store is down.
#[derive(Debug)]
pub(crate) struct Modes {
    /// The index of the first shadow check.
    pub(crate) shadow_from: usize,
    /// What each check counts.
    counts: SmallVec<[Count; 2]>,
    /// How each check's cost is settled after the response, when some
    /// check's is.
    settlements: Option<SmallVec<[Option<Settlement>; 2]>>,
    /// The enforced checks that fall back to a local limit, at their share
    /// of it; `None` when no check does.
    local: Option<LocalChecks>,
}

impl Modes {
    /// The modes of `checks`, built from `plan`, which it puts in order:
    /// for checks that need more than counting (see
    /// [`Priced::has_modes`](crate::layer::decide::priced::Priced::has_modes)).
    pub(crate) fn new(plan: &Plan, checks: &mut Checks, settings: Settings) -> Box<Self> {
        let shadow = |check: &Check| {
            settings.shadow
                || plan
                    .policy_named(check.policy())
                    .is_some_and(|policy| policy.is_shadow())
        };
        // Stable: enforced checks keep their order, and so do shadow ones.
        checks.sort_by_key(shadow);
        let shadow_from = checks.iter().position(shadow).unwrap_or(checks.len());
        let policies = || checks.iter().map(|check| plan.policy_named(check.policy()));
        let counts: SmallVec<[Count; 2]> = policies()
            .map(|policy| policy.map_or(Count::All, |policy| policy.count()))
            .collect();
        let fail_modes: SmallVec<[FailMode; 2]> = policies()
            .map(|policy| {
                policy
                    .and_then(|policy| policy.fail_mode())
                    .unwrap_or(settings.fail_mode)
            })
            .collect();
        let settlements: SmallVec<[Option<Settlement>; 2]> = policies()
            .map(|policy| policy.and_then(|policy| policy.settlement().cloned()))
            .collect();
        let local = LocalChecks::of(
            &checks[..shadow_from],
            &fail_modes,
            &counts,
            &settlements,
            settings.local_share,
        );
        Box::new(Self {
            shadow_from,
            counts,
            settlements: settlements
                .iter()
                .any(Option::is_some)
                .then_some(settlements),
            local: (!local.is_empty()).then_some(local),
        })
    }

    /// Whether the checks are ordered otherwise than the plan's policies.
    pub(crate) fn reordered(&self, checks: usize) -> bool {
        self.shadow_from > 0 && self.shadow_from < checks
    }

    /// The enforced checks that fall back to a local limit, at their
    /// share of it (see [`LocalChecks::of`]), if any does.
    pub(crate) fn local(&self) -> Option<&LocalChecks> {
        self.local.as_ref()
    }

    /// What each check counts.
    pub(crate) fn counts(&self) -> &[Count] {
        &self.counts
    }

    /// How each check's cost is settled after the response, when some
    /// check's is.
    pub(crate) fn settlements(&self) -> Option<&[Option<Settlement>]> {
        self.settlements.as_deref()
    }
}

/// Sends `checks` to `store`, enforced ones first: the shadow checks (from
/// `shadow_from`) are sent once the enforced ones admit the request, as a
/// call of their own. In one call with the enforced checks a shadow
/// denial would deny the request, and a denied request counts nowhere.
/// The answer holds the enforced checks' decisions alone when they deny,
/// or when the shadow checks fail.
///
/// The leases of concurrency checks the answer leaves undecided (a call
/// that failed, a request dropped meanwhile) are released by their ids.
#[inline]
pub(crate) fn check(store: &Arc<dyn Store>, checks: &[Check], shadow_from: usize) -> StoreFuture {
    let answer = if shadow_from == 0 || shadow_from >= checks.len() {
        store.check(checks)
    } else {
        check_apart(store, checks, shadow_from)
    };
    let leased = checks
        .iter()
        .position(|check| check.algorithm() == Algorithm::Concurrency);
    match leased {
        Some(first) => released_unless_decided(store, checks, first, answer),
        None => answer,
    }
}

fn check_apart(store: &Arc<dyn Store>, checks: &[Check], shadow_from: usize) -> StoreFuture {
    let (enforced, shadow) = checks.split_at(shadow_from);
    let decided = match store.check(enforced).into_ready() {
        Ok(Ok(decisions)) => decisions,
        Ok(Err(error)) => return StoreFuture::ready(Err(error)),
        Err(later) => {
            let store = store.clone();
            let shadow: Checks = shadow.iter().cloned().collect();
            return StoreFuture::new(async move {
                let decisions = later.await?;
                Ok(with_shadow(&*store, decisions, &shadow).await)
            });
        }
    };
    if !decided.iter().all(|decision| decision.admitted()) {
        return StoreFuture::ready(Ok(decided));
    }
    match store.check(shadow).into_ready() {
        Ok(outcome) => StoreFuture::ready(Ok(join(decided, outcome))),
        Err(later) => StoreFuture::new(async move { Ok(join(decided, later.await)) }),
    }
}

/// The enforced checks' decisions, and the shadow checks' after them if
/// the enforced ones admit the request.
async fn with_shadow(store: &dyn Store, decided: Decisions, shadow: &[Check]) -> Decisions {
    if !decided.iter().all(|decision| decision.admitted()) {
        return decided;
    }
    join(decided, store.check(shadow).await)
}

fn join(mut decided: Decisions, shadow: Result<Decisions, StoreError>) -> Decisions {
    match shadow {
        Ok(shadow) => decided.extend(shadow.iter().copied()),
        Err(error) => tracing::debug!(%error, "shadow policies undecided"),
    }
    decided
}

/// The leases of `checks` (from `first`, the first check with a lease on)
/// that the store may have taken, released unless
/// `answer` decides them: a call that failed or timed out (the store may
/// still run it, and take them), or a request dropped while its check was
/// in flight, releases them by the ids the checks carry; so does an
/// answer that leaves a check undecided (shadow checks that failed). A
/// decided check's lease is the response's to release (see
/// [`Owed`](crate::layer::after::owed::Owed)), and a denied one took nothing. Checks
/// without a lease are not copied.
fn released_unless_decided(
    store: &Arc<dyn Store>,
    checks: &[Check],
    first: usize,
    answer: StoreFuture,
) -> StoreFuture {
    let in_flight = |decided: usize| InFlight {
        store: store.clone(),
        checks: checks[first.max(decided)..].iter().cloned().collect(),
    };
    match answer.into_ready() {
        // Known at once: only what it leaves undecided is released (a
        // store in process decides everything, and nothing is copied).
        Ok(outcome) => {
            let decided = outcome.as_ref().map_or(0, |decisions| decisions.len());
            if decided < checks.len() {
                drop(in_flight(decided));
            }
            StoreFuture::ready(outcome)
        }
        Err(later) => {
            let mut in_flight = in_flight(0);
            StoreFuture::new(async move {
                let outcome = later.await;
                if let Ok(decisions) = &outcome {
                    let decided = decisions.len().saturating_sub(first);
                    in_flight
                        .checks
                        .drain(..decided.min(in_flight.checks.len()));
                }
                outcome
            })
        }
    }
}

/// Checks the store may hold leases of, not (yet) decided, from the first
/// with a lease on; their leases are released when dropped.
struct InFlight {
    store: Arc<dyn Store>,
    checks: Checks,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut leases = Recorded::new(&self.store);
        for check in &self.checks {
            if check.algorithm() == Algorithm::Concurrency {
                // A lease is released by its check's id; the time is not read.
                leases.push(check, Duration::ZERO);
            }
        }
        leases.give_back(report_release);
    }
}
