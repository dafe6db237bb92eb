//! [`RateLimit`]: the middleware service.

use std::mem;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use tower_service::Service;

use crate::cost::{self, Costs};
use crate::future::{AwaitingTier, Confirm, Pending, ResponseFuture};
use crate::layer::Shared;
use crate::response::{client_unidentified, missing_credentials};
use crate::throttle::TIER_LOOKUP_TIMEOUTS;
use crate::{
    Cost, FailMode, Identity, KeyExtractor, Policies, RateLimitLayer, ResponseBody, Store,
    TierFuture,
};

/// Rate-limits requests to the inner service `S`; built by
/// [`RateLimitLayer`].
///
/// `poll_ready` only asks the inner service: limits are per client and are
/// decided in `call`, so one busy client never holds back another.
#[derive(Clone)]
pub struct RateLimit<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl<S: std::fmt::Debug> std::fmt::Debug for RateLimit<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimit")
            .field("inner", &self.inner)
            .field("policies", &self.shared.policies)
            .finish_non_exhaustive()
    }
}

impl<S> RateLimit<S> {
    /// Wraps `inner`; see [`RateLimitLayer::new`].
    pub fn new(
        inner: S,
        store: impl Store,
        key_extractor: impl KeyExtractor,
        policies: Policies,
    ) -> Self {
        use tower_layer::Layer;
        RateLimitLayer::new(store, key_extractor, policies).layer(inner)
    }

    pub(crate) fn from_shared(inner: S, shared: Arc<Shared>) -> Self {
        Self { inner, shared }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

/// The route pattern policies match on: axum's `MatchedPath` when present,
/// the request path otherwise.
fn route_path(parts: &http::request::Parts) -> &str {
    #[cfg(feature = "axum")]
    if let Some(matched) = parts.extensions.get::<axum::extract::MatchedPath>() {
        return matched.as_str();
    }
    parts.uri.path()
}

/// The answer to a request no extractor identified: the layer's own, or
/// `401` when the chain keys by credentials alone, `500` otherwise.
pub(crate) fn unidentified(shared: &Shared, parts: &http::request::Parts) -> Response<Full<Bytes>> {
    match &shared.unidentified_response {
        Some(respond) => respond(parts).map(Full::new),
        None if shared.keys.needs_credentials() => missing_credentials(),
        None => client_unidentified(),
    }
}

/// The lookup of `identity`'s tier, when the layer has a lookup and the
/// identity names no tier.
pub(crate) fn tier_lookup(
    shared: &Shared,
    parts: &http::request::Parts,
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

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for RateLimit<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let (parts, body) = request.into_parts();
        let shared = &*self.shared;
        let policies = shared.policies.select(&parts.method, route_path(&parts));
        if policies.is_empty() {
            return ResponseFuture::unlimited(self.inner.call(Request::from_parts(parts, body)));
        }
        // The refusals of this address's credentials, before verifying any.
        let refusals = shared
            .credential_failures
            .as_ref()
            .and_then(|guard| Some((guard, guard.check_for(&parts, &*shared.keys)?)));
        if let Some((guard, check)) = &refusals
            && let Some(blocked) =
                guard.blocked_answer(check, shared.options, shared.limited_response.as_ref())
        {
            return ResponseFuture::answered(blocked);
        }
        let identity = match shared.keys.extract(&parts) {
            Ok(Some(identity)) => identity,
            Ok(None) => return ResponseFuture::answered(unidentified(shared, &parts)),
            Err(rejection) => {
                let check = refusals.map(|(_, check)| check);
                return ResponseFuture::refused(shared, check, rejection);
            }
        };
        let costs: Option<Costs> = shared.request_cost.as_ref().map(|request_cost| {
            policies
                .iter()
                .map(|policy| request_cost.cost(&parts, policy))
                .collect()
        });
        // Only the policies that count the request decide how it fails.
        let fail_closed = policies.iter().enumerate().any(|(index, policy)| {
            let counted = costs
                .as_ref()
                .is_none_or(|costs| costs[index] != Cost::Exempt);
            counted
                && policy
                    .configured_fail_mode()
                    .unwrap_or(shared.options.fail_mode)
                    == FailMode::Closed
        });
        // An API key still to be looked up has no tier to look up yet, and
        // neither it nor a tier being looked up has its checks yet.
        let unconfirmed = identity.unconfirmed.is_some();
        let lookup = if unconfirmed {
            None
        } else {
            tier_lookup(shared, &parts, &identity)
        };
        let checks = match lookup {
            _ if unconfirmed => Vec::new(),
            Some(_) => Vec::new(),
            None => match cost::checks(
                &policies,
                &identity.key,
                identity.tier.as_deref(),
                costs.as_ref(),
            ) {
                Ok(checks) => checks,
                Err(denied) => return ResponseFuture::cost_above_limit(&denied),
            },
        };

        // The clone may not be ready; the service that is ready goes with
        // this request (see tower-http's note on cloning inner services).
        let clone = self.inner.clone();
        let inner = mem::replace(&mut self.inner, clone);
        let pending = Pending {
            inner,
            request: Request::from_parts(parts, body),
            identity,
            checks,
            fail_closed,
            options: shared.options,
            deny_cache: shared.deny_cache.clone(),
            limited_response: shared.limited_response.clone(),
            sent_at: 0,
        };
        if unconfirmed {
            return ResponseFuture::confirming(Confirm {
                shared: self.shared.clone(),
                policies,
                costs,
                refusal: refusals.map(|(_, check)| check),
                pending,
            });
        }
        match lookup {
            Some(lookup) => ResponseFuture::looking_up(
                lookup,
                AwaitingTier {
                    store: shared.store.clone(),
                    policies,
                    costs,
                },
                pending,
            ),
            None => ResponseFuture::checking(&*shared.store, pending),
        }
    }
}
