//! [`ResponseFuture`]: a request waiting for its decision (only when it
//! must), then calling the inner service with where its decision sent it
//! ([`Next`]), or answered by the limiter.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::request::Parts;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tower_service::Service;

use crate::headers::RateHeaders;
use crate::key::Identity;
use crate::layer::after::owed::Owed;
use crate::layer::body::ResponseBody;
use crate::response::grpc::response_failed;

/// Where a request goes once it is decided.
pub(crate) enum Next {
    /// On to the inner service, with these rate-limit headers and what
    /// it owes the store once its response says how it went.
    Call(Option<RateHeaders>, Option<Owed>),
    /// Back to the client with the limiter's answer.
    Answer(Response<Bytes>),
}

impl Next {
    /// On to the inner service untouched.
    pub(crate) const PASS: Self = Self::Call(None, None);

    /// This way on, after giving an admitted client's `identity` to the
    /// inner service when the layer does (`insert`).
    pub(crate) fn handed_on(self, parts: &mut Parts, identity: Identity, insert: bool) -> Self {
        if insert && matches!(self, Self::Call(..)) {
            parts.extensions.insert(identity);
        }
        self
    }

    /// Puts in the request's extensions what its handler reports on, or
    /// keeps: the [`Usage`](crate::Usage) handle, when a policy settles
    /// its cost after the response, and the
    /// [`ConnectionLease`](crate::layer::ConnectionLease), when a request
    /// that holds leases asks for an upgrade.
    pub(crate) fn lend(&self, parts: &mut Parts) {
        let Self::Call(_, Some(owed)) = self else {
            return;
        };
        if let Some(usage) = owed.usage() {
            // An outer layer's handle gets the reports too.
            if let Some(outer) = parts.extensions.get::<crate::Usage>() {
                usage.report_to(outer.clone());
            }
            parts.extensions.insert(usage.clone());
        }
        if let Some(lease) = owed.connection_lease() {
            // An outer layer's handle is kept with this one.
            if let Some(outer) = parts.extensions.get::<crate::layer::ConnectionLease>() {
                lease.hold_outer(outer.clone());
            }
            parts.extensions.insert(lease.clone());
        }
    }
}

/// The rest of a waiting request's decision, with the request head back.
pub(crate) type Continuation = Pin<Box<dyn Future<Output = (Parts, Next)> + Send + 'static>>;

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
        // Waiting for the decision, with the inner service that was ready
        // for the request and the request's body.
        Deciding {
            decision: Continuation,
            inner: S,
            body: ReqBody,
        },
        // The inner service's future, and the rate-limit headers to add
        // to its response.
        Calling {
            #[pin]
            future: S::Future,
            headers: Option<RateHeaders>,
            // What the request owes the store, which the response body
            // takes over.
            owed: Option<Owed>,
        },
        // The limiter's answer, until it is taken.
        Answered {
            response: Option<Response<Bytes>>,
        },
    }
}

impl<S, ReqBody> ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    /// The future of a request decided at once: `call` is the inner
    /// service's call, made only if the request goes on.
    pub(crate) fn decided(next: Next, call: impl FnOnce() -> S::Future) -> Self {
        Self {
            state: match next {
                Next::Call(headers, owed) => State::Calling {
                    future: call(),
                    headers,
                    owed,
                },
                Next::Answer(response) => State::Answered {
                    response: Some(response),
                },
            },
        }
    }

    /// The future of a request that waits for `decision`, to go on to
    /// `inner` with `body` if it is admitted.
    pub(crate) fn deciding(decision: Continuation, inner: S, body: ReqBody) -> Self {
        Self {
            state: State::Deciding {
                decision,
                inner,
                body,
            },
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
                StateProj::Deciding { decision, .. } => {
                    let (mut parts, next) = ready!(decision.as_mut().poll(cx));
                    next.lend(&mut parts);
                    let placeholder = State::Answered { response: None };
                    let StateOwned::Deciding {
                        mut inner, body, ..
                    } = this.state.as_mut().project_replace(placeholder)
                    else {
                        unreachable!("the state was Deciding");
                    };
                    let request = Request::from_parts(parts, body);
                    this.state
                        .set(Self::decided(next, || inner.call(request)).state);
                }
                StateProj::Calling {
                    future,
                    headers,
                    owed,
                } => {
                    let result = ready!(future.poll(cx));
                    let mut owed = owed.take();
                    if let Some(owed) = owed.as_mut().filter(|owed| owed.awaits_status()) {
                        // A gRPC call whose status is in its trailers is
                        // settled by its body, when they come.
                        let failed = result.as_ref().map_or(Some(true), |response| {
                            response_failed(response.status(), response.headers())
                        });
                        // Units given back show in the headers.
                        if let Some(refunded) = failed.and_then(|failed| owed.on_status(failed)) {
                            *headers = Some(refunded);
                        }
                    }
                    // A failed call pays what it owes here.
                    let mut response = result?;
                    if let Some(owed) = owed.as_mut() {
                        owed.on_head(response.status(), response.headers());
                    }
                    if let Some(headers) = headers.take() {
                        headers.write(response.headers_mut());
                    }
                    return Poll::Ready(Ok(response.map(|body| ResponseBody::inner(body, owed))));
                }
                StateProj::Answered { response } => {
                    let response = response.take().expect("polled after completion");
                    return Poll::Ready(Ok(response.map(ResponseBody::answer)));
                }
            }
        }
    }
}
