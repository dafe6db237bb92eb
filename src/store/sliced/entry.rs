//! One client's [`Entry`] under one policy: the slice in hand under a
//! lock held for no more than arithmetic, the requests waiting for a new
//! one, and the units a request took.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::give_back::Slice;
use super::lock;
use crate::store::{Check, Decision, StoreError};

/// One client's slice under one policy.
#[derive(Default)]
pub(super) struct Entry {
    pub(super) state: Mutex<State>,
    /// Held by the request that takes a new slice, across its store call.
    pub(super) taking: tokio::sync::Mutex<()>,
    /// The units of the requests waiting for a slice. Past a slice's
    /// worth, a request goes to the store on its own instead: a queue
    /// one slice cannot serve would wait for call after call.
    pub(super) queued: AtomicU32,
}

#[derive(Default)]
pub(super) struct State {
    /// Counts the slices taken, so that what was taken from one is never
    /// put back into another.
    pub(super) generation: u64,
    pub(super) slice: Option<Slice>,
    /// The store's last answer to a slice's call: a request that was
    /// waiting meanwhile takes a denial or a failure as its own, and
    /// after a slice it did not get a share of, asks the store alone.
    pub(super) last: Option<Last>,
}

/// The answer to a slice's store call: a slice, a denial or a failure.
pub(super) struct Last {
    /// When it came.
    pub(super) at: Instant,
    /// The cost it was asked at.
    pub(super) cost: u32,
    pub(super) answer: Result<Decision, StoreError>,
}

impl State {
    /// What the store had left at its last answer, if that was a decision
    /// within the last `lifetime` (a slice's): older, the window has moved.
    pub(super) fn left_in_store(&self, lifetime: Duration) -> Option<u32> {
        let last = self
            .last
            .as_ref()
            .filter(|last| last.at.elapsed() < lifetime)?;
        last.answer
            .as_ref()
            .ok()
            .map(|decision| decision.remaining())
    }
}

/// A request queued for a slice: its units leave the queue when it is
/// answered, or dropped.
pub(super) struct Waiting {
    pub(super) entry: Arc<Entry>,
    pub(super) cost: u32,
    pub(super) since: Instant,
}

impl Waiting {
    /// Queues `check`'s request on `entry`, unless the queue holds a
    /// slice's worth already.
    pub(super) fn join(entry: Arc<Entry>, check: &Check) -> Option<Self> {
        let ahead = entry.queued.fetch_add(check.cost, Ordering::Relaxed);
        if ahead > 0 && ahead.saturating_add(check.cost) > check.slice {
            entry.queued.fetch_sub(check.cost, Ordering::Relaxed);
            return None;
        }
        Some(Self {
            entry,
            cost: check.cost,
            since: Instant::now(),
        })
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.entry.queued.fetch_sub(self.cost, Ordering::Relaxed);
    }
}

/// Units a request took from an entry: put back if the request is not
/// admitted after all.
pub(super) struct Taken {
    pub(super) entry: Arc<Entry>,
    pub(super) generation: u64,
    pub(super) cost: u32,
}

impl Taken {
    pub(super) fn put_back(self) {
        let mut state = lock(&self.entry.state);
        if state.generation == self.generation
            && let Some(slice) = &mut state.slice
        {
            slice.left = (slice.left + self.cost).min(slice.check.cost);
        }
    }
}

impl Entry {
    /// Units for `check`'s request from the live slice, if it has them
    /// and was taken under the request's terms.
    pub(super) fn take(self: &Arc<Self>, check: &Check, now: Instant) -> Option<(Taken, Decision)> {
        let cost = check.cost;
        let mut state = lock(&self.state);
        let generation = state.generation;
        let slice = state.slice.as_mut()?;
        if slice.left < cost || !slice.is_live(now) || !slice.serves(check) {
            return None;
        }
        slice.left -= cost;
        let decision = slice.decision(now);
        let taken = Taken {
            entry: self.clone(),
            generation,
            cost,
        };
        Some((taken, decision))
    }

    pub(super) fn is_empty(&self) -> bool {
        lock(&self.state).slice.is_none()
    }

    /// What a slice's call, answered since `waiting` queued, says to
    /// its request of `check`: a failure or a denial at no more than its
    /// cost are its own; after a denial of more than it costs, or a slice
    /// smaller than the policy's (the store had no more) that others
    /// spent, it asks the store alone. After a whole slice others spent,
    /// nothing: it takes the next.
    pub(super) fn answered_since(
        &self,
        waiting: &Waiting,
        check: &Check,
    ) -> Option<Result<Answer, StoreError>> {
        let state = lock(&self.state);
        let last = state
            .last
            .as_ref()
            .filter(|last| last.at >= waiting.since)?;
        match &last.answer {
            Err(error) => Some(Err(error.clone())),
            Ok(decision) if !decision.admitted() && last.cost <= waiting.cost => {
                Some(Ok(Answer::Denied(*decision)))
            }
            Ok(decision) if decision.admitted() && last.cost >= check.slice => None,
            Ok(_) => Some(Ok(Answer::Alone)),
        }
    }

    /// Remembers the answer to a slice's call.
    pub(super) fn remember(&self, cost: u32, answer: Result<Decision, StoreError>) {
        lock(&self.state).last = Some(Last {
            at: Instant::now(),
            cost,
            answer,
        });
    }
}

/// What a request's sliced check came to.
pub(super) enum Answer {
    /// Units taken, from a slice in hand or a new one.
    Took(Taken, Decision),
    /// The store has fewer units left than the request costs: its
    /// decision for the request alone.
    Denied(Decision),
    /// The request waited, and the slice that came was spent by others:
    /// it asks the store alone.
    Alone,
}
