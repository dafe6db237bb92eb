//! Holding a request instead of denying it ([`Policy::with_delay`]): when
//! every policy that denies it would fit it within its delay, the request
//! waits and is checked again, so it is counted when it is admitted.
//!
//! [`Policy::with_delay`]: crate::Policy::with_delay

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use crate::layer::Shared;
use crate::policy::plan::Plan;
use crate::store::{Check, Decision};

/// Requests a layer holds at once unless set.
pub(crate) const DEFAULT_MAX_DELAYED: usize = 10_000;

/// The shortest wait: a denial whose retry time is already past is asked
/// again after this, never in a tight loop.
const MIN_WAIT: Duration = Duration::from_micros(100);

/// One of the layer's places for a held request, given back when dropped
/// (the request admitted, answered, or its client gone).
#[derive(Debug)]
pub(crate) struct Slot(Arc<AtomicUsize>);

impl Slot {
    /// A place, if fewer than `max` requests are held now.
    fn take(held: &Arc<AtomicUsize>, max: usize) -> Option<Self> {
        let before = held.fetch_add(1, Ordering::AcqRel);
        if before >= max {
            held.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(Self(held.clone()))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A request being held: since when, and its place.
#[derive(Debug)]
pub(crate) struct Held {
    pub(crate) since: Instant,
    _slot: Slot,
}

impl Held {
    pub(crate) fn new(slot: Slot) -> Self {
        Self {
            since: Instant::now(),
            _slot: slot,
        }
    }
}

/// How long to hold a request the store denied, and its place if it is
/// not held yet (first held `since`): when every check that denies it
/// has a policy with a delay that its retry time fits within, counted
/// from when the request was first held. `None` to answer the denial.
pub(crate) fn wait(
    shared: &Shared,
    plan: &Plan,
    checks: &[Check],
    decisions: &[Decision],
    since: Option<Instant>,
) -> Option<(Duration, Option<Slot>)> {
    let spent = since.map_or(Duration::ZERO, |since| since.elapsed());
    let mut wait = None;
    for (check, decision) in checks.iter().zip(decisions) {
        let Some(retry) = decision.retry_after else {
            continue;
        };
        let delay = plan.policy_of(check)?.delay()?;
        if retry > delay.saturating_sub(spent) {
            return None;
        }
        wait = Some(wait.unwrap_or(MIN_WAIT).max(retry));
    }
    // A denial that names no retry time is answered.
    let wait = wait?;
    let slot = match since {
        Some(_) => None,
        None => Some(Slot::take(&shared.delayed, shared.options.max_delayed)?),
    };
    Some((wait, slot))
}
