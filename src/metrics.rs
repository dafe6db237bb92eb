//! What the limiter reports through the [`metrics`](https://docs.rs/metrics)
//! facade, with the `metrics` feature; without it every function here is
//! empty and compiles away. Labels are policy names, outcomes and error
//! kinds only, never a client's key.
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | `slidegate_decisions_total` | counter | `policy`, `outcome` |
//! | `slidegate_near_limit_total` | counter | `policy` |
//! | `slidegate_deny_list_total` | counter | `list` (`ips`, `api_keys`, `subjects`) |
//! | `slidegate_store_seconds` | histogram (a summary in metrics-exporter-prometheus unless buckets are set for it, as the example server sets them) | |
//! | `slidegate_store_errors_total` | counter | `kind` |
//! | `slidegate_breaker_state` | gauge (0 closed, 1 open, 2 probing) | |
//! | `slidegate_memory_keys` | gauge | |
//!
//! Outcomes: `admitted`, `denied`, `deny_cache` (denied without a store
//! call), `shadow_denied`, `failed_open`, `failed_closed`, `exempt`,
//! `local` (admitted on the local limit while the store is down),
//! `delay_full` (refused: too many requests held already).
//!
//! Each policy's counters are registered on first use: install the
//! recorder before the first request.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::rejection::Listed;
use crate::store::{Check, Decision, StoreError};

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
    DelayFull,
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
            Self::DelayFull => "delay_full",
        }
    }
}

/// Counts a request a deny list refused, by the list.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn deny_listed(list: Listed) {
    #[cfg(feature = "metrics")]
    metrics::counter!("slidegate_deny_list_total", "list" => list.name()).increment(1);
}

/// Counts `outcome` once for `policy`.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn decided(policy: &Arc<str>, outcome: Outcome) {
    #[cfg(feature = "metrics")]
    handles::count(policy, Some(outcome));
}

/// Counts the admitted decisions with at most a fifth of their limit left.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn near_limit(check: &Check, decision: &Decision) {
    #[cfg(feature = "metrics")]
    if u64::from(decision.remaining()) * 5 <= u64::from(decision.limit()) {
        handles::count(check.policy(), None);
    }
}

/// Records how long the store took to answer, and what failed.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn store_answered<T>(took: Option<Duration>, outcome: &Result<T, StoreError>) {
    #[cfg(feature = "metrics")]
    {
        if let Some(took) = took {
            handles::store_seconds().record(took.as_secs_f64());
        }
        if let Err(error) = outcome {
            let kind = match error {
                StoreError::Timeout(_) => "timeout",
                StoreError::Backend(_) => "backend",
                StoreError::Protocol(_) => "protocol",
                StoreError::Internal(_) => "internal",
                StoreError::CircuitOpen => "circuit_open",
                StoreError::Unsupported(_) => "unsupported",
                StoreError::Full(_) => "full",
            };
            metrics::counter!("slidegate_store_errors_total", "kind" => kind).increment(1);
        }
    }
}

/// The handles of the metrics counted per request, registered once: the
/// `metrics` macros build a key (and a label list, an allocation) and look
/// it up in the recorder on every call.
#[cfg(feature = "metrics")]
mod handles {
    use std::cell::RefCell;
    use std::sync::{Arc, OnceLock};

    use metrics::{Counter, Histogram};

    use super::Outcome;

    /// Outcomes, then the near-limit count.
    const SLOTS: usize = 10;

    /// A policy's counters, by slot, registered as they are first used.
    struct Entry {
        /// Kept, so that its address names no other policy while here.
        policy: Arc<str>,
        counters: [Option<Counter>; SLOTS],
    }

    /// Per thread, so that counting takes no lock: a short list, searched
    /// by the address of the policy's name.
    const MOST_POLICIES: usize = 64;

    thread_local! {
        static ENTRIES: RefCell<Vec<Entry>> = const { RefCell::new(Vec::new()) };
    }

    fn slot(outcome: Option<Outcome>) -> usize {
        match outcome {
            Some(outcome) => outcome as usize,
            None => SLOTS - 1,
        }
    }

    /// Adds one to `policy`'s count of `outcome` (`None`: near the limit).
    pub(super) fn count(policy: &Arc<str>, outcome: Option<Outcome>) {
        ENTRIES.with_borrow_mut(|entries| {
            let index = match entries.iter().position(|e| Arc::ptr_eq(&e.policy, policy)) {
                Some(index) => index,
                None => {
                    if entries.len() >= MOST_POLICIES {
                        // Policies replaced many times over: start afresh.
                        entries.clear();
                    }
                    entries.push(Entry {
                        policy: policy.clone(),
                        counters: Default::default(),
                    });
                    entries.len() - 1
                }
            };
            entries[index].counters[slot(outcome)]
                .get_or_insert_with(|| register(policy, outcome))
                .increment(1);
        });
    }

    fn register(policy: &Arc<str>, outcome: Option<Outcome>) -> Counter {
        match outcome {
            Some(outcome) => metrics::counter!(
                "slidegate_decisions_total",
                "policy" => policy.clone(),
                "outcome" => outcome.label()
            ),
            None => metrics::counter!("slidegate_near_limit_total", "policy" => policy.clone()),
        }
    }

    pub(super) fn store_seconds() -> &'static Histogram {
        static HISTOGRAM: OnceLock<Histogram> = OnceLock::new();
        HISTOGRAM.get_or_init(|| metrics::histogram!("slidegate_store_seconds"))
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

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    /// The metric names in `text`: each `slidegate_` followed by letters
    /// and underscores.
    fn names_in(text: &str) -> impl Iterator<Item = &str> {
        text.match_indices("slidegate_").map(move |(at, _)| {
            let rest = &text[at..];
            let end = rest
                .find(|c: char| !(c.is_ascii_lowercase() || c == '_'))
                .unwrap_or(rest.len());
            &rest[..end]
        })
    }

    /// The names the crate reports: the string literals that start with
    /// `slidegate_` in the code (above their tests) of this module and of
    /// the store's gauges.
    fn reported() -> BTreeSet<&'static str> {
        [include_str!("metrics.rs"), include_str!("store/gauges.rs")]
            .into_iter()
            .flat_map(|source| {
                let code = &source[..source.find("#[cfg(test)]").unwrap_or(source.len())];
                code.lines()
                    .filter(|line| !line.trim_start().starts_with("//"))
                    .flat_map(|line| line.split('"').skip(1).step_by(2))
                    .flat_map(names_in)
            })
            .collect()
    }

    #[test]
    fn the_dashboard_queries_every_metric_reported_and_no_other() {
        let dashboard: serde_json::Value =
            serde_json::from_str(include_str!("../docs/grafana-dashboard.json")).unwrap();
        let reported = reported();
        let mut queried = BTreeSet::new();
        for panel in dashboard["panels"].as_array().unwrap() {
            for target in panel["targets"].as_array().unwrap() {
                for name in names_in(target["expr"].as_str().unwrap()) {
                    // A histogram's series, as Prometheus names them.
                    let base = ["_bucket", "_sum", "_count"]
                        .iter()
                        .find_map(|suffix| name.strip_suffix(suffix))
                        .filter(|base| reported.contains(base))
                        .unwrap_or(name);
                    queried.insert(base.to_owned());
                }
            }
        }
        let reported: BTreeSet<String> = reported.iter().map(|&n| n.to_owned()).collect();
        assert_eq!(queried, reported);
        assert_eq!(reported.len(), 7, "{reported:?}");
    }
}
