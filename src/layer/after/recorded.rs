//! [`Recorded`]: units a store recorded for some of a request's checks,
//! to be given back by the times it recorded them at (refunds, a lease's
//! release), and how a give-back that failed is reported. Shared by what
//! a request owes ([`Owed`](crate::layer::after::owed::Owed)), a held request, an
//! upgraded connection's leases and the `Usage` handle.

use std::sync::Arc;
use std::time::Duration;

use smallvec::SmallVec;

use crate::log_lines::{REFUND_FAILURES, RELEASE_FAILURES};
use crate::store::Checks;
use crate::store::background::in_background_on;
use crate::store::{Check, Decision, Store, StoreError, StoreFuture, refund_of};

/// Units a store recorded for some of a request's checks, each at its
/// time ([`Decision::recorded_at`]); the store takes them back by these.
pub(crate) struct Recorded {
    store: Arc<dyn Store>,
    checks: Checks,
    at: SmallVec<[Duration; 2]>,
}

impl std::fmt::Debug for Recorded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorded")
            .field("checks", &self.checks.len())
            .finish_non_exhaustive()
    }
}

impl Recorded {
    pub(crate) fn new(store: &Arc<dyn Store>) -> Self {
        Self {
            store: store.clone(),
            checks: Checks::new(),
            at: SmallVec::new(),
        }
    }

    pub(crate) fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    pub(crate) fn checks(&self) -> &[Check] {
        &self.checks
    }

    pub(crate) fn times(&self) -> &[Duration] {
        &self.at
    }

    pub(crate) fn push(&mut self, check: &Check, at: Duration) {
        self.checks.push(check.clone());
        self.at.push(at);
    }

    /// [`push`](Self::push) for a refund of `decision`'s units: units a
    /// slice gave go back into it, units the store recorded for the
    /// request alone go back to the store (as a check without a slice).
    pub(crate) fn push_refund(&mut self, check: &Check, decision: &Decision, at: Duration) {
        self.checks.push(refund_of(check, decision));
        self.at.push(at);
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.checks.is_empty()
    }

    pub(crate) fn len(&self) -> usize {
        self.checks.len()
    }

    /// The shortest window (a lease's time) among the checks.
    pub(crate) fn shortest_window(&self) -> Duration {
        self.checks
            .iter()
            .map(|check| check.window())
            .min()
            .unwrap_or_default()
    }

    /// Keeps the leases among the checks a lease time from now; whether
    /// each is held (see [`Store::renew`]).
    pub(crate) fn renew(&self) -> StoreFuture<Vec<bool>> {
        self.store.renew(&self.checks)
    }

    /// Forgets the units: they stay counted.
    pub(crate) fn keep(&mut self) {
        self.checks.clear();
        self.at.clear();
    }

    /// Gives the units back (a lease is released by its check's id),
    /// without waiting; `report` is told how it went. Returns whether it
    /// has failed already.
    pub(crate) fn give_back(&mut self, report: fn(Result<(), StoreError>)) -> bool {
        self.give_back_on(None, report)
    }

    /// [`give_back`](Self::give_back), on `runtime` when the current
    /// thread has none.
    pub(crate) fn give_back_on(
        &mut self,
        runtime: Option<&tokio::runtime::Handle>,
        report: fn(Result<(), StoreError>),
    ) -> bool {
        if self.checks.is_empty() {
            return false;
        }
        let answer = self.store.refund(&self.checks, &self.at);
        self.keep();
        in_background_on(runtime, answer, report)
    }
}

/// Warns of a refund that failed: its units stay counted until they leave
/// the window, so the client is held to the limit a little longer.
pub(crate) fn report_refund(outcome: Result<(), StoreError>) {
    if let Err(error) = outcome
        && let Some(held_back) = REFUND_FAILURES.admit()
    {
        tracing::warn!(%error, held_back, "rate-limit refund failed; the units stay counted");
    }
}

/// Warns of a release that failed: the lease stays until it expires.
pub(crate) fn report_release(outcome: Result<(), StoreError>) {
    if let Err(error) = outcome
        && let Some(held_back) = RELEASE_FAILURES.admit()
    {
        tracing::warn!(%error, held_back, "concurrency lease release failed; it expires with its lease time");
    }
}
