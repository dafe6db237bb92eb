//! Concurrency leases as kept by [`MemoryStore`](super::MemoryStore), the
//! in-process twin of `lua/lease.lua`: each lease named by
//! the id its check carries (known before the store is asked, so that a
//! request whose check failed or was dropped can still release it), and
//! expiring a lease time after it was taken.

use std::collections::BTreeSet;
use std::hash::{BuildHasher, RandomState};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::store::{Check, Decision};

/// How long a full set of leases tells a client to wait: leases end when
/// their requests do, which no store knows in advance.
const RETRY: Duration = Duration::from_secs(1);

/// A new lease id: unique in this process (a counter), and across
/// processes with all but negligible odds (from a random start).
pub(crate) fn next_id() -> u64 {
    static START: OnceLock<u64> = OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let start = *START.get_or_init(|| RandomState::new().hash_one("slidegate lease ids"));
    start.wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed))
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Leases {
    /// The live leases: when (µs) each was taken, and its id.
    taken: BTreeSet<(u64, u64)>,
    /// When each live lease was taken, by id.
    by_id: foldhash::HashMap<u64, u64>,
    /// The lease time, in µs, as of the last decision.
    lease: u64,
}

impl Leases {
    /// Drops the leases that have expired by `now`.
    pub(super) fn prepare(&mut self, now: u64, check: &Check) {
        self.lease = check.window_micros();
        let cutoff = now.saturating_sub(self.lease);
        while let Some(&(at, id)) = self.taken.first()
            && at <= cutoff
        {
            self.taken.pop_first();
            self.by_id.remove(&id);
        }
    }

    pub(super) fn fits(&self, check: &Check) -> bool {
        self.taken.len() < check.limit() as usize
    }

    /// Takes the lease `id` at `now` (again, if it holds it: one lease
    /// per id, as on Redis); returns the time it was taken at.
    pub(super) fn record(&mut self, now: u64, id: u64) -> u64 {
        if let Some(before) = self.by_id.insert(id, now) {
            self.taken.remove(&(before, id));
        }
        self.taken.insert((now, id));
        now
    }

    /// Keeps the lease of `check` a lease time from `now`: one still held,
    /// or else one taken again within the limit (it expired, or its
    /// store's state was lost). Whether it is held.
    pub(super) fn renew(&mut self, now: u64, check: &Check) -> bool {
        self.prepare(now, check);
        if !self.by_id.contains_key(&check.id) && !self.fits(check) {
            return false;
        }
        self.record(now, check.id);
        true
    }

    /// Releases the lease `id`, if it is held.
    pub(super) fn release(&mut self, id: u64) {
        if let Some(at) = self.by_id.remove(&id) {
            self.taken.remove(&(at, id));
        }
    }

    pub(super) fn is_idle(&self, now: u64) -> bool {
        self.taken
            .last()
            .is_none_or(|&(newest, _)| newest <= now.saturating_sub(self.lease))
    }

    pub(super) fn decision(&self, check: &Check, admitted: bool) -> Decision {
        let held = u32::try_from(self.taken.len()).unwrap_or(u32::MAX);
        Decision::decided(
            admitted,
            check.limit,
            check.limit.saturating_sub(held),
            if held == 0 { Duration::ZERO } else { RETRY },
            (!admitted && !self.fits(check)).then_some(RETRY),
        )
    }
}
