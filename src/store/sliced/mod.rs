//! Slices of a client's limit, taken from a remote store ahead and spent
//! in this process (see [`Policy::with_slice`](crate::Policy::with_slice)):
//! [`Sliced`] wraps the layer's store when it is remote, and answers a
//! sliced check from the units in hand while they last and live.
//!
//! Each (namespace, policy, client) has an [`Entry`](entry::Entry) in the
//! [`Table`]: the slice in hand (see [`give_back`]), under a lock held
//! for no more than arithmetic, and a second lock that
//! the one request taking a new slice holds across its store call, so
//! that the others wait for its units rather than each calling. The call
//! runs on a task of its own: a request dropped meanwhile (its client
//! gone) leaves the slice it asked for installed, to be spent or given
//! back, never stranded in the store. A request that waited and found a
//! short slice (what the store had left) spent already asks the store
//! alone, exact, rather than wait for call after call. A slice ages out
//! after its lifetime, when a task spawned with it gives back what it
//! did not use; one found aged by a request is given back then. A new
//! slice is taken in [`refill`].

mod entry;
mod give_back;
mod refill;
mod table;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use smallvec::SmallVec;

use super::{Check, Decision, Decisions, Store, StoreError, StoreFuture};
use crate::store::Checks;
use crate::store::UNSET;
use entry::{Answer, Taken, Waiting};
use table::Table;

/// The longest a slice lives, whatever its window.
const MAX_LIFETIME: Duration = Duration::from_secs(1);

/// Clients with an entry at once, past which a new client's checks go to
/// the store one by one, exact: a flood of clients cannot grow the table
/// without bound (entries leave it as their slices age out).
const MAX_ENTRIES: usize = 1_000_000;

/// How long a slice of `check` lives: a tenth of its window, at most
/// [`MAX_LIFETIME`].
pub(crate) fn lifetime(check: &Check) -> Duration {
    (check.window() / 10).clamp(Duration::from_millis(1), MAX_LIFETIME)
}

/// A remote store, with the slices this process holds of it.
pub(crate) struct Sliced {
    table: Arc<Table>,
}

impl Sliced {
    pub(crate) fn new(store: Arc<dyn Store>) -> Self {
        Self {
            table: Arc::new(Table {
                store,
                entries: Mutex::default(),
                exact: AtomicBool::new(false),
            }),
        }
    }
}

/// The check a refund of `decision`'s units (a request's under `check`)
/// names: units a slice gave go back into it, units the store recorded
/// for the request alone go back to the store, as a check without a
/// slice. All the layer needs to know of slices when it gives units back.
pub(crate) fn refund_of(check: &Check, decision: &Decision) -> Check {
    let mut check = check.clone();
    if !decision.sliced {
        check.slice = 0;
    }
    check
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// How far a request's check has come: decided by the store (unsliced,
/// its client found no room in the table, or a slice's worth of requests
/// wait for a slice already), units taken, or waiting for a slice.
enum Part {
    Store,
    Took(Taken, Decision),
    Short(Waiting),
}

type Parts = SmallVec<[Part; 2]>;

impl Store for Sliced {
    fn check(&self, checks: &[Check]) -> StoreFuture {
        if checks.iter().all(|check| check.slice == 0) || self.table.exact.load(Ordering::Relaxed) {
            return self.table.store.check(checks);
        }
        let now = Instant::now();
        let mut short = false;
        let parts: Parts = checks
            .iter()
            .map(|check| {
                let entry = (check.slice > 0).then(|| self.table.entry(check)).flatten();
                let Some(entry) = entry else {
                    return Part::Store;
                };
                if let Some((taken, decision)) = entry.take(check, now) {
                    return Part::Took(taken, decision);
                }
                match Waiting::join(entry, check) {
                    Some(waiting) => {
                        short = true;
                        Part::Short(waiting)
                    }
                    None => Part::Store,
                }
            })
            .collect();
        if !short {
            return finish(&self.table, checks, parts);
        }
        let table = self.table.clone();
        let checks: Checks = checks.iter().cloned().collect();
        StoreFuture::new(async move {
            let mut parts = parts;
            for (index, check) in checks.iter().enumerate() {
                if !matches!(parts[index], Part::Short(_)) {
                    continue;
                }
                // A check asked alone goes to the store with the rest.
                let Part::Short(waiting) = std::mem::replace(&mut parts[index], Part::Store) else {
                    continue;
                };
                match table.clone().refill_apart(waiting, check.clone()).await {
                    Ok(Answer::Took(taken, decision)) => parts[index] = Part::Took(taken, decision),
                    Ok(Answer::Alone) => {}
                    Ok(Answer::Denied(decision)) => {
                        return Ok(denied(parts, &checks, index, decision));
                    }
                    Err(error) => {
                        put_back(parts);
                        return Err(error);
                    }
                }
            }
            finish(&table, &checks, parts).await
        })
    }

    fn peek(&self, checks: &[Check]) -> StoreFuture {
        self.table.store.peek(checks)
    }

    /// A sliced check's units go back into the slice they came from,
    /// while it lives; after, the request stays counted.
    fn refund(&self, checks: &[Check], recorded_at: &[Duration]) -> StoreFuture<()> {
        if checks.iter().all(|check| check.slice == 0) {
            return self.table.store.refund(checks, recorded_at);
        }
        if let Some(error) = super::unpaired_refund(checks, recorded_at) {
            return StoreFuture::ready(Err(error));
        }
        let mut rest = Checks::new();
        let mut times = SmallVec::<[Duration; 2]>::new();
        for (check, &at) in checks.iter().zip(recorded_at) {
            if check.slice == 0 {
                rest.push(check.clone());
                times.push(at);
            } else {
                self.table.refund_into_slice(check, at);
            }
        }
        if rest.is_empty() {
            return StoreFuture::ready(Ok(()));
        }
        self.table.store.refund(&rest, &times)
    }

    fn settle(&self, checks: &[Check], recorded_at: &[Duration], costs: &[u64]) -> StoreFuture<()> {
        self.table.store.settle(checks, recorded_at, costs)
    }

    fn renew(&self, checks: &[Check]) -> StoreFuture<Vec<bool>> {
        self.table.store.renew(checks)
    }

    /// Drops the slices in hand of the checks' clients (the store forgets
    /// their units) before the store resets them.
    fn reset(&self, checks: &[Check]) -> StoreFuture<()> {
        for check in checks.iter().filter(|check| check.slice > 0) {
            let entry = lock(&self.table.entries)
                .by_scope
                .get(&check.scope())
                .cloned();
            if let Some(entry) = entry {
                let mut state = lock(&entry.state);
                state.generation += 1;
                state.slice = None;
                state.last = None;
            }
        }
        self.table.store.reset(checks)
    }

    fn entries(&self, table: &str) -> StoreFuture<Vec<(String, String)>> {
        self.table.store.entries(table)
    }

    fn set_entry(&self, table: &str, field: &str, value: &str) -> StoreFuture<()> {
        self.table.store.set_entry(table, field, value)
    }

    fn remove_entry(&self, table: &str, field: &str, holding: Option<&str>) -> StoreFuture<()> {
        self.table.store.remove_entry(table, field, holding)
    }

    fn is_remote(&self) -> bool {
        self.table.store.is_remote()
    }

    fn shared_state(&self) -> Option<Arc<dyn std::any::Any + Send + Sync>> {
        self.table.store.shared_state()
    }

    fn recoveries(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        self.table.store.recoveries()
    }
}

/// Every sliced check of the request has its units: the others go to the
/// store, and the request stands or falls with its answer.
fn finish(table: &Table, checks: &[Check], parts: Parts) -> StoreFuture {
    let local: Option<Decisions> = parts
        .iter()
        .map(|part| match part {
            Part::Took(_, decision) => Some(*decision),
            _ => None,
        })
        .collect();
    if let Some(decisions) = local {
        return StoreFuture::ready(Ok(decisions));
    }
    let rest: Checks = checks
        .iter()
        .zip(&parts)
        .filter(|(_, part)| matches!(part, Part::Store))
        .map(|(check, _)| check.clone())
        .collect();
    match table.store.check(&rest).into_ready() {
        Ok(answer) => StoreFuture::ready(merged(parts, answer)),
        Err(later) => StoreFuture::new(async move { merged(parts, later.await) }),
    }
}

/// The store's decisions of the unsliced checks, in their places among
/// the slices' own; a denial puts the slices' units back.
fn merged(parts: Parts, answer: Result<Decisions, StoreError>) -> Result<Decisions, StoreError> {
    let decided = match answer {
        Ok(decided) => decided,
        Err(error) => {
            put_back(parts);
            return Err(error);
        }
    };
    let admitted = decided.iter().all(|decision| decision.admitted());
    let mut decided = decided.iter();
    let mut decisions = Decisions::new();
    for part in parts {
        let decision = match part {
            Part::Took(taken, mut decision) => {
                if !admitted {
                    taken.put_back();
                    decision.admitted = false;
                    decision.recorded_at_us = UNSET;
                }
                decision
            }
            _ => *decided
                .next()
                .ok_or_else(|| StoreError::Protocol("fewer decisions than checks".to_owned()))?,
        };
        decisions.push(decision);
    }
    Ok(decisions)
}

/// The decisions of a request whose check at `index` the store denied
/// (`decision`): the units its other checks took go back, and checks the
/// store was not asked about say nothing is known to be spent.
fn denied(parts: Parts, checks: &[Check], index: usize, decision: Decision) -> Decisions {
    parts
        .into_iter()
        .zip(checks)
        .enumerate()
        .map(|(at, (part, check))| match part {
            _ if at == index => decision,
            Part::Took(taken, mut decision) => {
                taken.put_back();
                decision.admitted = false;
                decision.recorded_at_us = UNSET;
                decision
            }
            Part::Store | Part::Short(_) => {
                Decision::new_denied(check.limit(), check.limit(), Duration::ZERO, None)
            }
        })
        .collect()
}

/// Puts back the units the parts took.
fn put_back(parts: Parts) {
    for part in parts {
        if let Part::Took(taken, _) = part {
            taken.put_back();
        }
    }
}

#[cfg(test)]
mod tests;
