//! What the limiter reports through the [`metrics`](https://docs.rs/metrics)
//! facade, with the `metrics` feature; without it every function here is
//! empty and compiles away. Labels are policy names, outcomes and error
//! kinds only, never a client's key.
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | `slidegate_decisions_total` | counter | `policy`, `outcome` |
//! | `slidegate_near_limit_total` | counter | `policy` |
//! | `slidegate_store_seconds` | histogram | |
//! | `slidegate_store_errors_total` | counter | `kind` |
//! | `slidegate_breaker_state` | gauge (0 closed, 1 open, 2 probing) | |
//! | `slidegate_memory_keys` | gauge | |
//!
//! Outcomes: `admitted`, `denied`, `deny_cache` (denied without a store
//! call), `shadow_denied`, `failed_open`, `failed_closed`, `exempt`,
//! `local` (admitted on the local limit while the store is down).
//!
//! Each policy's counters are registered on first use: install the
//! recorder before the first request.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::store::{BreakerState, Check, Decision, StoreError};

/// What became of a request under one policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Outcome {
    Admitted,
    Denied,
    DenyCache,
    ShadowDenied,
    FailedOpen,
    FailedClosed,
    Exempt,
    Local,
}

impl Outcome {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Self::Admitted => "admitted",
            Self::Denied => "denied",
            Self::DenyCache => "deny_cache",
            Self::ShadowDenied => "shadow_denied",
            Self::FailedOpen => "failed_open",
            Self::FailedClosed => "failed_closed",
            Self::Exempt => "exempt",
            Self::Local => "local",
        }
    }
}

/// Counts `outcome` once for `policy`.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn decided(policy: &Arc<str>, outcome: Outcome) {
    #[cfg(feature = "metrics")]
    handles::counter(policy, Some(outcome)).increment(1);
}

/// Counts the admitted decisions with at most a fifth of their limit left.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn near_limit(check: &Check, decision: &Decision) {
    #[cfg(feature = "metrics")]
    if u64::from(decision.remaining) * 5 <= u64::from(decision.limit) {
        handles::counter(&check.policy, None).increment(1);
    }
}

/// The counters of each policy, registered once: the `metrics` macros
/// build a label list on every call, an allocation per request.
#[cfg(feature = "metrics")]
mod handles {
    use std::collections::HashMap;
    use std::sync::{Arc, LazyLock, RwLock};

    use metrics::Counter;

    use super::Outcome;

    /// By policy and outcome; `None` for the near-limit count. Bounded by
    /// the policy names the process has seen.
    type Counters = HashMap<(Arc<str>, Option<Outcome>), Counter>;

    static COUNTERS: LazyLock<RwLock<Counters>> = LazyLock::new(Default::default);

    pub(super) fn counter(policy: &Arc<str>, outcome: Option<Outcome>) -> Counter {
        let key = (policy.clone(), outcome);
        if let Some(counter) = COUNTERS
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get(&key)
        {
            return counter.clone();
        }
        let counter = match outcome {
            Some(outcome) => metrics::counter!(
                "slidegate_decisions_total",
                "policy" => policy.clone(),
                "outcome" => outcome.label()
            ),
            None => metrics::counter!("slidegate_near_limit_total", "policy" => policy.clone()),
        };
        COUNTERS
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert(key, counter.clone());
        counter
    }
}

/// Records how long the store took to answer, and what failed.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn store_answered<T>(took: Option<Duration>, outcome: &Result<T, StoreError>) {
    #[cfg(feature = "metrics")]
    {
        if let Some(took) = took {
            metrics::histogram!("slidegate_store_seconds").record(took.as_secs_f64());
        }
        if let Err(error) = outcome {
            let kind = match error {
                StoreError::Timeout(_) => "timeout",
                StoreError::Backend(_) => "backend",
                StoreError::Protocol(_) => "protocol",
                StoreError::CircuitOpen => "circuit_open",
                StoreError::Unsupported(_) => "unsupported",
            };
            metrics::counter!("slidegate_store_errors_total", "kind" => kind).increment(1);
        }
    }
}

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
    if after >= before {
        metrics::gauge!("slidegate_memory_keys").increment((after - before) as f64);
    } else {
        metrics::gauge!("slidegate_memory_keys").decrement((before - after) as f64);
    }
}

/// Times a store call when someone listens: the `metrics` feature, or a
/// subscriber of the debug-level `rate_limit` span.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Timer(Option<Instant>);

impl Timer {
    pub(crate) fn start() -> Self {
        let listened = cfg!(feature = "metrics") || tracing::enabled!(tracing::Level::DEBUG);
        Self(listened.then(Instant::now))
    }

    pub(crate) fn elapsed(self) -> Option<Duration> {
        self.0.map(|started| started.elapsed())
    }
}
