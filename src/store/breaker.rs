//! [`CircuitBreaker`]: skips a failing store for a cool-down, so that a
//! frozen backend costs each request microseconds, not the store timeout.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::{Check, CheckFuture, Store, StoreError};

/// When a [`CircuitBreaker`] opens, and for how long.
///
/// ```
/// use slidegate::BreakerSettings;
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
}

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

const CLOSED: u8 = 0;
const OPEN: u8 = 1;
const PROBING: u8 = 2;

/// A [`Store`] that stops asking `S` after a run of failures: after
/// [`failures`](BreakerSettings::failures) consecutive errors or timeouts
/// it opens, and every check fails at once with
/// [`StoreError::CircuitOpen`] (so each policy's fail mode answers within
/// microseconds instead of after the store's timeout). Once the cool-down
/// has passed, one check goes to the store as a probe: an answer closes the
/// breaker, a failure opens it for another cool-down. Each change of state
/// is logged once.
///
/// Clones share the breaker.
///
/// ```
/// use slidegate::{BreakerSettings, CircuitBreaker, MemoryStore};
/// use std::time::Duration;
///
/// let store = CircuitBreaker::new(MemoryStore::new(), BreakerSettings::new(5, Duration::from_secs(2)));
/// assert_eq!(store.state(), slidegate::BreakerState::Closed);
/// ```
#[derive(Debug, Clone)]
pub struct CircuitBreaker<S> {
    store: S,
    breaker: Arc<Breaker>,
}

#[derive(Debug)]
struct Breaker {
    settings: BreakerSettings,
    /// `CLOSED`, `OPEN` or `PROBING`.
    state: AtomicU8,
    /// Failures in a row while closed.
    failures: AtomicU32,
    /// When the breaker last opened, in µs since `epoch`.
    opened_at: AtomicU64,
    epoch: Instant,
}

impl<S: Store> CircuitBreaker<S> {
    /// Guards `store` with a breaker of `settings`.
    pub fn new(store: S, settings: BreakerSettings) -> Self {
        crate::metrics::breaker_state(BreakerState::Closed);
        Self {
            store,
            breaker: Arc::new(Breaker {
                settings,
                state: AtomicU8::new(CLOSED),
                failures: AtomicU32::new(0),
                opened_at: AtomicU64::new(0),
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
        match self.breaker.state.load(Ordering::Acquire) {
            CLOSED => BreakerState::Closed,
            OPEN => BreakerState::Open,
            _ => BreakerState::Probing,
        }
    }
}

/// What a check may do, as the breaker stands.
enum Pass {
    /// Go to the store; `true` for the probe.
    Through(bool),
    /// Fail at once.
    Skip,
}

impl Breaker {
    fn micros_since_epoch(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    fn pass(&self) -> Pass {
        match self.state.load(Ordering::Acquire) {
            CLOSED => Pass::Through(false),
            OPEN => {
                let opened = self.opened_at.load(Ordering::Acquire);
                let cooled = self.micros_since_epoch().saturating_sub(opened)
                    >= u64::try_from(self.settings.cooldown.as_micros()).unwrap_or(u64::MAX);
                let won = cooled
                    && self
                        .state
                        .compare_exchange(OPEN, PROBING, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok();
                if won {
                    crate::metrics::breaker_state(BreakerState::Probing);
                    tracing::info!("rate-limit store breaker half-open: probing the store");
                    Pass::Through(true)
                } else {
                    Pass::Skip
                }
            }
            _ => Pass::Skip,
        }
    }

    /// Notes how a check that went to the store ended.
    fn observe<T>(&self, outcome: &Result<T, StoreError>, probe: bool) {
        match outcome {
            // A store that cannot do something is not failing.
            Ok(_) | Err(StoreError::Unsupported(_)) => {
                self.failures.store(0, Ordering::Release);
                let previous = self.state.swap(CLOSED, Ordering::AcqRel);
                if previous != CLOSED {
                    crate::metrics::breaker_state(BreakerState::Closed);
                    tracing::info!("rate-limit store breaker closed: the store answers again");
                }
            }
            Err(error) if probe => {
                self.open();
                tracing::debug!(%error, "rate-limit store probe failed; breaker open again");
            }
            Err(error) => {
                let failures = self.failures.fetch_add(1, Ordering::AcqRel) + 1;
                if failures >= self.settings.failures
                    && self
                        .state
                        .compare_exchange(CLOSED, OPEN, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
                {
                    self.opened_at
                        .store(self.micros_since_epoch(), Ordering::Release);
                    crate::metrics::breaker_state(BreakerState::Open);
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

    fn open(&self) {
        self.opened_at
            .store(self.micros_since_epoch(), Ordering::Release);
        self.state.store(OPEN, Ordering::Release);
        crate::metrics::breaker_state(BreakerState::Open);
    }

    /// `answer`, watched: its outcome moves the breaker.
    fn watch<T: Send + 'static>(
        self: &Arc<Self>,
        answer: CheckFuture<T>,
        probe: bool,
    ) -> CheckFuture<T> {
        match answer.into_ready() {
            Ok(outcome) => {
                self.observe(&outcome, probe);
                CheckFuture::ready(outcome)
            }
            Err(later) => {
                let mut watch = Watch {
                    breaker: self.clone(),
                    probe,
                    done: false,
                };
                CheckFuture::new(async move {
                    let outcome = later.await;
                    watch.answered(&outcome);
                    outcome
                })
            }
        }
    }
}

/// A check on its way to the store. A probe dropped before the store
/// answered (its request went away) decides nothing: the breaker opens
/// again, for another probe after the cool-down, rather than wait on it
/// for ever.
struct Watch {
    breaker: Arc<Breaker>,
    probe: bool,
    done: bool,
}

impl Watch {
    fn answered<T>(&mut self, outcome: &Result<T, StoreError>) {
        self.breaker.observe(outcome, self.probe);
        self.done = true;
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        if self.probe && !self.done {
            self.breaker.open();
        }
    }
}

impl<S: Store> CircuitBreaker<S> {
    fn guarded<T: Send + 'static>(
        &self,
        call: impl FnOnce(&S) -> CheckFuture<T>,
    ) -> CheckFuture<T> {
        match self.breaker.pass() {
            Pass::Through(probe) => self.breaker.watch(call(&self.store), probe),
            Pass::Skip => CheckFuture::ready(Err(StoreError::CircuitOpen)),
        }
    }
}

impl<S: Store> Store for CircuitBreaker<S> {
    fn check(&self, checks: &[Check]) -> CheckFuture {
        self.guarded(|store| store.check(checks))
    }

    fn peek(&self, checks: &[Check]) -> CheckFuture {
        self.guarded(|store| store.peek(checks))
    }

    fn refund(&self, checks: &[Check], recorded_at: &[Duration]) -> CheckFuture<()> {
        self.guarded(|store| store.refund(checks, recorded_at))
    }

    fn is_remote(&self) -> bool {
        self.store.is_remote()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;

    use super::*;
    use crate::key::Key;
    use crate::policy::Policy;

    /// A store that fails while `down` is set.
    #[derive(Debug, Default)]
    struct Flaky {
        down: AtomicBool,
        calls: AtomicU32,
    }

    impl Store for Arc<Flaky> {
        fn check(&self, _checks: &[Check]) -> CheckFuture {
            self.calls.fetch_add(1, Ordering::Relaxed);
            if self.down.load(Ordering::Relaxed) {
                CheckFuture::ready(Err(StoreError::Timeout(Duration::from_millis(50))))
            } else {
                CheckFuture::ready(Ok(crate::store::Decisions::new()))
            }
        }
    }

    fn check() -> [Check; 1] {
        [Check::new(
            &Policy::new("p", 1, Duration::from_secs(1)),
            Key::new("k"),
        )]
    }

    fn outcome(store: &impl Store) -> Result<crate::store::Decisions, StoreError> {
        store.check(&check()).into_ready().expect("ready")
    }

    #[test]
    fn opens_after_the_failures_in_a_row_and_skips_the_store() {
        let flaky = Arc::new(Flaky::default());
        let breaker = CircuitBreaker::new(
            flaky.clone(),
            BreakerSettings::new(3, Duration::from_secs(3600)),
        );
        flaky.down.store(true, Ordering::Relaxed);
        // Two failures, an answer in between: the run starts again.
        for _ in 0..2 {
            assert!(outcome(&breaker).is_err());
        }
        flaky.down.store(false, Ordering::Relaxed);
        assert!(outcome(&breaker).is_ok());
        flaky.down.store(true, Ordering::Relaxed);
        for _ in 0..3 {
            assert!(matches!(outcome(&breaker), Err(StoreError::Timeout(_))));
        }
        assert_eq!(breaker.state(), BreakerState::Open);
        let calls = flaky.calls.load(Ordering::Relaxed);
        flaky.down.store(false, Ordering::Relaxed);
        for _ in 0..100 {
            assert!(matches!(outcome(&breaker), Err(StoreError::CircuitOpen)));
        }
        assert_eq!(flaky.calls.load(Ordering::Relaxed), calls, "skipped");
    }

    #[test]
    fn after_the_cooldown_one_probe_decides() {
        let flaky = Arc::new(Flaky::default());
        // No cool-down: the first check after opening is the probe.
        let breaker = CircuitBreaker::new(flaky.clone(), BreakerSettings::new(1, Duration::ZERO));
        flaky.down.store(true, Ordering::Relaxed);
        assert!(matches!(outcome(&breaker), Err(StoreError::Timeout(_))));
        assert_eq!(breaker.state(), BreakerState::Open);
        // A failing probe opens it again.
        let calls = flaky.calls.load(Ordering::Relaxed);
        assert!(matches!(outcome(&breaker), Err(StoreError::Timeout(_))));
        assert_eq!(flaky.calls.load(Ordering::Relaxed), calls + 1);
        assert_eq!(breaker.state(), BreakerState::Open);
        // While a probe is out, the others are skipped.
        breaker.breaker.state.store(PROBING, Ordering::Release);
        assert!(matches!(outcome(&breaker), Err(StoreError::CircuitOpen)));
        breaker.breaker.state.store(OPEN, Ordering::Release);
        // A probe whose request went away opens it again.
        breaker.breaker.state.store(PROBING, Ordering::Release);
        let waiting = CheckFuture::new(std::future::pending());
        drop(
            breaker
                .breaker
                .watch::<crate::store::Decisions>(waiting, true),
        );
        assert_eq!(breaker.breaker.state.load(Ordering::Acquire), OPEN);
        // An answering probe closes it.
        flaky.down.store(false, Ordering::Relaxed);
        assert!(outcome(&breaker).is_ok());
        assert_eq!(breaker.state(), BreakerState::Closed);
        assert!(outcome(&breaker).is_ok());
    }
}
