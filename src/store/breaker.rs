//! [`CircuitBreaker`]: skips a failing store for a cool-down, so that a
//! frozen backend costs each request microseconds, not the store timeout.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use super::{Check, Store, StoreError, StoreFuture};

/// When a [`CircuitBreaker`] opens, and for how long.
///
/// ```
/// use slidegate::store::BreakerSettings;
/// use std::time::Duration;
///
/// let settings = BreakerSettings::new(5, Duration::from_secs(2));
/// assert_eq!(settings.failures(), 5);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerSettings {
    failures: u32,
    cooldown: Duration,
}

impl BreakerSettings {
    /// Opens after `failures` consecutive failures or timeouts (at least
    /// one), and skips the store for `cooldown` then.
    pub fn new(failures: u32, cooldown: Duration) -> Self {
        Self {
            failures: failures.max(1),
            cooldown,
        }
    }

    /// Consecutive failures that open the breaker.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// How long an open breaker skips the store.
    pub fn cooldown(&self) -> Duration {
        self.cooldown
    }

    /// How long a probe may take before it counts as a failure: the
    /// cool-down, and at least [`MIN_PROBE_DEADLINE`].
    fn probe_deadline(&self) -> Duration {
        self.cooldown.max(MIN_PROBE_DEADLINE)
    }
}

/// The least time a probe is given to answer, however short the cool-down.
const MIN_PROBE_DEADLINE: Duration = Duration::from_secs(1);

/// Whether the breaker lets checks through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BreakerState {
    /// Checks go to the store.
    Closed,
    /// The store is skipped until the cool-down ends.
    Open,
    /// One check, the probe, is with the store; the others are skipped
    /// until it answers.
    Probing,
}

/// A [`Store`] that stops asking `S` after a run of failures: after
/// [`failures`](BreakerSettings::failures) consecutive errors or timeouts
/// it opens, and every check fails at once with
/// [`StoreError::CircuitOpen`] (so each policy's fail mode answers within
/// microseconds instead of after the store's timeout).
///
/// Once the cool-down has passed, one check goes to the store as a probe,
/// and only the probe's answer moves the breaker: an answer closes it, a
/// failure (or no answer within the cool-down, and at least a second)
/// opens it for another cool-down. Inside a Tokio runtime the probe runs
/// on a task of its own, so it runs to its end whatever becomes of the
/// request that carried it: a client that sends requests and drops them
/// at once (its FIN with the request) cannot keep the breaker open, and
/// the breaker closes within a cool-down of the store answering again
/// (the repository's `tests/it/failures_shadow_fallback.rs`, with one such
/// client and with sixteen). Answers to calls sent before the breaker
/// opened are late news and move nothing. Each change of state is logged
/// once.
///
/// Clones share the breaker. The configuration file sets it in
/// `[redis.breaker]` (`failures`, `cooldown`). What each fail mode answers
/// meanwhile, a local limit included, is in the [`layer`](crate::layer)
/// module's *When the store is down*.
///
/// ```
/// use slidegate::store::{BreakerSettings, CircuitBreaker, MemoryStore};
/// use std::time::Duration;
///
/// let store = CircuitBreaker::new(MemoryStore::new(), BreakerSettings::new(5, Duration::from_secs(2)));
/// assert_eq!(store.state(), slidegate::store::BreakerState::Closed);
/// ```
#[derive(Debug, Clone)]
pub struct CircuitBreaker<S> {
    store: S,
    breaker: Arc<Breaker>,
}

/// The breaker's state as one word, so that every change is one atomic
/// step: the phase in the low two bits, and above them the *stamp*, the
/// time (µs since [`Breaker::epoch`]) the breaker last opened. An opening
/// always moves the stamp on, so the stamp also names the period a check
/// passed in, and an answer from an earlier period is told apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Word(u64);

const CLOSED: u64 = 0;
const OPEN: u64 = 1;
const PROBING: u64 = 2;

impl Word {
    fn new(stamp: u64, phase: u64) -> Self {
        Self((stamp << 2) | phase)
    }

    fn phase(self) -> u64 {
        self.0 & 3
    }

    fn stamp(self) -> u64 {
        self.0 >> 2
    }
}

#[derive(Debug)]
struct Breaker {
    settings: BreakerSettings,
    /// A [`Word`].
    state: AtomicU64,
    /// Failures in a row in the current closed period.
    failures: AtomicU32,
    epoch: Instant,
}

impl<S: Store> CircuitBreaker<S> {
    /// Guards `store` with a breaker of `settings`.
    pub fn new(store: S, settings: BreakerSettings) -> Self {
        crate::store::gauges::breaker_state(BreakerState::Closed);
        Self {
            store,
            breaker: Arc::new(Breaker {
                settings,
                state: AtomicU64::new(Word::new(0, CLOSED).0),
                failures: AtomicU32::new(0),
                epoch: Instant::now(),
            }),
        }
    }

    /// The guarded store.
    pub fn get_ref(&self) -> &S {
        &self.store
    }

    /// Where the breaker stands now.
    pub fn state(&self) -> BreakerState {
        match self.breaker.load().phase() {
            CLOSED => BreakerState::Closed,
            OPEN => BreakerState::Open,
            _ => BreakerState::Probing,
        }
    }
}

/// What a check may do, as the breaker stands.
enum Pass {
    /// Go to the store, in the closed period of this word.
    Closed(Word),
    /// Go to the store as the probe of this word's opening.
    Probe(Word),
    /// Fail at once.
    Skip,
}

impl Breaker {
    fn load(&self) -> Word {
        Word(self.state.load(Ordering::Acquire))
    }

    fn swap(&self, from: Word, to: Word) -> bool {
        self.state
            .compare_exchange(from.0, to.0, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    fn micros_since_epoch(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX >> 2)
    }

    /// The word of an opening that follows `from`: stamped now, and always
    /// later than `from`'s stamp.
    fn opening(&self, from: Word) -> Word {
        Word::new(self.micros_since_epoch().max(from.stamp() + 1), OPEN)
    }

    fn pass(&self) -> Pass {
        let word = self.load();

        match word.phase() {
            CLOSED => Pass::Closed(word),
            OPEN => {
                let cooled = self.micros_since_epoch().saturating_sub(word.stamp())
                    >= u64::try_from(self.settings.cooldown.as_micros()).unwrap_or(u64::MAX);
                let probing = Word::new(word.stamp(), PROBING);
                if cooled && self.swap(word, probing) {
                    crate::store::gauges::breaker_state(BreakerState::Probing);
                    tracing::info!("rate-limit store breaker half-open: probing the store");
                    Pass::Probe(probing)
                } else {
                    Pass::Skip
                }
            }
            _ => Pass::Skip,
        }
    }

    /// Notes how a check sent in the closed period `passed` ended. Only a
    /// check of the current period counts: one sent before the breaker
    /// last opened is late news.
    fn observe<T>(&self, outcome: &Result<T, StoreError>, passed: Word) {
        match outcome {
            // A store that cannot do something, or is full, is not
            // failing: it answered.
            Ok(_) | Err(StoreError::Unsupported(_) | StoreError::Full(_)) => {
                if self.load() == passed && self.failures.load(Ordering::Relaxed) != 0 {
                    self.failures.store(0, Ordering::Relaxed);
                }
            }
            Err(error) => {
                if self.load() != passed {
                    return;
                }
                let failures = self.failures.fetch_add(1, Ordering::AcqRel) + 1;
                if failures >= self.settings.failures && self.swap(passed, self.opening(passed)) {
                    crate::store::gauges::breaker_state(BreakerState::Open);
                    tracing::warn!(
                        %error,
                        failures,
                        cooldown = ?self.settings.cooldown,
                        "rate-limit store breaker open: skipping the store"
                    );
                }
            }
        }
    }

    /// Moves the breaker on the probe's answer: closed on an answer, open
    /// for another cool-down on a failure.
    fn probed<T>(&self, outcome: &Result<T, StoreError>, probe: Word) {
        match outcome {
            Ok(_) | Err(StoreError::Unsupported(_) | StoreError::Full(_)) => {
                self.failures.store(0, Ordering::Release);
                if self.swap(probe, Word::new(probe.stamp(), CLOSED)) {
                    crate::store::gauges::breaker_state(BreakerState::Closed);
                    tracing::info!("rate-limit store breaker closed: the store answers again");
                }
            }
            Err(error) => self.reopen(probe, error),
        }
    }

    fn reopen(&self, probe: Word, error: &dyn std::fmt::Display) {
        if self.swap(probe, self.opening(probe)) {
            crate::store::gauges::breaker_state(BreakerState::Open);
            tracing::debug!(%error, "rate-limit store probe failed; breaker open again");
        }
    }

    /// `answer` of a check sent in the closed period `passed`, watched.
    fn watch<T: Send + 'static>(
        self: &Arc<Self>,
        answer: StoreFuture<T>,
        passed: Word,
    ) -> StoreFuture<T> {
        match answer.into_ready() {
            Ok(outcome) => {
                self.observe(&outcome, passed);
                StoreFuture::ready(outcome)
            }
            Err(later) => {
                let breaker = self.clone();
                StoreFuture::new(async move {
                    let outcome = later.await;
                    breaker.observe(&outcome, passed);
                    outcome
                })
            }
        }
    }

    /// `answer` of the probe, run to its end whatever becomes of the
    /// request that carried it: on a task of its own when there is a Tokio
    /// runtime, bounded by the probe deadline.
    fn run_probe<T: Send + 'static>(
        &self,
        answer: StoreFuture<T>,
        mut watch: ProbeWatch,
    ) -> StoreFuture<T> {
        let later = match answer.into_ready() {
            Ok(outcome) => {
                watch.answered(&outcome);
                return StoreFuture::ready(outcome);
            }
            Err(later) => later,
        };
        let deadline = self.settings.probe_deadline();
        let probing = async move {
            let outcome = tokio::time::timeout(deadline, later)
                .await
                .unwrap_or(Err(StoreError::Timeout(deadline)));
            watch.answered(&outcome);
            outcome
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let task = runtime.spawn(probing);
                StoreFuture::new(async move {
                    task.await.unwrap_or_else(|stopped| {
                        Err(StoreError::backend(format!(
                            "the breaker's probe stopped: {stopped}"
                        )))
                    })
                })
            }
            // Without a runtime the probe runs with its request; dropped,
            // it opens the breaker again.
            Err(_) => StoreFuture::new(probing),
        }
    }
}

/// The probe on its way to the store. If it ends without an answer (its
/// task stopped with the runtime, or panicked; or, outside a runtime, its
/// request went away), the breaker opens again for another probe after the
/// cool-down, rather than wait on it for ever.
struct ProbeWatch {
    breaker: Arc<Breaker>,
    probe: Word,
    done: bool,
}

impl ProbeWatch {
    fn answered<T>(&mut self, outcome: &Result<T, StoreError>) {
        self.breaker.probed(outcome, self.probe);
        self.done = true;
    }
}

impl Drop for ProbeWatch {
    fn drop(&mut self) {
        if !self.done {
            self.breaker
                .reopen(self.probe, &"the probe ended without an answer");
        }
    }
}

impl<S: Store> CircuitBreaker<S> {
    fn guarded<T: Send + 'static>(
        &self,
        call: impl FnOnce(&S) -> StoreFuture<T>,
    ) -> StoreFuture<T> {
        match self.breaker.pass() {
            Pass::Closed(passed) => self.breaker.watch(call(&self.store), passed),
            Pass::Probe(probe) => {
                // Watched before the store is called: a store that panics
                // opens the breaker again instead of leaving it probing.
                let watch = ProbeWatch {
                    breaker: self.breaker.clone(),
                    probe,
                    done: false,
                };
                self.breaker.run_probe(call(&self.store), watch)
            }
            Pass::Skip => StoreFuture::ready(Err(StoreError::CircuitOpen)),
        }
    }
}

impl<S: Store> Store for CircuitBreaker<S> {
    fn check(&self, checks: &[Check]) -> StoreFuture {
        self.guarded(|store| store.check(checks))
    }

    fn peek(&self, checks: &[Check]) -> StoreFuture {
        self.guarded(|store| store.peek(checks))
    }

    fn refund(&self, checks: &[Check], recorded_at: &[Duration]) -> StoreFuture<()> {
        self.guarded(|store| store.refund(checks, recorded_at))
    }

    fn settle(&self, checks: &[Check], recorded_at: &[Duration], costs: &[u64]) -> StoreFuture<()> {
        self.guarded(|store| store.settle(checks, recorded_at, costs))
    }

    fn renew(&self, checks: &[Check]) -> StoreFuture<Vec<bool>> {
        self.guarded(|store| store.renew(checks))
    }

    fn reset(&self, checks: &[Check]) -> StoreFuture<()> {
        self.guarded(|store| store.reset(checks))
    }

    // The tables of changes are read in the background, a call a period
    // whatever the traffic: their failures (an ACL user allowed the
    // limiter's functions alone, say) never open the breaker.
    fn entries(&self, table: &str) -> StoreFuture<Vec<(String, String)>> {
        self.store.entries(table)
    }

    fn set_entry(&self, table: &str, field: &str, value: &str) -> StoreFuture<()> {
        self.store.set_entry(table, field, value)
    }

    fn remove_entry(&self, table: &str, field: &str, holding: Option<&str>) -> StoreFuture<()> {
        self.store.remove_entry(table, field, holding)
    }

    fn is_remote(&self) -> bool {
        self.store.is_remote()
    }

    fn shared_state(&self) -> Option<Arc<dyn std::any::Any + Send + Sync>> {
        self.store.shared_state()
    }

    fn recoveries(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        self.store.recoveries()
    }
}

#[cfg(test)]
mod tests;
