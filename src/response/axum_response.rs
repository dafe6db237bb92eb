//! An axum response as a rejection hook's answer: see
//! [`RateLimitLayer::on_rejection_into_response`](crate::RateLimitLayer::on_rejection_into_response).

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use http::Response;
use http_body_util::BodyExt;

use crate::log_lines::INCOMPLETE_HOOK_BODIES;

/// `response` with its body as bytes, when the body is complete now, as
/// the bodies of axum's own responses are (strings, bytes, `Json`, `Html`,
/// `Redirect`); `None`, so that the limiter answers itself, for a body
/// that streams or fails.
pub(crate) fn complete(response: axum::response::Response) -> Option<Response<Bytes>> {
    let (parts, body) = response.into_parts();
    let mut collecting = pin!(body.collect());
    let mut cx = Context::from_waker(Waker::noop());
    let reason = match collecting.as_mut().poll(&mut cx) {
        Poll::Ready(Ok(collected)) => {
            return Some(Response::from_parts(parts, collected.to_bytes()));
        }
        Poll::Ready(Err(error)) => error.to_string(),
        Poll::Pending => "its body is not complete at once".to_owned(),
    };
    if let Some(held_back) = INCOMPLETE_HOOK_BODIES.admit() {
        tracing::warn!(
            reason,
            held_back,
            "rejection hook's response unusable; the limiter answers itself"
        );
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::response::{Html, IntoResponse};
    use http::StatusCode;
    use http_body::Frame;

    /// A body whose first frame never comes.
    struct Streaming;

    impl http_body::Body for Streaming {
        type Data = Bytes;
        type Error = std::io::Error;

        fn poll_frame(
            self: std::pin::Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
            Poll::Pending
        }
    }

    #[test]
    fn complete_bodies_are_taken_and_streaming_ones_refused() {
        let html = (StatusCode::TOO_MANY_REQUESTS, Html("<p>slow down</p>")).into_response();
        let answer = complete(html).unwrap();
        assert_eq!(answer.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(answer.body(), "<p>slow down</p>");

        assert!(complete(Response::new(Body::new(Streaming))).is_none());
    }
}
