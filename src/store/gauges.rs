//! The store's own gauges, through the `metrics` facade (see "Metrics" in
//! the crate docs): the circuit breaker's state and the pairs the memory
//! stores track.

use super::BreakerState;

/// Sets the breaker's state.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn breaker_state(state: BreakerState) {
    #[cfg(feature = "metrics")]
    metrics::gauge!("slidegate_breaker_state").set(match state {
        BreakerState::Closed => 0.0,
        BreakerState::Open => 1.0,
        BreakerState::Probing => 2.0,
    });
}

/// Moves the memory stores' count of tracked pairs from `before` to
/// `after` (for one shard).
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn memory_keys(before: usize, after: usize) {
    #[cfg(feature = "metrics")]
    {
        static GAUGE: std::sync::OnceLock<metrics::Gauge> = std::sync::OnceLock::new();
        // Registered once: the macro builds a key and looks it up on
        // every call.
        let keys = GAUGE.get_or_init(|| metrics::gauge!("slidegate_memory_keys"));
        if after >= before {
            keys.increment((after - before) as f64);
        } else {
            keys.decrement((before - after) as f64);
        }
    }
}
