//! One test on both stores: [`on_both_stores!`] runs an `async fn
//! scenario(StoreUnderTest)` as two tests, `scenario::memory` and
//! `scenario::redis`, the second on a `redis-server` of its own.

use std::sync::Arc;
use std::time::Duration;

use slidegate::clock::FakeClock;
use slidegate::store::{Check, MemoryStore, RedisStore, Store};

use super::RedisServer;

/// Where fake clocks start: November 2023, in µs since the Unix epoch.
pub const START: u64 = 1_700_000_000_000_000;

/// Admits `records` requests of `check`, `per_ms` at a time in one
/// millisecond of `clock` (the store sends them in batches), each
/// admitted: a long log filled quickly.
pub async fn fill(store: &RedisStore, clock: &FakeClock, check: &Check, records: u32, per_ms: u32) {
    for _ in 0..records / per_ms {
        clock.advance(Duration::from_millis(1));
        let tasks: Vec<_> = (0..per_ms)
            .map(|_| {
                let (store, check) = (store.clone(), check.clone());
                tokio::spawn(async move { store.check(&[check]).await })
            })
            .collect();
        for task in tasks {
            assert!(task.await.unwrap().unwrap()[0].admitted());
        }
    }
}

/// Sends every request of `requests` in one batch call of a Redis store
/// (on a current-thread runtime), in their order, and gives each its
/// answer. A check that finds no call in flight goes alone, so a lead
/// check (its own policy and client, counting nothing the requests read)
/// is sent first, and the requests queue while it is in flight.
pub async fn in_one_batch(
    store: &Arc<RedisStore>,
    requests: Vec<Vec<Check>>,
) -> Vec<Result<slidegate::store::Decisions, slidegate::store::StoreError>> {
    let lead = slidegate::Policy::new("batch-lead", u32::MAX, Duration::from_secs(1));
    let lead = Check::new(&lead, slidegate::key::Key::new("lead")).unwrap();
    let mut answers = all_at_once(store, std::iter::once(vec![lead]).chain(requests)).await;
    assert!(answers.remove(0).is_ok(), "the lead check is decided");
    answers
}

/// Sends every request of `requests` at once, each from a task of its
/// own spawned in their order, and gives each its answer.
pub async fn all_at_once<S: Store>(
    store: &Arc<S>,
    requests: impl IntoIterator<Item = Vec<Check>>,
) -> Vec<Result<slidegate::store::Decisions, slidegate::store::StoreError>> {
    let tasks: Vec<_> = requests
        .into_iter()
        .map(|checks| {
            let store = store.clone();
            tokio::spawn(async move { store.check(&checks).await })
        })
        .collect();
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.unwrap());
    }
    answers
}

/// A store for one test, with the `redis-server` it runs on kept alive.
pub struct StoreUnderTest {
    pub store: Arc<dyn Store>,
    /// The store's clock, when the test drives time itself.
    pub clock: Option<FakeClock>,
    pub redis: Option<RedisServer>,
}

impl StoreUnderTest {
    /// A memory store, on a fake clock at [`START`] when `fake_clock`.
    pub fn memory(fake_clock: bool) -> Self {
        let clock = fake_clock.then(|| FakeClock::new(START));
        let store = match &clock {
            Some(clock) => MemoryStore::builder().with_clock(clock.clone()).build(),
            None => MemoryStore::new(),
        };
        Self {
            store: Arc::new(store),
            clock,
            redis: None,
        }
    }

    /// A Redis store on a `redis-server` of its own, on a fake clock at
    /// [`START`] when `fake_clock`.
    pub fn redis(fake_clock: bool) -> Self {
        let server = RedisServer::start();
        let clock = fake_clock.then(|| FakeClock::new(START));
        // No scenario is about the timeout: long, so that a loaded machine
        // never turns a slow answer into a fail mode's.
        let mut builder = RedisStore::builder(server.pool(4)).with_timeout(Duration::from_secs(30));
        if let Some(clock) = &clock {
            builder = builder.with_clock(clock.clone());
        }
        Self {
            store: Arc::new(builder.build().expect("the default prefix")),
            clock,
            redis: Some(server),
        }
    }
}

/// Runs `async fn $scenario(StoreUnderTest)` on both stores, as the tests
/// `$scenario::memory` and `$scenario::redis`; with `fake_clock`, each
/// store reads a fake clock the scenario moves.
macro_rules! on_both_stores {
    ($scenario:ident) => {
        on_both_stores!($scenario, false);
    };
    ($scenario:ident, fake_clock) => {
        on_both_stores!($scenario, true);
    };
    ($scenario:ident, $fake_clock:literal) => {
        mod $scenario {
            use crate::support::stores::StoreUnderTest;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn memory() {
                super::$scenario(StoreUnderTest::memory($fake_clock)).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn redis() {
                super::$scenario(StoreUnderTest::redis($fake_clock)).await;
            }
        }
    };
}
