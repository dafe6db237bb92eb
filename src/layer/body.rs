//! [`ResponseBody`]: the body of every response through the layer, which
//! holds what an admitted request owes the store until it ends.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use crate::layer::after::owed::Owed;
use crate::response::grpc::call_failed;

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
    /// pass, and stays counted if they never do. A request under a policy
    /// settled after the response
    /// ([`Policy::with_settlement`](crate::Policy::with_settlement))
    /// is settled when this body ends or is dropped, at the cost reported
    /// by then (a usage trailer among them).
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
            // Its leases, released when the body ends or is dropped; and
            // units to take back if the trailers show the call should not
            // count (dropped with the body otherwise, and so counted).
            owed: Option<Owed>,
        },
        Answer {
            bytes: Option<Bytes>,
        },
    }
}

impl<B> ResponseBody<B> {
    /// The inner service's body, holding what the request `owed` until
    /// it ends, and settling it by the gRPC status its trailers carry.
    pub(crate) fn inner(body: B, owed: Option<Owed>) -> Self {
        Self {
            kind: Kind::Inner { body, owed },
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
            Kind::Inner { owed, .. } => {
                if owed.is_some() {
                    "inner, owing the store"
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
            KindProj::Inner { body, owed } => {
                let frame = std::task::ready!(body.poll_frame(cx));
                if let (Some(Ok(sent)), Some(owed)) = (&frame, owed.as_mut())
                    && let Some(trailers) = sent.trailers_ref()
                    && owed.reads_headers()
                {
                    owed.on_headers(trailers);
                }
                let awaiting = owed.as_mut().filter(|owed| owed.awaits_status());
                match (&frame, awaiting) {
                    (Some(Ok(sent)), Some(owed)) => {
                        if let Some(failed) = sent.trailers_ref().and_then(call_failed) {
                            // The head is long gone: only the count changes.
                            let _ = owed.on_status(failed);
                        }
                    }
                    // A body that breaks is a call that failed.
                    (Some(Err(_)), Some(owed)) => {
                        let _ = owed.on_status(true);
                    }
                    (Some(_), None) => {}
                    // Sent to the end: the leases go now, not when hyper
                    // gets round to dropping the body.
                    (None, _) => drop(owed.take()),
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
