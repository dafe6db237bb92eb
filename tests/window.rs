//! Sliding-window semantics on a fake clock, run identically against
//! `MemoryStore` and a real `redis-server`.

mod support;

use std::time::Duration;

use slidegate::{
    Check, Decision, FakeClock, Key, MemoryStore, Policy, RedisStore, Store, StoreError,
};
use support::RedisServer;

const START: u64 = 1_700_000_000_000_000;
const SEC: Duration = Duration::from_secs(1);

/// A store on a fake clock, keeping its Redis server (if any) alive.
struct Subject {
    store: Box<dyn Store>,
    clock: FakeClock,
    _redis: Option<RedisServer>,
}

fn memory() -> Subject {
    let clock = FakeClock::new(START);
    Subject {
        store: Box::new(MemoryStore::builder().clock(clock.clone()).build()),
        clock,
        _redis: None,
    }
}

fn redis() -> Subject {
    let clock = FakeClock::new(START);
    let server = RedisServer::start();
    let store = RedisStore::builder(server.pool(4))
        .clock(clock.clone())
        .timeout(Duration::from_secs(5))
        .build();
    Subject {
        store: Box::new(store),
        clock,
        _redis: Some(server),
    }
}

impl Subject {
    async fn check(&self, policies: &[&Policy], key: &str) -> Vec<Decision> {
        self.try_check(policies, key).await.expect("store answers")
    }

    async fn try_check(
        &self,
        policies: &[&Policy],
        key: &str,
    ) -> Result<Vec<Decision>, StoreError> {
        let checks = policies
            .iter()
            .map(|p| Check::new(p, Key::new(key)))
            .collect();
        self.store.check(checks).await
    }

    async fn one(&self, policy: &Policy, key: &str) -> Decision {
        self.check(&[policy], key).await[0]
    }

    fn advance(&self, by: Duration) {
        self.clock.advance(by);
    }
}

/// Runs a scenario against both stores.
macro_rules! on_both_stores {
    ($scenario:ident) => {
        mod $scenario {
            #[tokio::test]
            async fn memory() {
                super::$scenario(super::memory()).await;
            }
            #[tokio::test]
            async fn redis() {
                super::$scenario(super::redis()).await;
            }
        }
    };
}

async fn window_slides_entry_by_entry(s: Subject) {
    let policy = Policy::new("slide", 3, 60 * SEC);
    for expected_remaining in [2, 1, 0] {
        let d = s.one(&policy, "alice").await;
        assert!(d.admitted);
        assert_eq!(d.remaining, expected_remaining);
        s.advance(10 * SEC);
    }
    // Now t = 30 s; entries at 0, 10, 20 s.
    let denied = s.one(&policy, "alice").await;
    assert!(!denied.admitted);
    assert_eq!(denied.remaining, 0);
    assert_eq!(denied.retry_after, Some(30 * SEC));
    assert_eq!(denied.reset, 30 * SEC);

    s.advance(30 * SEC - Duration::from_micros(1));
    let just_before = s.one(&policy, "alice").await;
    assert!(!just_before.admitted);
    assert_eq!(just_before.retry_after, Some(Duration::from_micros(1)));

    s.advance(Duration::from_micros(1));
    let at_edge = s.one(&policy, "alice").await;
    assert!(at_edge.admitted, "the entry at 0 s leaves at exactly 60 s");
    assert_eq!(at_edge.remaining, 0);
    assert_eq!(
        at_edge.reset,
        10 * SEC,
        "the oldest counted entry is at 10 s"
    );

    // Another client is untouched.
    assert_eq!(s.one(&policy, "bob").await.remaining, 2);
}
on_both_stores!(window_slides_entry_by_entry);

async fn weighted_cost_and_exact_retry_after(s: Subject) {
    let policy = Policy::new("weighted", 10, 60 * SEC).cost(4);
    assert_eq!(s.one(&policy, "k").await.remaining, 6);
    s.advance(5 * SEC);
    assert_eq!(s.one(&policy, "k").await.remaining, 2);
    s.advance(5 * SEC);
    // 8 of 10 used; 4 more need the entry at 0 s to leave: at 60 s.
    let denied = s.one(&policy, "k").await;
    assert!(!denied.admitted);
    assert_eq!(denied.remaining, 2, "a denied request consumes nothing");
    assert_eq!(denied.retry_after, Some(50 * SEC));
    // A cheaper request still fits in what is left.
    let cheap = Policy::new("weighted", 10, 60 * SEC).cost(2);
    let fits = s.one(&cheap, "k").await;
    assert!(fits.admitted);
    assert_eq!(fits.remaining, 0);
    // Now 4 + 4 + 2: a cost-4 request needs the first two entries gone.
    let denied = s.one(&policy, "k").await;
    assert_eq!(denied.retry_after, Some(50 * SEC));
    let big = Policy::new("weighted", 10, 60 * SEC).cost(10);
    let denied = s.one(&big, "k").await;
    assert_eq!(
        denied.retry_after,
        Some(60 * SEC),
        "all three entries must leave"
    );
}
on_both_stores!(weighted_cost_and_exact_retry_after);

async fn denied_requests_record_nothing(s: Subject) {
    let policy = Policy::new("flood", 5, 60 * SEC);
    for _ in 0..5 {
        assert!(s.one(&policy, "k").await.admitted);
    }
    for step in 0..200 {
        let d = s.one(&policy, "k").await;
        assert!(!d.admitted);
        assert_eq!(d.remaining, 0);
        assert_eq!(
            d.retry_after,
            Some(60 * SEC - step * Duration::from_millis(100))
        );
        s.advance(Duration::from_millis(100));
    }
    // 20 s of denied flood later, the window frees exactly when the first
    // five admitted requests leave.
    s.advance(40 * SEC - Duration::from_micros(1));
    assert!(!s.one(&policy, "k").await.admitted);
    s.advance(Duration::from_micros(1));
    let d = s.one(&policy, "k").await;
    assert!(d.admitted);
    assert_eq!(d.remaining, 4);
}
on_both_stores!(denied_requests_record_nothing);

async fn several_policies_are_all_or_nothing(s: Subject) {
    let endpoint = Policy::new("endpoint", 2, 60 * SEC);
    let account = Policy::new("account", 5, 3600 * SEC);
    for remaining in [(1, 4), (0, 3)] {
        let d = s.check(&[&endpoint, &account], "acct").await;
        assert!(d[0].admitted && d[1].admitted);
        assert_eq!((d[0].remaining, d[1].remaining), remaining);
    }
    let denied = s.check(&[&endpoint, &account], "acct").await;
    assert!(!denied[0].admitted && !denied[1].admitted);
    assert_eq!(denied[0].retry_after, Some(60 * SEC));
    assert_eq!(denied[1].retry_after, None, "the account policy had room");
    assert_eq!(denied[1].remaining, 3, "nothing was taken from the account");
    // The account budget is intact for another endpoint.
    let other = Policy::new("other", 10, 60 * SEC);
    let d = s.check(&[&other, &account], "acct").await;
    assert!(d[0].admitted);
    assert_eq!(d[1].remaining, 2);
}
on_both_stores!(several_policies_are_all_or_nothing);

/// A fixed-window counter with epoch-aligned windows, the algorithm the
/// boundary test shows leaking.
fn fixed_window_admits(trace: &[u64], limit: u32, window: u64) -> u32 {
    let mut current = (u64::MAX, 0u32);
    let mut admitted = 0;
    for &at in trace {
        let id = at / window;
        if current.0 != id {
            current = (id, 0);
        }
        if current.1 < limit {
            current.1 += 1;
            admitted += 1;
        }
    }
    admitted
}

async fn boundary_burst_admits_exactly_the_limit(s: Subject) {
    const L: u32 = 20;
    let window = 60 * SEC;
    let window_us = 60_000_000;
    let policy = Policy::new("boundary", L, window);
    // Move to 100 ms before an epoch-aligned window boundary.
    let boundary = (START / window_us + 1) * window_us;
    s.clock.set(boundary - 100_000);
    let mut trace = Vec::new();
    let mut admitted = 0;
    for phase in [boundary - 100_000, boundary + 100_000] {
        s.clock.set(phase);
        for _ in 0..L {
            trace.push(phase);
            admitted += u32::from(s.one(&policy, "burst").await.admitted);
        }
    }
    assert_eq!(admitted, L, "the sliding window holds across the boundary");
    assert_eq!(
        fixed_window_admits(&trace, L, window_us),
        2 * L,
        "a fixed window would have let twice the limit through"
    );
}
on_both_stores!(boundary_burst_admits_exactly_the_limit);

fn memory_with_handle(max_keys: usize) -> (Subject, MemoryStore) {
    let clock = FakeClock::new(START);
    let store = MemoryStore::builder()
        .clock(clock.clone())
        .max_keys(max_keys)
        .build();
    let subject = Subject {
        store: Box::new(store.clone()),
        clock,
        _redis: None,
    };
    (subject, store)
}

#[tokio::test]
async fn memory_store_evicts_idle_keys() {
    let (s, store) = memory_with_handle(1_000_000);
    let policy = Policy::new("idle", 1, 10 * SEC);
    for client in 0..1000 {
        s.one(&policy, &format!("c{client}")).await;
    }
    assert_eq!(store.len(), 1000);
    s.advance(10 * SEC - Duration::from_micros(1));
    assert_eq!(store.evict_idle(), 0, "entries still in the window stay");
    s.advance(Duration::from_micros(1));
    // New clients make shards sweep on their own as they grow.
    for client in 0..40_000 {
        s.one(&policy, &format!("n{client}")).await;
    }
    assert!(
        store.len() < 40_500,
        "the idle keys were swept on growth: {} left",
        store.len()
    );
    s.advance(10 * SEC);
    assert_eq!(store.evict_idle(), 40_000);
    assert!(store.is_empty());
}

#[tokio::test]
async fn memory_store_bounds_tracked_keys() {
    let (s, store) = memory_with_handle(640);
    let policy = Policy::new("bounded", 5, 60 * SEC);
    let mut full = 0;
    for client in 0..2000 {
        match s.try_check(&[&policy], &format!("c{client}")).await {
            Ok(_) => {}
            Err(StoreError::Full { max_keys }) => {
                assert_eq!(max_keys, 640);
                full += 1;
            }
            Err(other) => panic!("unexpected error {other}"),
        }
    }
    assert!(store.len() <= 640, "{} keys tracked", store.len());
    assert!(full >= 2000 - 640);
    // Known clients keep being counted while the store is full.
    let known = s.try_check(&[&policy], "c0").await.unwrap();
    assert_eq!(known[0].remaining, 3);
    // Once the window passes, idle keys make room again.
    s.advance(60 * SEC);
    assert!(s.try_check(&[&policy], "newcomer").await.is_ok());
}
