//! The token bucket as kept by [`MemoryStore`](super::MemoryStore), the
//! in-process twin of `lua/bucket.lua`.
//!
//! GCRA with the time scaled by the limit `L`: a unit costs `W` scaled
//! µs (`W` the window in µs) and each µs refills `L` of them, so the debt
//! is units × `W` whatever the limit, and a request of cost `c` fits when
//! `debt + c·W ≤ B·W` (`B` the burst). [`Policy`](crate::Policy)
//! validation keeps `B·W` below 2^52, so the Redis script's doubles are
//! exact, and this side computes the same integers.

use std::time::Duration;

use crate::store::{Check, Decision};

/// A bucket's state: its debt at the time it was last placed at.
///
/// A clock that steps back by at most a window leaves the bucket where it
/// was (no refill until the clock catches up); a longer step back carries
/// the debt to the new time. Peeks and denials place nothing, as the
/// script writes nothing for them, unless the bucket had to move (carried,
/// or measured under another window).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct TokenBucket {
    /// The time the bucket was placed at, in µs.
    at: u64,
    /// The debt at `at`, in units × window.
    debt: u64,
    /// The window the debt is measured in, in µs; 0 for a new bucket.
    window: u64,
    /// The limit it refills at, as of the last decision (for idleness).
    limit: u32,
    /// The fastest limit it has refilled at, as a limit of `window` (see
    /// [`refund`](Self::refund)).
    fastest: u64,
    /// The time at or before which a refund names nothing it can give
    /// back: the clock stepped back from it.
    floor: u64,
    /// The latest time a request held for its delay passes at, in µs.
    held_until: u64,
}

/// The largest debt a held request may start from (see
/// [`TokenBucket::fits_at`]).
const HOLD_PRODUCT: u64 = 1 << 52;

/// `n / d` rounded up.
fn ceil_div(n: u64, d: u64) -> u64 {
    n.div_ceil(d)
}

impl TokenBucket {
    /// Places the bucket at `now` (or where a clock that stepped back
    /// left it) for `check`, refilled since it was last placed. Returns
    /// whether it had to move, which the Redis script writes even when it
    /// counts nothing.
    pub(super) fn place(&mut self, now: u64, check: &Check) -> bool {
        let window = check.window_micros();
        let full = u64::from(check.burst) * window;
        let (stored_at, mut debt) = if self.window == 0 {
            (now, 0)
        } else {
            (self.at, self.debt)
        };
        let rewindowed = self.window != 0 && self.window != window;
        if rewindowed {
            // The same units under the new window, rounded up, as the
            // script computes them in doubles.
            let units = debt as f64 / self.window as f64;
            debt = ((units * window as f64).ceil() as u64).min(full);
        }
        let limit = u64::from(check.limit().max(1));
        let stepped_back = stored_at.saturating_sub(now) > window;
        let at = if stepped_back {
            now
        } else {
            stored_at.max(now)
        };
        let (mut fastest, mut floor) = if self.window == 0 {
            // A new bucket, as the script makes a key: no refund names
            // units taken before it (those of a bucket since reset).
            (limit, now.saturating_sub(1))
        } else {
            (self.fastest, self.floor)
        };
        if rewindowed {
            // The same rate as a limit of the new window, never below it,
            // as the script computes it in doubles.
            fastest = (fastest as f64 * window as f64 / self.window as f64).floor() as u64 + 1;
        }
        if stepped_back {
            // What refunds name was measured on the clock before the step.
            floor = floor.max(stored_at).max(self.held_until);
        }
        let mut faster = false;
        if !stepped_back && at > stored_at {
            if debt > 0 && limit > fastest {
                (fastest, faster) = (limit, true);
            }
            let refilled = at - stored_at;
            debt = if refilled >= ceil_div(debt, limit) {
                0
            } else {
                debt - refilled * limit
            };
        }
        *self = Self {
            at,
            debt,
            window,
            limit: check.limit().max(1),
            fastest,
            floor,
            held_until: self.held_until,
        };
        rewindowed || stepped_back || faster
    }

    /// When the bucket holds requests held for their delay and is now
    /// measured under another window, which would clamp the debt they
    /// added: until when (µs) it decides nothing (see
    /// `Placed::HeldElsewhere` in `spent.rs`).
    pub(super) fn held_elsewhere(&self, now: u64, check: &Check) -> Option<u64> {
        (self.window != 0 && self.window != check.window_micros() && self.held_until > now)
            .then_some(self.held_until)
    }

    fn full(check: &Check, window: u64) -> u64 {
        u64::from(check.burst) * window
    }

    /// How many of `units` a settlement may add to the debt: as many as
    /// keep it within 2^52 (and a request's cost within a `u32`), so the
    /// arithmetic stays exact, as the Redis script has it.
    pub(super) fn chargeable(&self, units: u64) -> u32 {
        let room = HOLD_PRODUCT.saturating_sub(self.debt) / self.window.max(1);
        u32::try_from(units.min(room)).unwrap_or(u32::MAX)
    }

    pub(super) fn fits(&self, check: &Check) -> bool {
        self.debt + u64::from(check.cost) * self.window <= Self::full(check, self.window)
    }

    /// Whether a request held until `pass` fits then, after
    /// [`place`](Self::place): the debt only falls as time passes, but a
    /// request held so long (by another policy) that the debt it would
    /// start from passes 2^52 is not held, as the script's doubles would
    /// no longer be exact.
    pub(super) fn fits_at(&self, check: &Check, pass: u64) -> bool {
        let gap = pass.saturating_sub(self.at);
        u64::from(check.cost) * self.window <= Self::full(check, self.window)
            && gap <= HOLD_PRODUCT / u64::from(self.limit.max(1))
    }

    /// Records `cost` units, taken at `pass` (now, or when a held request
    /// passes: the bucket refills nothing for the time it waits); returns
    /// the time a refund names: when they were taken.
    pub(super) fn record(&mut self, cost: u32, pass: u64, held: bool) -> u64 {
        if held {
            self.held_until = self.held_until.max(pass);
        }
        let limit = u64::from(self.limit.max(1));
        let start = self.at.max(pass);
        self.debt = self.debt.max((start - self.at) * limit) + u64::from(cost) * self.window;
        start
    }

    /// Gives back what `cost` units taken at `start` (see
    /// [`record`](Self::record)) may still owe, after
    /// [`place`](Self::place): their cost less what the bucket may have
    /// repaid since at the fastest limit it refilled at, never more than
    /// the debt. So a refund never gives back a unit already repaid, nor
    /// another request's, whatever tier refilled the bucket and whatever
    /// was refunded ahead of it; one long after the request gives back
    /// nothing.
    ///
    /// Nothing either for a time at or before the floor: one the clock
    /// stepped back from (a new clock's times are not comparable to it
    /// until it catches up), or a charge alone (time 0).
    ///
    /// While a held request has yet to pass, nothing: it passes at a time
    /// fixed when it was recorded, and debt taken back from ahead of it
    /// would let a new request take a slot beside it.
    pub(super) fn refund(&mut self, start: u64, cost: u32) -> bool {
        if self.held_until > self.at || start <= self.floor || start > self.at {
            return false;
        }
        let repaid = (self.at - start).saturating_mul(self.fastest);
        let unrepaid = (u64::from(cost) * self.window)
            .saturating_sub(repaid)
            .min(self.debt);
        self.debt -= unrepaid;
        unrepaid > 0
    }

    /// Whether the bucket is full again by `now`.
    pub(super) fn is_idle(&self, now: u64) -> bool {
        self.window == 0
            || now.saturating_sub(self.at) >= ceil_div(self.debt, u64::from(self.limit.max(1)))
    }

    /// Microseconds from `now` until `units` more fit.
    fn wait(&self, now: u64, check: &Check, units: u64) -> u64 {
        let full = Self::full(check, self.window);
        let need = self.debt + units * self.window;
        if need <= full {
            return 0;
        }
        ceil_div(need - full, u64::from(check.limit().max(1))) + self.at.saturating_sub(now)
    }

    pub(super) fn decision(&self, now: u64, check: &Check, admitted: bool) -> Decision {
        let full = Self::full(check, self.window);
        let remaining =
            (full.saturating_sub(self.debt) / self.window.max(1)).min(u64::from(check.burst));
        let reset = if remaining >= u64::from(check.burst) {
            0
        } else {
            self.wait(now, check, remaining + 1)
        };
        let retry_after = (!admitted && !self.fits(check))
            .then(|| Duration::from_micros(self.wait(now, check, u64::from(check.cost))));
        Decision::decided(
            admitted,
            check.burst,
            u32::try_from(remaining).unwrap_or(u32::MAX),
            Duration::from_micros(reset),
            retry_after,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::Key;
    use crate::policy::{Algorithm, Policy};

    const SECOND: u64 = 1_000_000;

    /// 10 a second, in a bucket of `burst`.
    fn check(burst: u32, cost: u32) -> Check {
        let policy = Policy::new("b", 10, Duration::from_secs(1))
            .with_algorithm(Algorithm::TokenBucket)
            .with_burst(burst)
            .with_cost(cost);
        Check::new(&policy, Key::new("k")).unwrap()
    }

    fn take(bucket: &mut TokenBucket, now: u64, check: &Check) -> Decision {
        bucket.place(now, check);
        let fits = bucket.fits(check);
        if fits {
            bucket.record(check.cost, now, false);
        }
        bucket.decision(now, check, fits)
    }

    #[test]
    fn a_full_bucket_spends_its_burst_then_refills_at_the_rate() {
        let check = check(5, 1);
        let mut bucket = TokenBucket::default();
        for left in (0..5).rev() {
            let decision = take(&mut bucket, 0, &check);
            assert!(decision.admitted());
            assert_eq!((decision.limit(), decision.remaining()), (5, left));
        }
        let denied = take(&mut bucket, 0, &check);
        assert!(!denied.admitted());
        // One unit refills every 100 ms.
        assert_eq!(denied.retry_after(), Some(Duration::from_millis(100)));
        assert!(!take(&mut bucket, SECOND / 10 - 1, &check).admitted);
        assert!(take(&mut bucket, SECOND / 10, &check).admitted);
        assert!(!take(&mut bucket, SECOND / 10, &check).admitted);
    }

    #[test]
    fn the_retry_time_is_when_the_whole_cost_fits() {
        let mut bucket = TokenBucket::default();
        assert!(take(&mut bucket, 0, &check(5, 5)).admitted());
        let denied = take(&mut bucket, 0, &check(5, 3));
        assert_eq!(denied.retry_after(), Some(Duration::from_millis(300)));
        assert_eq!(denied.reset(), Duration::from_millis(100));
        // Fractional intervals are exact: 3 a second is 333,333.33 µs a unit.
        let policy = Policy::new("b", 3, Duration::from_secs(1))
            .with_algorithm(Algorithm::TokenBucket)
            .with_burst(1);
        let third = Check::new(&policy, Key::new("k")).unwrap();
        let mut bucket = TokenBucket::default();
        assert!(take(&mut bucket, 0, &third).admitted);
        let denied = take(&mut bucket, 0, &third);
        assert_eq!(denied.retry_after(), Some(Duration::from_micros(333_334)));
        assert!(!take(&mut bucket, 333_333, &third).admitted);
        assert!(take(&mut bucket, 333_334, &third).admitted);
    }

    #[test]
    fn a_clock_that_steps_back_refills_nothing() {
        let check = check(1, 1);
        let mut bucket = TokenBucket::default();
        assert!(take(&mut bucket, 10 * SECOND, &check).admitted);
        // Back half a second: still the same debt, nothing refilled.
        assert!(!take(&mut bucket, 10 * SECOND - SECOND / 2, &check).admitted);
        assert!(take(&mut bucket, 10 * SECOND + SECOND / 10, &check).admitted);
    }
}
