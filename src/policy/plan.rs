//! [`Plan`]: what the request path reads for one (route, method), worked
//! out once when the policies are built: the policies, and per tier the
//! terms of their checks and the `RateLimit-Policy` field. A request
//! reads it once, in [`Plan::priced`].

use std::sync::Arc;

use http::HeaderValue;
use smallvec::SmallVec;

use super::cost::{Cost, Costs};
use super::{Algorithm, Count, FailMode, Policy};
use crate::headers::{policy_value, quota};
use crate::limits::Found;
use crate::rejection::CostAboveLimit;
use crate::store::{Check, Price, Terms};

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
}

/// What a request of one tier reads: one entry per policy, in order.
#[derive(Debug)]
pub(crate) struct TierPlan {
    /// The terms of each policy's check for the tier.
    pub(crate) terms: Box<[Terms]>,
    /// `RateLimit-Policy` when every policy counts the request.
    pub(crate) ietf_policy: Option<HeaderValue>,
}

impl TierPlan {
    fn new(policies: &[Arc<Policy>], tier: Option<&str>) -> Self {
        let terms: Box<[Terms]> = policies.iter().map(|p| Terms::of(p, tier)).collect();
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

/// What a request is checked at under a plan, read from it once: one
/// [`Price`] per policy that counts the request, in the plan's order; how
/// a store failure answers it; and whether its checks do more than count.
#[derive(Debug)]
pub(crate) struct Priced<'a> {
    pub(crate) prices: SmallVec<[Price<'a>; 2]>,
    /// Whether a policy that decides the request fails closed.
    pub(crate) fail_closed: bool,
    /// Whether the checks need [`Modes`](crate::layer::checks::Modes): a
    /// shadow policy, one that counts some responses only or settles its
    /// costs, or one that falls back to a local limit.
    pub(crate) has_modes: bool,
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
            policies: policies.into(),
        }
    }

    /// What a client of `tier` reads.
    pub(crate) fn tier(&self, tier: Option<&str>) -> &TierPlan {
        tier.and_then(|tier| self.tiers.iter().find(|(name, _)| &**name == tier))
            .map_or(&self.base, |(_, plan)| plan)
    }

    /// The request of a client of `tier`, priced: under each policy, at
    /// the request's cost where `costs` has one (none for a policy that
    /// exempts it) and at the client's own limit where `own` has one (one
    /// entry per policy). Under the layer's `shadow` mode no policy
    /// decides; `default` is the layer's fail mode. A cost that can never
    /// be admitted (above the limit, or a client's own limit below the
    /// policy's cost) is an error, never retried.
    pub(crate) fn priced(
        &self,
        tier: Option<&str>,
        costs: Option<&Costs>,
        own: Option<&Found>,
        shadow: bool,
        default: FailMode,
    ) -> Result<Priced<'_>, CostAboveLimit> {
        let mut priced = Priced {
            prices: SmallVec::new(),
            fail_closed: false,
            has_modes: shadow
                || self.special
                || self.local
                || (self.defaulted && default == FailMode::Local),
        };
        for (index, terms) in self.tier(tier).terms.iter().enumerate() {
            let (mut limit, mut burst) = (terms.limits.limit, terms.limits.burst);
            if let Some(own) = own.and_then(|own| own[index]) {
                let limits = self.policies[index].limits_with(tier, Some(own));
                (limit, burst) = (limits.limit, limits.burst);
            }
            let cost = match costs.map_or(Cost::Policy, |costs| costs[index]) {
                Cost::Policy => terms.limits.cost,
                Cost::Exempt => continue,
                // A lease is one request in flight, whatever it costs.
                Cost::Units(_) if terms.algorithm == Algorithm::Concurrency => 1,
                Cost::Units(units) => units.max(1),
            };
            if cost > burst {
                return Err(CostAboveLimit {
                    policy: terms.policy.clone(),
                    cost,
                    limit: burst,
                    window: terms.limits.window,
                });
            }
            // A shadow policy never denies, so it never fails closed.
            let (shadow_policy, fail_mode) = self.modes[index];
            let enforced = !shadow && !shadow_policy;
            priced.fail_closed |= enforced && fail_mode.unwrap_or(default) == FailMode::Closed;
            priced.prices.push(Price {
                terms,
                limit,
                burst,
                cost,
                enforced,
            });
        }
        Ok(priced)
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
        let fails_closed = |plan: &Plan, default| {
            let priced = plan.priced(None, None, None, false, default).unwrap();
            priced.fail_closed
        };
        let plan = plan();
        assert!(!fails_closed(&plan, FailMode::Open));
        assert!(fails_closed(&plan, FailMode::Closed));
        let closed = Plan::new(vec![Arc::new(
            Policy::new("pay", 3, Duration::from_secs(60)).with_fail_mode(FailMode::Closed),
        )]);
        assert!(fails_closed(&closed, FailMode::Open));
        let shadow = Policy::new("pay", 3, Duration::from_secs(60))
            .with_fail_mode(FailMode::Closed)
            .with_shadow(true);
        let shadow = Plan::new(vec![Arc::new(shadow)]);
        assert!(
            !fails_closed(&shadow, FailMode::Closed),
            "a shadow policy never denies"
        );
    }

    #[test]
    fn a_policy_a_cost_exempts_does_not_decide_how_the_request_fails() {
        let plan = plan();
        let closed = |costs: &Costs| {
            let priced = plan.priced(None, Some(costs), None, false, FailMode::Closed);
            priced.unwrap().fail_closed
        };
        let both: Costs = [Cost::Units(2), Cost::Policy].into_iter().collect();
        assert!(closed(&both), "search takes the layer's closed default");
        let daily_only: Costs = [Cost::Exempt, Cost::Units(2)].into_iter().collect();
        assert!(!closed(&daily_only), "daily fails open");
        let priced = plan.priced(None, Some(&daily_only), None, false, FailMode::Closed);
        let prices = priced.unwrap().prices;
        assert_eq!(
            (prices.len(), prices[0].limit, prices[0].cost),
            (1, 1000, 2)
        );
    }

    #[test]
    fn a_cost_above_the_clients_limit_is_refused_at_once() {
        let plan = plan();
        let costs: Costs = [Cost::Units(6), Cost::Policy].into_iter().collect();
        let refused = plan
            .priced(None, Some(&costs), None, false, FailMode::Open)
            .unwrap_err();
        assert_eq!((refused.cost(), refused.limit()), (6, 5));
        let own: Found = [Some(1), None].into_iter().collect();
        let costs: Costs = [Cost::Units(2), Cost::Policy].into_iter().collect();
        let refused = plan.priced(None, Some(&costs), Some(&own), false, FailMode::Open);
        assert_eq!(refused.unwrap_err().limit(), 1, "the client's own limit");
    }
}
