//! The sliding counter as kept by [`MemoryStore`](super::MemoryStore),
//! the in-process twin of `lua/counter.lua`, and what the fixed window
//! (`fixed.rs`) and the calendar share with it.
//!
//! Windows are aligned to the Unix epoch: window `n` covers
//! `[n·W, (n+1)·W)`.
//!
//! The sliding counter estimates the units in the sliding window as
//! `previous · (W − e) / W + current`, where `e` is the time elapsed in the
//! current window. It works in whole milliseconds and in integers only:
//! a request of cost `c` fits when
//! `previous · (W − e) + (current + c) · W ≤ limit · W`, and
//! [`Policy`](crate::Policy) validation keeps `limit · W` below 2^51, so the
//! same arithmetic is exact in Redis's Lua (doubles) and here.

use std::time::Duration;

use crate::store::Decision;

/// `floor(a / b)` for `b > 0`, with negative `a` giving 0.
fn floor_div(a: i128, b: i128) -> i128 {
    if a <= 0 { 0 } else { a / b }
}

/// The time counts last counted at `counted_us` are placed at for a
/// decision at `now_us`: no earlier than that, unless the clock stepped
/// back by more than `window_us` since.
pub(super) fn placed_at(counted_us: u64, now_us: u64, window_us: u64) -> u64 {
    if counted_us.saturating_sub(now_us) > window_us {
        now_us
    } else {
        counted_us.max(now_us)
    }
}

/// Microseconds from `now_us` to the millisecond `at_ms`, at least zero.
fn micros_until(at_ms: u64, now_us: u64) -> u64 {
    (at_ms * 1000).saturating_sub(now_us)
}

/// Two epoch-aligned fixed windows, the previous weighted by its overlap
/// with the sliding window.
///
/// Both counters place the current time no earlier than the latest time
/// a unit was counted at (`counted_us`), as the Redis script does: a clock
/// that steps back never takes them back to an earlier window, which
/// would forget the count. Peeks and denials place nothing. Waits are
/// still measured from the real time.
///
/// Both keep their counts when the window changes between checks (a tier
/// with a window of its own): each count is placed in the new window that
/// holds the latest time it can have been counted at, so it is never
/// forgotten early, and it still leaves once nothing more is counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct SlidingCounter {
    /// The id of the current window.
    id: u64,
    current: u64,
    previous: u64,
    /// The window in milliseconds, as of the last roll.
    window_ms: u64,
    /// The time the window is placed at for the current decision, in µs.
    at_us: u64,
    /// The latest time a unit was counted at, in µs.
    counted_us: u64,
    /// Units of requests held for their delay into the next window.
    ahead: u64,
}

/// Counts re-placed under a new window length.
#[derive(Debug, Default)]
struct Replaced {
    /// The new window id, of the time the counts are placed at.
    id: u64,
    current: u64,
    previous: u64,
}

impl Replaced {
    /// Adds `units` last counted at `at` (in the new window's unit),
    /// dropping them if that falls before the previous window.
    fn place(&mut self, units: u64, at: u64, window: u64) {
        let bucket = at / window;
        if bucket >= self.id {
            self.current += units;
        } else if bucket + 1 == self.id {
            self.previous += units;
        }
    }
}

/// Where the current time falls: window id and milliseconds into it.
#[derive(Debug, Clone, Copy)]
struct Position {
    now_ms: u64,
    id: u64,
    elapsed: u64,
    window: u64,
}

impl Position {
    fn new(now_us: u64, window_ms: u64) -> Self {
        let now_ms = now_us / 1000;
        let id = now_ms / window_ms;
        Self {
            now_ms,
            id,
            elapsed: now_ms - id * window_ms,
            window: window_ms,
        }
    }
}

impl SlidingCounter {
    /// Moves the counts to the window that holds `now_us`, or the latest
    /// time a unit was counted at if the clock has stepped back since, by
    /// at most a window. After a longer step back the counts are carried
    /// into `now_us`'s window: kept, and gone within two windows of the
    /// new time. Returns whether the counts had to move (carried back, or
    /// re-placed under a new window length), which the Redis script writes
    /// even when it counts nothing.
    pub(super) fn roll(&mut self, now_us: u64, window_ms: u64) -> bool {
        let stepped_back = self.counted_us.saturating_sub(now_us) > window_ms * 1000;
        self.at_us = placed_at(self.counted_us, now_us, window_ms * 1000);
        let rewindowed = self.window_ms != 0 && self.window_ms != window_ms;
        if rewindowed {
            self.rewindow(window_ms);
        }
        let id = Position::new(self.at_us, window_ms).id;
        let carried = stepped_back && self.id > id;
        if carried {
            self.id = id;
            self.counted_us = self.at_us;
        }
        if self.id + 1 == id {
            self.previous = self.current;
            self.current = std::mem::take(&mut self.ahead);
        } else if self.id + 2 == id {
            self.previous = std::mem::take(&mut self.ahead);
            self.current = 0;
        } else if self.id != id {
            (self.previous, self.current, self.ahead) = (0, 0, 0);
        }
        self.id = id;
        self.window_ms = window_ms;
        rewindowed || carried
    }

    /// When the counts hold units of requests held into the next window
    /// and are now counted under another window length, which could not
    /// keep those units until their requests pass: until when (µs) they
    /// decide nothing (see `Placed::HeldElsewhere` in `spent.rs`).
    pub(super) fn held_elsewhere(&self, now_us: u64, window_ms: u64) -> Option<u64> {
        let until_ms = (self.id + 2) * self.window_ms;
        let at_ms = placed_at(self.counted_us, now_us, window_ms * 1000) / 1000;
        (self.ahead > 0 && self.window_ms != 0 && self.window_ms != window_ms && at_ms < until_ms)
            .then_some(until_ms * 1000)
    }

    /// Re-places the counts, as of `at_us` under the old window, in
    /// `window_ms` windows: the current count at the latest time a unit
    /// was counted, the previous one at the end of its window, and units
    /// held into the next window in the window of `at_us` (never
    /// forgotten early; at worst counted a little long).
    fn rewindow(&mut self, window_ms: u64) {
        let old = self.window_ms;
        let now_ms = self.at_us / 1000;
        let old_id = now_ms / old;
        if old_id == self.id + 1 {
            self.previous = std::mem::take(&mut self.current);
        } else if old_id > self.id + 1 {
            (self.previous, self.current) = (0, 0);
        }
        let ahead = if old_id > self.id + 2 { 0 } else { self.ahead };
        self.ahead = 0;
        let old_id = old_id.max(self.id);
        let counted_ms = self.counted_us / 1000;
        let mut replaced = Replaced {
            id: now_ms / window_ms,
            ..Replaced::default()
        };
        replaced.place(self.current, counted_ms, window_ms);
        replaced.place(
            self.previous,
            (old_id * old).saturating_sub(1).min(counted_ms),
            window_ms,
        );
        replaced.place(ahead, now_ms, window_ms);
        self.id = replaced.id;
        self.current = replaced.current;
        self.previous = replaced.previous;
        self.window_ms = window_ms;
    }

    fn weighted(&self, at: Position, extra: u64) -> i128 {
        i128::from(self.previous) * i128::from(at.window - at.elapsed)
            + i128::from(self.current + extra) * i128::from(at.window)
    }

    /// Whether `cost` more units fit, after [`roll`](Self::roll): the
    /// estimate, and with units held into the next window, their sum
    /// with the current count (so the next window still fits them).
    /// How many of `units` a settlement may count: at most the limit,
    /// and no more than bring the current count to twice the limit, so
    /// the arithmetic stays exact, as the Redis script has it.
    pub(super) fn chargeable(&self, units: u64, limit: u32) -> u32 {
        let room = (2 * u64::from(limit)).saturating_sub(self.current);
        u32::try_from(units.min(room).min(u64::from(limit))).unwrap_or(u32::MAX)
    }

    pub(super) fn fits(&self, limit: u32, cost: u32) -> bool {
        let at = Position::new(self.at_us, self.window_ms);
        self.weighted(at, u64::from(cost)) <= i128::from(limit) * i128::from(at.window)
            && self.ahead_fits(limit, cost)
    }

    fn ahead_fits(&self, limit: u32, cost: u32) -> bool {
        self.ahead == 0 || self.current + u64::from(cost) + self.ahead <= u64::from(limit)
    }

    /// Whether `cost` more units fit at `pass_us`, in the current window or
    /// the next (a delay holds a request no further), after
    /// [`roll`](Self::roll).
    pub(super) fn fits_at(&self, limit: u32, cost: u32, pass_us: u64) -> bool {
        let at_ms = self.at_us.max(pass_us) / 1000;
        let w = self.window_ms;
        let id = at_ms / w;
        let elapsed = i128::from(at_ms - id * w);
        let (w, limit, cost) = (i128::from(w), i128::from(limit), i128::from(cost));
        let (previous, current, ahead) = (
            i128::from(self.previous),
            i128::from(self.current),
            i128::from(self.ahead),
        );
        if id == self.id {
            previous * (w - elapsed) + (current + cost) * w <= limit * w
                && (ahead == 0 || current + cost + ahead <= limit)
        } else if id == self.id + 1 {
            current * (w - elapsed) + (ahead + cost) * w <= limit * w
        } else {
            false
        }
    }

    /// Records `cost` units at `pass_us` (now, or when a held request
    /// passes: in the next window, they are held there); returns the time
    /// they were counted at.
    pub(super) fn record(&mut self, cost: u32, pass_us: u64) -> u64 {
        self.counted_us = self.at_us;
        if pass_us / 1000 / self.window_ms > self.id {
            self.ahead += u64::from(cost);
            return pass_us;
        }
        self.current += u64::from(cost);
        self.at_us
    }

    /// Takes back `cost` units counted at `at_us`, after
    /// [`roll`](Self::roll): from the window that holds it, if it is the
    /// current or the previous one and holds any. Returns whether it did.
    pub(super) fn refund(&mut self, at_us: u64, cost: u32) -> bool {
        let bucket = at_us / 1000 / self.window_ms;
        let cost = u64::from(cost);
        let count = if bucket == self.id + 1 {
            &mut self.ahead
        } else if bucket == self.id {
            &mut self.current
        } else if bucket + 1 == self.id {
            &mut self.previous
        } else {
            return false;
        };
        if *count == 0 {
            return false;
        }
        *count = count.saturating_sub(cost);
        true
    }

    /// Whether the counts can no longer matter at `now_us`.
    pub(super) fn is_idle(&self, now_us: u64) -> bool {
        let windows = if self.ahead > 0 { 3 } else { 2 };
        self.window_ms == 0
            || Position::new(now_us.max(self.at_us), self.window_ms).id >= self.id + windows
    }

    /// The first millisecond at which `cost` units fit, if nothing more is
    /// admitted meanwhile.
    fn first_fit_ms(&self, at: Position, limit: u32, cost: u32) -> u64 {
        let (limit, cost, w) = (i128::from(limit), i128::from(cost), i128::from(at.window));
        let (previous, current) = (i128::from(self.previous), i128::from(self.current));
        // In this window the estimate falls as the previous window slides
        // out: the smallest e' with previous·(W − e') ≤ room·W.
        let ahead = i128::from(self.ahead);
        let room = limit - current - cost;
        if room >= 0 && room >= ahead {
            if previous * (w - i128::from(at.elapsed)) <= room * w {
                return at.now_ms;
            }
            let elapsed = w - room * w / previous;
            if elapsed < w {
                return at.id * at.window + elapsed as u64;
            }
        }
        // In the next window, the current count becomes the previous one,
        // beside what is held into it.
        let next = (at.id + 1) * at.window;
        let next_room = limit - ahead - cost;
        if ahead > 0 && next_room < 0 {
            return next + at.window;
        }
        if current == 0 {
            return next;
        }
        let elapsed = (w - next_room * w / current).max(0);
        if elapsed < w {
            next + elapsed as u64
        } else {
            next + at.window
        }
    }

    /// The decision after [`roll`](Self::roll) (and [`record`](Self::record),
    /// if admitted). `reset` is when one more unit fits.
    pub(super) fn decision(&self, now_us: u64, limit: u32, cost: u32, admitted: bool) -> Decision {
        let at = Position::new(self.at_us, self.window_ms);
        let room = i128::from(limit) * i128::from(at.window) - self.weighted(at, 0);
        let mut remaining = floor_div(room, i128::from(at.window)).min(i128::from(limit)) as u32;
        if self.ahead > 0 {
            let left = u64::from(limit).saturating_sub(self.current + self.ahead);
            remaining = remaining.min(u32::try_from(left).unwrap_or(u32::MAX));
        }
        let reset = if remaining >= limit {
            0
        } else {
            micros_until(self.first_fit_ms(at, limit, remaining + 1), now_us)
        };
        let retry_after = (!admitted && !self.fits(limit, cost)).then(|| {
            Duration::from_micros(micros_until(self.first_fit_ms(at, limit, cost), now_us))
        });
        Decision::decided(
            admitted,
            limit,
            remaining,
            Duration::from_micros(reset),
            retry_after,
        )
    }
}

/// The decision of a count of `count` units of `limit` whose window (or
/// period) ends in `ends_in`: a fixed window's or a calendar quota's.
pub(super) fn count_decision(
    admitted: bool,
    limit: u32,
    count: u64,
    ends_in: Duration,
    retry_after: Option<Duration>,
) -> Decision {
    Decision::decided(
        admitted,
        limit,
        u32::try_from(u64::from(limit).saturating_sub(count)).unwrap_or(0),
        if count > 0 { ends_in } else { Duration::ZERO },
        retry_after,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const W_MS: u64 = 60_000;
    const W_US: u64 = W_MS * 1000;

    fn counter_at(now_us: u64) -> SlidingCounter {
        let mut counter = SlidingCounter::default();
        counter.roll(now_us, W_MS);
        counter
    }

    #[test]
    fn sliding_counter_weights_the_previous_window() {
        // 10 units in window 1; at 25% into window 2 they weigh 7.5.
        let mut counter = counter_at(W_US);
        counter.record(10, 0);
        let now = 2 * W_US + W_US / 4;
        counter.roll(now, W_MS);
        assert!(counter.fits(10, 2));
        assert!(!counter.fits(10, 3));
        let decision = counter.decision(now, 10, 3, false);
        assert_eq!(decision.remaining(), 2);
        // 3 units fit once the previous window weighs 7: at 30%.
        assert_eq!(
            decision.retry_after(),
            Some(Duration::from_micros(W_US * 3 / 10 - W_US / 4))
        );
        // One more unit (3 in all) is the same moment.
        assert_eq!(decision.reset(), decision.retry_after().unwrap());
    }

    #[test]
    fn sliding_counter_retry_can_fall_in_the_next_window() {
        // The current window is full: nothing fits before it becomes the
        // previous one and decays enough.
        let now = 5 * W_US + W_US / 2;
        let mut counter = counter_at(now);
        counter.record(10, 0);
        let decision = counter.decision(now, 10, 4, false);
        assert_eq!(decision.remaining(), 0);
        // In window 6, 10·(W − e)/W ≤ 6 from e = 0.4·W.
        assert_eq!(
            decision.retry_after(),
            Some(Duration::from_micros(6 * W_US + W_US * 4 / 10 - now))
        );
        // A cost equal to the limit waits for the whole next window.
        let full = counter.decision(now, 10, 10, false);
        assert_eq!(
            full.retry_after(),
            Some(Duration::from_micros(7 * W_US - now))
        );
    }

    #[test]
    fn sliding_counter_forgets_after_two_windows() {
        let mut counter = counter_at(0);
        counter.record(5, 0);
        assert!(!counter.is_idle(W_US));
        assert!(counter.is_idle(2 * W_US));
        counter.roll(3 * W_US, W_MS);
        assert_eq!(counter.decision(3 * W_US, 5, 1, false).remaining, 5);
    }
}
