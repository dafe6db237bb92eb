//! When Redis may have lost state it held for clients: it answers again
//! after calls failed for a while (down, unreachable, too slow), or a
//! call found the library missing (a server restarted empty, a new node).
//! The layer watches the count (see [`Store::recoveries`](crate::store::Store::recoveries))
//! to renew upgraded connections' leases at once (each connection at most
//! once a second); so that a Redis that is merely slow now and then
//! starts no renewals, failures count only once they have lasted
//! [`OUTAGE`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::clock::duration_micros;

/// How long calls must have failed for an answer to count as a recovery.
const OUTAGE: Duration = Duration::from_secs(1);

pub(super) struct Recoveries {
    /// What the times below count from.
    started: Instant,
    /// When the first of the calls failing now failed, in µs from
    /// `started`, plus one; 0 while calls are answered.
    failing_since: AtomicU64,
    count: watch::Sender<u64>,
}

impl Recoveries {
    pub(super) fn new() -> Self {
        Self {
            started: Instant::now(),
            failing_since: AtomicU64::new(0),
            count: watch::Sender::new(0),
        }
    }

    /// Now, in µs from `started`, plus one (never 0).
    fn now(&self) -> u64 {
        duration_micros(self.started.elapsed()).min(u64::MAX - 1) + 1
    }

    /// Notes a call that failed: Redis was not reached, or did not answer
    /// in time.
    pub(super) fn failed(&self) {
        let _ = self.failing_since.compare_exchange(
            0,
            self.now(),
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
    }

    /// Notes a call that Redis answered: a recovery, if calls had failed
    /// for [`OUTAGE`] before it.
    pub(super) fn answered(&self) {
        if self.failing_since.load(Ordering::Relaxed) == 0 {
            return;
        }
        let since = self.failing_since.swap(0, Ordering::Relaxed);
        if since != 0 && self.now().saturating_sub(since) >= duration_micros(OUTAGE) {
            self.recovered();
        }
    }

    /// Notes a Redis found without the library: restarted, perhaps empty.
    pub(super) fn lost(&self) {
        self.recovered();
    }

    fn recovered(&self) {
        self.count.send_modify(|count| *count += 1);
    }

    pub(super) fn watch(&self) -> watch::Receiver<u64> {
        self.count.subscribe()
    }
}
