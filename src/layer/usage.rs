//! [`Usage`]: where a handler reports what a request cost, for policies
//! that settle their costs after the response.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// No value reported yet.
const UNSET: u64 = u64::MAX;

/// What a request cost, as its handler reports it, for the policies that
/// settle their costs after the response
/// ([`Policy::settled_after_response`](crate::Policy::settled_after_response)).
///
/// The layer puts one in the request's extensions when such a policy
/// admitted the request; the handler (or its response stream) reports
/// the cost on it until the response body ends, and the last value
/// reported replaces the request's reservation. Clones share the value.
///
/// ```
/// use axum::{Extension, routing::post, Router};
/// use slidegate::Usage;
///
/// async fn complete(usage: Option<Extension<Usage>>) -> &'static str {
///     let tokens = 42; // what the model generated
///     if let Some(Extension(usage)) = usage {
///         usage.set(tokens);
///     }
///     "done"
/// }
///
/// let app: Router = Router::new().route("/complete", post(complete));
/// ```
#[derive(Debug, Clone)]
pub struct Usage(Arc<AtomicU64>);

impl Usage {
    /// A handle with nothing reported. The layer makes one per request
    /// it puts in; one made here serves to try a handler with.
    pub fn new() -> Self {
        Self(Arc::new(AtomicU64::new(UNSET)))
    }

    /// Reports that the request cost `units` in all.
    pub fn set(&self, units: u64) {
        self.0.store(units.min(UNSET - 1), Ordering::Relaxed);
    }

    /// Reports `units` more than reported so far (from none, 0): for a
    /// stream that counts as it goes.
    pub fn add(&self, units: u64) {
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |now| {
                let before = if now == UNSET { 0 } else { now };
                Some(before.saturating_add(units).min(UNSET - 1))
            });
    }

    /// The cost reported so far, if any.
    ///
    /// ```
    /// let usage = slidegate::Usage::new();
    /// assert_eq!(usage.get(), None);
    /// usage.add(3);
    /// usage.add(4);
    /// assert_eq!(usage.get(), Some(7));
    /// usage.set(5);
    /// assert_eq!(usage.get(), Some(5));
    /// ```
    pub fn get(&self) -> Option<u64> {
        let units = self.0.load(Ordering::Relaxed);
        (units != UNSET).then_some(units)
    }
}

impl Default for Usage {
    fn default() -> Self {
        Self::new()
    }
}
