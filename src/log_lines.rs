//! [`OncePerSecond`]: at most one log line a second for a repeated failure. A
//! Redis outage under load would otherwise write one identical line per
//! request, burying everything else in the log.

use std::sync::LazyLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// When the process first asked for the time of a log line.
static STARTED: LazyLock<Instant> = LazyLock::new(Instant::now);

/// Lets one event through per second and counts the ones it holds back.
#[derive(Debug)]
pub(crate) struct OncePerSecond {
    /// The second (counted from [`STARTED`], plus one) from which the next
    /// event may go through; 0 before the first.
    next_second: AtomicU64,
    held_back: AtomicU64,
}

/// Failures of the store, open or closed, from every layer in the process.
pub(crate) static STORE_FAILURES: OncePerSecond = OncePerSecond::new();

/// Requests of clients a full store does not track, limited locally.
pub(crate) static STORE_FULL: OncePerSecond = OncePerSecond::new();

/// Requests that reached a `PeerIp` without a peer address: a server set
/// up without connect info, which would otherwise log once per request.
pub(crate) static MISSING_PEER_ADDRESS: OncePerSecond = OncePerSecond::new();

/// Limit lookups that answered a limit the policy cannot count.
pub(crate) static LIMIT_LOOKUP_INVALID: OncePerSecond = OncePerSecond::new();

/// WebSocket messages the store could not count, passed.
pub(crate) static MESSAGES_UNCOUNTED: OncePerSecond = OncePerSecond::new();

/// The store's deny list and limits could not be read.
pub(crate) static RUNTIME_CHANGES_UNREAD: OncePerSecond = OncePerSecond::new();

/// Refunds the store could not take.
pub(crate) static REFUND_FAILURES: OncePerSecond = OncePerSecond::new();

/// Settlements the store could not take, and usage headers that held no
/// integer.
pub(crate) static SETTLE_FAILURES: OncePerSecond = OncePerSecond::new();

/// Concurrency leases the store could not release.
pub(crate) static RELEASE_FAILURES: OncePerSecond = OncePerSecond::new();

/// Rejection hooks' axum responses whose body was not complete at once.
#[cfg(feature = "axum")]
pub(crate) static INCOMPLETE_HOOK_BODIES: OncePerSecond = OncePerSecond::new();

impl OncePerSecond {
    pub(crate) const fn new() -> Self {
        Self {
            next_second: AtomicU64::new(0),
            held_back: AtomicU64::new(0),
        }
    }

    /// `Some(held back since the last one)` if this event is to be logged.
    pub(crate) fn admit(&self) -> Option<u64> {
        self.admit_at(STARTED.elapsed().as_secs() + 1)
    }

    fn admit_at(&self, second: u64) -> Option<u64> {
        let next = self.next_second.load(Ordering::Relaxed);
        if second >= next
            && self
                .next_second
                .compare_exchange(next, second + 1, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            Some(self.held_back.swap(0, Ordering::Relaxed))
        } else {
            self.held_back.fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_event_a_second_goes_through_with_the_count_held_back() {
        let lines = OncePerSecond::new();
        assert_eq!(lines.admit_at(1), Some(0), "the first is logged");
        assert_eq!(lines.admit_at(1), None);
        assert_eq!(lines.admit_at(1), None);
        assert_eq!(
            lines.admit_at(2),
            Some(2),
            "the next second says two were held back"
        );
        assert_eq!(lines.admit_at(2), None);
        assert_eq!(lines.admit_at(9), Some(1));
    }
}
