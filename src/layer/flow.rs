//! The steps a limited request goes through, shared by the layer's
//! synchronous path (in [`RateLimit::call`](crate::RateLimit)) and its
//! waiting one (in [`ResponseFuture`](crate::ResponseFuture)): find the
//! policies, build the checks, and ask the deny cache and the store; what
//! their answer leads to is [`verdict`](super::verdict)'s.

use std::cmp::Reverse;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Response};

use crate::deny_cache::DenyCache;
use crate::key::{Identity, KeyRejection};
use crate::layer::roles::{self, Refund, Roles};
use crate::layer::verdict::{decide, index_of_min, trace_decision};
use crate::layer::{Options, Shared};
use crate::metrics::{self, Outcome, Timer};
use crate::policy::cost::{self, Checks, Costs};
use crate::policy::plan::Plan;
use crate::policy::{Cost, FailMode, Policies};
use crate::response::headers::RateHeaders;
use crate::response::problem::{
    client_unidentified, cost_above_limit, invalid_credentials, missing_credentials,
    too_many_requests,
};
use crate::response::rejection::{self, OnRejection, Rejection};
use crate::store::{Check, CheckFuture};
use crate::throttle::TIER_LOOKUP_TIMEOUTS;
use crate::tier::TierFuture;

/// An answer of the limiter's that waits for the store.
pub(crate) type AnswerFuture = Pin<Box<dyn Future<Output = Response<Bytes>> + Send + 'static>>;

/// Where a request goes once it is decided.
pub(crate) enum Next {
    /// On to the inner service, with these rate-limit headers, and the
    /// units to refund if its response should not count.
    Call(Option<RateHeaders>, Option<Box<Refund>>),
    /// Back to the client with the limiter's answer.
    Answer(Response<Bytes>),
}

/// The request's checks, sent.
#[allow(
    clippy::large_enum_variant,
    reason = "returned once and taken apart at once; boxing would allocate per request"
)]
pub(crate) enum Sent {
    /// Decided at once: by the store, the deny cache, or before either.
    Now(Next),
    /// The store answers later.
    Later {
        check: CheckFuture,
        checks: Checks,
        roles: Option<Box<Roles>>,
        sent_at: SentAt,
        /// `RateLimit-Policy` as the plan had it, for when it answers.
        ietf_policy: Option<HeaderValue>,
    },
}

/// When a request's checks went to the store: on the deny cache's clock
/// (0 without one), and timed for the metrics and the `rate_limit` span.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SentAt {
    pub(crate) deny_clock: u64,
    pub(crate) timer: Timer,
}

/// The plan of a request: by the route pattern axum matched
/// (`MatchedPath`), or, outside axum, by its path matched against the
/// policies' patterns.
pub(crate) fn plan_for<'a>(policies: &'a Policies, parts: &Parts) -> &'a Plan {
    #[cfg(feature = "axum")]
    if let Some(matched) = parts.extensions.get::<axum::extract::MatchedPath>() {
        return policies.plan_in(&parts.method, matched.as_str(), false);
    }
    policies.plan_in(&parts.method, parts.uri.path(), true)
}

/// Whether a policy that counts the request fails closed: policies a
/// computed cost exempts, and shadow policies, do not decide how the
/// request fails.
pub(crate) fn fails_closed(plan: &Plan, costs: Option<&Costs>, options: Options) -> bool {
    let default = options.fail_mode;
    if options.shadow {
        return false;
    }
    let Some(costs) = costs else {
        return plan.fails_closed(default);
    };
    plan.policies().iter().zip(costs).any(|(policy, cost)| {
        *cost != Cost::Exempt
            && !policy.is_shadow()
            && policy.configured_fail_mode().unwrap_or(default) == FailMode::Closed
    })
}

/// The answer to a request no extractor identified: `401` when the chain
/// keys by credentials alone, `500` otherwise.
pub(crate) fn unidentified(shared: &Shared, parts: &Parts) -> Response<Bytes> {
    let missing_credentials = shared.keys.needs_credentials();
    let rejection = Rejection::Unidentified {
        parts,
        missing_credentials,
    };
    rejection::answer(shared.on_rejection.as_ref(), &rejection, || {
        if missing_credentials {
            self::missing_credentials()
        } else {
            client_unidentified()
        }
    })
}

/// The lookup of `identity`'s tier, when the layer has a lookup and the
/// identity names no tier.
pub(crate) fn tier_lookup(
    shared: &Shared,
    parts: &Parts,
    identity: &Identity,
) -> Option<TierFuture> {
    match &shared.tier_lookup {
        Some(lookup) if identity.tier.is_none() => Some(with_timeout(
            lookup.lookup(parts, identity),
            shared.options.lookup_timeout,
        )),
        _ => None,
    }
}

/// Bounds a tier lookup: past `timeout` the base limits apply.
fn with_timeout(lookup: TierFuture, timeout: Duration) -> TierFuture {
    Box::pin(async move {
        tokio::time::timeout(timeout, lookup)
            .await
            .unwrap_or_else(|_| {
                if let Some(held_back) = TIER_LOOKUP_TIMEOUTS.admit() {
                    tracing::warn!(
                        ?timeout,
                        held_back,
                        "tier lookup timed out; base limits apply"
                    );
                }
                None
            })
    })
}

/// Answers refused credentials `401`, after counting the refusal against
/// the client's address (`check`) when the layer counts them: `429` once
/// the address is past its limit. The answer waits when the store does.
pub(crate) fn refused(
    shared: &Shared,
    check: Option<Check>,
    rejection: KeyRejection,
) -> Result<Response<Bytes>, AnswerFuture> {
    tracing::debug!(reason = rejection.reason(), "credentials refused");
    let Some((guard, check)) = shared.credential_failures.as_ref().zip(check) else {
        let refused = Rejection::InvalidCredentials(&rejection);
        return Ok(rejection::answer(
            shared.on_rejection.as_ref(),
            &refused,
            || invalid_credentials(&rejection),
        ));
    };
    let refusal = guard.refusal(
        check,
        rejection,
        shared.options,
        shared.on_rejection.clone(),
    );
    match shared
        .store
        .check(std::slice::from_ref(&refusal.check))
        .into_ready()
    {
        Ok(outcome) => Ok(refusal.answer(outcome)),
        Err(count) => Err(Box::pin(async move { refusal.answer(count.await) })),
    }
}

/// A `429` from the deny cache, if a policy of `checks` is known to deny.
pub(crate) fn cached_denial(
    cache: &DenyCache,
    checks: &[Check],
    options: Options,
    on_rejection: Option<&OnRejection>,
) -> Option<Response<Bytes>> {
    let denied = cache.lookup(checks)?;
    for check in denied.checks.iter() {
        metrics::decided(&check.policy, Outcome::DenyCache);
    }
    let index = index_of_min(&denied.decisions, |d| Reverse(d.retry_after));
    trace_decision(&denied.checks[index].policy, Outcome::DenyCache, None);
    Some(too_many_requests(
        &denied.checks,
        &denied.decisions,
        index,
        Some(&denied.bodies[index]),
        on_rejection,
        options.header_style,
        options.reset_format,
    ))
}

/// Builds the checks of `identity` under `plan` and sends them: the answer
/// is known at once for a cost above the limit, an exempt request, a
/// denial the deny cache knows, or a store that decides in process.
pub(crate) fn send(
    shared: &Shared,
    plan: &Plan,
    identity: &Identity,
    costs: Option<&Costs>,
    fail_closed: bool,
) -> Sent {
    let tier = identity.tier.as_deref();
    let mut checks = match cost::checks(plan, &identity.key, tier, costs) {
        Ok(checks) => checks,
        Err(denied) => {
            let rejection = Rejection::CostAboveLimit(&denied);
            let response = rejection::answer(shared.on_rejection.as_ref(), &rejection, || {
                cost_above_limit(&denied)
            });
            return Sent::Now(Next::Answer(response));
        }
    };
    if checks.is_empty() {
        // Every policy of the request exempts it.
        return Sent::Now(Next::Call(None, None));
    }
    let roles = Roles::assign(plan, &mut checks, shared.options);
    let enforced = roles
        .as_ref()
        .map_or(checks.len(), |roles| roles.shadow_from);
    let mut deny_clock = 0;
    if let Some(cache) = &shared.deny_cache {
        let options = shared.options;
        if let Some(response) = cached_denial(
            cache,
            &checks[..enforced],
            options,
            shared.on_rejection.as_ref(),
        ) {
            return Sent::Now(Next::Answer(response));
        }
        deny_clock = cache.now();
    }
    let ietf_policy = ietf_policy(plan, tier, &checks, roles.as_deref());
    let sent_at = SentAt {
        deny_clock,
        timer: Timer::start(),
    };
    match roles::check(&shared.store, &checks, enforced).into_ready() {
        Ok(outcome) => Sent::Now(decide(
            shared,
            &checks,
            roles.as_deref(),
            ietf_policy,
            fail_closed,
            sent_at,
            outcome,
        )),
        Err(check) => Sent::Later {
            ietf_policy: ietf_policy.cloned(),
            check,
            checks,
            roles,
            sent_at,
        },
    }
}

/// `RateLimit-Policy` as the plan has it for `tier`, when every policy
/// counts the request (`checks` holds one check per policy) in the plan's
/// order.
pub(crate) fn ietf_policy<'a>(
    plan: &'a Plan,
    tier: Option<&str>,
    checks: &[Check],
    roles: Option<&Roles>,
) -> Option<&'a HeaderValue> {
    let in_order = roles.is_none_or(|roles| !roles.reordered(checks.len()));
    (checks.len() == plan.policies().len() && in_order)
        .then(|| plan.tier(tier).ietf_policy.as_ref())
        .flatten()
}
