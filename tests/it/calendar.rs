//! Calendar quotas on a fake clock, run identically against `MemoryStore`
//! and a real `redis-server`: counts per day, week, month and year that
//! start again at each boundary, with resets and retry times that count
//! to it (months of 28 to 31 days, leap years, offsets from UTC).

use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::support::stores::StoreUnderTest;
use crate::window::Subject;
use slidegate::Policy;
use slidegate::policy::{Calendar, Period};

const SEC: Duration = Duration::from_secs(1);
const DAY: Duration = Duration::from_secs(86_400);

/// µs since the Unix epoch of `seconds` since it.
fn at(seconds: u64) -> u64 {
    seconds * 1_000_000
}

/// 2028-02-29T23:59:59Z, the last second of a leap February.
const LEAP_DAY_LAST_SECOND: u64 = 1_835_481_599;
/// 2026-12-31T23:59:59Z.
const NEW_YEARS_EVE_LAST_SECOND: u64 = 1_798_761_599;

fn monthly(limit: u32) -> Policy {
    Policy::calendar("monthly", limit, Calendar::new(Period::Month))
}

/// A month's quota spent on February 29th is back at midnight, and the
/// March that starts then resets in 31 days.
async fn a_month_rolls_over_on_february_29th(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    s.clock.set(at(LEAP_DAY_LAST_SECOND));
    let policy = monthly(2);
    for remaining in [1, 0] {
        let d = s.one(&policy, "alice").await;
        assert!(d.admitted());
        assert_eq!((d.remaining(), d.reset()), (remaining, SEC));
    }
    let d = s.one(&policy, "alice").await;
    assert!(!d.admitted());
    assert_eq!(d.retry_after(), Some(SEC), "to midnight, exactly");

    s.advance(SEC - Duration::from_micros(1));
    assert!(
        !s.one(&policy, "alice").await.admitted(),
        "a µs before March"
    );
    s.advance(Duration::from_micros(1));
    let d = s.one(&policy, "alice").await;
    assert!(d.admitted(), "March 1st");
    assert_eq!((d.remaining(), d.reset()), (1, 31 * DAY));
}
on_both_stores!(a_month_rolls_over_on_february_29th, fake_clock);

/// December 31st rolls into January of the next year, for a month and
/// for a year.
async fn a_month_and_a_year_roll_over_on_december_31st(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    s.clock.set(at(NEW_YEARS_EVE_LAST_SECOND) + 500_000);
    let yearly = Policy::calendar("yearly", 5, Calendar::new(Period::Year));
    let policy = monthly(1);
    let d = s.check(&[&policy, &yearly], "bob").await;
    assert!(d[0].admitted());
    assert_eq!(d[0].reset(), SEC / 2);
    assert_eq!(d[1].reset(), SEC / 2);
    let d = s.one(&policy, "bob").await;
    assert_eq!(d.retry_after(), Some(SEC / 2));

    s.advance(SEC / 2);
    let d = s.check(&[&policy, &yearly], "bob").await;
    assert!(d[0].admitted(), "January");
    assert_eq!((d[0].remaining(), d[0].reset()), (0, 31 * DAY));
    // 2027 is no leap year.
    assert_eq!((d[1].remaining(), d[1].reset()), (4, 365 * DAY));
}
on_both_stores!(a_month_and_a_year_roll_over_on_december_31st, fake_clock);

/// A period at `+02:00` starts at 22:00 UTC the day before; a week
/// starts on Monday.
async fn offsets_and_weeks_move_the_boundaries(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    let berlin = Policy::calendar(
        "berlin",
        1,
        Calendar::new(Period::Month).with_east_of_utc(2 * 3600 * SEC),
    );
    // 2026-06-30T21:59:59Z is June in UTC+2 for one more second.
    s.clock.set(at(1_782_856_799));
    assert!(s.one(&berlin, "carol").await.admitted());
    let d = s.one(&berlin, "carol").await;
    assert_eq!(d.retry_after(), Some(SEC));
    s.advance(SEC);
    let d = s.one(&berlin, "carol").await;
    assert!(d.admitted(), "July in UTC+2");
    assert_eq!(d.reset(), 31 * DAY);

    let weekly = Policy::calendar("weekly", 1, Calendar::new(Period::Week));
    // Sunday 2026-11-29T23:59:59Z.
    s.clock.set(at(1_795_996_799));
    assert!(s.one(&weekly, "carol").await.admitted());
    assert_eq!(s.one(&weekly, "carol").await.retry_after(), Some(SEC));
    s.advance(SEC);
    let d = s.one(&weekly, "carol").await;
    assert!(d.admitted(), "Monday");
    assert_eq!(d.reset(), 7 * DAY);
}
on_both_stores!(offsets_and_weeks_move_the_boundaries, fake_clock);

/// The periods' ends, as the two stores compute them (the memory store
/// in Rust, checked against the `time` crate in its unit tests, and the
/// Redis script in Lua), agree at random instants from 1971 to 2199, at
/// random offsets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn period_ends_agree_across_stores_at_random_instants() {
    let memory = Subject::from(StoreUnderTest::memory(true));
    let redis = Subject::from(StoreUnderTest::redis(true));
    let mut rng = ChaCha8Rng::seed_from_u64(34);
    for round in 0..400 {
        let (period, longest) = [
            (Period::Day, DAY),
            (Period::Week, 7 * DAY),
            (Period::Month, 31 * DAY),
            (Period::Year, 366 * DAY),
        ][round % 4];
        let offset = Duration::from_secs(rng.gen_range(0..24 * 60) * 60);
        let calendar = if rng.gen_bool(0.5) {
            Calendar::new(period).with_east_of_utc(offset)
        } else {
            Calendar::new(period).with_west_of_utc(offset)
        };
        let policy = Policy::calendar("random", 10, calendar);
        let now = at(rng.gen_range(31_536_000..7_258_118_400)) + rng.gen_range(0..1_000_000);
        let key = format!("client-{round}");
        let mut resets = Vec::new();
        for s in [&memory, &redis] {
            s.clock.set(now);
            let d = s.one(&policy, &key).await;
            assert!(d.admitted());
            resets.push(d.reset());
        }
        assert_eq!(resets[0], resets[1], "{calendar:?} at {now} µs");
        assert!(
            resets[0] > Duration::ZERO && resets[0] <= longest,
            "{calendar:?} at {now} µs"
        );
    }
}

/// A refund gives units back to the period that counted them, and takes
/// nothing from the next one.
async fn a_refund_gives_back_only_to_its_own_period(tested: StoreUnderTest) {
    use slidegate::key::Key;
    use slidegate::store::Check;

    let s = Subject::from(tested);
    s.clock.set(at(LEAP_DAY_LAST_SECOND));
    let policy = monthly(2);
    let check = || Check::new(&policy, Key::new("dave")).unwrap();
    let first = s.store.check(&[check()]).await.unwrap()[0];
    let second = s.store.check(&[check()]).await.unwrap()[0];
    s.store
        .refund(&[check()], &[second.recorded_at().unwrap()])
        .await
        .unwrap();
    assert_eq!(
        s.one(&policy, "dave").await.remaining(),
        0,
        "one given back, one spent"
    );

    s.advance(SEC);
    assert!(s.one(&policy, "dave").await.admitted(), "March");
    // February's unit is not taken from March's count.
    s.store
        .refund(&[check()], &[first.recorded_at().unwrap()])
        .await
        .unwrap();
    let d = s.one(&policy, "dave").await;
    assert!(d.admitted());
    assert_eq!(d.remaining(), 0);
}
on_both_stores!(a_refund_gives_back_only_to_its_own_period, fake_clock);

/// A clock that steps back into the day before never ends a day's count
/// early: a request admitted then is counted with it, to its own end.
async fn a_clock_stepped_back_never_ends_a_count_early(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    let daily = Policy::calendar("daily", 3, Calendar::new(Period::Day));
    // 2027-01-01T00:00:05Z.
    s.clock.set(at(NEW_YEARS_EVE_LAST_SECOND + 6));
    assert!(s.one(&daily, "erin").await.admitted());
    assert!(s.one(&daily, "erin").await.admitted());
    // Stepped back to 2026-12-31T23:59:58Z.
    s.clock.set(at(NEW_YEARS_EVE_LAST_SECOND - 1));
    let d = s.one(&daily, "erin").await;
    assert!(d.admitted());
    assert_eq!(d.reset(), DAY + 2 * SEC, "to the end of January 1st");
    s.advance(2 * SEC);
    assert!(
        !s.one(&daily, "erin").await.admitted(),
        "January 1st: three spent"
    );
}
on_both_stores!(a_clock_stepped_back_never_ends_a_count_early, fake_clock);

/// A day's count, reloaded as a month's while the client is denied, is
/// kept to the month's end.
async fn a_count_reloaded_into_longer_periods_lasts_to_their_end(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    // 2028-02-10T00:00:00Z.
    s.clock.set(at(LEAP_DAY_LAST_SECOND - 19 * 86_400 - 86_399));
    let daily = Policy::calendar("quota", 1, Calendar::new(Period::Day));
    let monthly = Policy::calendar("quota", 1, Calendar::new(Period::Month));
    assert!(s.one(&daily, "frank").await.admitted());
    s.advance(SEC);
    let d = s.one(&monthly, "frank").await;
    assert!(!d.admitted());
    assert_eq!(d.retry_after(), Some(20 * DAY - SEC), "to March 1st");
    // Past the day's end, still February: still spent.
    s.advance(DAY);
    assert!(!s.one(&monthly, "frank").await.admitted());
}
on_both_stores!(
    a_count_reloaded_into_longer_periods_lasts_to_their_end,
    fake_clock
);
