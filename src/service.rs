//! [`RateLimit`]: the middleware service.

use std::mem;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower_service::Service;

use crate::future::{Pending, ResponseFuture};
use crate::layer::Shared;
use crate::{Check, KeyExtractor, Policies, RateLimitLayer, ResponseBody, Store};

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
        let (mut parts, body) = request.into_parts();
        let shared = &*self.shared;
        let policies = shared.policies.select(&parts.method, route_path(&parts));
        if policies.is_empty() {
            return ResponseFuture::unlimited(self.inner.call(Request::from_parts(parts, body)));
        }
        let Some(identity) = shared.keys.extract(&parts) else {
            return ResponseFuture::unidentified();
        };
        let checks = policies
            .iter()
            .map(|policy| Check::new(policy, identity.key.clone()))
            .collect();
        parts.extensions.insert(identity);
        let check = shared.store.check(checks);

        // The clone may not be ready; the service that is ready goes with
        // this request (see tower-http's note on cloning inner services).
        let clone = self.inner.clone();
        let inner = mem::replace(&mut self.inner, clone);
        ResponseFuture::checking(
            check,
            Pending {
                inner,
                request: Request::from_parts(parts, body),
                policies,
                options: shared.options,
            },
        )
    }
}
