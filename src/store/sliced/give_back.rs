//! A slice in hand ([`Slice`]), and what it did not use given back to
//! the store: when it ages out, when its table goes, on a task of its own.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use super::entry::Entry;
use super::table::Table;
use super::{lifetime, lock};
use crate::store::background::spawn_on;
use crate::store::{Check, Decision, Store, StoreError, StoreFuture};

/// Units taken from the store ahead.
pub(super) struct Slice {
    /// The check that took them: its cost is the slice's size.
    pub(super) check: Check,
    /// When the store recorded them (what a give-back names).
    pub(super) recorded_at: Duration,
    pub(super) left: u32,
    /// When the slice was asked for: it lives from then.
    pub(super) since: Instant,
    /// What the store answered then.
    pub(super) limit: u32,
    pub(super) remaining: u32,
    pub(super) reset: Duration,
}

impl Slice {
    /// Whether a request of `check` may spend it: taken under the same
    /// terms. A reload, a tier or a client's own limit that changed them
    /// takes a new slice, so that none is spent under a larger limit or
    /// slice than the request's.
    pub(super) fn serves(&self, check: &Check) -> bool {
        self.check.counts_as(check)
    }

    pub(super) fn is_live(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.since) < lifetime(&self.check)
    }

    /// The decision of a request that took units from it: the store's
    /// answer at the take, with what is left of the slice.
    pub(super) fn decision(&self, now: Instant) -> Decision {
        let elapsed = now.saturating_duration_since(self.since);
        let mut decision = Decision::new_admitted(
            self.limit,
            self.remaining.saturating_add(self.left),
            self.reset.saturating_sub(elapsed),
        )
        .with_recorded_at(self.recorded_at);
        decision.sliced = true;
        decision
    }

    /// Gives back to `store` the units not used: the record of the whole
    /// slice replaced by what was used. Nothing when every unit was.
    pub(super) fn give_back(self, store: &dyn Store) -> Option<StoreFuture<()>> {
        (self.left > 0).then(|| {
            let used = u64::from(self.check.cost - self.left);
            store.settle(
                std::slice::from_ref(&self.check),
                &[self.recorded_at],
                &[used],
            )
        })
    }
}

/// Runs a give-back to its end, on its own. A store that takes no
/// settlement makes `table` exact from then on.
pub(super) fn spawn_give_back(table: Weak<Table>, back: StoreFuture<()>) {
    let given = spawn_on(None, async move {
        match back.await {
            Ok(()) => {}
            Err(StoreError::Unsupported(_)) => {
                if let Some(table) = table.upgrade() {
                    table.go_exact();
                }
            }
            Err(error) => unreturned(&error),
        }
    });
    if let Err(error) = given {
        unreturned(&error);
    }
}

fn unreturned(error: &StoreError) {
    tracing::debug!(%error, "slidegate: a slice's unused units were not given back");
}

/// Gives back the slice of `generation` in `entry` when it has aged out,
/// and drops the entry from the table when nothing else took its place.
pub(super) fn age(table: &Weak<Table>, entry: &Arc<Entry>, generation: u64) {
    let Some(table) = table.upgrade() else {
        return;
    };
    let slice = {
        let mut state = lock(&entry.state);
        if state.generation != generation {
            return;
        }
        state.slice.take()
    };
    let Some(slice) = slice else {
        return;
    };
    let scope = slice.check.scope();
    if let Some(back) = slice.give_back(&*table.store) {
        spawn_give_back(Arc::downgrade(&table), back);
    }
    table.forget(&scope, entry);
}
