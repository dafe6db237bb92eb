//! The exact sliding-window log kept by [`MemoryStore`](super::MemoryStore),
//! the in-process twin of the log in `lua/check.lua`.

use std::collections::VecDeque;
use std::time::Duration;

use crate::store::Decision;

/// Admitted requests of one client under one policy, oldest first, with the
/// running sum of their costs.
#[derive(Debug, Default)]
pub(super) struct Log {
    entries: VecDeque<(u64, u32)>,
    sum: u64,
    window_micros: u64,
}

impl Log {
    /// Drops entries that have left the window: an entry at `t` counts while
    /// `now - window < t`.
    ///
    /// If the clock has stepped back by more than a window since the newest
    /// entry, every entry is pulled back to `now`: the count stays, and
    /// leaves within a window of the new time.
    pub(super) fn prune(&mut self, now: u64, window_micros: u64) {
        self.window_micros = window_micros;
        while let Some(&(at, cost)) = self.entries.front() {
            if at.saturating_add(window_micros) > now {
                break;
            }
            self.entries.pop_front();
            self.sum -= u64::from(cost);
        }
        if self
            .entries
            .back()
            .is_some_and(|&(newest, _)| newest.saturating_sub(now) > window_micros)
        {
            for (at, _) in &mut self.entries {
                *at = (*at).min(now);
            }
        }
    }

    pub(super) fn fits(&self, limit: u32, cost: u32) -> bool {
        self.sum + u64::from(cost) <= u64::from(limit)
    }

    /// Records `cost` at `now`, or at the newest entry's time if the clock
    /// has stepped back since: entries stay in time order.
    /// Returns the time it was recorded at.
    pub(super) fn record(&mut self, now: u64, cost: u32) -> u64 {
        let at = self
            .entries
            .back()
            .map_or(now, |&(newest, _)| newest.max(now));
        self.entries.push_back((at, cost));
        self.sum += u64::from(cost);
        at
    }

    /// Takes back `cost` units recorded at `at`: the newest entry of that
    /// cost recorded no later than `at` (entries of one time and cost are
    /// alike). Nothing, if it has left the window.
    pub(super) fn refund(&mut self, at: u64, cost: u32) {
        if let Some(index) = self
            .entries
            .iter()
            .rposition(|&(time, units)| time <= at && units == cost)
        {
            self.entries.remove(index);
            self.sum -= u64::from(cost);
        }
    }

    /// Whether every entry has left the window, so the log can be dropped.
    pub(super) fn is_idle(&self, now: u64) -> bool {
        self.entries
            .back()
            .is_none_or(|&(at, _)| at.saturating_add(self.window_micros) <= now)
    }

    /// The decision for this log after pruning (and recording, if admitted).
    pub(super) fn decision(&self, now: u64, limit: u32, cost: u32, admitted: bool) -> Decision {
        let reset = self
            .entries
            .front()
            .map_or(0, |&(at, _)| at + self.window_micros - now);
        let retry_after = (!admitted && !self.fits(limit, cost)).then(|| {
            let need = self.sum + u64::from(cost) - u64::from(limit);
            let mut freed = 0;
            let leaves = self.entries.iter().find_map(|&(at, entry_cost)| {
                freed += u64::from(entry_cost);
                (freed >= need).then_some(at)
            });
            // cost <= limit, so freeing every entry always suffices.
            let at = leaves.unwrap_or(now);
            Duration::from_micros(at + self.window_micros - now)
        });
        Decision {
            admitted,
            limit,
            remaining: u32::try_from(u64::from(limit).saturating_sub(self.sum)).unwrap_or(0),
            reset: Duration::from_micros(reset),
            retry_after,
            recorded_at: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: u64 = 1_000_000;

    #[test]
    fn entry_leaves_exactly_one_window_later() {
        let mut log = Log::default();
        log.prune(0, W);
        log.record(0, 1);
        log.prune(W - 1, W);
        assert!(!log.fits(1, 1));
        assert_eq!(
            log.decision(W - 1, 1, 1, false).retry_after,
            Some(Duration::from_micros(1))
        );
        log.prune(W, W);
        assert!(log.fits(1, 1));
        assert!(log.is_idle(W));
    }

    #[test]
    fn a_refund_takes_back_that_request_only() {
        let mut log = Log::default();
        log.prune(0, W);
        log.record(0, 1);
        let at = log.record(100, 2);
        log.record(200, 1);
        log.refund(at, 2);
        assert_eq!(log.entries, [(0, 1), (200, 1)]);
        assert_eq!(log.sum, 2);
        // Once it has left the window there is nothing to take back.
        log.prune(W + 150, W);
        log.refund(0, 1);
        assert_eq!(log.sum, 1);
    }

    #[test]
    fn weighted_retry_after_waits_for_enough_units() {
        let mut log = Log::default();
        log.prune(0, W);
        log.record(0, 3);
        log.record(100, 3);
        log.record(200, 3);
        // 9 of 10 used; a cost of 5 needs 4 freed: the first two entries.
        let decision = log.decision(300, 10, 5, false);
        assert_eq!(decision.remaining, 1);
        assert_eq!(
            decision.retry_after,
            Some(Duration::from_micros(100 + W - 300))
        );
        assert_eq!(decision.reset, Duration::from_micros(W - 300));
    }
}
