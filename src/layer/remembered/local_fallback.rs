//! [`LocalLimits`]: the in-process counts of policies that fall back to a
//! local limit ([`FailMode::Local`]) while the
//! store is unavailable.
//!
//! The local count of a client is kept whether the store answers or not:
//! each admission the store makes for a local-mode policy is recorded
//! here too (each policy on its own, at the local limit, so a count that
//! reaches it stays there), and each admission made here while the store
//! is down is here already. So when the store fails, the local count
//! starts from what the store admitted for the client; and for one window
//! after a failure, a request must fit the local count before the store
//! is asked, so admissions made locally while the store was down still
//! count when it answers again. Policies that count some responses only
//! are recorded too, and their units come back here when a response sends
//! them back to the store.
//! One instance (`local_share = 1`) thus admits at most the limit in any
//! window however the store flaps; with several instances, each holds its
//! share while the store is down and for a window after.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use smallvec::SmallVec;

use crate::layer::after::owed::Owed;
use crate::policy::{Algorithm, Count, FailMode, Settlement};
use crate::store::Checks;
use crate::store::{Check, Decisions, MemoryStore, Store};

/// The local counts of a layer, and when its store last failed.
pub(crate) struct LocalLimits {
    /// A `MemoryStore`, made on first use: most layers have no local-mode
    /// policy.
    store: OnceLock<Arc<dyn Store>>,
    /// When the store last failed, in µs after `epoch` plus one (0: never).
    failed_at: AtomicU64,
    epoch: Instant,
}

impl Default for LocalLimits {
    fn default() -> Self {
        Self {
            store: OnceLock::new(),
            failed_at: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }
}

/// A request's local checks, with what each counts.
#[derive(Debug)]
pub(crate) struct LocalChecks {
    pub(crate) checks: Checks,
    pub(crate) counts: SmallVec<[Count; 2]>,
    /// How each check's cost is settled after the response, if it is: in
    /// the local counts too, at the share of the cost reported.
    settlements: SmallVec<[Option<Settlement>; 2]>,
    /// The instances the limits are shared by.
    pub(crate) share: u32,
}

impl LocalChecks {
    /// The local checks of the enforced `checks` whose fail mode (in
    /// `fail_modes`, in order) is local: each at its limit divided by
    /// `share` (at least one unit), and its cost scaled alike (at least one
    /// unit), so a request costs the same share of a local limit as of the
    /// store's.
    pub(crate) fn of(
        checks: &[Check],
        fail_modes: &[FailMode],
        counts: &[Count],
        settlements: &[Option<Settlement>],
        share: u32,
    ) -> Self {
        let mut local = Self::empty(share);
        for (((check, mode), count), settlement) in
            checks.iter().zip(fail_modes).zip(counts).zip(settlements)
        {
            if *mode == FailMode::Local {
                local.push(check, *count, settlement.clone());
            }
        }
        local
    }

    fn empty(share: u32) -> Self {
        Self {
            checks: Checks::new(),
            counts: SmallVec::new(),
            settlements: SmallVec::new(),
            share,
        }
    }

    fn push(&mut self, check: &Check, count: Count, settlement: Option<Settlement>) {
        self.checks.push(local_check(check, self.share));
        self.counts.push(count);
        self.settlements.push(settlement);
    }

    /// How each check's cost is settled after the response, when some
    /// check's is.
    pub(crate) fn settlements(&self) -> Option<&[Option<Settlement>]> {
        self.settlements
            .iter()
            .any(Option::is_some)
            .then_some(&self.settlements[..])
    }

    /// Every one of the enforced `checks` at its share of its limit, as
    /// [`of`](Self::of) makes them, whatever its fail mode: for a request
    /// the store is too full to track (see [`StoreError::Full`](crate::store::StoreError::Full)),
    /// which is never admitted unlimited. `counts` in order, or `None`
    /// when every check counts every response.
    pub(crate) fn all(
        checks: &[Check],
        counts: Option<&[Count]>,
        settlements: Option<&[Option<Settlement>]>,
        share: u32,
    ) -> Self {
        let mut local = Self::empty(share);
        for (index, check) in checks.iter().enumerate() {
            // A lease too: the request is answered from these counts, so
            // its lease is given back to them.
            let count = counts.map_or(Count::All, |counts| counts[index]);
            let settlement = settlements.and_then(|settlements| settlements[index].clone());
            local.push(check, count, settlement);
        }
        local
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.checks.is_empty()
    }
}

/// `check` at `1 / share` of its limit and burst, and of its cost.
fn local_check(check: &Check, share: u32) -> Check {
    let mut local = check.clone();
    let share = share.max(1);
    local.limit = (check.limit() / share).max(1);
    local.burst = (check.burst / share).max(1);
    let scaled =
        (u64::from(check.cost) * u64::from(local.burst)).div_ceil(u64::from(check.burst.max(1)));
    local.cost = u32::try_from(scaled)
        .unwrap_or(u32::MAX)
        .clamp(1, local.burst);
    local
}

impl LocalLimits {
    /// The in-process store of the local counts.
    pub(crate) fn store(&self) -> &Arc<dyn Store> {
        self.store.get_or_init(|| Arc::new(MemoryStore::new()))
    }

    fn now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX) + 1
    }

    /// Decides `local` while the store is unavailable, and remembers that
    /// it was.
    pub(crate) fn decide(&self, local: &LocalChecks) -> Option<Decisions> {
        self.failed_at.fetch_max(self.now(), Ordering::Relaxed);
        self.store().check(&local.checks).into_ready().ok()?.ok()
    }

    /// Within a window of the store's last failure, the local decisions
    /// when the request does not fit the local counts: it is denied before
    /// the store is asked, so the store spends nothing on it.
    pub(crate) fn refuses(&self, local: &LocalChecks) -> Option<Decisions> {
        let failed_at = self.failed_at.load(Ordering::Relaxed);
        let window = local.checks.iter().map(|check| check.window()).max()?;
        let since = Duration::from_micros(self.now().saturating_sub(failed_at));
        if failed_at == 0 || since >= window {
            return None;
        }
        let decisions = self.store().peek(&local.checks).into_ready().ok()?.ok()?;
        (!decisions.iter().all(|decision| decision.admitted())).then_some(decisions)
    }

    /// Records an admission the store made in the local counts, each
    /// policy on its own (a count at its local limit stays there). For
    /// policies that count some responses only, the units to take back
    /// here too when the store's are.
    pub(crate) fn record(&self, local: &LocalChecks) -> Option<Owed> {
        let store = self.store();
        let (mut checks, mut decisions) = (Checks::new(), Decisions::new());
        let mut counts = SmallVec::<[Count; 2]>::new();
        for (check, &count) in local.checks.iter().zip(&local.counts) {
            // A lease the store gave is released to the store, never here.
            if check.algorithm() == Algorithm::Concurrency {
                continue;
            }
            // A memory store answers at once; nothing to wait for.
            let decided = store.check(std::slice::from_ref(check)).into_ready();
            if count != Count::All
                && let Ok(Ok(decided)) = decided
            {
                checks.push(check.clone());
                decisions.extend(decided.iter().copied());
                counts.push(count);
            }
        }
        Owed::of(
            store,
            &checks,
            &decisions,
            (Some(&counts), None),
            None,
            || None,
        )
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::key::Key;

    fn check(limit: u32, cost: u32) -> Check {
        let policy = crate::Policy::new("p", limit, Duration::from_secs(60));
        Check::new(&policy, Key::new("ip:192.0.2.1"))
            .unwrap()
            .with_cost(cost)
    }

    #[test]
    fn the_cost_scales_with_the_limit_and_always_fits() {
        for (limit, cost, share, local_limit, local_cost) in [
            (100, 1, 4, 25, 1),
            (100, 30, 4, 25, 8),
            (100, 100, 4, 25, 25),
            (10, 10, 3, 3, 3),
            (3, 2, 10, 1, 1),
            (u32::MAX, u32::MAX, 1, u32::MAX, u32::MAX),
        ] {
            let local = local_check(&check(limit, cost), share);
            assert_eq!((local.limit(), local.cost), (local_limit, local_cost));
        }
    }
}
