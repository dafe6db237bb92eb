//! A request's price under its plan: per policy that counts it, the
//! tier's terms at the client's own limit and the request's cost
//! ([`Price`]), read from the [`Plan`] once per request; and the checks
//! they make.

use std::sync::Arc;

use smallvec::SmallVec;

use crate::key::Key;
use crate::layer::decide::per_keys::PerKeys;
use crate::limits::Found;
use crate::policy::cost::{Cost, Costs};
use crate::policy::plan::Plan;
use crate::policy::{Algorithm, FailMode, Terms};
use crate::rejection::CostAboveLimit;
use crate::store::Check;

/// What a request is checked at under a plan, read from it once: one
/// [`Price`] per policy that counts the request, in the plan's order; how
/// a store failure answers it; and whether its checks do more than count.
#[derive(Debug)]
pub(crate) struct Priced<'a> {
    pub(crate) prices: SmallVec<[Price<'a>; 2]>,
    /// Whether a policy that decides the request fails closed.
    pub(crate) fail_closed: bool,
    /// Whether the checks need [`Modes`](crate::layer::decide::checks::Modes): a
    /// shadow policy, one that counts some responses only or settles its
    /// costs, or one that falls back to a local limit.
    pub(crate) has_modes: bool,
}

/// What the request asks of each policy of its plan, one entry per
/// policy where known: its cost (none where the policy's own), the key it
/// counts under (none where the client's), the own limit of that key
/// (none where its tier's).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Asked<'a> {
    pub(crate) costs: Option<&'a Costs>,
    pub(crate) per: Option<&'a PerKeys>,
    pub(crate) own: Option<&'a Found>,
}

impl<'a> Priced<'a> {
    /// The request of a client of `tier`, priced under `plan`: under each
    /// policy, at the request's cost where `asked` has one (none for a
    /// policy that exempts it), under the policy's own key where it
    /// counts per another, and at the client's own limit where it has
    /// one. Under the layer's `shadow` mode no policy decides; `default`
    /// is the layer's fail mode. A cost that can never be admitted (above
    /// the limit, or a client's own limit below the policy's cost) is an
    /// error, never retried.
    pub(crate) fn of(
        plan: &'a Plan,
        tier: Option<&str>,
        asked: Asked<'a>,
        shadow: bool,
        default: FailMode,
    ) -> Result<Self, CostAboveLimit> {
        let Asked { costs, per, own } = asked;
        let mut priced = Self {
            prices: SmallVec::new(),
            fail_closed: false,
            has_modes: plan.needs_modes(shadow, default),
        };
        for (index, terms) in plan.tier(tier).terms.iter().enumerate() {
            // A count shared by many clients is not the client's: its
            // terms are the base ones in every tier (the plan's), and so is
            // its own limit, one set for the key it counts under.
            let tier = tier.filter(|_| per.and_then(|per| per.key(index)).is_none());
            let (mut limit, mut burst) = (terms.limits.limit, terms.limits.burst);
            if let Some(own) = own.and_then(|own| own[index]) {
                let limits = plan.policies[index].limits_with(tier, Some(own));
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
            let (shadow_policy, fail_mode) = plan.modes()[index];
            let enforced = !shadow && !shadow_policy;
            priced.fail_closed |= enforced && fail_mode.unwrap_or(default) == FailMode::Closed;
            priced.prices.push(Price {
                terms,
                key: per.and_then(|per| per.key(index)),
                limit,
                burst,
                cost,
                enforced,
            });
        }
        Ok(priced)
    }
}

/// One policy's check of a request, but for the client: the tier's terms,
/// at the client's own limit and the request's cost.
#[derive(Debug)]
pub(crate) struct Price<'a> {
    pub(crate) terms: &'a Arc<Terms>,
    /// The key the policy counts under, when not the client's
    /// ([`Policy::per`](crate::Policy::per)).
    pub(crate) key: Option<&'a Key>,
    pub(crate) limit: u32,
    pub(crate) burst: u32,
    pub(crate) cost: u32,
    /// Whether the check decides the request: neither its policy nor
    /// the layer is in shadow mode.
    pub(crate) enforced: bool,
}

impl Price<'_> {
    /// The key the check counts under: the policy's own, or the
    /// client's, `client`.
    pub(crate) fn key<'k>(&'k self, client: &'k Key) -> &'k Key {
        self.key.unwrap_or(client)
    }

    /// The check of the request of the client `client`, in the layer's
    /// `namespace`.
    pub(crate) fn check(&self, client: &Key, namespace: Option<&Arc<str>>) -> Check {
        Check::of_terms(
            self.terms,
            self.key(client),
            namespace,
            (self.limit, self.burst),
            self.cost,
        )
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::policy::Policy;

    #[test]
    fn a_policy_without_a_fail_mode_takes_the_layers() {
        let fails_closed = |plan: &Plan, default| {
            let priced = Priced::of(plan, None, Asked::default(), false, default).unwrap();
            priced.fail_closed
        };
        let plan = Plan::sample();
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
        let plan = Plan::sample();
        let closed = |costs: &Costs| {
            let asked = Asked {
                costs: Some(costs),
                ..Asked::default()
            };
            let priced = Priced::of(&plan, None, asked, false, FailMode::Closed);
            priced.unwrap().fail_closed
        };
        let both: Costs = [Cost::Units(2), Cost::Policy].into_iter().collect();
        assert!(closed(&both), "search takes the layer's closed default");
        let daily_only: Costs = [Cost::Exempt, Cost::Units(2)].into_iter().collect();
        assert!(!closed(&daily_only), "daily fails open");
        let asked = Asked {
            costs: Some(&daily_only),
            ..Asked::default()
        };
        let priced = Priced::of(&plan, None, asked, false, FailMode::Closed);
        let prices = priced.unwrap().prices;
        assert_eq!(
            (prices.len(), prices[0].limit, prices[0].cost),
            (1, 1000, 2)
        );
    }

    #[test]
    fn a_cost_above_the_clients_limit_is_refused_at_once() {
        let plan = Plan::sample();
        let costs: Costs = [Cost::Units(6), Cost::Policy].into_iter().collect();
        let asked = Asked {
            costs: Some(&costs),
            ..Asked::default()
        };
        let refused = Priced::of(&plan, None, asked, false, FailMode::Open).unwrap_err();
        assert_eq!((refused.cost(), refused.limit()), (6, 5));
        let own: Found = [Some(1), None].into_iter().collect();
        let costs: Costs = [Cost::Units(2), Cost::Policy].into_iter().collect();
        let asked = Asked {
            costs: Some(&costs),
            per: None,
            own: Some(&own),
        };
        let refused = Priced::of(&plan, None, asked, false, FailMode::Open);
        assert_eq!(refused.unwrap_err().limit(), 1, "the client's own limit");
    }
}
