//! [`Plan`]: what the request path reads for one (route, method), worked
//! out once when the policies are built: the policies, and per tier the
//! terms of their checks and the `RateLimit-Policy` field. A request
//! reads it once, when the layer prices it.

use std::sync::Arc;

use http::HeaderValue;

use super::terms::{Terms, policy_value, quota};
use super::{Count, FailMode, Policy};

/// The policies that apply to one (route, method), and what a request
/// under them needs per tier.
#[derive(Debug)]
pub(crate) struct Plan {
    /// The policies, in order.
    pub(crate) policies: Box<[Arc<Policy>]>,
    /// Per policy, in order: whether it is in shadow mode, and its own
    /// fail mode.
    modes: Box<[(bool, Option<FailMode>)]>,
    /// For clients of no tier, or of a tier no policy names.
    base: TierPlan,
    /// For clients of each tier some policy names.
    tiers: Box<[(Arc<str>, TierPlan)]>,
    /// Whether a policy sets no fail mode (the layer's default decides).
    defaulted: bool,
    /// Whether a policy falls back to a local limit itself.
    local: bool,
    /// Whether a policy is in shadow mode, counts some responses only, or
    /// settles its costs after the response.
    special: bool,
    /// Whether a policy counts under a key of its own
    /// ([`Policy::per`]).
    per: bool,
    /// Whether a policy limits the messages of upgraded connections.
    messages: bool,
}

/// What a request of one tier reads: one entry per policy, in order.
#[derive(Debug)]
pub(crate) struct TierPlan {
    /// The terms of each policy's check for the tier.
    pub(crate) terms: Box<[Arc<Terms>]>,
    /// `RateLimit-Policy` when every policy counts the request.
    pub(crate) ietf_policy: Option<HeaderValue>,
}

impl TierPlan {
    fn new(policies: &[Arc<Policy>], tier: Option<&str>) -> Self {
        // A count shared by many clients (`Policy::per`) is no client's:
        // every tier reads its base terms.
        let terms: Box<[Arc<Terms>]> = policies
            .iter()
            .map(|p| Arc::new(Terms::of(p, tier.filter(|_| !p.is_per()))))
            .collect();
        let fields = policies.iter().zip(&terms).map(|(p, t)| {
            let l = &t.limits;
            (p.name(), quota(p.algorithm(), l.limit, l.window, l.burst))
        });
        Self {
            ietf_policy: policy_value(fields),
            terms,
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
            modes: policies
                .iter()
                .map(|p| (p.is_shadow(), p.fail_mode))
                .collect(),
            defaulted: policies
                .iter()
                .any(|p| p.fail_mode.is_none() && !p.is_shadow()),
            local: policies
                .iter()
                .any(|p| p.fail_mode == Some(FailMode::Local)),
            special: policies
                .iter()
                .any(|p| p.is_shadow() || p.count() != Count::All || p.settlement.is_some()),
            per: policies.iter().any(|p| p.is_per()),
            messages: policies.iter().any(|p| p.messages().is_some()),
            policies: policies.into(),
        }
    }

    /// Whether a policy limits the messages of upgraded connections
    /// ([`Policy::with_messages`]).
    #[inline]
    pub(crate) fn counts_messages(&self) -> bool {
        self.messages
    }

    /// Whether a policy counts under a key of its own ([`Policy::per`]),
    /// so the request's keys are read beside its client's.
    #[inline]
    pub(crate) fn counts_per(&self) -> bool {
        self.per
    }

    /// What a client of `tier` reads.
    pub(crate) fn tier(&self, tier: Option<&str>) -> &TierPlan {
        tier.and_then(|tier| self.tiers.iter().find(|(name, _)| &**name == tier))
            .map_or(&self.base, |(_, plan)| plan)
    }

    /// The policy of this plan named `name` (by the name's own `Arc`, as
    /// a check built from the plan holds it).
    pub(crate) fn policy_named(&self, name: &Arc<str>) -> Option<&Policy> {
        self.policies
            .iter()
            .find(|policy| Arc::ptr_eq(policy.shared_name(), name))
            .map(|policy| &**policy)
    }

    /// Per policy, in order: whether it is in shadow mode, and its own
    /// fail mode.
    pub(crate) fn modes(&self) -> &[(bool, Option<FailMode>)] {
        &self.modes
    }

    /// Whether a request's checks under this plan need their modes (see
    /// `Priced::has_modes` in the layer): under the layer's `shadow`
    /// mode, or its `default` fail mode of a local limit for a policy
    /// that sets none.
    pub(crate) fn needs_modes(&self, shadow: bool, default: FailMode) -> bool {
        shadow || self.special || self.local || (self.defaulted && default == FailMode::Local)
    }
}

#[cfg(test)]
impl Plan {
    /// A plan of two policies for tests: "search", 5 a minute (50 per
    /// 1.5 s for the "pro" tier), and "daily", 1,000 a day, failing open.
    pub(crate) fn sample() -> Self {
        use std::time::Duration;

        let search = Policy::new("search", 5, Duration::from_secs(60)).with_tier(
            "pro",
            super::TierLimits::new()
                .with_limit(50)
                .with_window(Duration::from_millis(1500)),
        );
        let daily =
            Policy::new("daily", 1000, Duration::from_secs(86_400)).with_fail_mode(FailMode::Open);
        Self::new(vec![Arc::new(search), Arc::new(daily)])
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn each_tier_reads_its_own_limits_and_policy_field() {
        let plan = Plan::sample();
        let pro = plan.tier(Some("pro"));
        assert_eq!(pro.terms[0].limits.limit, 50);
        assert_eq!(pro.terms[1].limits.limit, 1000);
        assert_eq!(
            pro.ietf_policy.as_ref().unwrap(),
            "\"search\";q=50;w=2, \"daily\";q=1000;w=86400"
        );
        for tier in [None, Some("gold")] {
            let base = plan.tier(tier);
            assert_eq!(base.terms[0].limits.limit, 5);
            assert_eq!(
                base.ietf_policy.as_ref().unwrap(),
                "\"search\";q=5;w=60, \"daily\";q=1000;w=86400"
            );
        }
    }

    #[test]
    fn a_count_shared_through_per_reads_its_base_terms_in_every_tier() {
        let shared = Policy::new("everyone", 100, Duration::from_secs(60))
            .per(crate::Global)
            .with_tier("pro", super::super::TierLimits::new().with_limit(1000));
        let own = Policy::new("own", 5, Duration::from_secs(60))
            .with_tier("pro", super::super::TierLimits::new().with_limit(50));
        let plan = Plan::new(vec![Arc::new(own), Arc::new(shared)]);
        let pro = plan.tier(Some("pro"));
        assert_eq!(
            (pro.terms[0].limits.limit, pro.terms[1].limits.limit),
            (50, 100)
        );
        assert_eq!(
            pro.ietf_policy.as_ref().unwrap(),
            "\"own\";q=50;w=60, \"everyone\";q=100;w=60"
        );
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
}
