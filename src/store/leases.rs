//! Concurrency leases as kept by [`MemoryStore`](super::MemoryStore), the
//! in-process twin of their half of `lua/check.lua`: the times leases
//! were taken at, each unique, each expiring a lease time later.

use std::collections::BTreeSet;
use std::time::Duration;

use crate::store::{Check, Decision};

/// How long a full set of leases tells a client to wait: leases end when
/// their requests do, which no store knows in advance.
const RETRY: Duration = Duration::from_secs(1);

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Leases {
    /// The times (µs) the live leases were taken at.
    taken: BTreeSet<u64>,
    /// The lease time, in µs, as of the last decision.
    lease: u64,
}

impl Leases {
    /// Drops the leases that have expired by `now`.
    pub(super) fn prepare(&mut self, now: u64, check: &Check) {
        self.lease = check.window_micros();
        let cutoff = now.saturating_sub(self.lease);
        while self.taken.first().is_some_and(|&at| at <= cutoff) {
            self.taken.pop_first();
        }
    }

    pub(super) fn fits(&self, check: &Check) -> bool {
        self.taken.len() < check.limit as usize
    }

    /// Takes a lease; returns the time it was taken at, which releases it.
    pub(super) fn record(&mut self, now: u64) -> u64 {
        let at = self.taken.last().map_or(now, |&newest| now.max(newest + 1));
        self.taken.insert(at);
        at
    }

    /// Releases the lease taken at `at`.
    pub(super) fn release(&mut self, at: u64) {
        self.taken.remove(&at);
    }

    pub(super) fn is_idle(&self, now: u64) -> bool {
        self.taken
            .last()
            .is_none_or(|&newest| newest <= now.saturating_sub(self.lease))
    }

    pub(super) fn decision(&self, check: &Check, admitted: bool) -> Decision {
        let held = u32::try_from(self.taken.len()).unwrap_or(u32::MAX);
        Decision {
            admitted,
            limit: check.limit,
            remaining: check.limit.saturating_sub(held),
            reset: if held == 0 { Duration::ZERO } else { RETRY },
            retry_after: (!admitted && !self.fits(check)).then_some(RETRY),
            recorded_at: None,
            blocked_for: None,
        }
    }
}
