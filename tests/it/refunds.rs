//! A refund gives back only what the refunded request still holds, on
//! every algorithm and both stores: units the window (or the bucket's
//! refill) already gave back are never given twice.

use std::time::Duration;

use crate::support::stores::StoreUnderTest;
use crate::window::Subject;
use slidegate::clock::Clock;
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
        assert!(d.admitted(), "one a second fits: {d:?}");
        held.push(d.recorded_at().expect("a bucket names its units"));
        s.advance(SEC);
    }
    let mut admitted = 0;
    for recorded in held {
        s.store.refund(&check, &[recorded]).await.unwrap();
        if s.store.check(&check).await.unwrap()[0].admitted() {
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
    assert_eq!(second.remaining(), 2);
    // At once: the second request's 4 units come back whole.
    s.store
        .refund(&check, &[second.recorded_at().unwrap()])
        .await
        .unwrap();
    assert_eq!(s.store.peek(&check).await.unwrap()[0].remaining(), 6);
    let third = s.store.check(&check).await.unwrap()[0];
    assert_eq!(third.remaining(), 2);
    // 2 s on, 2 units have refilled: the third gives back the 2 of its 4
    // not yet repaid, had it been first.
    s.advance(2 * SEC);
    assert_eq!(s.store.peek(&check).await.unwrap()[0].remaining(), 4);
    s.store
        .refund(&check, &[third.recorded_at().unwrap()])
        .await
        .unwrap();
    assert_eq!(s.store.peek(&check).await.unwrap()[0].remaining(), 6);
    // 5 s on, the first would have been repaid: nothing comes back.
    s.advance(3 * SEC);
    s.store
        .refund(&check, &[first.recorded_at().unwrap()])
        .await
        .unwrap();
    assert_eq!(s.store.peek(&check).await.unwrap()[0].remaining(), 9);
}
on_both_stores!(a_bucket_refund_gives_back_what_is_still_owed, fake_clock);

/// A bucket refilled at a tier's faster rate: a refund of a request of
/// the slower tier gives back nothing the faster refill already repaid.
/// A, 2 units at 1 a second; half a second later B, 1 unit at 4 a second
/// (the refill repaid A whole); A's refund then leaves B's unit owed.
async fn a_refund_counts_the_fastest_refill(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    let tier = |limit| {
        Policy::new("tiers", limit, SEC)
            .with_algorithm(Algorithm::TokenBucket)
            .with_burst(2)
    };
    let slow = [Check::new(&tier(1), Key::new("k")).unwrap()];
    let fast = [Check::new(&tier(4), Key::new("k")).unwrap()];
    let a = s
        .store
        .check(&[slow[0].clone().with_cost(2)])
        .await
        .unwrap()[0];
    assert!(a.admitted(), "{a:?}");
    s.advance(SEC / 2);
    assert!(s.store.check(&fast).await.unwrap()[0].admitted(), "B");
    s.store
        .refund(&[slow[0].clone().with_cost(2)], &[a.recorded_at().unwrap()])
        .await
        .unwrap();
    let d = s.store.peek(&slow).await.unwrap()[0];
    assert_eq!(d.remaining(), 1, "B's unit is still owed: {d:?}");
}
on_both_stores!(a_refund_counts_the_fastest_refill, fake_clock);

/// The same with tiers of one limit and different windows, whose rates
/// differ: A, 2 units at 10 per 10 s; 0.2 s later B, 1 unit at 10 a
/// second (the refill repaid A whole); A's refund, measured in A's
/// window, still leaves B's unit owed.
async fn a_refund_counts_the_fastest_refill_across_windows(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    let tier = |window| {
        Policy::new("windows", 10, window)
            .with_algorithm(Algorithm::TokenBucket)
            .with_burst(2)
    };
    let slow = [Check::new(&tier(10 * SEC), Key::new("k")).unwrap()];
    let fast = [Check::new(&tier(SEC), Key::new("k")).unwrap()];
    let a = s
        .store
        .check(&[slow[0].clone().with_cost(2)])
        .await
        .unwrap()[0];
    assert!(a.admitted(), "{a:?}");
    s.advance(SEC / 5);
    assert!(s.store.check(&fast).await.unwrap()[0].admitted(), "B");
    s.store
        .refund(&[slow[0].clone().with_cost(2)], &[a.recorded_at().unwrap()])
        .await
        .unwrap();
    let d = s.store.peek(&slow).await.unwrap()[0];
    assert_eq!(d.remaining(), 1, "B's unit is still owed: {d:?}");
}
on_both_stores!(
    a_refund_counts_the_fastest_refill_across_windows,
    fake_clock
);

/// A clock stepped back by more than a window: a refund of a request
/// recorded before the step gives back nothing, since the new clock's
/// times cannot say what the bucket repaid of it. A, 2 units at 1 a
/// second; 1.5 s on, B (A is three quarters repaid); then the clock steps
/// back 5 s, and A's refund must not free B's unit: at most one more
/// unit fits (none while the refund gives nothing back).
async fn a_refund_across_a_clock_step_back_frees_no_repaid_units(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    let policy = Policy::new("stepped", 1, SEC)
        .with_algorithm(Algorithm::TokenBucket)
        .with_burst(2);
    let one = [Check::new(&policy, Key::new("k")).unwrap()];
    let two = [one[0].clone().with_cost(2)];
    let a = s.store.check(&two).await.unwrap()[0];
    assert!(a.admitted(), "{a:?}");
    s.advance(SEC * 3 / 2);
    assert!(s.store.check(&one).await.unwrap()[0].admitted(), "B");
    s.clock.set(s.clock.now_micros() - 5_000_000);
    s.store
        .refund(&two, &[a.recorded_at().unwrap()])
        .await
        .unwrap();
    let mut admitted = 0;
    for _ in 0..3 {
        if s.store.check(&one).await.unwrap()[0].admitted() {
            admitted += 1;
        }
    }
    assert!(
        admitted <= 1,
        "{admitted} admitted: B's unit was given back"
    );
}
on_both_stores!(
    a_refund_across_a_clock_step_back_frees_no_repaid_units,
    fake_clock
);

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
        .refund(&check, &[a.recorded_at().unwrap()])
        .await
        .unwrap();
    assert!(s.store.check(&check).await.unwrap()[0].admitted(), "C");
    s.advance(SEC);
    s.store
        .refund(&check, &[b.recorded_at().unwrap()])
        .await
        .unwrap();
    // C's unit is owed whole: two units fit only a second from now.
    let two = [check[0].clone().with_cost(2)];
    let d = s.store.peek(&two).await.unwrap()[0];
    assert_eq!(d.retry_after(), Some(SEC), "{d:?}");
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
                s.store.check(&check).await.unwrap()[0].admitted(),
                "{algorithm:?}"
            );
        }
        s.store
            .refund(&check, &[early.recorded_at().unwrap()])
            .await
            .unwrap();
        let d = s.store.check(&check).await.unwrap()[0];
        assert!(
            !d.admitted(),
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
        assert!(d.admitted(), "{d:?}");
        in_flight.push((check, d.recorded_at().expect("recorded")));
    }
    let bucket = [Check::new(&new_bucket, Key::new("k")).unwrap()];
    for _ in 0..2 {
        assert!(s.store.check(&bucket).await.unwrap()[0].admitted());
    }
    for (check, recorded) in in_flight {
        s.store.refund(&[check], &[recorded]).await.unwrap();
    }
    let d = s.store.check(&bucket).await.unwrap()[0];
    assert!(d.admitted());
    assert_eq!(d.remaining(), 0, "the bucket kept its two requests: {d:?}");
    assert!(!s.store.check(&bucket).await.unwrap()[0].admitted());
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
        assert_eq!(s.store.check(&check).await.unwrap()[0].delayed_for(), None);
    }
    let mut held = Vec::new();
    for _ in 0..3 {
        let d = s.store.check(&check).await.unwrap()[0];
        assert!(d.admitted() && d.delayed_for().is_some(), "{d:?}");
        held.push(d);
    }
    // The last passes at 1 s. The first one's client goes away.
    assert_eq!(held[2].delayed_for(), Some(SEC));
    s.store
        .refund(&check, &[held[0].recorded_at().unwrap()])
        .await
        .unwrap();
    s.advance(SEC);
    // At 1 s the last held request passes: a new one waits its turn.
    let next = s.store.check(&check).await.unwrap()[0];
    assert!(
        next.delayed_for().is_some_and(|wait| wait >= SEC / 3),
        "{next:?}"
    );
}
on_both_stores!(
    a_bucket_keeps_the_units_of_a_held_request_that_leaves,
    fake_clock
);

/// A bucket written before refunds counted the fastest refill (32 bytes,
/// no fastest limit or floor) keeps its debt, and a refund of a request
/// recorded then (which named when its units would be repaid) gives
/// nothing back: what it names cannot be compared with the new times.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bucket_of_the_older_format_keeps_its_debt() {
    let mut tested = StoreUnderTest::redis(true);
    let redis = tested.redis.take().unwrap();
    let s = Subject::from(tested);
    let policy = Policy::new("older", 1, SEC)
        .with_algorithm(Algorithm::TokenBucket)
        .with_burst(2);
    let two = [Check::new(&policy, Key::new("k")).unwrap().with_cost(2)];
    let a = s.store.check(&two).await.unwrap()[0];
    assert!(a.admitted(), "{a:?}");
    let keys = redis.cli(&["KEYS", "*:b"]);
    let key = keys.trim();
    let at = s.clock.now_micros().to_string();
    let pack =
        "return redis.call('SET', KEYS[1], struct.pack('>I8I8I8I8', ARGV[1], ARGV[2], ARGV[3], 0))";
    redis.cli(&["EVAL", pack, "1", key, &at, "2000000", "1000000"]);
    s.advance(SEC / 2);
    let repaid_by = a.recorded_at().unwrap() + 2 * SEC;
    for named in [repaid_by, a.recorded_at().unwrap()] {
        s.store.refund(&two, &[named]).await.unwrap();
    }
    // Half a unit repaid of two: the next unit fits in half a second.
    let d = s.store.peek(&two).await.unwrap()[0];
    assert_eq!((d.remaining(), d.reset()), (0, SEC / 2), "{d:?}");
}

/// The algorithms that count in aggregate and keep when their state was
/// made, limit 100 an hour. (A calendar's 16-byte count has no room for
/// it: a longer one would read as empty to an older instance.)
fn aggregates() -> [Policy; 3] {
    let hour = 3600 * SEC;
    [
        Policy::new("fixed", 100, hour).with_algorithm(Algorithm::FixedWindow),
        Policy::new("counter", 100, hour).with_algorithm(Algorithm::SlidingCounter),
        Policy::new("bucket", 100, hour)
            .with_algorithm(Algorithm::TokenBucket)
            .with_burst(100),
    ]
}

/// A refund or settlement of units counted before a reset names units of
/// a state that is gone: it takes nothing from the fresh count (where it
/// took back the units of requests admitted since), and a settlement
/// still counts its final cost. Each state is born at its first request
/// after the reset, and a refund naming an earlier time gives back
/// nothing.
async fn a_refund_after_a_reset_takes_nothing_from_the_fresh_count(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    for policy in aggregates() {
        let name = policy.name().to_owned();
        let check = [Check::new(&policy, Key::new("client"))
            .unwrap()
            .with_cost(10)];
        for settle in [false, true] {
            let before = s.store.check(&check).await.unwrap()[0];
            let recorded = before.recorded_at().expect("a count names its units");
            s.store.reset(&check).await.unwrap();
            s.advance(Duration::from_millis(1));
            let after = s.store.check(&check).await.unwrap()[0];
            assert_eq!(after.remaining(), 90, "{name}");
            s.advance(Duration::from_millis(1));
            if settle {
                s.store.settle(&check, &[recorded], &[3]).await.unwrap();
            } else {
                s.store.refund(&check, &[recorded]).await.unwrap();
            }
            let left = s.store.peek(&check).await.unwrap()[0].remaining();
            let expected = if settle { 87 } else { 90 };
            assert_eq!(left, expected, "{name}, settled: {settle}");
            // The request admitted since the reset is still refunded.
            s.store
                .refund(&check, &[after.recorded_at().unwrap()])
                .await
                .unwrap();
            let left = s.store.peek(&check).await.unwrap()[0].remaining();
            assert_eq!(left, expected + 10, "{name}, settled: {settle}");
            s.store.reset(&check).await.unwrap();
            s.advance(Duration::from_millis(1));
        }
    }
}
on_both_stores!(
    a_refund_after_a_reset_takes_nothing_from_the_fresh_count,
    fake_clock
);

/// A settlement of a sliding log's request whose reserved units have
/// left the window does not count them again (they would count anew, at
/// the settlement's time, where the reserved units had already gone): a
/// slice's give-back counts nothing, and a reservation the request
/// outgrew counts only the units beyond it, which no record ever
/// counted. One within the window replaces them, whether or not the log
/// still holds them.
async fn a_late_settlement_of_a_log_counts_only_what_was_never_counted(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    let policy = Policy::new("log", 100, 10 * SEC);
    let check = [Check::new(&policy, Key::new("client"))
        .unwrap()
        .with_cost(10)];
    let early = s.store.check(&check).await.unwrap()[0];
    s.advance(11 * SEC);
    s.store
        .settle(&check, &[early.recorded_at().unwrap()], &[3])
        .await
        .unwrap();
    assert_eq!(s.store.peek(&check).await.unwrap()[0].remaining(), 100);
    // A request that outlived the window and cost 25 of its 10 reserved.
    let long = s.store.check(&check).await.unwrap()[0];
    s.advance(11 * SEC);
    s.store
        .settle(&check, &[long.recorded_at().unwrap()], &[25])
        .await
        .unwrap();
    assert_eq!(s.store.peek(&check).await.unwrap()[0].remaining(), 85);
    s.advance(11 * SEC);
    // Within the window: replaced.
    let timely = s.store.check(&check).await.unwrap()[0];
    s.advance(SEC);
    s.store
        .settle(&check, &[timely.recorded_at().unwrap()], &[3])
        .await
        .unwrap();
    assert_eq!(s.store.peek(&check).await.unwrap()[0].remaining(), 97);
    // Within the window, the log reset since: the final cost counts.
    let reset = s.store.check(&check).await.unwrap()[0];
    s.store.reset(&check).await.unwrap();
    s.advance(SEC);
    s.store
        .settle(&check, &[reset.recorded_at().unwrap()], &[3])
        .await
        .unwrap();
    assert_eq!(s.store.peek(&check).await.unwrap()[0].remaining(), 97);
}
on_both_stores!(
    a_late_settlement_of_a_log_counts_only_what_was_never_counted,
    fake_clock
);

/// A settlement sent twice (a retry after a timeout) counts once: a
/// reservation of 10 settled to 3 beside 50 other units leaves 53 counted
/// on every algorithm, where the second gave back 10 of the others' units
/// (46 on the counters, the bucket and the calendar) or counted 3 again
/// (56 on the log). Each settlement marks the reservation's id: another
/// reservation recorded at the same time is settled on its own.
async fn a_settlement_sent_twice_counts_once(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    let hour = 3600 * SEC;
    let calendar = Algorithm::Calendar(slidegate::policy::Calendar::new(
        slidegate::policy::Period::Day,
    ));
    let policies = [
        Policy::new("log", 100, hour),
        Policy::new("counter", 100, hour).with_algorithm(Algorithm::SlidingCounter),
        Policy::new("fixed", 100, hour).with_algorithm(Algorithm::FixedWindow),
        Policy::new("bucket", 100, hour)
            .with_algorithm(Algorithm::TokenBucket)
            .with_burst(100),
        Policy::new("calendar", 100, hour).with_algorithm(calendar),
    ];
    for policy in policies {
        let name = policy.name().to_owned();
        let check = |cost| {
            [Check::new(&policy, Key::new("client"))
                .unwrap()
                .with_cost(cost)]
        };
        let [reservation] = check(10);
        let reservation = [reservation.with_settlement_id()];
        let reserved = s.store.check(&reservation).await.unwrap()[0];
        // Another request at the same time, settled too (a batch's
        // requests share their time): its id is its own.
        let [twin] = check(10);
        let twin = [twin.with_settlement_id()];
        let other = s.store.check(&twin).await.unwrap()[0];
        assert!(other.admitted(), "{name}");
        let others = s.store.check(&check(40)).await.unwrap()[0];
        assert!(reserved.admitted() && others.admitted(), "{name}");
        let at = reserved.recorded_at().unwrap();
        for _ in 0..2 {
            s.store.settle(&reservation, &[at], &[3]).await.unwrap();
            let left = s.store.peek(&check(1)).await.unwrap()[0].remaining();
            assert_eq!(left, 47, "{name}");
        }
        // The twin's settlement counts, once.
        for _ in 0..2 {
            let twin_at = other.recorded_at().unwrap();
            s.store.settle(&twin, &[twin_at], &[5]).await.unwrap();
            let left = s.store.peek(&check(1)).await.unwrap()[0].remaining();
            assert_eq!(left, 52, "{name}");
        }
        // The others' units are still theirs to give back.
        s.store
            .refund(&check(40), &[others.recorded_at().unwrap()])
            .await
            .unwrap();
        let left = s.store.peek(&check(1)).await.unwrap()[0].remaining();
        assert_eq!(left, 92, "{name}");
        // Sent again after a reset, it still counts nothing.
        s.store.reset(&check(1)).await.unwrap();
        s.store.settle(&reservation, &[at], &[3]).await.unwrap();
        let left = s.store.peek(&check(1)).await.unwrap()[0].remaining();
        assert_eq!(left, 100, "{name}");
    }
}
on_both_stores!(a_settlement_sent_twice_counts_once, fake_clock);
