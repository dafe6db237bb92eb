//! The fixed window as kept by [`MemoryStore`](super::MemoryStore), the
//! in-process twin of `lua/fixed.lua`: one epoch-aligned window, window
//! `n` covering `[n·W, (n+1)·W)`.

use std::time::Duration;

use super::counter::{count_decision, placed_at};
use crate::store::Decision;

/// One epoch-aligned fixed window: cheap, and leaky at the boundary.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct FixedWindow {
    id: u64,
    count: u64,
    window_us: u64,
    /// The time the window is placed at for the current decision, in µs.
    at_us: u64,
    /// The latest time a unit was counted at, in µs.
    counted_us: u64,
    /// Units of requests held for their delay into the next window.
    ahead: u64,
}

impl FixedWindow {
    /// Moves to the window that holds `now_us` (or the latest time a unit
    /// was counted at, if the clock has stepped back since by at most a
    /// window), emptying it if it is new. After a longer step back the
    /// count is carried into `now_us`'s window. Returns whether the count
    /// had to move (as [`SlidingCounter::roll`](super::counter::SlidingCounter::roll)).
    pub(super) fn roll(&mut self, now_us: u64, window_us: u64) -> bool {
        let stepped_back = self.counted_us.saturating_sub(now_us) > window_us;
        self.at_us = placed_at(self.counted_us, now_us, window_us);
        let id = self.at_us / window_us;
        let rewindowed = self.window_us != 0 && self.window_us != window_us;
        if rewindowed {
            // Under a new window length the count stays in the window that
            // holds the latest time a unit was counted at, if that is now's.
            // Units held into the next window have passed, and their
            // window ended, by now (see `held_elsewhere`).
            let old_id = self.at_us / self.window_us;
            if old_id > self.id || self.counted_us / window_us < id {
                self.count = 0;
            }
            self.ahead = 0;
            self.id = id;
        }
        let carried = stepped_back && self.id > id;
        if carried {
            self.id = id;
            self.counted_us = self.at_us;
        }
        if self.id + 1 == id {
            self.count = std::mem::take(&mut self.ahead);
        } else if id != self.id {
            (self.count, self.ahead) = (0, 0);
        }
        self.id = id;
        self.window_us = window_us;
        rewindowed || carried
    }

    /// As [`SlidingCounter::held_elsewhere`](super::counter::SlidingCounter::held_elsewhere).
    pub(super) fn held_elsewhere(&self, now_us: u64, window_us: u64) -> Option<u64> {
        let until = (self.id + 2) * self.window_us;
        (self.ahead > 0
            && self.window_us != 0
            && self.window_us != window_us
            && placed_at(self.counted_us, now_us, window_us) < until)
            .then_some(until)
    }

    pub(super) fn fits(&self, limit: u32, cost: u32) -> bool {
        self.count + u64::from(cost) <= u64::from(limit)
    }

    /// Whether `cost` more units fit at `pass_us`, in this window or the
    /// next (a delay holds a request no further), after [`roll`](Self::roll).
    pub(super) fn fits_at(&self, limit: u32, cost: u32, pass_us: u64) -> bool {
        let id = self.at_us.max(pass_us) / self.window_us;
        let count = if id == self.id {
            self.count
        } else if id == self.id + 1 {
            self.ahead
        } else {
            return false;
        };
        count + u64::from(cost) <= u64::from(limit)
    }

    /// Records `cost` units at `pass_us` (now, or when a held request
    /// passes: in the next window, they are held there); returns the time
    /// they were counted at.
    pub(super) fn record(&mut self, cost: u32, pass_us: u64) -> u64 {
        self.counted_us = self.at_us;
        if pass_us / self.window_us > self.id {
            self.ahead += u64::from(cost);
            return pass_us;
        }
        self.count += u64::from(cost);
        self.at_us
    }

    /// Takes back `cost` units counted at `at_us`, after
    /// [`roll`](Self::roll), if that was in the current window (or held
    /// into the next) and it holds any. Returns whether it did.
    pub(super) fn refund(&mut self, at_us: u64, cost: u32) -> bool {
        let id = at_us / self.window_us;
        let count = if id == self.id + 1 {
            &mut self.ahead
        } else if id == self.id {
            &mut self.count
        } else {
            return false;
        };
        if *count == 0 {
            return false;
        }
        *count = count.saturating_sub(u64::from(cost));
        true
    }

    pub(super) fn is_idle(&self, now_us: u64) -> bool {
        if self.window_us == 0 {
            return true;
        }
        let id = now_us.max(self.at_us) / self.window_us;
        id != self.id && (self.ahead == 0 || id > self.id + 1)
    }

    pub(super) fn decision(&self, now_us: u64, limit: u32, cost: u32, admitted: bool) -> Decision {
        let ends_in = Duration::from_micros((self.id + 1) * self.window_us - now_us);
        // What is held into the next window may leave no room there.
        let fits_in = if self.ahead > 0 && self.ahead + u64::from(cost) > u64::from(limit) {
            ends_in + Duration::from_micros(self.window_us)
        } else {
            ends_in
        };
        let retry_after = (!admitted && !self.fits(limit, cost)).then_some(fits_in);
        count_decision(admitted, limit, self.count, ends_in, retry_after)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W_US: u64 = 60_000_000;

    #[test]
    fn fixed_window_empties_at_the_boundary() {
        let mut window = FixedWindow::default();
        window.roll(W_US - 10, W_US);
        window.record(3, 0);
        let decision = window.decision(W_US - 10, 3, 1, false);
        assert_eq!(decision.retry_after(), Some(Duration::from_micros(10)));
        assert_eq!(decision.reset(), Duration::from_micros(10));
        window.roll(W_US, W_US);
        assert!(window.fits(3, 3));
        assert_eq!(window.decision(W_US, 3, 1, false).reset(), Duration::ZERO);
    }
}
