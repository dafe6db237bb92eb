//! [`RateLimit`]: the middleware service.

use std::mem;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use tower_service::Service;

use crate::key::{Identity, KeyExtractor, confirmed};
use crate::layer::flow::{self, Next, Sent, SentAt};
use crate::layer::future::{Pending, ResponseFuture, Step};
use crate::layer::{RateLimitLayer, Shared};
use crate::metrics::{self, Outcome};
use crate::policy::Policies;
use crate::policy::cost::Costs;
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
    ResBody: From<Bytes>,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    /// Decides the request here when every answer is known at once (a
    /// store in process, the deny cache, an early rejection) and calls the
    /// inner service directly; only a request that must wait (an API-key
    /// or tier lookup, a store across the network) takes a clone of the
    /// inner service into its future.
    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let (mut parts, body) = request.into_parts();
        let shared = &*self.shared;
        let policies = shared.policies.load();
        let plan = flow::plan_for(&policies, &parts);
        let exempt = || shared.exempt.as_ref().is_some_and(|exempt| exempt(&parts));
        if plan.policies().is_empty() {
            return ResponseFuture::calling(
                self.inner.call(Request::from_parts(parts, body)),
                None,
                None,
            );
        }
        if exempt() {
            for policy in plan.policies() {
                metrics::decided(policy.shared_name(), Outcome::Exempt);
            }
            return ResponseFuture::calling(
                self.inner.call(Request::from_parts(parts, body)),
                None,
                None,
            );
        }
        // The refusals of this address's credentials, before verifying any.
        let refusal = shared
            .credential_failures
            .as_ref()
            .and_then(|guard| Some((guard, guard.check_for(&parts, &*shared.keys)?)));
        if let Some((guard, check)) = &refusal
            && let Some(blocked) =
                guard.blocked_answer(check, shared.options, shared.on_rejection.as_ref())
        {
            return ResponseFuture::answered(blocked);
        }
        let refusal = refusal.map(|(_, check)| check);
        let identity = match shared.keys.extract(&parts) {
            Ok(Some(identity)) => identity,
            Ok(None) => return ResponseFuture::answered(flow::unidentified(shared, &parts)),
            Err(rejection) => {
                return match flow::refused(shared, refusal, rejection) {
                    Ok(response) => ResponseFuture::answered(response),
                    Err(answer) => ResponseFuture::answering(answer),
                };
            }
        };
        let costs: Option<Costs> = shared.request_cost.as_ref().map(|request_cost| {
            plan.policies()
                .iter()
                .map(|policy| request_cost.cost(&parts, policy))
                .collect()
        });
        let fail_closed = flow::fails_closed(plan, costs.as_ref(), shared.options);

        // An API key still to be confirmed has no tier to look up yet.
        let (step, identity, sent, sent_at, ietf_policy) = if identity.unconfirmed.is_some() {
            let placeholder = Identity::new(identity.key.clone());
            let confirm = confirmed(identity, shared.options.lookup_timeout);
            (
                Step::Confirming(confirm),
                placeholder,
                None,
                SentAt::default(),
                None,
            )
        } else if let Some(lookup) = flow::tier_lookup(shared, &parts, &identity) {
            (
                Step::LookingUp(lookup),
                identity,
                None,
                SentAt::default(),
                None,
            )
        } else {
            match flow::send(shared, plan, &identity, costs.as_ref(), fail_closed) {
                Sent::Now(Next::Call(headers, refund)) => {
                    if shared.options.insert_identity {
                        parts.extensions.insert(identity);
                    }
                    let future = self.inner.call(Request::from_parts(parts, body));
                    return ResponseFuture::calling(future, headers, refund);
                }
                Sent::Now(Next::Answer(response)) => return ResponseFuture::answered(response),
                Sent::Later {
                    check,
                    checks,
                    roles,
                    sent_at,
                    ietf_policy,
                } => (
                    Step::Checking(check),
                    identity,
                    Some((checks, roles)),
                    sent_at,
                    ietf_policy,
                ),
            }
        };

        // The clone may not be ready; the service that is ready goes with
        // this request (see tower-http's note on cloning inner services).
        let clone = self.inner.clone();
        let inner = mem::replace(&mut self.inner, clone);
        let pending = Pending {
            inner,
            parts,
            body,
            shared: self.shared.clone(),
            identity,
            costs,
            fail_closed,
            refusal,
            sent,
            sent_at,
            ietf_policy,
        };
        ResponseFuture::waiting(step, pending)
    }
}
