//! When Redis may have lost state it held for clients: it answers again
//! after calls failed (down, unreachable, too slow), or a call found the
//! library missing (a server restarted empty, a new node). The layer
//! watches the count (see [`Store::recoveries`](crate::store::Store::recoveries))
//! to renew upgraded connections' leases at once.

use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::watch;

pub(super) struct Recoveries {
    /// Set by a call that failed, until one is answered.
    failing: AtomicBool,
    count: watch::Sender<u64>,
}

impl Recoveries {
    pub(super) fn new() -> Self {
        Self {
            failing: AtomicBool::new(false),
            count: watch::Sender::new(0),
        }
    }

    /// Notes a call that failed: Redis was not reached, or did not answer
    /// in time.
    pub(super) fn failed(&self) {
        self.failing.store(true, Ordering::Relaxed);
    }

    /// Notes a call that Redis answered: a recovery, if calls failed
    /// before it.
    pub(super) fn answered(&self) {
        if self.failing.load(Ordering::Relaxed) && self.failing.swap(false, Ordering::Relaxed) {
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
