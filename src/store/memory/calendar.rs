//! Calendar quotas as kept by [`MemoryStore`](super::MemoryStore), the
//! in-process twin of `lua/calendar.lua`: one count and the
//! end of the period it is in.

use std::time::Duration;

use super::counter::count_decision;
use crate::policy::Calendar;
use crate::store::Decision;

/// A client's count in one calendar period.
///
/// A count whose period has ended starts again at 0 in the period that
/// holds `now`. One whose period has not is kept until the later of its
/// end and the end of `now`'s period: a clock that steps back into an
/// earlier period, or a policy that now counts shorter periods, never ends
/// it early, and one that counts longer periods keeps it to their end.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct CalendarCount {
    /// The end of the count's period (µs since the Unix epoch).
    ends: u64,
    count: u64,
}

impl CalendarCount {
    /// Places the count at the period of `calendar` that holds `now`;
    /// returns whether a kept count moved to a later end, which the Redis
    /// script writes even when it counts nothing.
    pub(super) fn place(&mut self, now: u64, calendar: Calendar) -> bool {
        let period = calendar.period_end(now);
        if self.ends <= now {
            (self.ends, self.count) = (period, 0);
            false
        } else if period > self.ends {
            self.ends = period;
            true
        } else {
            false
        }
    }

    pub(super) fn fits(&self, limit: u32, cost: u32) -> bool {
        self.count + u64::from(cost) <= u64::from(limit)
    }

    /// Counts `cost` units at `now`; returns the time they were counted at.
    pub(super) fn record(&mut self, cost: u32, now: u64) -> u64 {
        self.count += u64::from(cost);
        now
    }

    /// Takes back `cost` units counted at `at`, if that was in the
    /// count's period and it holds any. Returns whether it did.
    pub(super) fn refund(&mut self, at: u64, cost: u32, calendar: Calendar) -> bool {
        if self.count == 0 || calendar.period_end(at) != self.ends {
            return false;
        }
        self.count = self.count.saturating_sub(u64::from(cost));
        true
    }

    pub(super) fn is_idle(&self, now: u64) -> bool {
        self.count == 0 || self.ends <= now
    }

    pub(super) fn decision(&self, now: u64, limit: u32, cost: u32, admitted: bool) -> Decision {
        let ends_in = Duration::from_micros(self.ends.saturating_sub(now));
        let retry_after = (!admitted && !self.fits(limit, cost)).then_some(ends_in);
        count_decision(admitted, limit, self.count, ends_in, retry_after)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Period;

    const DAY: u64 = 86_400_000_000;

    #[test]
    fn the_count_starts_again_at_the_boundary() {
        let daily = Calendar::new(Period::Day);
        let mut quota = CalendarCount::default();
        let noon = 20_000 * DAY + DAY / 2;
        quota.place(noon, daily);
        quota.record(3, noon);
        assert!(!quota.fits(3, 1));
        let decision = quota.decision(noon, 3, 1, false);
        assert_eq!(decision.retry_after(), Some(Duration::from_micros(DAY / 2)));
        assert_eq!(
            (decision.remaining(), decision.reset()),
            (0, Duration::from_micros(DAY / 2))
        );

        quota.place(noon + DAY / 2 - 1, daily);
        assert!(!quota.fits(3, 1), "a µs before midnight");
        quota.place(noon + DAY / 2, daily);
        assert!(quota.fits(3, 3), "midnight");
    }

    #[test]
    fn a_refund_takes_back_only_from_its_own_period() {
        let daily = Calendar::new(Period::Day);
        let mut quota = CalendarCount::default();
        let day = 20_000 * DAY;
        quota.place(day + 5, daily);
        let at = quota.record(2, day + 5);
        quota.place(day + DAY + 5, daily);
        assert!(!quota.refund(at, 2, daily), "yesterday's units are gone");
        let today = quota.record(2, day + DAY + 5);
        assert!(quota.refund(today, 5, daily));
        assert!(quota.fits(2, 2), "never below zero");
    }

    #[test]
    fn a_clock_stepped_back_keeps_the_count_to_its_end() {
        let daily = Calendar::new(Period::Day);
        let mut quota = CalendarCount::default();
        let tomorrow = 20_001 * DAY + 10;
        quota.place(tomorrow, daily);
        quota.record(2, tomorrow);
        assert!(!quota.place(tomorrow - 20, daily));
        assert!(!quota.fits(2, 1), "kept after the step back");
        assert_eq!(quota.ends, 20_002 * DAY, "to the end of its own day");
    }

    #[test]
    fn a_longer_period_keeps_the_count_to_its_end() {
        let mut quota = CalendarCount::default();
        let day = 20_000 * DAY + 10;
        quota.place(day, Calendar::new(Period::Day));
        quota.record(2, day);
        assert!(quota.place(day, Calendar::new(Period::Year)), "moved");
        assert!(!quota.fits(2, 1));
        quota.place(day + DAY, Calendar::new(Period::Year));
        assert!(!quota.fits(2, 1), "kept past the day's end");
    }
}
