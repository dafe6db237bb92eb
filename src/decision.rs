//! The outcome of one policy's check.

use std::time::Duration;

/// What a store decided for one policy of a request.
///
/// A request with several policies is admitted only if all admit it; the
/// store then reports the same `admitted` value on every decision, and a
/// denied request has consumed nothing from any of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// Whether the request was admitted (and its cost recorded).
    pub admitted: bool,
    /// The policy's limit, in units per window.
    pub limit: u32,
    /// Units left in the window after this request; never negative.
    pub remaining: u32,
    /// Time until the oldest counted unit leaves the window, that is, until
    /// capacity next grows. Zero when nothing is counted.
    pub reset: Duration,
    /// When this policy cannot fit the request: the time until enough
    /// capacity frees for its cost, exact to the microsecond. `None` when it
    /// fits.
    pub retry_after: Option<Duration>,
}
