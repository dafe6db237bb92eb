//! The outcome of one policy's check.

use std::cmp::Reverse;
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::time::Duration;

use smallvec::SmallVec;

use crate::store::Check;

/// What a store decided for one policy of a request, read with the
/// methods below.
///
/// A request with several policies is admitted only if all admit it; the
/// store then reports the same `admitted` value on every decision, and a
/// denied request has consumed nothing from any of them. Its times are
/// kept in whole microseconds (56 bytes in all, moved on every request's
/// way), and read as [`Duration`]s.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    pub(crate) limit: u32,
    pub(crate) remaining: u32,
    /// Each time in µs; an optional one is [`UNSET`] when it is not set.
    pub(crate) reset_us: u64,
    pub(crate) retry_after_us: u64,
    pub(crate) delayed_for_us: u64,
    pub(crate) recorded_at_us: u64,
    pub(crate) blocked_for_us: u64,
    pub(crate) admitted: bool,
    /// Whether the units came from a slice this process holds (see
    /// [`Policy::with_slice`](crate::Policy::with_slice)) rather than from
    /// the store for this request alone: a refund goes back where they
    /// came from.
    pub(crate) sliced: bool,
}

/// An optional time of a [`Decision`] that is not set.
pub(crate) const UNSET: u64 = u64::MAX;

/// `duration` in whole microseconds, below [`UNSET`].
pub(crate) fn micros(duration: Duration) -> u64 {
    u64::try_from(duration.as_micros()).map_or(UNSET - 1, |us| us.min(UNSET - 1))
}

/// An optional time in microseconds, [`UNSET`] for `None`.
pub(crate) fn optional_micros(duration: Option<Duration>) -> u64 {
    duration.map_or(UNSET, micros)
}

fn optional(us: u64) -> Option<Duration> {
    (us != UNSET).then(|| Duration::from_micros(us))
}

impl Decision {
    /// Whether the request was admitted (and its cost recorded).
    pub fn admitted(&self) -> bool {
        self.admitted
    }

    /// The policy's limit, in units per window.
    pub fn limit(&self) -> u32 {
        self.limit
    }

    /// Units left in the window after this request; never negative.
    pub fn remaining(&self) -> u32 {
        self.remaining
    }

    /// Time until the oldest counted unit leaves the window, that is, until
    /// capacity next grows. Zero when nothing is counted.
    pub fn reset(&self) -> Duration {
        Duration::from_micros(self.reset_us)
    }

    /// When this policy cannot fit the request: the time until enough
    /// capacity frees for its cost, exact to the microsecond. `None` when it
    /// fits, and for an admitted request.
    pub fn retry_after(&self) -> Option<Duration> {
        optional(self.retry_after_us)
    }

    /// When the request was admitted after a delay (see
    /// [`Policy::with_delay`](crate::Policy::with_delay)): how long it
    /// waits before it passes. Its units are recorded at the time it
    /// passes, under every policy of the request, so nothing admitted
    /// meanwhile takes its place; a client that goes away meanwhile gives
    /// them back with a [refund](crate::store::Store::refund). `None` for
    /// a request that passes now, and for a denied one.
    pub fn delayed_for(&self) -> Option<Duration> {
        optional(self.delayed_for_us)
    }

    /// When an admitted request's units were recorded, since the Unix
    /// epoch on the store's clock: what [`Store::refund`](crate::store::Store::refund)
    /// is given to take exactly those units back. `None` when nothing was
    /// recorded, or the store takes no refunds.
    pub fn recorded_at(&self) -> Option<Duration> {
        optional(self.recorded_at_us)
    }

    /// When the client is blocked by this policy (see
    /// [`Policy::with_block`](crate::Policy::with_block)): how long the
    /// block still lasts. A block ends only with its time (or a reset),
    /// never with a refund, so a denial is known to stand this long even
    /// under a policy that counts only some responses. `None` when the
    /// client is not blocked.
    pub fn blocked_for(&self) -> Option<Duration> {
        optional(self.blocked_for_us)
    }

    /// An admitted request's decision: its cost is recorded, `remaining`
    /// units are left, and capacity next grows in `reset`. For stores of
    /// your own.
    ///
    /// ```
    /// use slidegate::store::Decision;
    /// use std::time::Duration;
    ///
    /// let decision = Decision::new_admitted(10, 9, Duration::from_secs(60));
    /// assert!(decision.admitted() && decision.retry_after().is_none());
    /// ```
    pub fn new_admitted(limit: u32, remaining: u32, reset: Duration) -> Self {
        Self {
            limit,
            remaining,
            reset_us: micros(reset),
            retry_after_us: UNSET,
            delayed_for_us: UNSET,
            recorded_at_us: UNSET,
            blocked_for_us: UNSET,
            admitted: true,
            sliced: false,
        }
    }

    /// This admission, after a wait of `wait`: for stores of your own that
    /// hold requests for a policy's delay.
    ///
    /// ```
    /// use slidegate::store::Decision;
    /// use std::time::Duration;
    ///
    /// let wait = Duration::from_millis(120);
    /// let decision = Decision::new_admitted(10, 0, Duration::from_secs(1)).with_delayed_for(wait);
    /// assert_eq!(decision.delayed_for(), Some(wait));
    /// ```
    #[must_use]
    pub fn with_delayed_for(mut self, wait: Duration) -> Self {
        self.delayed_for_us = micros(wait);
        self
    }

    /// This decision, with its units recorded at `at` (since the Unix
    /// epoch, on the store's clock): for stores of your own that take
    /// [`refunds`](crate::store::Store::refund).
    ///
    /// ```
    /// use slidegate::store::Decision;
    /// use std::time::Duration;
    ///
    /// let at = Duration::from_secs(1_800_000_000);
    /// let decision = Decision::new_admitted(10, 9, Duration::from_secs(60)).with_recorded_at(at);
    /// assert_eq!(decision.recorded_at(), Some(at));
    /// ```
    #[must_use]
    pub fn with_recorded_at(mut self, at: Duration) -> Self {
        self.recorded_at_us = micros(at);
        self
    }

    /// A denied request's decision: nothing is recorded. `retry_after` is
    /// when this policy fits the request, or `None` if it fits now (another
    /// policy of the request denied it).
    ///
    /// ```
    /// use slidegate::store::Decision;
    /// use std::time::Duration;
    ///
    /// let wait = Duration::from_secs(3);
    /// let decision = Decision::new_denied(10, 0, wait, Some(wait));
    /// assert!(!decision.admitted());
    /// ```
    pub fn new_denied(
        limit: u32,
        remaining: u32,
        reset: Duration,
        retry_after: Option<Duration>,
    ) -> Self {
        Self::decided(false, limit, remaining, reset, retry_after)
    }

    /// A store's decision, `admitted` or not, with `retry_after` when this
    /// policy does not fit the request: nothing recorded, delayed or
    /// blocked (the `with_*` methods add them).
    pub(crate) fn decided(
        admitted: bool,
        limit: u32,
        remaining: u32,
        reset: Duration,
        retry_after: Option<Duration>,
    ) -> Self {
        Self {
            retry_after_us: optional_micros(retry_after),
            admitted,
            ..Self::new_admitted(limit, remaining, reset)
        }
    }

    /// This denial, by a policy that blocks the client for `left` more:
    /// for stores of your own that block.
    ///
    /// ```
    /// use slidegate::store::Decision;
    /// use std::time::Duration;
    ///
    /// let left = Duration::from_secs(600);
    /// let decision = Decision::new_denied(10, 0, left, Some(left)).with_blocked_for(left);
    /// assert_eq!(decision.blocked_for(), Some(left));
    /// ```
    #[must_use]
    pub fn with_blocked_for(mut self, left: Duration) -> Self {
        self.blocked_for_us = micros(left);
        self
    }
}

impl fmt::Debug for Decision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Decision")
            .field("admitted", &self.admitted)
            .field("limit", &self.limit)
            .field("remaining", &self.remaining)
            .field("reset", &self.reset())
            .field("retry_after", &self.retry_after())
            .field("delayed_for", &self.delayed_for())
            .field("recorded_at", &self.recorded_at())
            .field("blocked_for", &self.blocked_for())
            .field("sliced", &self.sliced)
            .finish()
    }
}

/// One [`Decision`] per check of a request, in the checks' order: a slice
/// when borrowed, held inline for the usual one or two.
///
/// ```
/// use slidegate::store::{Decision, Decisions};
/// use std::time::Duration;
///
/// let mut decisions = Decisions::new();
/// decisions.push(Decision::new_admitted(10, 9, Duration::from_secs(60)));
/// assert!(decisions.iter().all(|d| d.admitted()));
/// let copied: Decisions = decisions.iter().copied().collect();
/// assert_eq!(copied, decisions);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Decisions(SmallVec<[Decision; 2]>);

impl Decisions {
    /// No decisions yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds the decision of the next check.
    pub fn push(&mut self, decision: Decision) {
        self.0.push(decision);
    }
}

impl Deref for Decisions {
    type Target = [Decision];

    fn deref(&self) -> &[Decision] {
        &self.0
    }
}

impl DerefMut for Decisions {
    fn deref_mut(&mut self) -> &mut [Decision] {
        &mut self.0
    }
}

impl FromIterator<Decision> for Decisions {
    fn from_iter<I: IntoIterator<Item = Decision>>(decisions: I) -> Self {
        Self(decisions.into_iter().collect())
    }
}

impl Extend<Decision> for Decisions {
    fn extend<I: IntoIterator<Item = Decision>>(&mut self, decisions: I) {
        self.0.extend(decisions);
    }
}

impl From<Vec<Decision>> for Decisions {
    fn from(decisions: Vec<Decision>) -> Self {
        Self(decisions.into())
    }
}

impl<const N: usize> From<[Decision; N]> for Decisions {
    fn from(decisions: [Decision; N]) -> Self {
        decisions.into_iter().collect()
    }
}

impl<'a> IntoIterator for &'a Decisions {
    type Item = &'a Decision;
    type IntoIter = std::slice::Iter<'a, Decision>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

/// The index of the first decision with the least `key` (0 when empty).
pub(crate) fn index_of_min<K: Ord>(decisions: &[Decision], key: impl Fn(&Decision) -> K) -> usize {
    decisions
        .iter()
        .enumerate()
        .min_by_key(|(_, decision)| key(decision))
        .map_or(0, |(index, _)| index)
}

/// The decision the `X-RateLimit-*` fields report, of a request whose
/// checks are `checks`: the policy closest to denying, the one that leaves
/// the fewest requests of this request's cost (units left ÷ cost), then
/// the latest reset (a client that waits for an earlier one is still
/// refused by the other). Raw units would mislead beside a budget of
/// costly units: 597 of 600 requests left beside 3,500 of 10,000 tokens
/// at 3,000 a call is one more call, not 597.
pub(crate) fn closest_to_denying(checks: &[Check], decisions: &[Decision]) -> usize {
    debug_assert_eq!(checks.len(), decisions.len(), "one check per decision");
    let cost = |index: usize| checks.get(index).map_or(1, |check| check.cost.max(1));
    decisions
        .iter()
        .enumerate()
        .min_by_key(|(index, decision)| {
            (
                decision.remaining / cost(*index),
                Reverse(decision.reset_us),
            )
        })
        .map_or(0, |(index, _)| index)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request's decisions are moved on its way (from the store, into
    /// its headers and its future): times in whole microseconds, not
    /// `Option<Duration>`s.
    #[test]
    fn a_decision_stays_small_and_keeps_its_times() {
        let size = std::mem::size_of::<Decision>();
        assert!(size <= 56, "a decision is {size} bytes");
        let wait = Duration::from_micros(1_500);
        let denied = Decision::new_denied(5, 0, wait, Some(wait)).with_blocked_for(wait);
        assert_eq!(
            (denied.retry_after(), denied.blocked_for()),
            (Some(wait), Some(wait))
        );
        assert_eq!((denied.recorded_at(), denied.delayed_for()), (None, None));
        assert_eq!(denied.reset(), wait);
        let far = Decision::new_admitted(5, 4, Duration::MAX).with_recorded_at(Duration::ZERO);
        assert_eq!(
            far.recorded_at(),
            Some(Duration::ZERO),
            "a time of zero is set"
        );
        assert!(
            far.reset() > Duration::from_secs(1 << 40),
            "a huge time saturates"
        );
    }
}
