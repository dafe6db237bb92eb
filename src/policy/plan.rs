//! [`Plan`]: what the request path reads for one (route, method), worked
//! out once when the policies are built: the policies, and per tier their
//! limits and the `RateLimit-Policy` field.

use std::sync::Arc;

use http::HeaderValue;

use super::{Count, FailMode, Limits, Policy};
use crate::headers::{policy_value, quota};
use crate::store::Check;

/// The policies that apply to one (route, method), and what a request
/// under them needs per tier.
#[derive(Debug)]
pub(crate) struct Plan {
    policies: Box<[Arc<Policy>]>,
    /// For clients of no tier, or of a tier no policy names.
    base: TierPlan,
    /// For clients of each tier some policy names.
    tiers: Box<[(Arc<str>, TierPlan)]>,
    /// Whether a policy sets [`FailMode::Closed`] itself.
    closed: bool,
    /// Whether a policy sets no fail mode (the layer's default decides).
    defaulted: bool,
    /// Whether a policy falls back to a local limit itself.
    local: bool,
    /// Whether a policy is in shadow mode, counts some responses only, or
    /// settles its costs after the response.
    special: bool,
}

/// What a request of one tier reads: one entry per policy, in order.
#[derive(Debug)]
pub(crate) struct TierPlan {
    /// The limit, window and cost of each policy for the tier.
    pub(crate) limits: Box<[Limits]>,
    /// `RateLimit-Policy` when every policy counts the request.
    pub(crate) ietf_policy: Option<HeaderValue>,
}

impl TierPlan {
    fn new(policies: &[Arc<Policy>], tier: Option<&str>) -> Self {
        let limits: Box<[Limits]> = policies.iter().map(|p| p.limits_for(tier)).collect();
        let fields = policies.iter().zip(&limits);
        Self {
            ietf_policy: policy_value(
                fields.map(|(p, l)| (p.name(), quota(p.algorithm(), l.limit, l.window, l.burst))),
            ),
            limits,
        }
    }
}

impl Plan {
    pub(crate) fn new(policies: Vec<Arc<Policy>>) -> Self {
        let mut tier_names: Vec<&Arc<str>> = Vec::new();
        for policy in &policies {
            for (tier, _) in &policy.tiers {
                if !tier_names.contains(&tier) {
                    tier_names.push(tier);
                }
            }
        }
        let tiers = tier_names
            .into_iter()
            .map(|tier| (tier.clone(), TierPlan::new(&policies, Some(tier))))
            .collect();
        Self {
            base: TierPlan::new(&policies, None),
            tiers,
            // A shadow policy never denies, so it never fails closed.
            closed: policies
                .iter()
                .any(|p| p.fail_mode == Some(FailMode::Closed) && !p.is_shadow()),
            defaulted: policies
                .iter()
                .any(|p| p.fail_mode.is_none() && !p.is_shadow()),
            local: policies
                .iter()
                .any(|p| p.fail_mode == Some(FailMode::Local)),
            special: policies
                .iter()
                .any(|p| p.is_shadow() || p.count() != Count::All || p.settlement.is_some()),
            policies: policies.into(),
        }
    }

    /// The policies, in order.
    pub(crate) fn policies(&self) -> &[Arc<Policy>] {
        &self.policies
    }

    /// What a client of `tier` reads.
    pub(crate) fn tier(&self, tier: Option<&str>) -> &TierPlan {
        tier.and_then(|tier| self.tiers.iter().find(|(name, _)| &**name == tier))
            .map_or(&self.base, |(_, plan)| plan)
    }

    /// Whether a request that every policy counts fails closed when the
    /// layer's default is `default`.
    pub(crate) fn fails_closed(&self, default: FailMode) -> bool {
        self.closed || (self.defaulted && default == FailMode::Closed)
    }

    /// Whether a request's checks need more than counting under the
    /// layer's default fail mode: a shadow policy, one that counts some
    /// responses only, or one that falls back to a local limit.
    pub(crate) fn has_modes(&self, default: FailMode) -> bool {
        self.special || self.local || (self.defaulted && default == FailMode::Local)
    }

    /// The policy a check of this plan was built from.
    pub(crate) fn policy_of(&self, check: &Check) -> Option<&Policy> {
        self.policies
            .iter()
            .find(|policy| Arc::ptr_eq(policy.shared_name(), &check.policy))
            .map(|policy| &**policy)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::policy::TierLimits;

    fn plan() -> Plan {
        let search = Policy::new("search", 5, Duration::from_secs(60)).with_tier(
            "pro",
            TierLimits::new()
                .with_limit(50)
                .with_window(Duration::from_millis(1500)),
        );
        let daily =
            Policy::new("daily", 1000, Duration::from_secs(86_400)).with_fail_mode(FailMode::Open);
        Plan::new(vec![Arc::new(search), Arc::new(daily)])
    }

    #[test]
    fn each_tier_reads_its_own_limits_and_policy_field() {
        let plan = plan();
        let pro = plan.tier(Some("pro"));
        assert_eq!(pro.limits[0].limit, 50);
        assert_eq!(pro.limits[1].limit, 1000);
        assert_eq!(
            pro.ietf_policy.as_ref().unwrap(),
            "\"search\";q=50;w=2, \"daily\";q=1000;w=86400"
        );
        for tier in [None, Some("gold")] {
            let base = plan.tier(tier);
            assert_eq!(base.limits[0].limit, 5);
            assert_eq!(
                base.ietf_policy.as_ref().unwrap(),
                "\"search\";q=5;w=60, \"daily\";q=1000;w=86400"
            );
        }
    }

    #[test]
    fn a_bucket_states_its_burst_per_its_refill_time() {
        let bucket = Policy::new("api", 10, Duration::from_secs(1))
            .with_algorithm(crate::policy::Algorithm::TokenBucket)
            .with_burst(25);
        let leases = Policy::concurrency("exports", 2);
        let plan = Plan::new(vec![Arc::new(bucket), Arc::new(leases)]);
        assert_eq!(
            plan.tier(None).ietf_policy.as_ref().unwrap(),
            "\"api\";q=25;w=3, \"exports\";q=2"
        );
    }

    #[test]
    fn a_policy_without_a_fail_mode_takes_the_layers() {
        let plan = plan();
        assert!(!plan.fails_closed(FailMode::Open));
        assert!(plan.fails_closed(FailMode::Closed));
        let closed = Plan::new(vec![Arc::new(
            Policy::new("pay", 3, Duration::from_secs(60)).with_fail_mode(FailMode::Closed),
        )]);
        assert!(closed.fails_closed(FailMode::Open));
    }
}
