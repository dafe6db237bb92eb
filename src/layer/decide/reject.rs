//! Every answer the limiter writes itself goes through [`reject`]: the
//! rejection hook's answer (or a gRPC status), completed with the headers
//! of the limiter's own, or the limiter's own.

use std::sync::Arc;

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::request::Parts;
use http::{HeaderMap, Method, Response};

use crate::RateLimitLayer;
use crate::headers::HeaderFormat;
use crate::layer::Shared;
use crate::rejection::limited;
use crate::rejection::{Rejection, fill_missing};
use crate::response::grpc::is_grpc_content_type;
use crate::response::problem;

impl RateLimitLayer {
    /// Answers the limiter's rejections with `respond` where it returns a
    /// response, and with the limiter's own answers where it returns
    /// `None`: `application/problem+json`, or for a gRPC call
    /// (`content-type: application/grpc`) the gRPC status of
    /// [`Rejection::to_grpc`]. `respond` sees a typed [`Rejection`] (over a
    /// limit, invalid credentials, an unidentified client, a cost above the
    /// limit, the store unavailable) and the request's head (method, URI,
    /// headers), to answer each client in its own terms. Its answer keeps
    /// its status, headers and body, and gets the headers of the limiter's
    /// own answer that it does not set itself (`Retry-After`, the
    /// rate-limit headers, `WWW-Authenticate`): set one to send another
    /// value. With axum, [`on_rejection_into_response`] takes a hook that
    /// answers `impl IntoResponse`.
    ///
    /// ```
    /// use bytes::Bytes;
    /// use http::{Response, StatusCode, header::{ACCEPT, CONTENT_TYPE}};
    /// use slidegate::{Global, Policies, Policy, RateLimitLayer, Rejection, store::MemoryStore};
    /// use std::time::Duration;
    ///
    /// let policies = Policies::single(Policy::new("all", 10, Duration::from_secs(1))).unwrap();
    /// let layer = RateLimitLayer::new(MemoryStore::new(), Global, policies).on_rejection(|rejection, request| {
    ///     let Rejection::Limited(limited) = rejection else {
    ///         return None; // the limiter's own answer
    ///     };
    ///     let accept = request.headers.get(ACCEPT)?.to_str().ok()?;
    ///     if !accept.contains("text/plain") {
    ///         return None;
    ///     }
    ///     let text = format!("slow down: try again in {} s\n", limited.retry_after().as_secs());
    ///     let response = Response::builder()
    ///         .status(StatusCode::TOO_MANY_REQUESTS)
    ///         .header(CONTENT_TYPE, "text/plain; charset=utf-8")
    ///         .body(Bytes::from(text))
    ///         .unwrap();
    ///     Some(response)
    /// });
    /// ```
    ///
    /// [`on_rejection_into_response`]: Self::on_rejection_into_response
    #[must_use]
    pub fn on_rejection(
        mut self,
        respond: impl Fn(&Rejection<'_>, &Parts) -> Option<Response<Bytes>> + Send + Sync + 'static,
    ) -> Self {
        Arc::make_mut(&mut self.shared).on_rejection = Some(Arc::new(respond));
        self
    }

    /// [`on_rejection`](Self::on_rejection) with a hook that answers as an
    /// axum handler does, with anything that implements
    /// [`IntoResponse`](axum::response::IntoResponse): `Html`, `Json`, a
    /// `(StatusCode, ...)` tuple, `Redirect`. The answer's body must be
    /// complete at once, as those are: a body that streams is not waited
    /// for, and the limiter answers itself (with a warning in the log).
    ///
    /// An HTML page for browsers, the limiter's JSON for everyone else:
    ///
    /// ```
    /// use axum::{http::{StatusCode, header::ACCEPT}, response::Html};
    /// use slidegate::{PeerIp, Policies, Policy, RateLimitLayer, Rejection, store::MemoryStore};
    /// use std::time::Duration;
    ///
    /// let policies = Policies::single(Policy::new("all", 10, Duration::from_secs(1))).unwrap();
    /// let layer = RateLimitLayer::new(MemoryStore::new(), PeerIp::new(), policies)
    ///     .on_rejection_into_response(|rejection, request| {
    ///         let Rejection::Limited(limited) = rejection else {
    ///             return None;
    ///         };
    ///         let accept = request.headers.get(ACCEPT)?.to_str().ok()?;
    ///         accept.contains("text/html").then(|| {
    ///             let wait = limited.retry_after().as_secs();
    ///             let page = format!("<h1>Slow down</h1><p>Try again in {wait} seconds.</p>");
    ///             (StatusCode::TOO_MANY_REQUESTS, Html(page))
    ///         })
    ///     });
    /// ```
    #[cfg(feature = "axum")]
    #[must_use]
    pub fn on_rejection_into_response<R>(
        self,
        respond: impl Fn(&Rejection<'_>, &Parts) -> Option<R> + Send + Sync + 'static,
    ) -> Self
    where
        R: axum::response::IntoResponse,
    {
        self.on_rejection(move |rejection, request| {
            let response = respond(rejection, request)?.into_response();
            crate::response::axum_response::complete(response)
        })
    }
}

/// The answer to `rejection` for the request whose head is `parts`: the
/// layer's hook's, or for a gRPC call the gRPC status, with each header of
/// the limiter's own answer it does not set itself (`Retry-After`, the
/// rate-limit headers, `WWW-Authenticate`); otherwise the limiter's own.
pub(crate) fn reject(shared: &Shared, parts: &Parts, rejection: Rejection<'_>) -> Response<Bytes> {
    let format = shared.settings.header_format;
    let custom = shared
        .on_rejection
        .as_deref()
        .and_then(|hook| hook(&rejection, parts))
        .or_else(|| is_grpc(parts).then(|| rejection.to_grpc()));
    let Some(mut custom) = custom else {
        return own_answer(&rejection, format);
    };
    if let Rejection::Limited(limited) = rejection {
        // The headers alone: the body is never rendered.
        let mut headers = HeaderMap::new();
        limited::limited_headers(limited, format, &mut headers);
        fill_missing(&mut custom, &headers);
    } else {
        fill_missing(&mut custom, own_answer(&rejection, format).headers());
    }
    custom
}

/// The limiter's own answer to `rejection`.
fn own_answer(rejection: &Rejection<'_>, format: HeaderFormat) -> Response<Bytes> {
    match *rejection {
        Rejection::Limited(limited) => limited::too_many_requests(limited, format),
        Rejection::InvalidCredentials(refused) => problem::invalid_credentials(refused),
        Rejection::Unidentified {
            missing_credentials: true,
        } => problem::missing_credentials(),
        Rejection::Unidentified { .. } => problem::client_unidentified(),
        Rejection::CostAboveLimit(denied) => problem::cost_above_limit(
            denied.policy(),
            denied.cost(),
            denied.limit(),
            denied.window(),
        ),
        Rejection::StoreUnavailable(_) => problem::limiter_unavailable(),
        Rejection::DenyListed(list) => problem::deny_listed(list.name()),
        Rejection::DelayFull { retry_after } => problem::delay_full(retry_after),
    }
}

/// Whether the request is a gRPC call: a `POST` (as every call is) of
/// `application/grpc`, or a subtype such as `application/grpc+proto`
/// (gRPC-Web is not). Other methods are told without a header lookup.
fn is_grpc(parts: &Parts) -> bool {
    if parts.method != Method::POST {
        return false;
    }
    parts
        .headers
        .get(CONTENT_TYPE)
        .is_some_and(is_grpc_content_type)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Request;

    fn with_content_type(value: &str) -> Parts {
        Request::post("/grpc.health.v1.Health/Check")
            .header(CONTENT_TYPE, value)
            .body(())
            .unwrap()
            .into_parts()
            .0
    }

    #[test]
    fn grpc_calls_are_told_by_their_content_type() {
        for grpc in [
            "application/grpc",
            "application/grpc+proto",
            "Application/GRPC;x=1",
        ] {
            assert!(is_grpc(&with_content_type(grpc)), "{grpc}");
        }
        for other in [
            "application/grpc-web",
            "application/grpcx",
            "application/json",
            "text/plain",
        ] {
            assert!(!is_grpc(&with_content_type(other)), "{other}");
        }
        assert!(!is_grpc(&Request::new(()).into_parts().0));
        let mut get = with_content_type("application/grpc");
        get.method = Method::GET;
        assert!(!is_grpc(&get), "a gRPC call is a POST");
    }
}
