//! A settlement (or charges as a [`Usage`](crate::Usage) handle reports)
//! sent to the store: in turn with the charges of its request on their
//! way, and sent again while the store cannot be reached.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use smallvec::SmallVec;
use tokio::sync::{OwnedRwLockReadGuard, RwLock};

use crate::layer::after::recorded::Recorded;
use crate::log_lines::SETTLE_FAILURES;
use crate::store::Checks;
use crate::store::background::spawn_on;
use crate::store::{Store, StoreError, StoreFuture};

/// A settlement (or charges as a handle reports) sent to a store, kept
/// to send again while the store cannot be reached.
pub(crate) struct Sent {
    store: Arc<dyn Store>,
    checks: Checks,
    times: SmallVec<[Duration; 2]>,
    costs: SmallVec<[u64; 2]>,
    turn: Turn,
}

/// How a settlement waits for the charges of its request on their way,
/// so that each counts once: what one landed is taken from the
/// settlement's cost, and what one did not land stays in it (one that
/// timed out may have landed all the same, and then counts twice).
pub(crate) enum Turn {
    /// Charges as the handle reported: each cost, once it lands, is
    /// added to what its reservation was charged. They hold their
    /// request's lock for reading until answered.
    Charge {
        charged: SmallVec<[Arc<AtomicU64>; 2]>,
        _held: OwnedRwLockReadGuard<()>,
    },
    /// A settlement, sent once it holds the lock for writing: each cost
    /// less what charges landed on its reservation (none for one moved
    /// to the keys of another algorithm).
    Settle {
        lock: Arc<RwLock<()>>,
        charged: SmallVec<[Option<Arc<AtomicU64>>; 2]>,
    },
}

/// How many times a settlement is sent at most, and the wait before the
/// second: doubled each time, to at most `SETTLE_RETRY_MOST`. About a
/// minute in all.
pub(crate) const SETTLE_ATTEMPTS: u32 = 16;

pub(crate) const SETTLE_RETRY: Duration = Duration::from_millis(100);

pub(crate) const SETTLE_RETRY_MOST: Duration = Duration::from_secs(5);

/// How long after its first sending a settlement is still sent again,
/// whatever the store's timeout: within the five minutes a store keeps a
/// settlement's mark, so that a copy sent again after one that landed
/// late is still found settled.
pub(crate) const SETTLE_RESENT_FOR: Duration = Duration::from_secs(240);

impl Sent {
    pub(crate) fn new(
        store: Arc<dyn Store>,
        recorded: &Recorded,
        costs: SmallVec<[u64; 2]>,
        turn: Turn,
    ) -> Self {
        Self {
            store,
            checks: recorded.checks().iter().cloned().collect(),
            times: recorded.times().iter().copied().collect(),
            costs,
            turn,
        }
    }

    /// Sends the settlement: at once to a store in process; otherwise on
    /// the current runtime, or else `runtime`, sent again while the store
    /// cannot be reached (see [`until_answered`](Self::until_answered)),
    /// an open circuit breaker's answer at once included.
    pub(crate) fn send(mut self, runtime: Option<&tokio::runtime::Handle>) {
        if let Turn::Settle { lock, .. } = &self.turn {
            if lock.try_write().is_err() {
                let lock = lock.clone();
                let settled = async move {
                    drop(lock.write().await);
                    self.less_landed();
                    let first = self.store.settle(&self.checks, &self.times, &self.costs);
                    self.until_answered(first).await;
                };
                if let Err(no_runtime) = spawn_on(runtime, settled) {
                    report_settlement(Err(no_runtime));
                }
                return;
            }
            self.less_landed();
        }
        let answer = self.store.settle(&self.checks, &self.times, &self.costs);
        let first = match answer.into_ready() {
            Ok(Err(error)) if self.retried(&error) => StoreFuture::ready(Err(error)),
            Ok(outcome) => return self.done(outcome),
            Err(later) => later,
        };
        if let Err(no_runtime) = spawn_on(runtime, self.until_answered(first)) {
            report_settlement(Err(no_runtime));
        }
    }

    /// Takes from each cost of a settlement what the charges as the
    /// handle reported landed.
    pub(crate) fn less_landed(&mut self) {
        let Turn::Settle { charged, .. } = &self.turn else {
            return;
        };
        for (cost, charged) in self.costs.iter_mut().zip(charged) {
            if let Some(charged) = charged {
                *cost = cost.saturating_sub(charged.load(Ordering::Acquire));
            }
        }
    }

    /// Counts what landed, and warns of what did not.
    pub(crate) fn done(&self, outcome: Result<(), StoreError>) {
        if let (Ok(()), Turn::Charge { charged, .. }) = (&outcome, &self.turn) {
            for (charged, units) in charged.iter().zip(&self.costs) {
                charged.fetch_add(*units, Ordering::AcqRel);
            }
        }
        report_settlement(outcome);
    }

    /// Waits for `first`, the settlement's first answer, and sends it
    /// again while the store could not be reached (it failed, or its
    /// circuit breaker is open) or did not answer in time, until it is
    /// taken, or after [`SETTLE_ATTEMPTS`] sendings (about a minute with a
    /// short store timeout; never past [`SETTLE_RESENT_FOR`]): a
    /// settlement lost to an outage
    /// would leave a client that reported more than its reservation
    /// charged the reservation alone. One that timed out may have landed:
    /// it is sent again only when the store settles each reservation once
    /// (see [`retried`](Self::retried)).
    pub(crate) async fn until_answered(self, first: StoreFuture<()>) {
        let started = tokio::time::Instant::now();
        let mut outcome = first.await;
        let mut wait = SETTLE_RETRY;
        for _ in 1..SETTLE_ATTEMPTS {
            match &outcome {
                Err(error) if self.retried(error) => {}
                _ => break,
            }
            if started.elapsed() + wait > SETTLE_RESENT_FOR {
                break;
            }
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(SETTLE_RETRY_MOST);
            outcome = self
                .store
                .settle(&self.checks, &self.times, &self.costs)
                .await;
        }
        self.done(outcome);
    }

    /// Whether the settlement, failed with `error`, is sent again: the
    /// store could not be reached, or its breaker is open; or it timed
    /// out, and may have landed, when every reservation it settles is
    /// named by its id (see [`Check::with_settlement_id`](crate::store::Check::with_settlement_id)),
    /// which the store settles once. A charge alone names none, and is
    /// not sent again after a timeout: it could count twice.
    fn retried(&self, error: &StoreError) -> bool {
        match error {
            StoreError::Backend(_) | StoreError::CircuitOpen => true,
            StoreError::Timeout(_) => {
                matches!(self.turn, Turn::Settle { .. })
                    && self.checks.iter().all(|check| check.id != 0)
                    && self.times.iter().all(|at| !at.is_zero())
            }
            _ => false,
        }
    }
}

/// Warns of a settlement that failed: one that timed out may still land;
/// one that failed otherwise (after its retries) leaves the reservation
/// counted instead of the cost reported.
pub(crate) fn report_settlement(outcome: Result<(), StoreError>) {
    let Err(error) = outcome else {
        return;
    };
    let Some(held_back) = SETTLE_FAILURES.admit() else {
        return;
    };
    if matches!(error, StoreError::Timeout(_)) {
        tracing::warn!(%error, held_back, "rate-limit settlement timed out; it may still land");
    } else {
        tracing::warn!(%error, held_back, "rate-limit settlement failed; the reservation stays counted instead of the cost reported");
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::key::Key;
    use crate::policy::Policy;
    use crate::store::Check;

    /// A store whose settlements each take `took`, then time out; it
    /// notes when each was sent.
    struct Slow {
        took: Duration,
        sent: Mutex<Vec<tokio::time::Instant>>,
    }

    impl Store for Slow {
        fn check(&self, _: &[Check]) -> StoreFuture {
            StoreFuture::ready(Err(StoreError::Unsupported("check")))
        }

        fn settle(&self, _: &[Check], _: &[Duration], _: &[u64]) -> StoreFuture<()> {
            self.sent.lock().unwrap().push(tokio::time::Instant::now());
            let took = self.took;
            StoreFuture::new(async move {
                tokio::time::sleep(took).await;
                Err(StoreError::Timeout(took))
            })
        }
    }

    /// A settlement that times out is sent again, but never past
    /// `SETTLE_RESENT_FOR` from its first sending, however long the
    /// store's timeout: a late copy would land after the store forgot
    /// the first, and count twice.
    #[tokio::test(start_paused = true)]
    async fn a_settlement_is_not_sent_again_past_the_time_its_mark_is_kept() {
        for (took, sendings) in [
            (Duration::from_millis(50), SETTLE_ATTEMPTS as usize),
            (Duration::from_secs(60), 4),
        ] {
            let store = Arc::new(Slow {
                took,
                sent: Mutex::new(Vec::new()),
            });
            let dyn_store: Arc<dyn Store> = store.clone();
            let policy = Policy::new("tokens", 1_000, Duration::from_secs(60));
            let check = Check::new(&policy, Key::new("client"))
                .unwrap()
                .with_settlement_id();
            let mut reserved = Recorded::new(&dyn_store);
            reserved.push(&check, Duration::from_secs(1));
            let turn = Turn::Settle {
                lock: Arc::new(RwLock::new(())),
                charged: SmallVec::from_elem(None, 1),
            };
            let sent = Sent::new(
                dyn_store.clone(),
                &reserved,
                SmallVec::from_elem(3, 1),
                turn,
            );
            let started = tokio::time::Instant::now();
            let first = dyn_store.settle(&sent.checks, &sent.times, &sent.costs);
            sent.until_answered(first).await;
            let times = store.sent.lock().unwrap().clone();
            assert_eq!(times.len(), sendings, "a store answering in {took:?}");
            assert!(times.iter().all(|at| *at - started <= SETTLE_RESENT_FOR));
        }
    }
}
