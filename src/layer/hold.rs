//! Holding a request instead of denying it ([`Policy::with_delay`]): when
//! every policy that denies it would fit it within its delay, the request
//! waits and is checked again, so it is counted when it is admitted.
//!
//! A held request passes only when the store admits it: a check again
//! that fails never fails open (see `outcome`). Held requests are bounded
//! three ways: per client and policy, by what the client's own limit can
//! grant within the delay; per layer, by a count and by the bytes of their
//! heads. Held requests of one client that wake together are checked
//! again together, in one batch call on Redis.
//!
//! [`Policy::with_delay`]: crate::Policy::with_delay

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::request::Parts;
use tokio::time::Instant;

use crate::layer::Shared;
use crate::policy::plan::Plan;
use crate::policy::{Algorithm, Policy};
use crate::store::{Check, Decision, Scope};

/// Requests a layer holds at once unless set.
pub(crate) const DEFAULT_MAX_DELAYED: usize = 10_000;

/// Bytes of request heads a layer holds at once unless set: 64 MiB.
pub(crate) const DEFAULT_MAX_DELAYED_BYTES: usize = 64 << 20;

/// The shortest wait: a denial whose retry time is already past is asked
/// again after this, never in a tight loop.
const MIN_WAIT: Duration = Duration::from_micros(100);

/// The requests a layer (with its clones) holds now.
#[derive(Debug, Default)]
pub(crate) struct Holding {
    count: AtomicUsize,
    bytes: AtomicUsize,
    /// Per client and policy: how many requests it holds.
    queues: Mutex<HashMap<Scope, usize>>,
}

impl Holding {
    /// How many requests are held now.
    pub(crate) fn count(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }
}

/// One held request's place, given back when dropped (the request
/// admitted, answered, or its client gone).
#[derive(Debug)]
pub(crate) struct Slot {
    holding: Arc<Holding>,
    bytes: usize,
    queue: Scope,
}

/// The bounds a request to hold must fit within.
struct Bounds {
    max: usize,
    max_bytes: usize,
    /// The most its client may hold under its policy.
    client_max: usize,
}

impl Slot {
    /// A place for a request of `bytes` behind the client `queue`, if the
    /// layer and the client have room for it.
    fn take(holding: &Arc<Holding>, bounds: &Bounds, bytes: usize, queue: Scope) -> Option<Self> {
        if holding.count.fetch_add(1, Ordering::AcqRel) >= bounds.max {
            holding.count.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        if holding.bytes.fetch_add(bytes, Ordering::AcqRel) + bytes > bounds.max_bytes {
            holding.bytes.fetch_sub(bytes, Ordering::AcqRel);
            holding.count.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        let mut queues = lock(&holding.queues);
        let held = queues.entry(queue.clone()).or_insert(0);
        if *held >= bounds.client_max {
            drop(queues);
            holding.bytes.fetch_sub(bytes, Ordering::AcqRel);
            holding.count.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        *held += 1;
        drop(queues);
        Some(Self {
            holding: holding.clone(),
            bytes,
            queue,
        })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        {
            let mut queues = lock(&self.holding.queues);
            if let Some(held) = queues.get_mut(&self.queue) {
                *held -= 1;
                if *held == 0 {
                    queues.remove(&self.queue);
                }
            }
        }
        self.holding.bytes.fetch_sub(self.bytes, Ordering::AcqRel);
        self.holding.count.fetch_sub(1, Ordering::AcqRel);
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Counts stay consistent whatever panicked while holding the lock.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
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
    parts: &Parts,
    checks: &[Check],
    decisions: &[Decision],
    since: Option<Instant>,
) -> Option<(Duration, Option<Slot>)> {
    let spent = since.map_or(Duration::ZERO, |since| since.elapsed());
    let mut wait = None;
    let mut first_denial = None;
    for (check, decision) in checks.iter().zip(decisions) {
        let Some(retry) = decision.retry_after else {
            continue;
        };
        let policy = plan.policy_of(check)?;
        let delay = policy.delay()?;
        if retry > delay.saturating_sub(spent) {
            return None;
        }
        first_denial.get_or_insert((check, policy));
        wait = Some(wait.unwrap_or(MIN_WAIT).max(retry));
    }
    // A denial that names no retry time is answered.
    let wait = wait?;
    let slot = match (since, first_denial) {
        (Some(_), _) => None,
        (None, Some((check, policy))) => {
            let bounds = Bounds {
                max: shared.options.max_delayed,
                max_bytes: shared.options.max_delayed_bytes,
                client_max: client_max(check, policy),
            };
            Some(Slot::take(
                &shared.delayed,
                &bounds,
                head_bytes(parts),
                check.scope(),
            )?)
        }
        (None, None) => return None,
    };
    Some((wait, slot))
}

/// The most requests of `check`'s client that its policy may hold: as
/// many as its limit can grant within the delay. A token bucket refills
/// `limit` units a window; the window algorithms can free all `limit`
/// units within any window the delay starts.
fn client_max(check: &Check, policy: &Policy) -> usize {
    let delay = policy.delay().unwrap_or_default().as_micros();
    let window = check.window.as_micros().max(1);
    let limit = u128::from(check.limit);
    let units = match check.algorithm {
        Algorithm::TokenBucket => (limit * delay).div_ceil(window),
        _ => limit * delay.div_ceil(window),
    };
    let requests = units / u128::from(check.cost.max(1));
    usize::try_from(requests).unwrap_or(usize::MAX).max(1)
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
