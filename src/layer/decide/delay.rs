//! Delaying a request instead of denying it ([`Policy::with_delay`]).
//!
//! The store decides a request once: one that fits every policy within
//! its delay is admitted at the time it fits, its units recorded at that
//! time (see [`Decision::delayed_for`]), so no request admitted meanwhile
//! takes its place and the store is not asked again. The layer then waits
//! until that time and calls the inner service. A client that goes away
//! meanwhile gives its units back.
//!
//! A client's held requests are bounded by what its own limit grants
//! within the delay (the store records none beyond it); a layer's by a
//! count and by the bytes of their heads. A request the layer has no room
//! to hold, its places taken by other requests, is answered `503` with its
//! units given back: other clients filling the layer never push a client
//! toward its block. A layer that holds no request at all
//! (`max_delayed` 0) answers `429`, as the policies would without a delay:
//! its units are given back, unless one of its policies blocks, where they
//! stay counted, so that a client that keeps asking reaches its block.
//!
//! [`Policy::with_delay`]: crate::Policy::with_delay
//! [`Decision::delayed_for`]: crate::store::Decision::delayed_for

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use http::request::Parts;

use crate::layer::after::owed::Owed;
use crate::layer::after::recorded::{Recorded, report_refund};
use crate::policy::Algorithm;
use crate::store::{Check, Decision, Decisions, Store};
use crate::store::{UNSET, micros};

/// Requests a layer holds at once unless set.
pub(crate) const DEFAULT_MAX_DELAYED: usize = 10_000;

/// Bytes of request heads a layer holds at once unless set: 64 MiB.
pub(crate) const DEFAULT_MAX_DELAYED_BYTES: usize = 64 << 20;

/// The requests a layer (with its clones) holds now.
#[derive(Debug, Default)]
pub(crate) struct DelayedRequests {
    count: AtomicUsize,
    bytes: AtomicUsize,
}

impl DelayedRequests {
    /// How many requests are held now.
    pub(crate) fn count(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }
}

/// One held request's place, given back when dropped (the request passed,
/// or its client went away).
#[derive(Debug)]
pub(crate) struct Hold {
    delayed: Arc<DelayedRequests>,
    bytes: usize,
}

impl Hold {
    /// A place for the request whose head is `parts`, if the layer has
    /// room for it: at most `max` requests and `max_bytes` of heads.
    pub(crate) fn take(
        delayed: &Arc<DelayedRequests>,
        max: usize,
        max_bytes: usize,
        parts: &Parts,
    ) -> Option<Self> {
        let bytes = head_bytes(parts);
        if delayed.count.fetch_add(1, Ordering::AcqRel) >= max {
            delayed.count.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        if delayed.bytes.fetch_add(bytes, Ordering::AcqRel) + bytes > max_bytes {
            delayed.bytes.fetch_sub(bytes, Ordering::AcqRel);
            delayed.count.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(Self {
            delayed: delayed.clone(),
            bytes,
        })
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.delayed.bytes.fetch_sub(self.bytes, Ordering::AcqRel);
        self.delayed.count.fetch_sub(1, Ordering::AcqRel);
    }
}

/// An admitted request that passes once it has waited: what it goes on
/// with then (`T`, the call of the inner service), its place, and the
/// units it gives back if it never passes.
pub(crate) struct Delayed<T> {
    wait: Duration,
    then: T,
    _hold: Hold,
    unpassed: Unpassed,
}

impl<T> Delayed<T> {
    pub(crate) fn new(wait: Duration, then: T, hold: Hold, unpassed: Unpassed) -> Self {
        Self {
            wait,
            then,
            _hold: hold,
            unpassed,
        }
    }

    /// Waits, then gives what the request goes on with; dropped before
    /// then, the request gives its units back.
    pub(crate) async fn pass(self) -> T {
        tokio::time::sleep(self.wait).await;
        let Self {
            then, mut unpassed, ..
        } = self;
        unpassed.0.keep();
        then
    }
}

/// The units a held request gives back unless it passes: every policy's
/// but a lease's (its response body releases a lease, as for every
/// admitted request).
pub(crate) struct Unpassed(Recorded);

impl Unpassed {
    pub(crate) fn of(store: &Arc<dyn Store>, checks: &[Check], decisions: &[Decision]) -> Self {
        let mut recorded = Recorded::new(store);
        for (check, decision) in checks.iter().zip(decisions) {
            if let (Some(at), false) = (
                decision.recorded_at(),
                check.algorithm() == Algorithm::Concurrency,
            ) {
                recorded.push_refund(check, decision, at);
            }
        }
        Self(recorded)
    }

    /// Keeps the units counted: nothing is given back.
    pub(crate) fn keep(mut self) {
        self.0.keep();
    }
}

impl Drop for Unpassed {
    fn drop(&mut self) {
        self.0.give_back(report_refund);
    }
}

/// The denials of a request the store admitted after `wait` but the
/// layer has no room to hold, one per enforced check (the first
/// `enforced` of `checks`, with their `decisions`), each to retry after
/// the wait. Its units are given back and its leases released, shadow
/// checks' included, unless `keep_for_block` and an enforced policy of
/// its blocks: then they stay counted, so that a client that keeps asking
/// reaches its block.
pub(crate) fn unheld(
    store: &Arc<dyn Store>,
    checks: &[Check],
    decisions: &[Decision],
    enforced: usize,
    wait: Duration,
    keep_for_block: bool,
) -> Decisions {
    // Its leases go at once.
    drop(Owed::of(
        store,
        checks,
        decisions,
        (None, None),
        None,
        || None,
    ));
    let unpassed = Unpassed::of(store, checks, decisions);
    if keep_for_block
        && checks[..enforced]
            .iter()
            .any(|check| check.block_micros() > 0)
    {
        unpassed.keep();
    }
    decisions[..enforced]
        .iter()
        .map(|d| Decision {
            admitted: false,
            retry_after_us: micros(wait),
            delayed_for_us: UNSET,
            recorded_at_us: UNSET,
            ..*d
        })
        .collect()
}

/// The bytes a held request's head keeps: its URI and header fields.
fn head_bytes(parts: &Parts) -> usize {
    let headers: usize = parts
        .headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len())
        .sum();
    let uri = parts
        .uri
        .path_and_query()
        .map_or(0, |path| path.as_str().len())
        + parts
            .uri
            .authority()
            .map_or(0, |authority| authority.as_str().len());
    uri + headers
}
