//! The limits beyond the sliding window, on both stores: the token
//! bucket, the block after a denial, and resetting a client.

use std::sync::Arc;
use std::time::Duration;

use crate::support::stores::StoreUnderTest;
use crate::window::Subject;
use slidegate::{
    Policy,
    key::Key,
    policy::Algorithm,
    store::{Check, Store},
};

const SEC: Duration = Duration::from_secs(1);
const MS: Duration = Duration::from_millis(1);

/// `limit` a second, in a bucket of `burst`.
fn bucket(limit: u32, burst: u32) -> Policy {
    Policy::new("bucket", limit, SEC)
        .with_algorithm(Algorithm::TokenBucket)
        .with_burst(burst)
}

async fn a_token_bucket_spends_its_burst_then_refills_at_its_rate(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    let policy = bucket(10, 20);
    for left in (0..20).rev() {
        let d = s.one(&policy, "k").await;
        assert!(d.admitted());
        assert_eq!(
            (d.limit(), d.remaining()),
            (20, left),
            "the burst is the limit"
        );
    }
    let denied = s.one(&policy, "k").await;
    assert!(!denied.admitted());
    assert_eq!(
        denied.retry_after(),
        Some(100 * MS),
        "one unit refills in 100 ms"
    );
    assert_eq!(denied.reset(), 100 * MS);
    s.advance(100 * MS - Duration::from_micros(1));
    assert!(!s.one(&policy, "k").await.admitted());
    s.advance(Duration::from_micros(1));
    assert!(s.one(&policy, "k").await.admitted());
    assert!(!s.one(&policy, "k").await.admitted());
    // A second refills ten units, never more than the burst.
    s.advance(SEC);
    for _ in 0..10 {
        assert!(s.one(&policy, "k").await.admitted());
    }
    assert!(!s.one(&policy, "k").await.admitted());
    s.advance(60 * SEC);
    assert_eq!(s.one(&policy, "k").await.remaining(), 19);
}
on_both_stores!(
    a_token_bucket_spends_its_burst_then_refills_at_its_rate,
    fake_clock
);

async fn a_token_bucket_retries_when_the_whole_cost_fits(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    let big = bucket(10, 20).with_cost(15);
    let small = bucket(10, 20).with_cost(4);
    assert_eq!(s.one(&big, "k").await.remaining(), 5);
    assert_eq!(s.one(&small, "k").await.remaining(), 1);
    let denied = s.one(&big, "k").await;
    assert!(!denied.admitted());
    assert_eq!(denied.remaining(), 1, "a denied request takes nothing");
    // 14 more units: 1.4 s at 10 a second.
    assert_eq!(denied.retry_after(), Some(1400 * MS));
    s.advance(1400 * MS);
    assert!(s.one(&big, "k").await.admitted());
    // A rate that is no whole number of µs a unit stays exact: three a
    // second is 333,333⅓ µs a unit, so one unit is back after 333,334 µs.
    let thirds = bucket(3, 1);
    assert!(s.one(&thirds, "t").await.admitted());
    let denied = s.one(&thirds, "t").await;
    assert_eq!(denied.retry_after(), Some(Duration::from_micros(333_334)));
    s.advance(Duration::from_micros(333_333));
    assert!(!s.one(&thirds, "t").await.admitted());
    s.advance(Duration::from_micros(1));
    assert!(s.one(&thirds, "t").await.admitted());
    // A client that comes back exactly at each retry time gets one unit
    // every 333,334 µs (whole µs, rounded up): 179 within the next
    // minute, never more than three a second.
    let mut admitted = 0;
    let mut elapsed = Duration::ZERO;
    while elapsed < 60 * SEC {
        let d = s.one(&thirds, "t").await;
        match d.retry_after() {
            None => admitted += 1,
            Some(wait) => {
                s.advance(wait);
                elapsed += wait;
            }
        }
    }
    assert_eq!(admitted, 179);
}
on_both_stores!(a_token_bucket_retries_when_the_whole_cost_fits, fake_clock);

/// 600 requests at once on one bucket: exactly the burst is admitted.
async fn a_token_bucket_admits_exactly_its_burst_under_concurrency(tested: StoreUnderTest) {
    let s = Arc::new(Subject::from(tested));
    let policy = Arc::new(bucket(1, 50));
    let tasks: Vec<_> = (0..600)
        .map(|_| {
            let (s, policy) = (s.clone(), policy.clone());
            tokio::spawn(async move { s.one(&policy, "crowd").await.admitted() })
        })
        .collect();
    let mut admitted = 0;
    for task in tasks {
        admitted += u32::from(task.await.unwrap());
    }
    assert_eq!(admitted, 50);
}
on_both_stores!(
    a_token_bucket_admits_exactly_its_burst_under_concurrency,
    fake_clock
);

async fn a_denial_blocks_the_client_for_the_block_time(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    let login = Policy::new("login", 3, 60 * SEC).with_block(600 * SEC);
    for _ in 0..3 {
        assert!(s.one(&login, "mallory").await.admitted());
    }
    let denied = s.one(&login, "mallory").await;
    assert!(!denied.admitted());
    assert_eq!(
        denied.retry_after(),
        Some(600 * SEC),
        "blocked from the denial"
    );
    // The window has long emptied, but the block holds.
    s.advance(120 * SEC);
    let blocked = s.one(&login, "mallory").await;
    assert!(!blocked.admitted());
    assert_eq!(blocked.remaining(), 0);
    assert_eq!(blocked.retry_after(), Some(480 * SEC));
    // Requests during the block do not extend it.
    s.advance(480 * SEC - MS);
    assert!(!s.one(&login, "mallory").await.admitted());
    s.advance(MS);
    let free = s.one(&login, "mallory").await;
    assert!(free.admitted());
    assert_eq!(free.remaining(), 2);
    // Another client was never blocked.
    assert!(s.one(&login, "alice").await.admitted());
}
on_both_stores!(a_denial_blocks_the_client_for_the_block_time, fake_clock);

/// A request another policy denies is no denial of the blocking policy:
/// only its own count blocks.
async fn only_a_policys_own_denial_blocks(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    let blocking = Policy::new("blocking", 10, 60 * SEC).with_block(600 * SEC);
    let tight = Policy::new("tight", 1, 60 * SEC);
    let both = [&blocking, &tight];
    assert!(s.check(&both, "k").await[0].admitted());
    let denied = s.check(&both, "k").await;
    assert!(!denied[0].admitted());
    assert_eq!(denied[0].retry_after(), None, "the blocking policy fits");
    assert_eq!(denied[1].retry_after(), Some(60 * SEC));
    // The blocking policy alone still admits.
    let alone = s.one(&blocking, "k").await;
    assert!(alone.admitted());
    assert_eq!(alone.remaining(), 8);
}
on_both_stores!(only_a_policys_own_denial_blocks, fake_clock);

async fn a_reset_forgets_the_count_and_the_block(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    let policies = [
        Policy::new("log", 2, 60 * SEC).with_block(600 * SEC),
        Policy::new("counter", 2, 60 * SEC).with_algorithm(Algorithm::SlidingCounter),
        Policy::new("fixed", 2, 60 * SEC).with_algorithm(Algorithm::FixedWindow),
        bucket(1, 2),
    ];
    for policy in &policies {
        for _ in 0..3 {
            s.one(policy, "k").await;
        }
        let checks = [Check::new(policy, Key::new("k")).unwrap()];
        let other = [Check::new(policy, Key::new("other")).unwrap()];
        s.one(policy, "other").await;
        let peeked = s.store.peek(&checks).await.unwrap()[0];
        assert!(!peeked.admitted(), "{}", policy.name());
        s.store.reset(&checks).await.unwrap();
        let peeked = s.store.peek(&checks).await.unwrap()[0];
        assert!(peeked.admitted(), "{}: {peeked:?}", policy.name());
        assert_eq!(peeked.remaining(), 2, "{}", policy.name());
        // Another client keeps its count.
        let kept = s.store.peek(&other).await.unwrap()[0];
        assert_eq!(kept.remaining(), 1, "{}", policy.name());
        // A reset of a client never seen is no error.
        let unknown = [Check::new(policy, Key::new("unknown")).unwrap()];
        s.store.reset(&unknown).await.unwrap();
    }
}
on_both_stores!(a_reset_forgets_the_count_and_the_block, fake_clock);
