//! The table of the clients' entries: one per (namespace, policy,
//! client) holding a slice, bounded, and swept as slices age out.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use super::entry::Entry;
use super::give_back::spawn_give_back;
use super::{MAX_ENTRIES, lock};
use crate::store::{Check, Scope, Store};

pub(super) struct Table {
    pub(super) store: Arc<dyn Store>,
    pub(super) entries: Mutex<Entries>,
    /// Set when the store cannot take a slice back (it names no time for
    /// its records, or takes no settlement): from then on every check is
    /// the store's alone, since a slice it cannot take back would leave
    /// its unused units counted for a whole window.
    pub(super) exact: AtomicBool,
}

/// The clients' entries. An entry leaves when its slice ages out, or when a
/// request that found it empty is done with it and no other holds it;
/// one left behind by a race is swept when the table doubles.
#[derive(Default)]
pub(super) struct Entries {
    pub(super) by_scope: HashMap<Scope, Arc<Entry>, foldhash::fast::RandomState>,
    pub(super) sweep_at: usize,
}

/// The size at which the table is first swept.
pub(super) const FIRST_SWEEP: usize = 1024;

impl Entries {
    /// Whether `entry` may leave: empty, and held by none but the table
    /// and the caller.
    pub(super) fn is_idle(entry: &Arc<Entry>, held: usize) -> bool {
        Arc::strong_count(entry) <= held && entry.is_empty()
    }
}

impl Table {
    /// The entry of `check`'s client, made if need be; `None` when the
    /// table is full and the client has none.
    pub(super) fn entry(&self, check: &Check) -> Option<Arc<Entry>> {
        let mut entries = lock(&self.entries);
        let scope = check.scope();
        if let Some(entry) = entries.by_scope.get(&scope) {
            return Some(entry.clone());
        }
        if entries.by_scope.len() >= entries.sweep_at.max(FIRST_SWEEP) {
            entries
                .by_scope
                .retain(|_, entry| !Entries::is_idle(entry, 1));
            entries.sweep_at = 2 * entries.by_scope.len();
        }
        if entries.by_scope.len() >= MAX_ENTRIES {
            return None;
        }
        Some(entries.by_scope.entry(scope).or_default().clone())
    }

    /// Drops `entry`, which the caller holds, from the table when it holds
    /// no slice and no other request holds it.
    pub(super) fn forget(&self, scope: &Scope, entry: &Arc<Entry>) {
        let mut entries = lock(&self.entries);
        let kept = entries
            .by_scope
            .get(scope)
            .is_some_and(|kept| Arc::ptr_eq(kept, entry));
        if kept && Entries::is_idle(entry, 2) {
            entries.by_scope.remove(scope);
        }
    }

    /// Makes every check from now on the store's alone.
    pub(super) fn go_exact(&self) {
        if !self.exact.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "slidegate: the store cannot take back a slice's unused units; \
                 policies with a slice are decided by the store request by request"
            );
        }
    }
}

impl Table {
    pub(super) fn refund_into_slice(&self, check: &Check, at: Duration) {
        let entry = lock(&self.entries).by_scope.get(&check.scope()).cloned();
        let Some(entry) = entry else {
            return;
        };
        let mut state = lock(&entry.state);
        if let Some(slice) = state.slice.as_mut().filter(|slice| slice.recorded_at == at) {
            slice.left = (slice.left + check.cost).min(slice.check.cost);
        }
    }
}

impl Drop for Table {
    fn drop(&mut self) {
        if tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        let entries = self
            .entries
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        for entry in std::mem::take(&mut entries.by_scope).into_values() {
            let slice = lock(&entry.state).slice.take();
            if let Some(back) = slice.and_then(|slice| slice.give_back(&*self.store)) {
                // The table is going: nothing to make exact.
                spawn_give_back(Weak::new(), back);
            }
        }
    }
}
