//! [`Check`]: one policy to check for one client, built from the terms of
//! a policy's check for a tier ([`Terms`], worked out once per plan).

use std::sync::Arc;
use std::time::Duration;

use smallvec::SmallVec;

use super::next_id;
use crate::clock::duration_micros;
use crate::key::Key;
use crate::policy::{Algorithm, Limits, Policy, PolicyError, Terms};

/// One policy to check for one client, as one of a request's checks.
///
/// Built only from a valid [`Policy`] ([`Check::new`], [`Check::for_tier`]),
/// so every store is given limits it computes exactly (and alike): a
/// check cannot be edited into a window of 0 or a product past the
/// precision of Redis's numbers. Its parts are read with the methods of
/// the same names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    /// What the policy's check carries for the client's tier, shared by
    /// every check made from it.
    pub(crate) terms: Arc<Terms>,
    pub(crate) namespace: Option<Arc<str>>,
    pub(crate) key: Key,
    /// The client's limit and burst: the tier's, or the client's own.
    pub(crate) limit: u32,
    pub(crate) burst: u32,
    pub(crate) cost: u32,
    /// The units an instance takes at a time from a remote store
    /// ([`Policy::with_slice`]), at most the burst; 0 for none (and for a
    /// refund of units the store recorded for the request alone).
    pub(crate) slice: u32,
    /// The id of the lease a concurrency check takes; for a reservation
    /// settled after the response, the id its settlement names (see
    /// [`Store::settle`](crate::store::Store::settle)), so that one sent
    /// twice counts once; 0 otherwise.
    pub(crate) id: u64,
}

impl Check {
    /// The check of `policy` for the client `key`, or why the policy is
    /// not valid (as [`Policies`](crate::Policies) would refuse it).
    ///
    /// ```
    /// use slidegate::{Policy, key::Key, store::Check};
    /// use std::time::Duration;
    ///
    /// let check = Check::new(&Policy::new("api", 10, Duration::from_secs(1)), Key::new("alice"))?;
    /// assert_eq!((check.limit(), check.cost()), (10, 1));
    /// assert!(Check::new(&Policy::new("api", 10, Duration::ZERO), Key::new("alice")).is_err());
    /// # Ok::<(), slidegate::policy::PolicyError>(())
    /// ```
    pub fn new(policy: &Policy, key: Key) -> Result<Self, PolicyError> {
        Self::for_tier(policy, key, None)
    }

    /// The check of `policy` for the client `key` of `tier`: the tier's
    /// overrides apply (see [`Policy::with_tier`]).
    ///
    /// ```
    /// use slidegate::{Policy, key::Key, policy::TierLimits, store::Check};
    /// use std::time::Duration;
    ///
    /// let search = Policy::new("search", 5, Duration::from_secs(60)).with_tier("pro", TierLimits::new().with_limit(50));
    /// assert_eq!(Check::for_tier(&search, Key::new("a"), Some("pro"))?.limit(), 50);
    /// assert_eq!(Check::for_tier(&search, Key::new("a"), Some("gold"))?.limit(), 5);
    /// # Ok::<(), slidegate::policy::PolicyError>(())
    /// ```
    pub fn for_tier(policy: &Policy, key: Key, tier: Option<&str>) -> Result<Self, PolicyError> {
        policy.validate()?;
        Ok(Self::of_limits(policy, &key, policy.limits_for(tier)))
    }

    /// The check of a valid `policy` for `key` under `limits` (the
    /// policy's for a tier, or a client's own limit), at their cost.
    pub(crate) fn of_limits(policy: &Policy, key: &Key, limits: Limits) -> Self {
        let terms = Arc::new(Terms::with_limits(policy, limits));
        Self::of_terms(&terms, key, None, (limits.limit, limits.burst), limits.cost)
    }

    /// The check of the client `key` under `terms`, in `namespace`, at the
    /// client's own `(limit, burst)` and the request's `cost`.
    pub(crate) fn of_terms(
        terms: &Arc<Terms>,
        key: &Key,
        namespace: Option<&Arc<str>>,
        (limit, burst): (u32, u32),
        cost: u32,
    ) -> Self {
        Self {
            terms: terms.clone(),
            namespace: namespace.cloned(),
            key: key.clone(),
            limit,
            burst,
            cost,
            // A client allowed less than the policy's slice takes its
            // whole limit; one allowed a single unit, none.
            slice: match terms.slice.min(burst) {
                0 | 1 => 0,
                slice => slice,
            },
            id: match terms.algorithm {
                Algorithm::Concurrency => next_id(),
                _ => 0,
            },
        }
    }

    /// This check with an id of its own for the settlement of what it
    /// reserves ([`Store::settle`](crate::store::Store::settle)): a store
    /// settles one id's reservation once, however often the settlement is
    /// sent (a retry after a timeout), within five minutes of the first.
    /// The layer gives one to every reservation it settles; a check
    /// without one is settled each time. One id is one reservation: give
    /// each request's check its own (as here), never clone one check with
    /// an id for several requests, whose settlements after the first
    /// would then count nothing. A concurrency check keeps its lease's id.
    ///
    /// ```
    /// use slidegate::{Policy, key::Key, store::Check};
    /// use std::time::Duration;
    ///
    /// let check = Check::new(&Policy::new("tokens", 10_000, Duration::from_secs(3600)), Key::new("a"))?;
    /// let reserved = check.with_settlement_id();
    /// assert_ne!(reserved, reserved.clone().with_settlement_id());
    /// # Ok::<(), slidegate::policy::PolicyError>(())
    /// ```
    #[must_use]
    pub fn with_settlement_id(mut self) -> Self {
        if self.algorithm() != Algorithm::Concurrency {
            self.id = next_id();
        }
        self
    }

    /// This check at a cost of `cost` units instead of the policy's: at
    /// least 1, and a cost above the burst (which never fits, and is
    /// denied with the wait of a whole window) is kept as one unit more
    /// than the burst. A concurrency check always costs 1.
    ///
    /// ```
    /// use slidegate::{Policy, key::Key, store::Check};
    /// use std::time::Duration;
    ///
    /// let check = Check::new(&Policy::new("api", 10, Duration::from_secs(1)), Key::new("a"))?;
    /// assert_eq!(check.clone().with_cost(4).cost(), 4);
    /// assert_eq!(check.with_cost(u32::MAX).cost(), 11);
    /// # Ok::<(), slidegate::policy::PolicyError>(())
    /// ```
    #[must_use]
    pub fn with_cost(mut self, cost: u32) -> Self {
        self.cost = match self.algorithm() {
            Algorithm::Concurrency => 1,
            _ => cost.clamp(1, self.burst.saturating_add(1)),
        };
        self
    }

    /// The policy's name; part of the store key.
    pub fn policy(&self) -> &Arc<str> {
        &self.terms.policy
    }

    /// The namespace of the layer that checks
    /// ([`RateLimitLayer::with_namespace`](crate::RateLimitLayer::with_namespace)),
    /// if it has one; part of the store key, so a store keeps the counts
    /// of one policy name in two namespaces apart.
    pub fn namespace(&self) -> Option<&Arc<str>> {
        self.namespace.as_ref()
    }

    /// The client's key.
    pub fn key(&self) -> &Key {
        &self.key
    }

    /// Units allowed per window.
    pub fn limit(&self) -> u32 {
        self.limit
    }

    /// The sliding window (a concurrency policy's lease time).
    pub fn window(&self) -> Duration {
        self.terms.limits.window
    }

    /// Units this request consumes.
    pub fn cost(&self) -> u32 {
        self.cost
    }

    /// The counting algorithm.
    pub fn algorithm(&self) -> Algorithm {
        self.terms.algorithm
    }

    /// The units a client may spend at once: a token bucket's size, the
    /// limit for every other algorithm.
    pub fn burst(&self) -> u32 {
        self.burst
    }

    /// How long a denial by this check's own count blocks the client;
    /// zero for a policy that does not block.
    pub fn block(&self) -> Duration {
        Duration::from_micros(self.terms.block_micros)
    }

    /// How long a request may be held instead of denied; zero for a
    /// policy that holds none. A denial whose retry time is within it is
    /// no denial for the [`block`](Self::block): only a request beyond
    /// the delay starts one.
    pub fn delay(&self) -> Duration {
        Duration::from_micros(self.terms.delay_micros)
    }

    /// The longest window any of the policy's tiers counts it under, and
    /// at least its own: a sliding log keeps every record this window
    /// covers, whichever tier's request comes first. Other algorithms
    /// need not read it.
    pub fn span(&self) -> Duration {
        Duration::from_micros(self.terms.span_micros)
    }

    /// The id of the lease a concurrency check takes, `None` for other
    /// algorithms: each check is given a new one when it is built, so
    /// that the lease can be released by its id whatever became of the
    /// store's answer (a call that timed out, a request dropped while its
    /// check was in flight). A store releases it when
    /// [`refund`](super::Store::refund) is given the check, and takes nothing for
    /// an id released before its check arrived. One id is one lease: build
    /// a check for each request, as the layer does, rather than sending
    /// one check again.
    pub fn lease_id(&self) -> Option<u64> {
        (self.algorithm() == Algorithm::Concurrency).then_some(self.id)
    }

    /// Whose count the check is: its namespace, policy and client.
    pub(crate) fn scope(&self) -> Scope {
        (
            self.namespace.clone(),
            self.terms.policy.clone(),
            self.key.clone(),
        )
    }

    /// Whether `other` counts under the same terms (one comparison, as
    /// the deny cache makes it), at the same client limit, burst and
    /// slice: what was taken or denied for one stands for the other.
    pub(crate) fn counts_as(&self, other: &Check) -> bool {
        (self.limit, self.burst, self.slice) == (other.limit, other.burst, other.slice)
            // `Arc`'s own comparison: the same pointer, or equal terms.
            && self.terms == other.terms
    }

    /// The window in microseconds.
    pub(crate) fn window_micros(&self) -> u64 {
        duration_micros(self.terms.limits.window)
    }

    /// The block in microseconds (0 for none).
    pub(crate) fn block_micros(&self) -> u64 {
        self.terms.block_micros
    }

    /// The delay in microseconds (0 for none).
    pub(crate) fn delay_micros(&self) -> u64 {
        self.terms.delay_micros
    }

    /// The span in microseconds (see [`span`](Self::span)).
    pub(crate) fn span_micros(&self) -> u64 {
        self.terms.span_micros
    }
}

/// Whose count a check is: its layer's namespace, its policy and its
/// client (see [`Check::scope`]).
pub(crate) type Scope = (Option<Arc<str>>, Arc<str>, Key);

/// One request's checks: one per policy that counts it, inline for the
/// usual one or two.
pub(crate) type Checks = SmallVec<[Check; 2]>;

#[cfg(test)]
mod tests {
    use super::*;

    /// A request's checks are moved on its way (into the request's future,
    /// into a store's call): what is the same for every client of a tier
    /// is shared behind one pointer, not copied.
    #[test]
    fn a_check_holds_only_what_differs_per_request() {
        let size = std::mem::size_of::<Check>();
        assert!(size <= 72, "a check is {size} bytes");
    }
}
