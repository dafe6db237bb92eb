//! Sliding-window semantics on a fake clock, run identically against
//! `MemoryStore` and a real `redis-server`.

use std::sync::Arc;
use std::time::Duration;

use crate::support::RedisServer;
use crate::support::stores::START;
use crate::support::stores::StoreUnderTest;
use slidegate::{
    Policy,
    clock::FakeClock,
    key::Key,
    policy::Algorithm,
    store::{Check, Decision, Decisions, MemoryStore, Store, StoreError},
};

const SEC: Duration = Duration::from_secs(1);
/// The longest window a policy may have (366 days, `PolicyError::WindowTooLong`).
const MAX_WINDOW: Duration = Duration::from_secs(366 * 86_400);

/// A store on a fake clock, keeping its Redis server (if any) alive.
pub(crate) struct Subject {
    pub(crate) store: Arc<dyn Store>,
    pub(crate) clock: FakeClock,
    _redis: Option<RedisServer>,
}

impl From<StoreUnderTest> for Subject {
    fn from(tested: StoreUnderTest) -> Self {
        Self {
            store: tested.store,
            clock: tested.clock.expect("a fake clock"),
            _redis: tested.redis,
        }
    }
}

impl Subject {
    pub(crate) async fn check(&self, policies: &[&Policy], key: &str) -> Decisions {
        self.try_check(policies, key).await.expect("store answers")
    }

    pub(crate) async fn try_check(
        &self,
        policies: &[&Policy],
        key: &str,
    ) -> Result<Decisions, StoreError> {
        let checks = policies
            .iter()
            .map(|p| Check::new(p, Key::new(key)).unwrap())
            .collect::<Vec<_>>();
        self.store.check(&checks).await
    }

    pub(crate) async fn one(&self, policy: &Policy, key: &str) -> Decision {
        self.check(&[policy], key).await[0]
    }

    /// The units left for `key` now, asked with a request costing more
    /// than the limit, which can never be admitted and so records nothing.
    pub(crate) async fn check_only(&self, policy: &Policy, key: &str) -> u32 {
        let mut probe = Check::new(policy, Key::new(key)).unwrap();
        probe = probe.with_cost(policy.limit() + 1);
        let d = self.store.check(&[probe]).await.expect("store answers")[0];
        assert!(!d.admitted(), "the probe must not be admitted");
        d.remaining()
    }

    pub(crate) fn advance(&self, by: Duration) {
        self.clock.advance(by);
    }
}

async fn window_slides_entry_by_entry(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    let policy = Policy::new("slide", 3, 60 * SEC);
    for expected_remaining in [2, 1, 0] {
        let d = s.one(&policy, "alice").await;
        assert!(d.admitted());
        assert_eq!(d.remaining(), expected_remaining);
        s.advance(10 * SEC);
    }
    // Now t = 30 s; entries at 0, 10, 20 s.
    let denied = s.one(&policy, "alice").await;
    assert!(!denied.admitted());
    assert_eq!(denied.remaining(), 0);
    assert_eq!(denied.retry_after(), Some(30 * SEC));
    assert_eq!(denied.reset(), 30 * SEC);

    s.advance(30 * SEC - Duration::from_micros(1));
    let just_before = s.one(&policy, "alice").await;
    assert!(!just_before.admitted());
    assert_eq!(just_before.retry_after(), Some(Duration::from_micros(1)));

    s.advance(Duration::from_micros(1));
    let at_edge = s.one(&policy, "alice").await;
    assert!(
        at_edge.admitted(),
        "the entry at 0 s leaves at exactly 60 s"
    );
    assert_eq!(at_edge.remaining(), 0);
    assert_eq!(
        at_edge.reset(),
        10 * SEC,
        "the oldest counted entry is at 10 s"
    );

    // Another client is untouched.
    assert_eq!(s.one(&policy, "bob").await.remaining(), 2);
}
on_both_stores!(window_slides_entry_by_entry, fake_clock);

async fn weighted_cost_and_exact_retry_after(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    let policy = Policy::new("weighted", 10, 60 * SEC).with_cost(4);
    assert_eq!(s.one(&policy, "k").await.remaining(), 6);
    s.advance(5 * SEC);
    assert_eq!(s.one(&policy, "k").await.remaining(), 2);
    s.advance(5 * SEC);
    // 8 of 10 used; 4 more need the entry at 0 s to leave: at 60 s.
    let denied = s.one(&policy, "k").await;
    assert!(!denied.admitted());
    assert_eq!(denied.remaining(), 2, "a denied request consumes nothing");
    assert_eq!(denied.retry_after(), Some(50 * SEC));
    // A cheaper request still fits in what is left.
    let cheap = Policy::new("weighted", 10, 60 * SEC).with_cost(2);
    let fits = s.one(&cheap, "k").await;
    assert!(fits.admitted());
    assert_eq!(fits.remaining(), 0);
    // Now 4 + 4 + 2: a cost-4 request needs the first two entries gone.
    let denied = s.one(&policy, "k").await;
    assert_eq!(denied.retry_after(), Some(50 * SEC));
    let big = Policy::new("weighted", 10, 60 * SEC).with_cost(10);
    let denied = s.one(&big, "k").await;
    assert_eq!(
        denied.retry_after(),
        Some(60 * SEC),
        "all three entries must leave"
    );
}
on_both_stores!(weighted_cost_and_exact_retry_after, fake_clock);

async fn denied_requests_record_nothing(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    let policy = Policy::new("flood", 5, 60 * SEC);
    for _ in 0..5 {
        assert!(s.one(&policy, "k").await.admitted());
    }
    for step in 0..200 {
        let d = s.one(&policy, "k").await;
        assert!(!d.admitted());
        assert_eq!(d.remaining(), 0);
        assert_eq!(
            d.retry_after(),
            Some(60 * SEC - step * Duration::from_millis(100))
        );
        s.advance(Duration::from_millis(100));
    }
    // 20 s of denied flood later, the window frees exactly when the first
    // admitted request leaves, and the others (recorded a microsecond
    // apart, as requests of one microsecond are) one by one after it.
    s.advance(40 * SEC - Duration::from_micros(1));
    assert!(!s.one(&policy, "k").await.admitted());
    for _ in 0..5 {
        s.advance(Duration::from_micros(1));
        let d = s.one(&policy, "k").await;
        assert!(d.admitted());
        assert_eq!(d.remaining(), 0);
    }
    let d = s.one(&policy, "k").await;
    assert!(!d.admitted());
    assert_eq!(
        d.retry_after(),
        Some(60 * SEC - 4 * Duration::from_micros(1))
    );
}
on_both_stores!(denied_requests_record_nothing, fake_clock);

async fn several_policies_are_all_or_nothing(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    let endpoint = Policy::new("endpoint", 2, 60 * SEC);
    let account = Policy::new("account", 5, 3600 * SEC);
    for remaining in [(1, 4), (0, 3)] {
        let d = s.check(&[&endpoint, &account], "acct").await;
        assert!(d[0].admitted() && d[1].admitted());
        assert_eq!((d[0].remaining(), d[1].remaining()), remaining);
    }
    let denied = s.check(&[&endpoint, &account], "acct").await;
    assert!(!denied[0].admitted() && !denied[1].admitted());
    assert_eq!(denied[0].retry_after(), Some(60 * SEC));
    assert_eq!(denied[1].retry_after(), None, "the account policy had room");
    assert_eq!(
        denied[1].remaining(),
        3,
        "nothing was taken from the account"
    );
    // The account budget is intact for another endpoint.
    let other = Policy::new("other", 10, 60 * SEC);
    let d = s.check(&[&other, &account], "acct").await;
    assert!(d[0].admitted());
    assert_eq!(d[1].remaining(), 2);
}
on_both_stores!(several_policies_are_all_or_nothing, fake_clock);

async fn boundary_burst_admits_exactly_the_limit(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    const L: u32 = 20;
    let window = 60 * SEC;
    let window_us = 60_000_000;
    let policy = |algorithm| Policy::new("boundary", L, window).with_algorithm(algorithm);
    // A burst of L 100 ms before an epoch-aligned window boundary and
    // another 100 ms after it.
    let boundary = (START / window_us + 1) * window_us;
    let mut admitted = [0; 3];
    for phase in [boundary - 100_000, boundary + 100_000] {
        s.clock.set(phase);
        for _ in 0..L {
            for (i, algorithm) in ALGORITHMS.into_iter().enumerate() {
                let key = format!("burst-{algorithm:?}");
                admitted[i] += u32::from(s.one(&policy(algorithm), &key).await.admitted());
            }
        }
    }
    let [log, counter, fixed] = admitted;
    assert_eq!(log, L, "the sliding log holds across the boundary");
    assert_eq!(counter, L, "the sliding counter holds too");
    assert_eq!(fixed, 2 * L, "a fixed window lets twice the limit through");
}
on_both_stores!(boundary_burst_admits_exactly_the_limit, fake_clock);

const ALGORITHMS: [Algorithm; 3] = [
    Algorithm::SlidingLog,
    Algorithm::SlidingCounter,
    Algorithm::FixedWindow,
];

/// For every algorithm: a denied request fits exactly `retry_after` later,
/// not a microsecond sooner, and `reset` is when capacity grows.
async fn retry_after_is_exact_for_every_algorithm(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    for algorithm in ALGORITHMS {
        let policy = Policy::new("exact", 10, 10 * SEC)
            .with_cost(3)
            .with_algorithm(algorithm);
        let key = format!("{algorithm:?}");
        // Spread three admissions over 7.3 s, then ask until denied.
        let mut denied = None;
        for _ in 0..10 {
            let d = s.one(&policy, &key).await;
            if !d.admitted() {
                denied = Some(d);
                break;
            }
            s.advance(Duration::from_millis(2433));
        }
        let denied = denied.expect("a cost-3 request is denied within 10 tries");
        let retry = denied.retry_after().expect("a denied request says when");
        assert!(retry > Duration::ZERO, "{algorithm:?}");
        s.advance(retry - Duration::from_micros(1));
        let early = s.one(&policy, &key).await;
        assert!(!early.admitted(), "{algorithm:?}: admitted 1 µs early");
        assert_eq!(
            early.retry_after(),
            Some(Duration::from_micros(1)),
            "{algorithm:?}"
        );
        s.advance(Duration::from_micros(1));
        assert!(
            s.one(&policy, &key).await.admitted(),
            "{algorithm:?}: not admitted at retry_after"
        );

        // Reset: capacity is the same a microsecond before and grows at it.
        let probe = Policy::new("exact", 10, 10 * SEC)
            .with_cost(1)
            .with_algorithm(algorithm);
        s.one(&probe, &format!("{key}-reset")).await;
        s.advance(SEC);
        let second = s.one(&probe, &format!("{key}-reset")).await;
        assert!(second.reset() > Duration::ZERO, "{algorithm:?}");
        s.advance(second.reset() - Duration::from_micros(1));
        let held = s.check_only(&probe, &format!("{key}-reset")).await;
        s.advance(Duration::from_micros(1));
        let grown = s.check_only(&probe, &format!("{key}-reset")).await;
        assert!(
            grown > held,
            "{algorithm:?}: remaining {held} before reset, {grown} at it"
        );
    }
}
on_both_stores!(retry_after_is_exact_for_every_algorithm, fake_clock);

/// The sliding counter's estimate: the previous window weighted by its
/// overlap, plus the current one.
async fn sliding_counter_weights_the_previous_window(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    let window_us = 60_000_000;
    let policy =
        Policy::new("weighted-counter", 10, 60 * SEC).with_algorithm(Algorithm::SlidingCounter);
    let start = (START / window_us + 1) * window_us;
    s.clock.set(start + 30_000_000);
    for _ in 0..10 {
        assert!(s.one(&policy, "c").await.admitted());
    }
    assert!(!s.one(&policy, "c").await.admitted());
    // 25% into the next window the 10 weigh 7.5: two more fit, not three.
    s.clock.set(start + window_us + 15_000_000);
    let d = s.one(&policy, "c").await;
    assert!(d.admitted());
    assert_eq!(d.remaining(), 1);
    assert!(s.one(&policy, "c").await.admitted());
    let denied = s.one(&policy, "c").await;
    assert!(!denied.admitted());
    // 10·(W − e)/W + 2 + 1 ≤ 10 once e ≥ 0.3·W: 3 s from now.
    assert_eq!(denied.retry_after(), Some(3 * SEC));
}
on_both_stores!(sliding_counter_weights_the_previous_window, fake_clock);

async fn mixed_algorithms_are_all_or_nothing(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    let log = Policy::new("mixed-log", 5, 60 * SEC);
    let counter =
        Policy::new("mixed-counter", 3, 60 * SEC).with_algorithm(Algorithm::SlidingCounter);
    let fixed = Policy::new("mixed-fixed", 4, 60 * SEC).with_algorithm(Algorithm::FixedWindow);
    for _ in 0..3 {
        let d = s.check(&[&log, &counter, &fixed], "m").await;
        assert!(d.iter().all(|d| d.admitted()));
    }
    let denied = s.check(&[&log, &counter, &fixed], "m").await;
    assert!(denied.iter().all(|d| !d.admitted()));
    assert!(denied[1].retry_after().is_some(), "the counter denied");
    assert_eq!((denied[0].remaining(), denied[2].remaining()), (2, 1));
    // Nothing was taken from the log or the fixed window.
    let d = s.check(&[&log, &fixed], "m").await;
    assert!(d[0].admitted() && d[1].admitted());
    assert_eq!((d[0].remaining(), d[1].remaining()), (1, 0));
}
on_both_stores!(mixed_algorithms_are_all_or_nothing, fake_clock);

fn memory_with_handle(max_keys: usize) -> (Subject, MemoryStore) {
    let clock = FakeClock::new(START);
    let store = MemoryStore::builder()
        .with_clock(clock.clone())
        .with_max_keys(max_keys)
        .build();
    let subject = Subject {
        store: Arc::new(store.clone()),
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
async fn memory_store_bounds_tracked_keys_and_never_refuses_a_check() {
    let (s, store) = memory_with_handle(640);
    let policy = Policy::new("bounded", 5, 60 * SEC);
    for client in 0..2000 {
        let decisions = s
            .try_check(&[&policy], &format!("c{client}"))
            .await
            .expect("a full memory store still decides");
        assert!(decisions[0].admitted());
        assert!(store.len() <= 640, "{} keys tracked", store.len());
    }
    assert!(store.len() > 600, "the bound is used: {}", store.len());
}

#[tokio::test]
async fn a_store_of_one_key_still_decides_batches_whole() {
    let (s, store) = memory_with_handle(1);
    let a = Policy::new("a", 2, 60 * SEC);
    let b = Policy::new("b", 1, 60 * SEC);
    let first = s.try_check(&[&a, &b], "k").await.unwrap();
    assert!(first.iter().all(|d| d.admitted()));
    assert_eq!(store.len(), 1);
    // `b` was pushed out by `a`, or the other way round: at worst one
    // more request is admitted, and every check is still answered.
    let second = s.try_check(&[&a, &b], "k").await.unwrap();
    assert_eq!(second.len(), 2);
    assert!(store.len() <= 1);
}

/// Redis expires keys on its own clock, which keeps running while a fake
/// clock stands still: counts written at an injected time must not vanish
/// before that time says their window is over.
#[tokio::test]
async fn redis_keeps_counts_while_its_own_clock_runs_ahead_of_an_injected_one() {
    let s = Subject::from(StoreUnderTest::redis(true));
    let log = Policy::new("still-log", 2, Duration::from_millis(2));
    let counter = Policy::new("still-counter", 2, Duration::from_millis(2))
        .with_algorithm(Algorithm::SlidingCounter);
    let fixed = Policy::new("still-fixed", 2, SEC).with_algorithm(Algorithm::FixedWindow);
    // 500 µs before the fixed window's end: its exact TTL would be 1 ms.
    s.advance(SEC - Duration::from_micros(500));
    for policy in [&log, &counter, &fixed] {
        let mut spend = Check::new(policy, Key::new("still")).unwrap();
        spend = spend.with_cost(2);
        assert!(s.store.check(&[spend]).await.unwrap()[0].admitted());
    }
    // Real time passes well beyond every exact TTL; the fake clock does not.
    tokio::time::sleep(Duration::from_millis(50)).await;
    for policy in [&log, &counter, &fixed] {
        let d = s.one(policy, "still").await;
        assert!(!d.admitted(), "{} forgot its count: {d:?}", policy.name());
    }
}

/// A check with the longest window a policy may have is counted by every
/// algorithm alike.
async fn the_longest_window_is_counted(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    for algorithm in [
        Algorithm::SlidingLog,
        Algorithm::SlidingCounter,
        Algorithm::FixedWindow,
    ] {
        let policy =
            Policy::new(format!("endless-{algorithm:?}"), 2, MAX_WINDOW).with_algorithm(algorithm);
        let check = Check::new(&policy, Key::new("forever")).unwrap();
        for expected in [true, true, false] {
            let decision = s.store.check(std::slice::from_ref(&check)).await.unwrap()[0];
            assert_eq!(decision.admitted(), expected, "{algorithm:?}: {decision:?}");
            // A sliding counter may wait into the next window.
            let longest = 2 * MAX_WINDOW;
            assert!(decision.reset() <= longest, "{algorithm:?}: {decision:?}");
            if !expected {
                let retry = decision.retry_after().expect("denied");
                assert!(
                    retry > SEC && retry <= longest,
                    "{algorithm:?}: {decision:?}"
                );
            }
        }
    }
}
on_both_stores!(the_longest_window_is_counted, fake_clock);

/// No check can be built that a store would divide by zero on, or that
/// the two stores would count apart: a fixed window of 0, a counter's
/// window under a millisecond or not in whole milliseconds (the script
/// counts in milliseconds), a window past the longest, a bucket or
/// counter past the precision of Redis's numbers.
#[test]
fn a_check_is_only_built_from_limits_both_stores_count_alike() {
    let key = || Key::new("k");
    let refused = [
        Policy::new("p", 2, Duration::ZERO).with_algorithm(Algorithm::FixedWindow),
        Policy::new("p", 2, Duration::from_micros(999)).with_algorithm(Algorithm::SlidingCounter),
        Policy::new("p", 2, Duration::from_micros(1_500)).with_algorithm(Algorithm::SlidingCounter),
        Policy::new("p", 2, Duration::MAX),
        Policy::new("p", u32::MAX, 7_200 * SEC).with_algorithm(Algorithm::TokenBucket),
        Policy::new("p", 4_000_000_000, 86_400 * SEC).with_algorithm(Algorithm::SlidingCounter),
        Policy::new("p", 0, SEC),
    ];
    for policy in refused {
        assert!(Check::new(&policy, key()).is_err(), "{policy:?}");
    }
    let fine =
        Policy::new("p", 2, Duration::from_micros(1_500)).with_algorithm(Algorithm::FixedWindow);
    assert_eq!(
        Check::new(&fine, key()).unwrap().window(),
        Duration::from_micros(1_500)
    );
}

/// A clock that steps back 2 ms across a window boundary (NTP, a failover
/// to a skewed node) never resets a count: within 3 ms, no algorithm
/// admits more than its limit.
async fn a_clock_stepping_back_across_a_boundary_never_resets_a_count(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    for algorithm in [
        Algorithm::SlidingLog,
        Algorithm::SlidingCounter,
        Algorithm::FixedWindow,
    ] {
        let policy = Policy::new(format!("step-{algorithm:?}"), 5, SEC).with_algorithm(algorithm);
        // 1 ms past a whole second: a window boundary for the counters.
        let boundary = (START / 1_000_000 + 10) * 1_000_000;
        let mut admitted = 0;
        for at in [boundary + 1_000, boundary - 1_000, boundary + 2_000] {
            s.clock.set(at);
            for _ in 0..5 {
                admitted += usize::from(s.one(&policy, "stepper").await.admitted());
            }
        }
        assert_eq!(admitted, 5, "{algorithm:?} admitted {admitted} within 3 ms");
        // And the wait it reports is from the real (earlier) time.
        s.clock.set(boundary - 1_000);
        let denied = s.one(&policy, "stepper").await;
        assert!(
            denied.retry_after().unwrap() > Duration::from_millis(2),
            "{algorithm:?}: {denied:?}"
        );
    }
}
on_both_stores!(
    a_clock_stepping_back_across_a_boundary_never_resets_a_count,
    fake_clock
);

/// A clock that steps back by an hour, far more than a window, keeps each
/// client's count, and holds it no longer than two windows of the new
/// time (not until real time catches up an hour later).
async fn a_clock_stepping_back_by_an_hour_holds_a_count_two_windows_at_most(
    tested: StoreUnderTest,
) {
    let s = Subject::from(tested);
    for algorithm in [
        Algorithm::SlidingLog,
        Algorithm::SlidingCounter,
        Algorithm::FixedWindow,
    ] {
        let policy = Policy::new(format!("leap-{algorithm:?}"), 5, SEC).with_algorithm(algorithm);
        let at = START + 3_600_000_000 + 250_000;
        s.clock.set(at);
        for _ in 0..5 {
            assert!(s.one(&policy, "leaper").await.admitted(), "{algorithm:?}");
        }
        s.clock.set(at - 3_600_000_000);
        for _ in 0..5 {
            let denied = s.one(&policy, "leaper").await;
            assert!(
                !denied.admitted(),
                "{algorithm:?} forgot its count: {denied:?}"
            );
            assert!(
                denied.retry_after().unwrap() <= 2 * SEC,
                "{algorithm:?}: {denied:?}"
            );
        }
        s.advance(2 * SEC);
        for _ in 0..5 {
            let decision = s.one(&policy, "leaper").await;
            assert!(
                decision.admitted(),
                "{algorithm:?} still held: {decision:?}"
            );
        }
    }
}
on_both_stores!(
    a_clock_stepping_back_by_an_hour_holds_a_count_two_windows_at_most,
    fake_clock
);

/// A policy whose window changes between requests of one client (a tier
/// with its own window, a client whose tier changes) keeps the client's
/// count: alternating windows never resets it, for any algorithm, and the
/// count still leaves once nothing more is admitted (the counters estimate
/// when, as they do under one window).
async fn a_window_that_changes_between_requests_keeps_the_count(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    for algorithm in [
        Algorithm::SlidingLog,
        Algorithm::SlidingCounter,
        Algorithm::FixedWindow,
    ] {
        let name = format!("tiered-{algorithm:?}");
        let windows = [
            Policy::new(name.clone(), 5, 60 * SEC).with_algorithm(algorithm),
            Policy::new(name.clone(), 5, 120 * SEC).with_algorithm(algorithm),
            Policy::new(name, 5, 45 * SEC).with_algorithm(algorithm),
        ];
        let mut admitted = 0;
        for i in 0..24 {
            let decision = s.one(&windows[i % 3], "switcher").await;
            admitted += usize::from(decision.admitted());
            s.advance(Duration::from_millis(250));
        }
        assert_eq!(
            admitted, 5,
            "{algorithm:?} admitted {admitted} of 24 within 6 s"
        );
        // Denied requests keep coming under every window; the count still
        // leaves within two of the longest windows.
        let mut freed_after = None;
        for second in 0..=240 {
            let decision = s.one(&windows[second % 3], "switcher").await;
            if decision.admitted() {
                freed_after = Some(second);
                break;
            }
            s.advance(SEC);
        }
        let freed_after = freed_after.unwrap_or_else(|| panic!("{algorithm:?} never let go"));
        if algorithm == Algorithm::SlidingLog {
            // Exact: the first units leave the shortest window after 45 s.
            assert!(freed_after >= 38, "the log let go after {freed_after} s");
        }
    }
}
on_both_stores!(
    a_window_that_changes_between_requests_keeps_the_count,
    fake_clock
);

/// A tier with a shorter window never erases what a longer one counted:
/// limit 5 a minute, 5 requests, one a second later under a one-second
/// burst tier (the same policy and key), then the minute tier again is
/// still full. The log keeps records for the longest window it has been
/// counted under.
async fn a_shorter_window_tier_never_erases_a_longer_ones_count(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    let minute = Policy::new("tiered", 5, 60 * SEC);
    let burst = Policy::new("tiered", 5, SEC);
    for _ in 0..5 {
        assert!(s.one(&minute, "k").await.admitted());
    }
    s.advance(SEC);
    assert!(
        s.one(&burst, "k").await.admitted(),
        "the burst tier sees one second"
    );
    s.advance(SEC);
    let d = s.one(&minute, "k").await;
    assert!(!d.admitted(), "the minute tier still sees all six: {d:?}");
    assert_eq!(d.remaining(), 0);
    // Two must leave for it to fit: the second of the five, recorded a
    // microsecond after the first, leaves the minute 58 s and 1 µs on.
    assert_eq!(d.retry_after(), Some(58 * SEC + Duration::from_micros(1)));
}
on_both_stores!(
    a_shorter_window_tier_never_erases_a_longer_ones_count,
    fake_clock
);

/// A cost above the limit never fits, on any algorithm: the denial says
/// to wait a whole window, never 0 (which a client would take as "retry
/// at once", forever).
async fn a_cost_above_the_limit_waits_a_window(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    for algorithm in [Algorithm::SlidingLog, Algorithm::FixedWindow] {
        let policy = Policy::new(format!("{algorithm:?}"), 3, 10 * SEC).with_algorithm(algorithm);
        let mut check = Check::new(&policy, Key::new("k")).unwrap();
        check = check.with_cost(4);
        for _ in 0..2 {
            let d = s.store.check(std::slice::from_ref(&check)).await.unwrap()[0];
            assert!(!d.admitted(), "{algorithm:?}");
            assert!(
                d.retry_after()
                    .is_some_and(|wait| wait > Duration::ZERO && wait <= 10 * SEC),
                "{algorithm:?}: {d:?}"
            );
            // With records in the window, the same.
            assert!(s.one(&policy, "k").await.admitted());
        }
    }
    let policy = Policy::new("log-window", 3, 10 * SEC);
    let mut check = Check::new(&policy, Key::new("k")).unwrap();
    check = check.with_cost(4);
    let d = s.store.check(std::slice::from_ref(&check)).await.unwrap()[0];
    assert_eq!(d.retry_after(), Some(10 * SEC));
}
on_both_stores!(a_cost_above_the_limit_waits_a_window, fake_clock);

/// Refunding one request twice takes its units back once: the second
/// refund names a record that is gone, and takes nothing from the others
/// (even those recorded in the same microsecond, with the same cost).
async fn a_second_refund_of_one_request_takes_nothing(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    let policy = Policy::new("refunds", 3, 60 * SEC);
    let check = [Check::new(&policy, Key::new("k")).unwrap()];
    let mut recorded = Vec::new();
    for _ in 0..3 {
        let d = s.store.check(&check).await.unwrap()[0];
        recorded.push(d.recorded_at().expect("recorded"));
    }
    assert_eq!(
        recorded[1] - recorded[0],
        Duration::from_micros(1),
        "one microsecond apart"
    );
    for _ in 0..2 {
        s.store.refund(&check, &recorded[1..2]).await.unwrap();
    }
    let peek = s.store.peek(&check).await.unwrap()[0];
    assert_eq!(peek.remaining(), 1, "one request's units came back, once");
}
on_both_stores!(a_second_refund_of_one_request_takes_nothing, fake_clock);

/// A refund of a request that has left the window takes nothing and
/// fails nothing, whatever the key's TTL was set for, and the other
/// policies of the same refund still take theirs back.
async fn a_refund_of_a_gone_request_takes_nothing_and_the_rest_still_runs(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    let short = Policy::new("short", 1, 10 * SEC);
    let long = Policy::new("long", 1, 3600 * SEC);
    let checks = [
        Check::new(&short, Key::new("k")).unwrap(),
        Check::new(&long, Key::new("k")).unwrap(),
    ];
    let d = s.store.check(&checks).await.unwrap();
    let recorded: Vec<Duration> = d.iter().map(|d| d.recorded_at().unwrap()).collect();
    // Long past the short window, and past the minute of grace the keys'
    // TTLs get with an injected clock.
    s.advance(100 * SEC);
    s.store.refund(&checks, &recorded).await.expect("no error");
    let d = s.store.check(&checks[1..]).await.unwrap()[0];
    assert!(d.admitted(), "the long policy's unit came back: {d:?}");
}
on_both_stores!(
    a_refund_of_a_gone_request_takes_nothing_and_the_rest_still_runs,
    fake_clock
);

/// A tier whose burst is below the debt the client already owes (spent
/// under a larger burst) reports 0 remaining, never a negative count, and
/// the same reset on both stores: when one unit fits the smaller bucket.
async fn a_burst_lowered_below_the_debt_leaves_nothing(tested: StoreUnderTest) {
    use slidegate::policy::TierLimits;
    let s = Subject::from(tested);
    let policy = Policy::new("lowered", 10, 10 * SEC)
        .with_algorithm(Algorithm::TokenBucket)
        .with_tier("small", TierLimits::new().with_burst(2));
    let spend = Check::new(&policy, Key::new("k")).unwrap().with_cost(10);
    assert!(s.store.check(&[spend]).await.unwrap()[0].admitted());
    let small = Check::for_tier(&policy, Key::new("k"), Some("small")).unwrap();
    let d = s.store.check(&[small]).await.unwrap()[0];
    assert!(!d.admitted());
    assert_eq!((d.limit(), d.remaining()), (2, 0));
    // A debt of 10 units in a bucket of 2: 9 must refill, one a second.
    assert_eq!(d.reset(), 9 * SEC);
    assert_eq!(d.retry_after(), Some(9 * SEC));
}
on_both_stores!(a_burst_lowered_below_the_debt_leaves_nothing, fake_clock);

/// Tiers with windows of their own on one log: a tier of 10 a second
/// begins the log, and a tier of 10 per 10 seconds then sees every record
/// its window covers, though the short tier alone would have let them
/// leave. Ten requests as the short tier over three seconds leave the
/// long one nothing.
async fn a_longer_tier_sees_records_a_shorter_one_began(tested: StoreUnderTest) {
    use slidegate::policy::TierLimits;
    let s = Subject::from(tested);
    let policy =
        Policy::new("tiered", 10, SEC).with_tier("long", TierLimits::new().with_window(10 * SEC));
    let short = Check::new(&policy, Key::new("k")).unwrap();
    let long = Check::for_tier(&policy, Key::new("k"), Some("long")).unwrap();
    for _ in 0..10 {
        let d = s.store.check(std::slice::from_ref(&short)).await.unwrap()[0];
        assert!(d.admitted(), "{d:?}");
        s.advance(SEC * 3 / 10);
    }
    let d = s.store.check(std::slice::from_ref(&long)).await.unwrap()[0];
    assert!(!d.admitted(), "ten units lie in the long window: {d:?}");
    assert_eq!(d.remaining(), 0);
    // The first of them leaves ten seconds after it came.
    assert_eq!(d.retry_after(), Some(10 * SEC - 3 * SEC));
    // The short tier still counts only its own second.
    let d = s.store.check(std::slice::from_ref(&short)).await.unwrap()[0];
    assert!(d.admitted(), "{d:?}");
    assert_eq!(d.remaining(), 6);
}
on_both_stores!(a_longer_tier_sees_records_a_shorter_one_began, fake_clock);

/// A log that fits a request now, held for another policy's delay,
/// records it at the time it passes; a later check of that log alone
/// must not take that record for a clock that stepped back and move it
/// to now, which would let it leave the window before the request even
/// passed.
async fn a_record_held_for_another_policy_stays_where_it_passes(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    let quick = Policy::new("quick", 1, SEC);
    let slow = Policy::new("slow", 1, 6 * SEC).with_delay(5 * SEC);
    assert!(s.check(&[&quick, &slow], "k").await[0].admitted());
    s.advance(SEC * 3 / 2);
    let held = s.check(&[&quick, &slow], "k").await;
    assert!(held[0].admitted());
    assert_eq!(held[0].delayed_for(), Some(SEC * 9 / 2), "passes at 6 s");
    s.advance(SEC / 2);
    assert!(
        !s.one(&quick, "k").await.admitted(),
        "2 s: the record at 6 s counts"
    );
    s.advance(SEC * 21 / 5);
    let late = s.one(&quick, "k").await;
    assert!(
        !late.admitted(),
        "6.2 s: the held request passed at 6 s: {late:?}"
    );
}
on_both_stores!(
    a_record_held_for_another_policy_stays_where_it_passes,
    fake_clock
);

/// A key that holds units of a request held into its next window, then
/// counted under another window length (a tier with a window of its own,
/// or a reload), could not keep those units until the request passes: it
/// denies every request until the window the held one passes in has
/// ended, rather than forget them.
async fn held_units_survive_a_change_of_window_length(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    for algorithm in [Algorithm::FixedWindow, Algorithm::SlidingCounter] {
        let name = format!("{algorithm:?}");
        let long = Policy::new(name.clone(), 2, 10 * SEC)
            .with_algorithm(algorithm)
            .with_delay(20 * SEC);
        let short = Policy::new(name, 1, SEC).with_algorithm(algorithm);
        for _ in 0..2 {
            assert!(s.one(&long, "k").await.admitted());
        }
        s.advance(SEC);
        let held = s.one(&long, "k").await;
        let wait = held.delayed_for().expect("held into the next window");
        s.advance(SEC / 2);
        let meanwhile = s.one(&short, "k").await;
        assert!(!meanwhile.admitted(), "{algorithm:?}: {meanwhile:?}");
        // When the held request passes, the shorter window still counts it.
        s.advance(wait - SEC / 2);
        let beside = s.one(&short, "k").await;
        assert!(!beside.admitted(), "{algorithm:?}: {beside:?}");
        s.advance(60 * SEC);
    }
}
on_both_stores!(held_units_survive_a_change_of_window_length, fake_clock);

/// The same for a token bucket: re-measured under another window, its
/// debt would be clamped to the burst and forget what held requests
/// added; it denies until the last of them has passed.
async fn a_bucket_holding_requests_keeps_them_across_a_change_of_window(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    let bucket = |limit: u32, window: Duration| {
        Policy::new("bucket", limit, window)
            .with_algorithm(Algorithm::TokenBucket)
            .with_burst(1)
            .with_delay(5 * SEC)
    };
    let (second, two_seconds) = (bucket(1, SEC), bucket(2, 2 * SEC));
    assert!(s.one(&second, "k").await.admitted());
    for expected in [SEC, 2 * SEC] {
        assert_eq!(s.one(&second, "k").await.delayed_for(), Some(expected));
    }
    s.advance(SEC / 2);
    // The same rate, another window: nothing passes beside the held two.
    let d = s.one(&two_seconds, "k").await;
    assert!(!d.admitted(), "{d:?}");
    assert_eq!(d.retry_after(), Some(SEC * 3 / 2));
}
on_both_stores!(
    a_bucket_holding_requests_keeps_them_across_a_change_of_window,
    fake_clock
);
