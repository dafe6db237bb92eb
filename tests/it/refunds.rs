//! A refund gives back only what the refunded request still holds, on
//! every algorithm and both stores: units the window (or the bucket's
//! refill) already gave back are never given twice.

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

/// A token bucket of 1 a second, burst 1, that refunds every admitted
/// request long after it was made (as `count = "failures"` does for a
/// slow successful login): each refund comes after the bucket refilled
/// those units, so it gives back nothing, and a request right after each
/// refund is denied but the first.
async fn a_late_refund_never_grows_a_buckets_burst(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    let policy = Policy::new("login", 1, SEC)
        .with_algorithm(Algorithm::TokenBucket)
        .with_burst(1);
    let check = [Check::new(&policy, Key::new("mallory")).unwrap()];
    let mut held = Vec::new();
    for _ in 0..8 {
        let d = s.store.check(&check).await.unwrap()[0];
        assert!(d.admitted, "one a second fits: {d:?}");
        held.push(d.recorded_at.expect("a bucket names its units"));
        s.advance(SEC);
    }
    let mut admitted = 0;
    for recorded in held {
        s.store.refund(&check, &[recorded]).await.unwrap();
        if s.store.check(&check).await.unwrap()[0].admitted {
            admitted += 1;
        }
    }
    assert_eq!(
        admitted, 1,
        "the bucket's burst of 1, whatever was refunded"
    );
}
on_both_stores!(a_late_refund_never_grows_a_buckets_burst, fake_clock);

/// A refund of a bucket's request gives back what it may still owe,
/// counted as if its units were the first of the debt (so never more than
/// it holds): all of them at once, part of them part way, none once they
/// would have been repaid.
async fn a_bucket_refund_gives_back_what_is_still_owed(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    // One unit a second, in a bucket of 10; each request costs 4.
    let policy = Policy::new("owed", 10, 10 * SEC)
        .with_algorithm(Algorithm::TokenBucket)
        .with_burst(10)
        .with_cost(4);
    let check = [Check::new(&policy, Key::new("k")).unwrap()];
    let first = s.store.check(&check).await.unwrap()[0];
    let second = s.store.check(&check).await.unwrap()[0];
    assert_eq!(second.remaining, 2);
    // At once: the second request's 4 units come back whole.
    s.store
        .refund(&check, &[second.recorded_at.unwrap()])
        .await
        .unwrap();
    assert_eq!(s.store.peek(&check).await.unwrap()[0].remaining, 6);
    let third = s.store.check(&check).await.unwrap()[0];
    assert_eq!(third.remaining, 2);
    // 2 s on, 2 units have refilled: the third gives back the 2 of its 4
    // not yet repaid, had it been first.
    s.advance(2 * SEC);
    assert_eq!(s.store.peek(&check).await.unwrap()[0].remaining, 4);
    s.store
        .refund(&check, &[third.recorded_at.unwrap()])
        .await
        .unwrap();
    assert_eq!(s.store.peek(&check).await.unwrap()[0].remaining, 6);
    // 5 s on, the first would have been repaid: nothing comes back.
    s.advance(3 * SEC);
    s.store
        .refund(&check, &[first.recorded_at.unwrap()])
        .await
        .unwrap();
    assert_eq!(s.store.peek(&check).await.unwrap()[0].remaining, 9);
}
on_both_stores!(a_bucket_refund_gives_back_what_is_still_owed, fake_clock);

/// A refund ahead of a request never lets that request's own refund take
/// a later request's units: A and B at once, A refunded half way, C, then
/// B refunded once it is repaid gives back nothing of C's.
async fn a_refund_ahead_never_makes_a_later_refund_take_more(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    let policy = Policy::new("ahead", 1, SEC)
        .with_algorithm(Algorithm::TokenBucket)
        .with_burst(2);
    let check = [Check::new(&policy, Key::new("k")).unwrap()];
    let a = s.store.check(&check).await.unwrap()[0];
    let b = s.store.check(&check).await.unwrap()[0];
    s.advance(SEC / 2);
    s.store
        .refund(&check, &[a.recorded_at.unwrap()])
        .await
        .unwrap();
    assert!(s.store.check(&check).await.unwrap()[0].admitted, "C");
    s.advance(SEC);
    s.store
        .refund(&check, &[b.recorded_at.unwrap()])
        .await
        .unwrap();
    // C's unit is owed whole: two units fit only a second from now.
    let two = [check[0].clone().with_cost(2)];
    let d = s.store.peek(&two).await.unwrap()[0];
    assert_eq!(d.retry_after, Some(SEC), "{d:?}");
}
on_both_stores!(
    a_refund_ahead_never_makes_a_later_refund_take_more,
    fake_clock
);

/// The same rule on every algorithm that counts in a window: once a
/// request's units have left the window, its refund gives back nothing,
/// so a refunded request never makes room for one more than the limit.
async fn a_refund_after_the_window_gives_back_nothing(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    for algorithm in [
        Algorithm::SlidingLog,
        Algorithm::SlidingCounter,
        Algorithm::FixedWindow,
        Algorithm::TokenBucket,
    ] {
        let policy = Policy::new(format!("{algorithm:?}"), 2, 10 * SEC).with_algorithm(algorithm);
        let check = [Check::new(&policy, Key::new("k")).unwrap()];
        let early = s.store.check(&check).await.unwrap()[0];
        // Two windows on: every algorithm has let the early request go.
        s.advance(20 * SEC);
        for _ in 0..2 {
            assert!(
                s.store.check(&check).await.unwrap()[0].admitted,
                "{algorithm:?}"
            );
        }
        s.store
            .refund(&check, &[early.recorded_at.unwrap()])
            .await
            .unwrap();
        let d = s.store.check(&check).await.unwrap()[0];
        assert!(
            !d.admitted,
            "{algorithm:?}: the refund of a gone request made room: {d:?}"
        );
        s.advance(20 * SEC);
    }
}
on_both_stores!(a_refund_after_the_window_gives_back_nothing, fake_clock);

/// A policy reloaded as another algorithm while requests counted by the
/// old one are in flight: their refunds (and lease releases) take nothing
/// from the new counts, which stay as they are, on both stores.
async fn a_refund_from_before_an_algorithm_change_keeps_the_new_counts(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    let old_log = Policy::new("switched", 3, 10 * SEC);
    let old_lease = Policy::concurrency("switched", 3);
    let new_bucket = Policy::new("switched", 3, 10 * SEC).with_algorithm(Algorithm::TokenBucket);
    let mut in_flight = Vec::new();
    for policy in [&old_log, &old_lease] {
        let check = Check::new(policy, Key::new("k")).unwrap();
        let d = s.store.check(std::slice::from_ref(&check)).await.unwrap()[0];
        assert!(d.admitted, "{d:?}");
        in_flight.push((check, d.recorded_at.expect("recorded")));
    }
    let bucket = [Check::new(&new_bucket, Key::new("k")).unwrap()];
    for _ in 0..2 {
        assert!(s.store.check(&bucket).await.unwrap()[0].admitted);
    }
    for (check, recorded) in in_flight {
        s.store.refund(&[check], &[recorded]).await.unwrap();
    }
    let d = s.store.check(&bucket).await.unwrap()[0];
    assert!(d.admitted);
    assert_eq!(d.remaining, 0, "the bucket kept its two requests: {d:?}");
    assert!(!s.store.check(&bucket).await.unwrap()[0].admitted);
}
on_both_stores!(
    a_refund_from_before_an_algorithm_change_keeps_the_new_counts,
    fake_clock
);

/// A token bucket keeps the units of a held request whose client leaves
/// before it passes: held requests pass at times fixed when they were
/// recorded, and debt taken back from ahead of them would let a new
/// request take a slot beside the last of them.
async fn a_bucket_keeps_the_units_of_a_held_request_that_leaves(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    // 3 a second, in a bucket of 2, held up to 1.2 s.
    let policy = Policy::new("held", 3, SEC)
        .with_algorithm(Algorithm::TokenBucket)
        .with_burst(2)
        .with_delay(SEC * 6 / 5);
    let check = [Check::new(&policy, Key::new("k")).unwrap()];
    for _ in 0..2 {
        assert_eq!(s.store.check(&check).await.unwrap()[0].delayed_for, None);
    }
    let mut held = Vec::new();
    for _ in 0..3 {
        let d = s.store.check(&check).await.unwrap()[0];
        assert!(d.admitted && d.delayed_for.is_some(), "{d:?}");
        held.push(d);
    }
    // The last passes at 1 s. The first one's client goes away.
    assert_eq!(held[2].delayed_for, Some(SEC));
    s.store
        .refund(&check, &[held[0].recorded_at.unwrap()])
        .await
        .unwrap();
    s.advance(SEC);
    // At 1 s the last held request passes: a new one waits its turn.
    let next = s.store.check(&check).await.unwrap()[0];
    assert!(
        next.delayed_for.is_some_and(|wait| wait >= SEC / 3),
        "{next:?}"
    );
}
on_both_stores!(
    a_bucket_keeps_the_units_of_a_held_request_that_leaves,
    fake_clock
);
