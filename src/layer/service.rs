//! [`RateLimit`]: the middleware service.

use std::mem;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower_service::Service;

use crate::key::KeyExtractor;
use crate::layer::body::ResponseBody;
use crate::layer::decide::decide;
use crate::layer::future::ResponseFuture;
use crate::layer::{RateLimitLayer, Shared};
use crate::policy::Policies;
use crate::store::Store;

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

    /// Decides the request here when every answer is known at once (a
    /// store in process, the deny cache, an early rejection) and calls the
    /// inner service directly; only a request that must wait (an API-key
    /// or tier lookup, a store across the network) takes the inner service
    /// into its future, leaving a clone in its place.
    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let (mut parts, body) = request.into_parts();
        match decide(&self.shared, &mut parts) {
            Ok(next) => {
                next.lend(&mut parts);
                ResponseFuture::decided(next, || self.inner.call(Request::from_parts(parts, body)))
            }
            Err(decision) => {
                // The clone may not be ready; the service that is ready
                // goes with this request (see tower-http's note on cloning
                // inner services).
                let clone = self.inner.clone();
                let inner = mem::replace(&mut self.inner, clone);
                ResponseFuture::deciding(decision, inner, body)
            }
        }
    }
}
