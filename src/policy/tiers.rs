//! Tiers: a policy's overrides for a client's tier ([`TierLimits`]), and
//! the limits in force for one request ([`Limits`]).

use std::sync::Arc;
use std::time::Duration;

use super::error::validate_counts;
use super::{Algorithm, Policy, PolicyError};

/// Per-tier overrides of a [`Policy`]'s limit, window and cost; what is not
/// set keeps the policy's base value.
///
/// ```
/// use slidegate::policy::TierLimits;
/// use std::time::Duration;
///
/// let pro = TierLimits::new().with_limit(50).with_window(Duration::from_secs(60));
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierLimits {
    limit: Option<u32>,
    pub(super) window: Option<Duration>,
    cost: Option<u32>,
    pub(super) burst: Option<u32>,
}

impl TierLimits {
    /// No overrides yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Overrides the limit.
    #[must_use]
    pub fn with_limit(mut self, limit: u32) -> Self {
        self.limit = Some(limit);
        self
    }

    /// Overrides the window.
    #[must_use]
    pub fn with_window(mut self, window: Duration) -> Self {
        self.window = Some(window);
        self
    }

    /// Overrides the cost of one request.
    #[must_use]
    pub fn with_cost(mut self, cost: u32) -> Self {
        self.cost = Some(cost);
        self
    }

    /// Overrides the bucket size of a [`Algorithm::TokenBucket`] policy.
    #[must_use]
    pub fn with_burst(mut self, burst: u32) -> Self {
        self.burst = Some(burst);
        self
    }
}

/// The limit, window and cost in force for one request: a policy's base
/// values, or its overrides for the client's tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Limits {
    /// Units allowed per window.
    pub limit: u32,
    /// The sliding window.
    pub window: Duration,
    /// Units one request consumes.
    pub cost: u32,
    /// The units a client may spend at once: a token bucket's size, the
    /// limit for every other algorithm. No cost may exceed it.
    pub burst: u32,
}

impl Policy {
    /// Overrides the limit, window or cost for clients of `tier` (from a
    /// JWT claim or an API-key table). Clients of other tiers, or of none,
    /// get the base values.
    ///
    /// ```
    /// use slidegate::{Policy, policy::TierLimits};
    /// use std::time::Duration;
    ///
    /// let search = Policy::new("search", 5, Duration::from_secs(60))
    ///     .with_tier("pro", TierLimits::new().with_limit(50));
    /// assert_eq!(search.limits_for(Some("pro")).limit, 50);
    /// assert_eq!(search.limits_for(Some("gold")).limit, 5);
    /// assert_eq!(search.limits_for(None).limit, 5);
    /// ```
    #[must_use]
    pub fn with_tier(mut self, tier: impl Into<Arc<str>>, limits: TierLimits) -> Self {
        let tier = tier.into();
        self.tiers.retain(|(name, _)| *name != tier);
        self.tiers.push((tier, limits));
        self
    }

    /// The limits in force for a client of `tier`.
    pub fn limits_for(&self, tier: Option<&str>) -> Limits {
        let overrides = tier
            .and_then(|tier| self.tiers.iter().find(|(name, _)| &**name == tier))
            .map(|(_, limits)| *limits)
            .unwrap_or_default();
        let limit = overrides.limit.unwrap_or(self.limit);
        let burst = match self.algorithm {
            Algorithm::TokenBucket => overrides.burst.or(self.burst).unwrap_or(limit),
            _ => limit,
        };
        Limits {
            limit,
            window: overrides.window.unwrap_or(self.window),
            cost: match self.algorithm {
                // A lease is one request in flight, whatever it costs.
                Algorithm::Concurrency => 1,
                _ => overrides.cost.unwrap_or(self.cost),
            },
            burst,
        }
    }

    /// Whether `limit` may be a client's own limit under this policy (an
    /// override, or a limit lookup's answer): the limits it makes with the
    /// policy and with each of its tiers pass the same validation as the
    /// policy's own, but for the cost (a cost above a client's own limit is
    /// refused per request).
    pub(crate) fn validate_own_limit(&self, limit: u32) -> Result<(), PolicyError> {
        let tiers = self.tiers.iter().map(|(tier, _)| Some(&**tier));
        for tier in std::iter::once(None).chain(tiers) {
            // Named only for an error: a kept answer is checked per request.
            let name = || match tier {
                Some(tier) => format!("{} (tier `{tier}`, a client's own limit)", self.name),
                None => format!("{} (a client's own limit)", self.name),
            };
            validate_counts(name, self.limits_with(tier, Some(limit)), self.algorithm)?;
        }
        Ok(())
    }

    /// The longest window the policy or any of its tiers counts under.
    pub(crate) fn longest_window(&self) -> Duration {
        self.tiers
            .iter()
            .filter_map(|(_, limits)| limits.window)
            .fold(self.window, Duration::max)
    }

    /// The limits in force for a client of `tier` whose own limit (from a
    /// [limit lookup](crate::RateLimitLayer::with_limit_lookup)) is `own`: it replaces
    /// the tier's limit, and a token bucket's burst too unless the policy
    /// or tier sets one.
    pub(crate) fn limits_with(&self, tier: Option<&str>, own: Option<u32>) -> Limits {
        let mut limits = self.limits_for(tier);
        if let Some(limit) = own {
            let tier_burst = tier
                .and_then(|tier| self.tiers.iter().find(|(name, _)| &**name == tier))
                .and_then(|(_, limits)| limits.burst);
            let own_burst = self.algorithm == Algorithm::TokenBucket
                && (tier_burst.is_some() || self.burst.is_some());
            if !own_burst {
                limits.burst = limit;
            }
            limits.limit = limit;
        }
        limits
    }
}
