//! [`ResponseFuture`]: check the store, then call the inner service or
//! answer for it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use pin_project_lite::pin_project;
use tower_service::Service;

use crate::layer::Options;
use crate::response::{client_unidentified, limiter_unavailable, too_many_requests, write_headers};
use crate::store::{CheckFuture, StoreError};
use crate::{Decision, FailMode, Policy, ResponseBody};

/// What the request needs once the store has decided.
pub(crate) struct Pending<S, ReqBody> {
    pub(crate) inner: S,
    pub(crate) request: Request<ReqBody>,
    pub(crate) policies: Vec<Arc<Policy>>,
    pub(crate) options: Options,
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
        Checking {
            check: CheckFuture,
            pending: Option<Pending<S, ReqBody>>,
        },
        Calling {
            #[pin]
            future: S::Future,
            headers: Option<(Decision, Options)>,
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

    pub(crate) fn unidentified() -> Self {
        Self::answered(client_unidentified())
    }

    pub(crate) fn checking(check: CheckFuture, pending: Pending<S, ReqBody>) -> Self {
        Self {
            state: State::Checking {
                check,
                pending: Some(pending),
            },
        }
    }

    fn answered(response: Response<Full<Bytes>>) -> Self {
        Self {
            state: State::Answered {
                response: Some(response),
            },
        }
    }
}

/// Where the store's answer leads.
enum Next {
    Call(Option<Decision>),
    Answer(Response<Full<Bytes>>),
}

fn decide(
    policies: &[Arc<Policy>],
    options: Options,
    outcome: Result<Vec<Decision>, StoreError>,
) -> Next {
    let decisions = outcome.and_then(|decisions| {
        if decisions.len() == policies.len() {
            Ok(decisions)
        } else {
            Err(StoreError::Protocol(format!(
                "{} decisions for {} policies",
                decisions.len(),
                policies.len()
            )))
        }
    });
    match decisions {
        Ok(decisions) if decisions.iter().all(|d| d.admitted) => {
            // Report the policy closest to denying.
            let tightest = decisions
                .iter()
                .min_by_key(|d| (d.remaining, std::cmp::Reverse(d.reset)));
            Next::Call(tightest.copied())
        }
        Ok(decisions) => {
            // The policy that frees last is the one the client waits for.
            let (policy, decision) = policies
                .iter()
                .zip(&decisions)
                .max_by_key(|(_, d)| d.retry_after)
                .expect("a denied batch has at least one decision");
            Next::Answer(too_many_requests(
                policy,
                decision,
                options.header_style,
                options.reset_format,
            ))
        }
        Err(error) => {
            let closed = policies
                .iter()
                .any(|p| p.configured_fail_mode().unwrap_or(options.fail_mode) == FailMode::Closed);
            if closed {
                tracing::error!(%error, "rate-limit store unavailable; failing closed");
                Next::Answer(limiter_unavailable())
            } else {
                tracing::warn!(%error, "rate-limit store unavailable; failing open");
                Next::Call(None)
            }
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
                StateProj::Checking { check, pending } => {
                    let outcome = ready!(check.as_mut().poll(cx));
                    let Pending {
                        mut inner,
                        request,
                        policies,
                        options,
                    } = pending.take().expect("polled after the check completed");
                    let next = match decide(&policies, options, outcome) {
                        Next::Call(decision) => State::Calling {
                            future: inner.call(request),
                            headers: decision.map(|d| (d, options)),
                        },
                        Next::Answer(response) => State::Answered {
                            response: Some(response),
                        },
                    };
                    this.state.set(next);
                }
                StateProj::Calling { future, headers } => {
                    let mut response = ready!(future.poll(cx))?;
                    if let Some((decision, options)) = headers.take() {
                        write_headers(
                            response.headers_mut(),
                            &decision,
                            options.header_style,
                            options.reset_format,
                        );
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
