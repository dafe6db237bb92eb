//! Per-request costs: [`RequestCost`], and what one request computed.

use http::request::Parts;
use smallvec::SmallVec;

use crate::policy::Policy;

/// What a request costs under one policy, as a [`RequestCost`] says.
///
/// ```
/// use slidegate::policy::Cost;
///
/// assert_eq!(Cost::from(Some(3)), Cost::Units(3));
/// assert_eq!(Cost::from(None), Cost::Policy);
/// // Leaving a policy out is said in so many words, never by a zero.
/// assert_ne!(Cost::from(0), Cost::Exempt);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Cost {
    /// The policy's own cost (its tier's, if the client has one).
    #[default]
    Policy,
    /// This many units. Every counted request costs at least one unit, so
    /// `Units(0)` is spent as 1: a computed zero never makes a request free.
    Units(u32),
    /// The policy does not count this request at all.
    Exempt,
}

impl From<u32> for Cost {
    fn from(units: u32) -> Self {
        Self::Units(units)
    }
}

impl From<Option<u32>> for Cost {
    fn from(units: Option<u32>) -> Self {
        units.map_or(Self::Policy, Self::Units)
    }
}

/// Computes what a request costs under a policy from its head: a GraphQL
/// query's weight, a batch's size, an export's row count. Set with
/// [`RateLimitLayer::with_request_cost`](crate::RateLimitLayer::with_request_cost).
///
/// [`Cost::Policy`] (or `None`) keeps the policy's own cost (its tier's,
/// if the client has one); [`Cost::Units`] (or `Some(n)`) spends `n` units,
/// at least one; [`Cost::Exempt`] leaves the policy out for this request.
/// A cost above the client's limit can never be admitted, so the request is
/// answered `422 Unprocessable Content` at once, without `Retry-After`:
/// waiting would not help.
///
/// A cost read from the request is the client's to choose: clamp it to
/// what the endpoint can really serve, and never let it exempt a request.
///
/// Closures of the right shape are `RequestCost`s:
///
/// ```
/// use http::request::Parts;
/// use slidegate::{Policy, policy::{Cost, RequestCost}};
///
/// /// The `x-batch-size` header (1 to 500), for the "batch" policy only.
/// fn batch_size(parts: &Parts, policy: &Policy) -> Cost {
///     if policy.name() != "batch" {
///         return Cost::Policy;
///     }
///     let size = parts.headers.get("x-batch-size").and_then(|v| v.to_str().ok()?.parse::<u32>().ok());
///     Cost::Units(size.unwrap_or(1).clamp(1, 500))
/// }
/// fn takes(_: impl RequestCost) {}
/// takes(batch_size);
/// ```
pub trait RequestCost: Send + Sync + 'static {
    /// The request's cost under `policy`.
    fn cost(&self, parts: &Parts, policy: &Policy) -> Cost;
}

impl<F, C> RequestCost for F
where
    F: Fn(&Parts, &Policy) -> C + Send + Sync + 'static,
    C: Into<Cost>,
{
    fn cost(&self, parts: &Parts, policy: &Policy) -> Cost {
        self(parts, policy).into()
    }
}

/// The costs one request computed, one per applying policy.
pub(crate) type Costs = SmallVec<[Cost; 2]>;
