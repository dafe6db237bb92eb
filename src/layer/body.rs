//! [`ResponseBody`]: the body of every response through the layer, and the
//! concurrency [`Leases`] it holds until it ends.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use smallvec::SmallVec;

use crate::layer::background::in_background;
use crate::layer::roles::Refund;
use crate::policy::Algorithm;
use crate::policy::cost::Checks;
use crate::response::grpc::call_failed;
use crate::store::{Check, CheckFuture, Decision, Store, StoreError};
use crate::throttle::RELEASE_FAILURES;

pin_project! {
    /// The body of a response from [`RateLimit`](crate::RateLimit): the
    /// inner service's body, or the limiter's own answer (`429`, `503`,
    /// ...).
    ///
    /// An admitted request under a concurrency limit
    /// ([`Policy::concurrency`](crate::Policy::concurrency)) holds its lease
    /// in this body: until the body has been sent to its end, or is
    /// dropped (the client went away, the connection broke). A gRPC call
    /// under a policy that counts failures or successes only
    /// ([`Count`](crate::policy::Count)) is settled here when its trailers
    /// pass, and stays counted if they never do.
    pub struct ResponseBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Inner {
            #[pin]
            body: B,
            leases: Option<Leases>,
            // Units to take back if the trailers show the call should not
            // count; dropped with the body otherwise, and so counted.
            refund: Option<Box<Refund>>,
        },
        Answer {
            bytes: Option<Bytes>,
        },
    }
}

impl<B> ResponseBody<B> {
    /// The inner service's body, holding `leases` until it ends, and
    /// settling `refund` by the gRPC status its trailers carry.
    pub(crate) fn inner(body: B, leases: Option<Leases>, refund: Option<Box<Refund>>) -> Self {
        Self {
            kind: Kind::Inner {
                body,
                leases,
                refund,
            },
        }
    }

    /// The limiter's own answer.
    pub(crate) fn answer(bytes: Bytes) -> Self {
        Self {
            kind: Kind::Answer {
                bytes: (!bytes.is_empty()).then_some(bytes),
            },
        }
    }
}

impl<B> std::fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &self.kind {
            Kind::Inner { leases, .. } => {
                if leases.is_some() {
                    "inner, holding leases"
                } else {
                    "inner"
                }
            }
            Kind::Answer { .. } => "answer",
        };
        f.debug_tuple("ResponseBody").field(&kind).finish()
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body,
    B::Data: From<Bytes>,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        match self.project().kind.project() {
            KindProj::Inner {
                body,
                leases,
                refund,
            } => {
                let frame = std::task::ready!(body.poll_frame(cx));
                match &frame {
                    Some(Ok(sent)) if refund.is_some() => {
                        if let Some(failed) = sent.trailers_ref().and_then(call_failed)
                            && let Some(refund) = refund.take()
                        {
                            // The head is long gone: only the count changes.
                            let _ = refund.settle(failed);
                        }
                    }
                    Some(Ok(_)) => {}
                    // A body that breaks is a call that failed.
                    Some(Err(_)) => {
                        if let Some(refund) = refund.take() {
                            let _ = refund.settle(true);
                        }
                    }
                    // Sent to the end: the leases go now, not when hyper
                    // gets round to dropping the body.
                    None => drop(leases.take()),
                }
                Poll::Ready(frame)
            }
            KindProj::Answer { bytes } => {
                Poll::Ready(bytes.take().map(|bytes| Ok(Frame::data(bytes.into()))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body, .. } => body.is_end_stream(),
            Kind::Answer { bytes } => bytes.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body, .. } => body.size_hint(),
            Kind::Answer { bytes } => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |bytes| bytes.len() as u64))
            }
        }
    }
}

/// The concurrency leases an admitted request took, released when
/// dropped: on a task of its own for a store that answers later.
pub(crate) struct Leases(Box<Held>);

struct Held {
    store: Arc<dyn Store>,
    checks: Checks,
    taken_at: SmallVec<[Duration; 2]>,
}

impl Leases {
    /// The leases `store` gave the concurrency checks among `checks`;
    /// `None` when there are none.
    pub(crate) fn of(
        store: &Arc<dyn Store>,
        checks: &[Check],
        decisions: &[Decision],
    ) -> Option<Self> {
        let mut held: Option<Held> = None;
        for (check, decision) in checks.iter().zip(decisions) {
            if let (Algorithm::Concurrency, Some(at)) = (check.algorithm, decision.recorded_at) {
                let held = held.get_or_insert_with(|| Held {
                    store: store.clone(),
                    checks: Checks::new(),
                    taken_at: SmallVec::new(),
                });
                held.checks.push(check.clone());
                held.taken_at.push(at);
            }
        }
        held.map(|held| Self(Box::new(held)))
    }
}

impl Drop for Leases {
    fn drop(&mut self) {
        let held = &self.0;
        let _ = in_background(held.store.refund(&held.checks, &held.taken_at), report);
    }
}

/// The leases of `checks` that the store may have taken, released unless
/// `answer` decides them: a call that failed or timed out (the store may
/// still run it, and take them), or a request dropped while its check was
/// in flight, releases them by the ids the checks carry; so does an
/// answer that leaves a check undecided (a shadow batch that failed). A
/// decided check's lease is the response's to release ([`Leases::of`]),
/// and a denied one took nothing. Checks without a lease cost nothing.
pub(crate) fn released_unless_decided(
    store: &Arc<dyn Store>,
    checks: &[Check],
    answer: CheckFuture,
) -> CheckFuture {
    let Some(first) = checks
        .iter()
        .position(|check| check.algorithm == Algorithm::Concurrency)
    else {
        return answer;
    };
    let pending = |decided: usize| Pending {
        store: store.clone(),
        checks: checks[first.max(decided)..].iter().cloned().collect(),
    };
    match answer.into_ready() {
        // Known at once: only what it leaves undecided is released (a
        // store in process decides everything, and nothing is copied).
        Ok(outcome) => {
            let decided = outcome.as_ref().map_or(0, |decisions| decisions.len());
            if decided < checks.len() {
                drop(pending(decided));
            }
            CheckFuture::ready(outcome)
        }
        Err(later) => {
            let mut pending = pending(0);
            CheckFuture::new(async move {
                let outcome = later.await;
                if let Ok(decisions) = &outcome {
                    let decided = decisions.len().saturating_sub(first);
                    pending.checks.drain(..decided.min(pending.checks.len()));
                }
                outcome
            })
        }
    }
}

/// Leases a store may hold for checks not (yet) decided, from the first
/// with a lease on; released when dropped.
struct Pending {
    store: Arc<dyn Store>,
    checks: Checks,
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.checks
            .retain(|check| check.algorithm == Algorithm::Concurrency);
        if self.checks.is_empty() {
            return;
        }
        // A lease is released by its check's id; the time is not read.
        let times: SmallVec<[Duration; 2]> = self.checks.iter().map(|_| Duration::ZERO).collect();
        let _ = in_background(self.store.refund(&self.checks, &times), report);
    }
}

/// Warns of a release that failed: the lease stays until it expires.
fn report(outcome: Result<(), StoreError>) {
    if let Err(error) = outcome
        && let Some(held_back) = RELEASE_FAILURES.admit()
    {
        tracing::warn!(%error, held_back, "concurrency lease release failed; it expires with its lease time");
    }
}
