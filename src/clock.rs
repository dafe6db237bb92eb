//! Time sources for the memory store, the Redis store's script (when set)
//! and the deny cache, and for deterministic tests.
//!
//! Window logic never reads the system clock directly: it asks a [`Clock`]
//! for the current time in microseconds since the Unix epoch. Unless one is
//! set, that is the system's, monotonic and anchored to the wall clock once
//! (so it never steps backwards when NTP adjusts the system time);
//! [`FakeClock`] only moves when a test tells it to.

#[cfg(any(test, feature = "test-util"))]
use std::sync::Arc;
#[cfg(any(test, feature = "test-util"))]
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// A source of "now", in microseconds since the Unix epoch.
pub trait Clock: std::fmt::Debug + Send + Sync + 'static {
    /// The current time in microseconds since the Unix epoch.
    fn now_micros(&self) -> u64;
}

/// The real clock: the wall-clock time at construction, advanced by a
/// monotonic [`Instant`], so it never steps backwards when NTP adjusts the
/// system time.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SystemClock {
    anchor_micros: u64,
    anchor: Instant,
}

impl SystemClock {
    /// Anchors a new clock to the current wall-clock time.
    pub(crate) fn new() -> Self {
        let since_epoch = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO);
        Self {
            anchor_micros: duration_micros(since_epoch),
            anchor: Instant::now(),
        }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    fn now_micros(&self) -> u64 {
        self.anchor_micros + duration_micros(self.anchor.elapsed())
    }
}

/// A clock that moves only when told to. Clones share the same time.
///
/// ```
/// use slidegate::clock::{Clock, FakeClock};
/// use std::time::Duration;
///
/// let clock = FakeClock::new(1_000_000);
/// let shared = clock.clone();
/// clock.advance(Duration::from_millis(1500));
/// assert_eq!(shared.now_micros(), 2_500_000);
/// ```
#[cfg(any(test, feature = "test-util"))]
#[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
#[derive(Debug, Clone, Default)]
pub struct FakeClock {
    micros: Arc<AtomicU64>,
}

#[cfg(any(test, feature = "test-util"))]
impl FakeClock {
    /// A fake clock that reads `start_micros` until advanced.
    pub fn new(start_micros: u64) -> Self {
        Self {
            micros: Arc::new(AtomicU64::new(start_micros)),
        }
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        self.micros.fetch_add(duration_micros(by), Ordering::SeqCst);
    }

    /// Sets the clock to `micros` since the Unix epoch.
    pub fn set(&self, micros: u64) {
        self.micros.store(micros, Ordering::SeqCst);
    }
}

#[cfg(any(test, feature = "test-util"))]
impl Clock for FakeClock {
    fn now_micros(&self) -> u64 {
        self.micros.load(Ordering::SeqCst)
    }
}

/// A duration in whole microseconds, saturating at `u64::MAX`.
pub(crate) fn duration_micros(duration: Duration) -> u64 {
    u64::try_from(duration.as_micros()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn system_clock_is_near_wall_clock_and_monotonic() {
        let clock = SystemClock::new();
        let wall = duration_micros(SystemTime::now().duration_since(UNIX_EPOCH).unwrap());
        let first = clock.now_micros();
        let second = clock.now_micros();
        assert!(first.abs_diff(wall) < 1_000_000);
        assert!(second >= first);
    }

    #[test]
    fn fake_clock_moves_only_when_told() {
        let clock = FakeClock::new(7);
        assert_eq!(clock.now_micros(), 7);
        clock.advance(Duration::from_micros(3));
        assert_eq!(clock.now_micros(), 10);
        clock.set(100);
        assert_eq!(clock.now_micros(), 100);
    }
}
