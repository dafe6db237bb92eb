//! [`ResponseFuture`]: check the store, then call the inner service or
//! answer for it.

use std::cmp::Reverse;
use std::future::Future;
use std::mem;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use pin_project_lite::pin_project;
use tower_service::Service;

use crate::cost::{self, CostAboveLimit, Costs};
use crate::credentials::Refusal;
use crate::key::{Confirming, confirmed};
use crate::layer::Options;
use crate::layer::Shared;
use crate::limited::LimitedResponse;
use crate::response::{
    LimitedBody, RateHeaders, cost_above_limit, invalid_credentials, limiter_unavailable,
    too_many_requests,
};
use crate::service::{tier_lookup, unidentified};
use crate::store::{CheckFuture, CheckOutcome, StoreError};
use crate::throttle::STORE_FAILURES;
use crate::{
    Check, Decision, DenyCache, Extracted, Identity, KeyRejection, Policy, ResponseBody, Store,
    TierFuture,
};

/// What the request needs once the store has decided.
pub(crate) struct Pending<S, ReqBody> {
    pub(crate) inner: S,
    pub(crate) request: Request<ReqBody>,
    /// Who the client is; put in the request's extensions only if the
    /// request goes on to the inner service.
    pub(crate) identity: Identity,
    /// The checks sent to the store (empty until a tier lookup ends).
    pub(crate) checks: Vec<Check>,
    /// Whether any policy of the request fails closed.
    pub(crate) fail_closed: bool,
    pub(crate) options: Options,
    pub(crate) deny_cache: Option<DenyCache>,
    pub(crate) limited_response: Option<LimitedResponse>,
    /// When the checks went to the store, on the deny cache's clock.
    pub(crate) sent_at: u64,
}

/// A `429` from the deny cache, if a policy of `checks` is known to deny.
pub(crate) fn cached_denial(
    cache: &DenyCache,
    checks: &[Check],
    options: Options,
    limited_response: Option<&LimitedResponse>,
) -> Option<Response<Full<Bytes>>> {
    let denied = cache.lookup(checks)?;
    let index = index_of_min(&denied.decisions, |d| Reverse(d.retry_after));
    let body = limited_response.map_or(
        LimitedBody::Template(&denied.bodies[index]),
        LimitedBody::Custom,
    );
    Some(too_many_requests(
        &denied.checks,
        &denied.decisions,
        index,
        body,
        options.header_style,
        options.reset_format,
    ))
}

/// What a request whose API key is being looked up needs to go on.
pub(crate) struct Confirm<S, ReqBody> {
    pub(crate) shared: Arc<Shared>,
    pub(crate) policies: Arc<[Arc<Policy>]>,
    pub(crate) costs: Option<Costs>,
    /// The count of refused credentials of the client's address, if any.
    pub(crate) refusal: Option<Check>,
    pub(crate) pending: Pending<S, ReqBody>,
}

impl<S, ReqBody> Confirm<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    /// Goes on once the key is resolved: with the client it names, or
    /// answering for a client the chain cannot key or refuses.
    fn resolved(self, resolved: Extracted) -> State<S, ReqBody> {
        let Self {
            shared,
            policies,
            costs,
            refusal,
            mut pending,
        } = self;
        let identity = match resolved {
            Ok(Some(identity)) => identity,
            Ok(None) => {
                let (parts, _) = pending.request.into_parts();
                return State::answered(unidentified(&shared, &parts));
            }
            Err(rejection) => return State::refused(&shared, refusal, rejection),
        };
        let (parts, body) = pending.request.into_parts();
        let lookup = tier_lookup(&shared, &parts, &identity);
        pending.request = Request::from_parts(parts, body);
        pending.identity = identity;
        match lookup {
            Some(lookup) => State::LookingUp {
                lookup,
                awaiting: Some(AwaitingTier {
                    store: shared.store.clone(),
                    policies,
                    costs,
                }),
                pending: Some(pending),
            },
            None => State::with_checks(&*shared.store, &policies, costs.as_ref(), None, pending),
        }
    }
}

/// What a request waiting for its client's tier needs to build its checks.
pub(crate) struct AwaitingTier {
    pub(crate) store: Arc<dyn Store>,
    pub(crate) policies: Arc<[Arc<Policy>]>,
    pub(crate) costs: Option<Costs>,
}

pin_project! {
    /// The response future of [`RateLimit`](crate::RateLimit).
    pub struct ResponseFuture<S, ReqBody>
    where
        S: Service<Request<ReqBody>>,
    {
        #[pin]
        state: State<S, ReqBody>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, ReqBody>
    where
        S: Service<Request<ReqBody>>,
    {
        Confirming {
            confirm: Confirming,
            rest: Option<Confirm<S, ReqBody>>,
        },
        LookingUp {
            lookup: TierFuture,
            awaiting: Option<AwaitingTier>,
            pending: Option<Pending<S, ReqBody>>,
        },
        Checking {
            check: CheckFuture,
            pending: Option<Pending<S, ReqBody>>,
        },
        CountingRefusal {
            count: CheckFuture,
            refusal: Option<Refusal>,
        },
        Calling {
            #[pin]
            future: S::Future,
            headers: Option<RateHeaders>,
        },
        Answered {
            response: Option<Response<Full<Bytes>>>,
        },
    }
}

impl<S, ReqBody> ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    pub(crate) fn unlimited(future: S::Future) -> Self {
        Self {
            state: State::Calling {
                future,
                headers: None,
            },
        }
    }

    /// Answers refused credentials; see [`State::refused`].
    pub(crate) fn refused(shared: &Shared, check: Option<Check>, rejection: KeyRejection) -> Self {
        Self {
            state: State::refused(shared, check, rejection),
        }
    }

    /// Looks the request's API key up before going on (see
    /// [`ApiKeyLookup`](crate::ApiKeyLookup)).
    pub(crate) fn confirming(mut rest: Confirm<S, ReqBody>) -> Self {
        let placeholder = Identity::new(rest.pending.identity.key.clone());
        let identity = mem::replace(&mut rest.pending.identity, placeholder);
        Self {
            state: State::Confirming {
                confirm: confirmed(identity, rest.shared.options.lookup_timeout),
                rest: Some(rest),
            },
        }
    }

    pub(crate) fn cost_above_limit(denied: &CostAboveLimit) -> Self {
        Self::answered(cost_above_limit(denied))
    }

    pub(crate) fn checking(store: &dyn Store, pending: Pending<S, ReqBody>) -> Self {
        Self {
            state: State::checking(store, pending),
        }
    }

    pub(crate) fn looking_up(
        lookup: TierFuture,
        awaiting: AwaitingTier,
        pending: Pending<S, ReqBody>,
    ) -> Self {
        Self {
            state: State::LookingUp {
                lookup,
                awaiting: Some(awaiting),
                pending: Some(pending),
            },
        }
    }

    pub(crate) fn answered(response: Response<Full<Bytes>>) -> Self {
        Self {
            state: State::Answered {
                response: Some(response),
            },
        }
    }
}

impl<S, ReqBody> State<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    fn answered(response: Response<Full<Bytes>>) -> Self {
        Self::Answered {
            response: Some(response),
        }
    }

    /// Answers refused credentials `401`, after counting the refusal
    /// against the client's address (`check`) when the layer counts them:
    /// `429` once the address is past its limit.
    fn refused(shared: &Shared, check: Option<Check>, rejection: KeyRejection) -> Self {
        tracing::debug!(reason = rejection.reason(), "credentials refused");
        match shared.credential_failures.as_ref().zip(check) {
            Some((guard, check)) => Self::counting_refusal(
                &*shared.store,
                guard.refusal(
                    check,
                    rejection,
                    shared.options,
                    shared.limited_response.clone(),
                ),
            ),
            None => Self::answered(invalid_credentials(&rejection)),
        }
    }

    fn counting_refusal(store: &dyn Store, refusal: Refusal) -> Self {
        match store
            .check(std::slice::from_ref(&refusal.check))
            .into_ready()
        {
            Ok(outcome) => Self::answered(refusal.answer(outcome)),
            Err(count) => Self::CountingRefusal {
                count,
                refusal: Some(refusal),
            },
        }
    }

    /// Builds the request's checks for its client's `tier` and sends them,
    /// or answers `422` for a cost above the client's limit.
    fn with_checks(
        store: &dyn Store,
        policies: &[Arc<Policy>],
        costs: Option<&Costs>,
        tier: Option<Arc<str>>,
        mut pending: Pending<S, ReqBody>,
    ) -> Self {
        if tier.is_some() {
            pending.identity.tier = tier;
        }
        match cost::checks(
            policies,
            &pending.identity.key,
            pending.identity.tier.as_deref(),
            costs,
        ) {
            Ok(checks) => {
                pending.checks = checks;
                State::checking(store, pending)
            }
            Err(denied) => Self::answered(cost_above_limit(&denied)),
        }
    }

    /// Sends the checks to the store, unless the deny cache answers.
    fn checking(store: &dyn Store, mut pending: Pending<S, ReqBody>) -> Self {
        if pending.checks.is_empty() {
            // Every policy of the request exempts it.
            return Self::decided(pending, Ok(Vec::new()));
        }
        if let Some(cache) = &pending.deny_cache {
            if let Some(response) = cached_denial(
                cache,
                &pending.checks,
                pending.options,
                pending.limited_response.as_ref(),
            ) {
                return Self::Answered {
                    response: Some(response),
                };
            }
            pending.sent_at = cache.now();
        }
        match store.check(&pending.checks).into_ready() {
            Ok(outcome) => Self::decided(pending, outcome),
            Err(check) => Self::Checking {
                check,
                pending: Some(pending),
            },
        }
    }

    /// Calls the inner service or answers for it, as the store decided.
    fn decided(pending: Pending<S, ReqBody>, outcome: CheckOutcome) -> Self {
        let Pending {
            mut inner,
            mut request,
            identity,
            checks,
            fail_closed,
            options,
            deny_cache,
            limited_response,
            sent_at,
        } = pending;
        let cache = deny_cache.as_ref().map(|cache| (cache, sent_at));
        let limited_body = limited_response
            .as_ref()
            .map_or(LimitedBody::Problem, LimitedBody::Custom);
        match decide(&checks, fail_closed, options, cache, limited_body, outcome) {
            Next::Call(headers) => {
                request.extensions_mut().insert(identity);
                Self::Calling {
                    future: inner.call(request),
                    headers,
                }
            }
            Next::Answer(response) => Self::Answered {
                response: Some(response),
            },
        }
    }
}

/// Where the store's answer leads.
enum Next {
    Call(Option<RateHeaders>),
    Answer(Response<Full<Bytes>>),
}

/// The index of the first decision with the least `key` (0 when empty).
fn index_of_min<K: Ord>(decisions: &[Decision], key: impl Fn(&Decision) -> K) -> usize {
    decisions
        .iter()
        .enumerate()
        .min_by_key(|(_, decision)| key(decision))
        .map_or(0, |(index, _)| index)
}

fn decide(
    checks: &[Check],
    fail_closed: bool,
    options: Options,
    deny_cache: Option<(&DenyCache, u64)>,
    limited_body: LimitedBody<'_>,
    outcome: CheckOutcome,
) -> Next {
    let decisions = outcome.and_then(|decisions| {
        if decisions.len() == checks.len() {
            Ok(decisions)
        } else {
            Err(StoreError::Protocol(format!(
                "{} decisions for {} checks",
                decisions.len(),
                checks.len()
            )))
        }
    });
    match decisions {
        Ok(decisions) if decisions.is_empty() => Next::Call(None),
        Ok(decisions) if decisions.iter().all(|d| d.admitted) => {
            // Report the policy closest to denying.
            let reported = index_of_min(&decisions, |d| (d.remaining, Reverse(d.reset)));
            Next::Call(Some(RateHeaders::new(
                checks,
                &decisions,
                reported,
                None,
                options.header_style,
                options.reset_format,
            )))
        }
        Ok(decisions) => {
            if let Some((cache, sent_at)) = deny_cache {
                cache.remember(checks, &decisions, sent_at);
            }
            // The policy that frees last is the one the client waits for.
            let denied = index_of_min(&decisions, |d| Reverse(d.retry_after));
            Next::Answer(too_many_requests(
                checks,
                &decisions,
                denied,
                limited_body,
                options.header_style,
                options.reset_format,
            ))
        }
        // `held_back`: failures since the last line, which were not logged.
        Err(error) if fail_closed => {
            if let Some(held_back) = STORE_FAILURES.admit() {
                tracing::error!(%error, held_back, "rate-limit store unavailable; failing closed");
            }
            Next::Answer(limiter_unavailable())
        }
        Err(error) => {
            if let Some(held_back) = STORE_FAILURES.admit() {
                tracing::warn!(%error, held_back, "rate-limit store unavailable; failing open");
            }
            Next::Call(None)
        }
    }
}

impl<S, ReqBody, ResBody> Future for ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    type Output = Result<Response<ResponseBody<ResBody>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Confirming { confirm, rest } => {
                    let resolved = ready!(confirm.as_mut().poll(cx));
                    let rest = rest.take().expect("polled after the key was confirmed");
                    this.state.set(rest.resolved(resolved));
                }
                StateProj::LookingUp {
                    lookup,
                    awaiting,
                    pending,
                } => {
                    let tier = ready!(lookup.as_mut().poll(cx));
                    let AwaitingTier {
                        store,
                        policies,
                        costs,
                    } = awaiting.take().expect("polled after the lookup completed");
                    let pending = pending.take().expect("polled after the lookup completed");
                    let next =
                        State::with_checks(&*store, &policies, costs.as_ref(), tier, pending);
                    this.state.set(next);
                }
                StateProj::Checking { check, pending } => {
                    let outcome = ready!(Pin::new(check).poll(cx));
                    let pending = pending.take().expect("polled after the check completed");
                    this.state.set(State::decided(pending, outcome));
                }
                StateProj::CountingRefusal { count, refusal } => {
                    let outcome = ready!(Pin::new(count).poll(cx));
                    let refusal = refusal.take().expect("polled after the count completed");
                    this.state.set(State::Answered {
                        response: Some(refusal.answer(outcome)),
                    });
                }
                StateProj::Calling { future, headers } => {
                    let mut response = ready!(future.poll(cx))?;
                    if let Some(headers) = headers.take() {
                        headers.write(response.headers_mut());
                    }
                    return Poll::Ready(Ok(response.map(ResponseBody::inner)));
                }
                StateProj::Answered { response } => {
                    let response = response.take().expect("polled after completion");
                    return Poll::Ready(Ok(response.map(ResponseBody::limiter)));
                }
            }
        }
    }
}
