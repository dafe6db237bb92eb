//! [`Calendar`]: quotas counted per calendar period (day, week, month,
//! year) rather than per sliding window.

use std::time::Duration;

/// The calendar period a [`Calendar`] quota counts in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Period {
    /// From midnight to midnight.
    Day,
    /// From Monday 00:00 to the next Monday 00:00.
    Week,
    /// From the 1st at 00:00 to the next month's 1st (28 to 31 days).
    Month,
    /// From January 1st at 00:00 to the next (365 or 366 days).
    Year,
}

impl Period {
    /// The period's name in the config file and in the Redis script.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Day => "day",
            Self::Week => "week",
            Self::Month => "month",
            Self::Year => "year",
        }
    }
}

/// A quota per calendar period: a policy
/// ([`Policy::calendar`](crate::Policy::calendar)) counts a client's units
/// per day, week, month or year, the limit per period, and the count starts
/// again at each boundary: midnight, Monday 00:00, the 1st of the month,
/// January 1st. In the config file, `calendar = "day" | "week" | "month" |
/// "year"` takes the place of `window` (and of `algorithm`).
///
/// The boundaries are in UTC, or at a fixed offset from it
/// ([`with_east_of_utc`](Self::with_east_of_utc), [`with_west_of_utc`](Self::with_west_of_utc),
/// config `utc_offset`): a period at `"+02:00"` starts at 00:00 UTC+2,
/// 22:00 UTC the day before, all year round (no daylight saving time).
/// `X-RateLimit-Reset` and `Retry-After` count to the next boundary, with
/// months of 28 to 31 days and leap years as the Gregorian calendar has
/// them. On Redis the period is read from Redis's clock.
///
/// The count is exact and one number per client (16 bytes on Redis,
/// expiring at the period's end). A count is never ended early: a clock
/// that steps back into an earlier period, or a reload into shorter
/// periods, keeps it to its own end. A calendar quota takes no delay, and
/// its tiers no window of their own.
///
/// ```toml
/// [[policy]]
/// name = "monthly"
/// limit = 10000                        # calls a month, reset on the 1st
/// calendar = "month"
/// utc_offset = "+02:00"                # optional; UTC by default
/// ```
///
/// ```rust
/// use slidegate::Policy;
/// use slidegate::policy::{Calendar, Period};
/// use std::time::Duration;
///
/// let monthly = Policy::calendar(
///     "monthly",
///     10_000,
///     Calendar::new(Period::Month).with_east_of_utc(Duration::from_secs(2 * 3600)),
/// );
/// ```
///
/// ```
/// use slidegate::policy::{Calendar, Period};
/// use std::time::Duration;
///
/// // Months as they run in Berlin in summer: from 22:00 UTC on the last day before.
/// let monthly = Calendar::new(Period::Month).with_east_of_utc(Duration::from_secs(2 * 3600));
/// assert_eq!(monthly.utc_offset_seconds(), 7200);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Calendar {
    period: Period,
    /// Seconds east of UTC.
    offset: i32,
}

/// The longest offset from UTC a calendar may have (exclusive): a day.
const MAX_OFFSET_SECONDS: i32 = 86_400;

impl Calendar {
    /// Periods of `period`, in UTC.
    pub fn new(period: Period) -> Self {
        Self { period, offset: 0 }
    }

    /// The periods at `offset` ahead of UTC (`+HH:MM`): under a day, in
    /// whole minutes, else the policy is refused.
    #[must_use]
    pub fn with_east_of_utc(mut self, offset: Duration) -> Self {
        self.offset = offset_seconds(offset);
        self
    }

    /// The periods at `offset` behind UTC (`-HH:MM`): under a day, in
    /// whole minutes, else the policy is refused.
    #[must_use]
    pub fn with_west_of_utc(mut self, offset: Duration) -> Self {
        self.offset = offset_seconds(offset).saturating_neg();
        self
    }

    /// The period counted in.
    pub fn period(&self) -> Period {
        self.period
    }

    /// The offset from UTC, in seconds east (negative west).
    pub fn utc_offset_seconds(&self) -> i32 {
        self.offset
    }

    /// Whether the offset is one a policy may have: under a day, in whole
    /// minutes.
    pub(crate) fn is_valid(&self) -> bool {
        self.offset.abs() < MAX_OFFSET_SECONDS && self.offset % 60 == 0
    }

    /// The period's length as a window is shown (in `429` bodies and the
    /// IETF `RateLimit-Policy` field): a day, 7 days, and humantime's
    /// month (30.44 days) and year (365.25 days).
    pub(crate) fn nominal_window(&self) -> Duration {
        Duration::from_secs(match self.period {
            Period::Day => 86_400,
            Period::Week => 7 * 86_400,
            Period::Month => 2_630_016,
            Period::Year => 31_557_600,
        })
    }

    /// The end of the period that holds `now`, both in µs since the Unix
    /// epoch: the next boundary after it.
    pub(crate) fn period_end(&self, now_micros: u64) -> u64 {
        let local = i64::try_from(now_micros / 1_000_000)
            .unwrap_or(i64::MAX / 2)
            .saturating_add(i64::from(self.offset))
            .max(0);
        let today = local / SECONDS_PER_DAY;
        let next_day = match self.period {
            Period::Day => today + 1,
            // Day 0, 1970-01-01, was a Thursday: week w starts on day
            // 7w - 3, a Monday.
            Period::Week => ((today + 3) / 7 + 1) * 7 - 3,
            Period::Month => match civil_from_days(today) {
                (year, 12) => days_from_civil(year + 1, 1),
                (year, month) => days_from_civil(year, month + 1),
            },
            Period::Year => days_from_civil(civil_from_days(today).0 + 1, 1),
        };
        let boundary = next_day * SECONDS_PER_DAY - i64::from(self.offset);
        u64::try_from(boundary).map_or(0, |seconds| seconds.saturating_mul(1_000_000))
    }
}

const SECONDS_PER_DAY: i64 = 86_400;

/// Days since 1970-01-01 of the 1st of `month` (1 to 12) of `year`, in the
/// proleptic Gregorian calendar (Howard Hinnant's `days_from_civil`, for
/// years from 0 on).
fn days_from_civil(year: i64, month: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year / 400;
    let year_of_era = year - era * 400;
    let shifted_month = if month > 2 { month - 3 } else { month + 9 };
    let day_of_year = (153 * shifted_month + 2) / 5;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

/// The year and month (1 to 12) of day `days` since 1970-01-01, at or
/// after it (Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, i64) {
    let days = days + 719_468;
    let era = days / 146_097;
    let day_of_era = days - era * 146_097;
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let shifted_month = (5 * day_of_year + 2) / 153;
    let year = year_of_era + era * 400;
    if shifted_month >= 10 {
        (year + 1, shifted_month - 9)
    } else {
        (year, shifted_month + 3)
    }
}

/// `offset` in seconds; one that is no whole number of seconds, or past
/// any valid offset, is kept as one no policy may have.
fn offset_seconds(offset: Duration) -> i32 {
    if offset.subsec_nanos() != 0 {
        return i32::MAX;
    }
    i32::try_from(offset.as_secs()).unwrap_or(i32::MAX)
}

#[cfg(test)]
mod tests {
    use time::{Date, Month, OffsetDateTime};

    use super::*;

    /// µs at `y-m-d hh:mm` UTC.
    fn at(y: i32, m: u8, d: u8, hh: u8, mm: u8) -> u64 {
        let date = Date::from_calendar_date(y, Month::try_from(m).unwrap(), d).unwrap();
        let time = time::Time::from_hms(hh, mm, 0).unwrap();
        let seconds = date.with_time(time).assume_utc().unix_timestamp();
        u64::try_from(seconds).unwrap() * 1_000_000
    }

    #[test]
    fn periods_end_at_their_boundaries() {
        let utc = |period| Calendar::new(period);
        // Leap years: February 29th rolls into March.
        assert_eq!(
            utc(Period::Month).period_end(at(2028, 2, 29, 23, 59)),
            at(2028, 3, 1, 0, 0)
        );
        assert_eq!(
            utc(Period::Month).period_end(at(2027, 2, 28, 12, 0)),
            at(2027, 3, 1, 0, 0)
        );
        assert_eq!(
            utc(Period::Month).period_end(at(2026, 12, 31, 23, 59)),
            at(2027, 1, 1, 0, 0)
        );
        assert_eq!(
            utc(Period::Year).period_end(at(2028, 6, 1, 0, 0)),
            at(2029, 1, 1, 0, 0)
        );
        // A boundary starts the next period.
        assert_eq!(
            utc(Period::Day).period_end(at(2026, 11, 26, 0, 0)),
            at(2026, 11, 27, 0, 0)
        );
        // Weeks start on Monday: 2026-11-26 is a Thursday; a Monday's
        // week ends the next Monday.
        assert_eq!(
            utc(Period::Week).period_end(at(2026, 11, 26, 9, 0)),
            at(2026, 11, 30, 0, 0)
        );
        assert_eq!(
            utc(Period::Week).period_end(at(2026, 11, 30, 0, 0)),
            at(2026, 12, 7, 0, 0)
        );
    }

    #[test]
    fn an_offset_moves_the_boundaries() {
        let hours = |h: u64| Duration::from_secs(h * 3600);
        let berlin = Calendar::new(Period::Month).with_east_of_utc(hours(2));
        // 22:30 UTC on June 30th is already July in UTC+2.
        assert_eq!(
            berlin.period_end(at(2026, 6, 30, 22, 30)),
            at(2026, 7, 31, 22, 0)
        );
        assert_eq!(
            berlin.period_end(at(2026, 6, 30, 21, 30)),
            at(2026, 6, 30, 22, 0)
        );
        let new_york = Calendar::new(Period::Day).with_west_of_utc(hours(5));
        assert_eq!(
            new_york.period_end(at(2026, 1, 1, 3, 0)),
            at(2026, 1, 1, 5, 0)
        );
    }

    /// The next boundary as the `time` crate finds it.
    fn next_boundary(calendar: &Calendar, now_micros: u64) -> u64 {
        let local = (now_micros / 1_000_000) as i64 + i64::from(calendar.offset);
        let today = OffsetDateTime::from_unix_timestamp(local).unwrap().date();
        let next = match calendar.period {
            Period::Day => today.next_day().unwrap(),
            Period::Week => today.next_occurrence(time::Weekday::Monday),
            Period::Month => match today.month() {
                Month::December => Date::from_calendar_date(today.year() + 1, Month::January, 1),
                month => Date::from_calendar_date(today.year(), month.next(), 1),
            }
            .unwrap(),
            Period::Year => Date::from_calendar_date(today.year() + 1, Month::January, 1).unwrap(),
        };
        let seconds = next.midnight().assume_utc().unix_timestamp() - i64::from(calendar.offset);
        u64::try_from(seconds).unwrap() * 1_000_000
    }

    #[test]
    fn boundaries_agree_with_the_time_crate() {
        // Every day from 1971 to 2400 at a few offsets and hours: leap
        // years, centuries (2100 is no leap year, 2000 and 2400 are).
        for day in (365_i64..157_000).step_by(7) {
            for (hour, offset) in [(0, 0), (5, -330), (23, 840), (12, -720)] {
                let now = (day * 86_400 + hour * 3600) as u64 * 1_000_000 + 999_999;
                for period in [Period::Day, Period::Week, Period::Month, Period::Year] {
                    let calendar = Calendar {
                        period,
                        offset: offset * 60,
                    };
                    assert_eq!(
                        calendar.period_end(now),
                        next_boundary(&calendar, now),
                        "{calendar:?} at {now}"
                    );
                }
            }
        }
    }

    #[test]
    fn offsets_are_whole_minutes_under_a_day() {
        let month = Calendar::new(Period::Month);
        assert!(
            month
                .with_east_of_utc(Duration::from_secs(14 * 3600))
                .is_valid()
        );
        assert!(
            month
                .with_west_of_utc(Duration::from_secs(9 * 3600 + 1800))
                .is_valid()
        );
        assert!(
            !month
                .with_east_of_utc(Duration::from_secs(86_400))
                .is_valid()
        );
        assert!(!month.with_east_of_utc(Duration::from_secs(90)).is_valid());
        assert!(
            !month
                .with_east_of_utc(Duration::from_millis(60_001))
                .is_valid()
        );
        assert!(!month.with_west_of_utc(Duration::MAX).is_valid());
    }
}
