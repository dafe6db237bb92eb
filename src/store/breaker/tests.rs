//! Unit tests of `breaker.rs`.

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
    fn check(&self, _checks: &[Check]) -> StoreFuture {
        self.calls.fetch_add(1, Ordering::Relaxed);
        if self.down.load(Ordering::Relaxed) {
            StoreFuture::ready(Err(StoreError::Timeout(Duration::from_millis(50))))
        } else {
            StoreFuture::ready(Ok(crate::store::Decisions::new()))
        }
    }
}

fn check() -> [Check; 1] {
    [Check::new(&Policy::new("p", 1, Duration::from_secs(1)), Key::new("k")).unwrap()]
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
    // An answering probe closes it.
    flaky.down.store(false, Ordering::Relaxed);
    assert!(outcome(&breaker).is_ok());
    assert_eq!(breaker.state(), BreakerState::Closed);
    assert!(outcome(&breaker).is_ok());
}

/// A store whose every answer waits until the test gives it: `Some(true)`
/// answers, `Some(false)` fails.
#[derive(Debug, Clone)]
struct Gated {
    answers: tokio::sync::watch::Receiver<Option<bool>>,
    calls: Arc<AtomicU32>,
}

impl Gated {
    fn new() -> (Self, tokio::sync::watch::Sender<Option<bool>>) {
        let (give, answers) = tokio::sync::watch::channel(None);
        let calls = Arc::new(AtomicU32::new(0));
        (Self { answers, calls }, give)
    }
}

impl Store for Gated {
    fn check(&self, _checks: &[Check]) -> StoreFuture {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let mut answers = self.answers.clone();
        StoreFuture::new(async move {
            let given = *answers
                .wait_for(Option::is_some)
                .await
                .expect("the test holds the sender");
            if given == Some(true) {
                Ok(crate::store::Decisions::new())
            } else {
                Err(StoreError::Timeout(Duration::from_millis(50)))
            }
        })
    }
}

#[test]
fn a_full_store_is_answering_not_failing() {
    let breaker = CircuitBreaker::new(
        Arc::new(Flaky::default()),
        BreakerSettings::new(1, Duration::from_secs(3600)),
    );
    for _ in 0..10 {
        breaker.breaker.observe::<()>(
            &Err(StoreError::Full("new client".into())),
            Word::new(0, CLOSED),
        );
    }
    assert_eq!(breaker.state(), BreakerState::Closed);
}

/// A store whose `check` panics.
#[derive(Debug)]
struct Panicking;

impl Store for Panicking {
    fn check(&self, _checks: &[Check]) -> StoreFuture {
        panic!("a store bug");
    }
}

#[test]
fn a_probe_whose_store_panics_opens_the_breaker_again() {
    let breaker = CircuitBreaker::new(Panicking, BreakerSettings::new(1, Duration::ZERO));
    breaker.breaker.observe::<()>(
        &Err(StoreError::Timeout(Duration::from_millis(50))),
        Word::new(0, CLOSED),
    );
    let probing = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        drop(breaker.check(&check()));
    }));
    assert!(probing.is_err());
    assert_eq!(breaker.state(), BreakerState::Open, "not left probing");
}

#[tokio::test(start_paused = true)]
async fn a_late_answer_from_before_the_opening_moves_nothing() {
    let (gated, give) = Gated::new();
    let settings = BreakerSettings::new(1, Duration::from_secs(3600));
    // A check held at the gate, then a failure that opens the breaker.
    let breaker = CircuitBreaker::new(gated, settings);
    let held = breaker.check(&check());
    breaker.breaker.observe::<()>(
        &Err(StoreError::Timeout(Duration::from_millis(50))),
        Word::new(0, CLOSED),
    );
    assert_eq!(breaker.state(), BreakerState::Open);
    give.send_replace(Some(true));
    assert!(held.await.is_ok());
    assert_eq!(
        breaker.state(),
        BreakerState::Open,
        "an answer to a check sent before the opening is not a probe"
    );
}

#[tokio::test(start_paused = true)]
async fn a_probe_whose_request_went_away_still_decides() {
    let (gated, give) = Gated::new();
    let breaker = CircuitBreaker::new(gated.clone(), BreakerSettings::new(1, Duration::ZERO));
    give.send_replace(Some(false));
    assert!(breaker.check(&check()).await.is_err());
    assert_eq!(breaker.state(), BreakerState::Open);
    give.send_replace(None);
    // The probe's request is dropped before the store answers.
    drop(breaker.check(&check()));
    assert_eq!(breaker.state(), BreakerState::Probing);
    assert!(matches!(
        breaker.check(&check()).into_ready(),
        Ok(Err(StoreError::CircuitOpen))
    ));
    give.send_replace(Some(true));
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert_eq!(
        breaker.state(),
        BreakerState::Closed,
        "the probe ran to its end"
    );
    assert_eq!(gated.calls.load(Ordering::Relaxed), 2);
}

#[tokio::test(start_paused = true)]
async fn a_probe_that_never_answers_fails_at_its_deadline() {
    let (gated, _give) = Gated::new();
    let cooldown = Duration::from_secs(2);
    let breaker = CircuitBreaker::new(gated, BreakerSettings::new(1, cooldown));
    breaker.breaker.observe::<()>(
        &Err(StoreError::Timeout(Duration::from_millis(50))),
        Word::new(0, CLOSED),
    );
    tokio::time::advance(cooldown + Duration::from_millis(1)).await;
    let probe = breaker.check(&check());
    assert_eq!(breaker.state(), BreakerState::Probing);
    assert!(matches!(probe.await, Err(StoreError::Timeout(d)) if d == cooldown));
    assert_eq!(breaker.state(), BreakerState::Open);
}
