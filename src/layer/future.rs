//! [`ResponseFuture`]: what a request becomes once the layer has looked at
//! it: the inner service's future, the limiter's own answer, or a wait
//! (for an API-key lookup, a tier lookup or the store) before one of those.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Request, Response};
use pin_project_lite::pin_project;
use tower_service::Service;

use crate::key::{Confirming, Extracted};
use crate::layer::Shared;
use crate::layer::flow::{self, AnswerFuture, Next, Sent, SentAt};
use crate::layer::roles::{Refund, Roles};
use crate::layer::verdict;
use crate::policy::cost::{Checks, Costs};
use crate::response::headers::RateHeaders;
use crate::store::{Check, CheckFuture, CheckOutcome};
use crate::tier::TierFuture;

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
    #[project_replace = StateOwned]
    enum State<S, ReqBody>
    where
        S: Service<Request<ReqBody>>,
    {
        // The inner service's future, and the rate-limit headers to add
        // to its response.
        Calling {
            #[pin]
            future: S::Future,
            headers: Option<RateHeaders>,
            // Units to take back if the response should not count.
            refund: Option<Box<Refund>>,
        },
        // The limiter's answer, known at once.
        Answered {
            response: Option<Response<Bytes>>,
        },
        // The limiter's answer, once a refusal of credentials is counted.
        Answering {
            answer: AnswerFuture,
        },
        // A request that waits before it is decided.
        Waiting {
            wait: Box<Wait<S, ReqBody>>,
        },
    }
}

impl<S, ReqBody> ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    pub(crate) fn calling(
        future: S::Future,
        headers: Option<RateHeaders>,
        refund: Option<Box<Refund>>,
    ) -> Self {
        Self {
            state: State::Calling {
                future,
                headers,
                refund,
            },
        }
    }

    pub(crate) fn answered(response: Response<Bytes>) -> Self {
        Self {
            state: State::Answered {
                response: Some(response),
            },
        }
    }

    pub(crate) fn answering(answer: AnswerFuture) -> Self {
        Self {
            state: State::Answering { answer },
        }
    }

    pub(crate) fn waiting(step: Step, pending: Pending<S, ReqBody>) -> Self {
        Self {
            state: State::Waiting {
                wait: Box::new(Wait { step, pending }),
            },
        }
    }
}

/// What a waiting request waits for.
pub(crate) enum Step {
    /// An API-key lookup, to know who the client is.
    Confirming(Confirming),
    /// A tier lookup, to know the client's limits.
    LookingUp(TierFuture),
    /// The store's decision.
    Checking(CheckFuture),
    /// The count of refused credentials, to answer them.
    Refusing(AnswerFuture),
}

/// Where a waiting request goes once a step is done.
enum Flow {
    Wait(Step),
    Done(Next),
}

/// A request waiting before it is decided, and what it waits for.
pub(crate) struct Wait<S, ReqBody> {
    step: Step,
    pending: Pending<S, ReqBody>,
}

/// What a waiting request keeps: the inner service that was ready for it
/// (the layer kept a clone of it), the request, and what the layer has
/// learnt of it so far.
pub(crate) struct Pending<S, ReqBody> {
    pub(crate) inner: S,
    pub(crate) parts: Parts,
    pub(crate) body: ReqBody,
    pub(crate) shared: Arc<Shared>,
    pub(crate) identity: crate::Identity,
    pub(crate) costs: Option<Costs>,
    /// Whether any policy that counts the request fails closed.
    pub(crate) fail_closed: bool,
    /// The count of refused credentials of the client's address, if any.
    pub(crate) refusal: Option<Check>,
    /// The checks sent to the store, once sent, and their roles.
    pub(crate) sent: Option<(Checks, Option<Box<Roles>>)>,
    /// When the checks went to the store, on the deny cache's clock.
    pub(crate) sent_at: SentAt,
    /// `RateLimit-Policy` from the plan the checks were built under.
    pub(crate) ietf_policy: Option<HeaderValue>,
}

impl<S, ReqBody> Wait<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Next> {
        loop {
            let flow = match &mut self.step {
                Step::Confirming(confirm) => {
                    let resolved = ready!(confirm.as_mut().poll(cx));
                    self.pending.resolved(resolved)
                }
                Step::LookingUp(lookup) => {
                    let tier = ready!(lookup.as_mut().poll(cx));
                    if tier.is_some() {
                        self.pending.identity.tier = tier;
                    }
                    self.pending.send()
                }
                Step::Checking(check) => {
                    let outcome = ready!(Pin::new(check).poll(cx));
                    Flow::Done(self.pending.decided(outcome))
                }
                Step::Refusing(answer) => {
                    Flow::Done(Next::Answer(ready!(answer.as_mut().poll(cx))))
                }
            };
            match flow {
                Flow::Wait(step) => self.step = step,
                Flow::Done(next) => return Poll::Ready(next),
            }
        }
    }
}

impl<S, ReqBody> Pending<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    /// Goes on once the API key is resolved: with the client it names, or
    /// answering for a client the chain cannot key or refuses.
    fn resolved(&mut self, resolved: Extracted) -> Flow {
        let shared = &*self.shared;
        match resolved {
            Ok(Some(identity)) => self.identity = identity,
            Ok(None) => return Flow::Done(Next::Answer(flow::unidentified(shared, &self.parts))),
            Err(rejection) => {
                return match flow::refused(shared, self.refusal.take(), rejection) {
                    Ok(response) => Flow::Done(Next::Answer(response)),
                    Err(answer) => Flow::Wait(Step::Refusing(answer)),
                };
            }
        }
        match flow::tier_lookup(shared, &self.parts, &self.identity) {
            Some(lookup) => Flow::Wait(Step::LookingUp(lookup)),
            None => self.send(),
        }
    }

    /// Sends the checks of the client's tier, unless they are decided at
    /// once.
    fn send(&mut self) -> Flow {
        let shared = &*self.shared;
        let policies = shared.policies.load();
        let plan = flow::plan_for(&policies, &self.parts);
        match flow::send(
            shared,
            plan,
            &self.identity,
            self.costs.as_ref(),
            self.fail_closed,
        ) {
            Sent::Now(next) => Flow::Done(next),
            Sent::Later {
                check,
                checks,
                roles,
                sent_at,
                ietf_policy,
            } => {
                self.sent = Some((checks, roles));
                self.sent_at = sent_at;
                self.ietf_policy = ietf_policy;
                Flow::Wait(Step::Checking(check))
            }
        }
    }

    fn decided(&mut self, outcome: CheckOutcome) -> Next {
        let (checks, roles) = self.sent.take().unwrap_or_default();
        verdict::decide(
            &self.shared,
            &checks,
            roles.as_deref(),
            self.ietf_policy.as_ref(),
            self.fail_closed,
            self.sent_at,
            outcome,
        )
    }

    /// The state that follows `next`.
    fn into_state(self, next: Next) -> State<S, ReqBody> {
        match next {
            Next::Call(headers, refund) => {
                let Self {
                    mut inner,
                    mut parts,
                    body,
                    shared,
                    identity,
                    ..
                } = self;
                if shared.options.insert_identity {
                    parts.extensions.insert(identity);
                }
                State::Calling {
                    future: inner.call(Request::from_parts(parts, body)),
                    headers,
                    refund,
                }
            }
            Next::Answer(response) => State::Answered {
                response: Some(response),
            },
        }
    }
}

impl<S, ReqBody, ResBody> Future for ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ResBody: From<Bytes>,
{
    type Output = Result<Response<ResBody>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Calling {
                    future,
                    headers,
                    refund,
                } => {
                    let result = ready!(future.poll(cx));
                    if let Some(refund) = refund.take() {
                        refund.settle(result.as_ref().ok().map(|response| response.status()));
                    }
                    let mut response = result?;
                    if let Some(headers) = headers.take() {
                        headers.write(response.headers_mut());
                    }
                    return Poll::Ready(Ok(response));
                }
                StateProj::Answered { response } => {
                    let response = response.take().expect("polled after completion");
                    return Poll::Ready(Ok(response.map(ResBody::from)));
                }
                StateProj::Answering { answer } => {
                    let response = ready!(answer.as_mut().poll(cx));
                    return Poll::Ready(Ok(response.map(ResBody::from)));
                }
                StateProj::Waiting { wait } => {
                    let next = ready!(wait.poll_next(cx));
                    let placeholder = State::Answered { response: None };
                    if let StateOwned::Waiting { wait } =
                        this.state.as_mut().project_replace(placeholder)
                    {
                        this.state.set(wait.pending.into_state(next));
                    }
                }
            }
        }
    }
}
