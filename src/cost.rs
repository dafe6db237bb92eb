//! Per-request costs: [`RequestCost`], and the checks a request's costs
//! make.

use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;
use smallvec::SmallVec;

use crate::{Check, Key, Policy};

/// Computes what a request costs under a policy from its head: a GraphQL
/// query's weight, a batch's size, an export's row count. Set with
/// [`RateLimitLayer::request_cost`](crate::RateLimitLayer::request_cost).
///
/// `None` keeps the policy's own cost (its tier's, if the client has one);
/// `Some(0)` means the policy does not count the request. A cost above the
/// client's limit can never be admitted, so the request is answered
/// `422 Unprocessable Content` at once, without `Retry-After`: waiting
/// would not help.
///
/// Closures of the right shape are `RequestCost`s:
///
/// ```
/// use http::request::Parts;
/// use slidegate::{Policy, RequestCost};
///
/// /// The `x-batch-size` header, for the "batch" policy only.
/// fn batch_size(parts: &Parts, policy: &Policy) -> Option<u32> {
///     if policy.name() != "batch" {
///         return None;
///     }
///     parts.headers.get("x-batch-size")?.to_str().ok()?.parse().ok()
/// }
/// fn takes(_: impl RequestCost) {}
/// takes(batch_size);
/// ```
pub trait RequestCost: Send + Sync + 'static {
    /// The request's cost under `policy`, or `None` for the policy's own.
    fn cost(&self, parts: &Parts, policy: &Policy) -> Option<u32>;
}

impl<F> RequestCost for F
where
    F: Fn(&Parts, &Policy) -> Option<u32> + Send + Sync + 'static,
{
    fn cost(&self, parts: &Parts, policy: &Policy) -> Option<u32> {
        self(parts, policy)
    }
}

/// The costs one request computed, one per applying policy.
pub(crate) type Costs = SmallVec<[Option<u32>; 2]>;

/// A request that costs more under a policy than the client may ever
/// spend in one of its windows.
#[derive(Debug)]
pub(crate) struct CostAboveLimit {
    pub(crate) policy: Arc<str>,
    pub(crate) cost: u32,
    pub(crate) limit: u32,
    pub(crate) window: Duration,
}

/// The request's checks for the client `key` of `tier`: one per policy,
/// at the computed cost where there is one, none for a policy the request
/// costs nothing under.
pub(crate) fn checks(
    policies: &[Arc<Policy>],
    key: &Key,
    tier: Option<&str>,
    costs: Option<&Costs>,
) -> Result<Vec<Check>, CostAboveLimit> {
    let mut checks = Vec::with_capacity(policies.len());
    for (index, policy) in policies.iter().enumerate() {
        let mut check = Check::for_tier(policy, key.clone(), tier);
        match costs.and_then(|costs| costs[index]) {
            None => {}
            Some(0) => continue,
            Some(cost) if cost > check.limit => {
                return Err(CostAboveLimit {
                    policy: check.policy,
                    cost,
                    limit: check.limit,
                    window: check.window,
                });
            }
            Some(cost) => check.cost = cost,
        }
        checks.push(check);
    }
    Ok(checks)
}
