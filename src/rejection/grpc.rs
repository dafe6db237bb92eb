//! A rejection as a gRPC status ([`Rejection::to_grpc`]).

use bytes::Bytes;
use http::{HeaderValue, Response};

use super::Rejection;
use crate::response::grpc::{
    INTERNAL, PERMISSION_DENIED, RESOURCE_EXHAUSTED, UNAUTHENTICATED, UNAVAILABLE, pushback_ms,
    status_response,
};

impl Rejection<'_> {
    /// This rejection as a gRPC status, in a "Trailers-Only" response
    /// (HTTP `200`, `content-type: application/grpc`, `grpc-status` and
    /// `grpc-message` in the headers, no body):
    ///
    /// | rejection | status |
    /// |---|---|
    /// | over a limit | `RESOURCE_EXHAUSTED`, with `grpc-retry-pushback-ms` (the time until the call fits) |
    /// | a cost above the limit | `RESOURCE_EXHAUSTED`, with `grpc-retry-pushback-ms: -1` (never retry) |
    /// | credentials that do not verify, or none where they are needed | `UNAUTHENTICATED` |
    /// | a client on a deny list | `PERMISSION_DENIED` |
    /// | no client identified otherwise | `INTERNAL` |
    /// | the store down, failing closed | `UNAVAILABLE`, with `grpc-retry-pushback-ms: 1000` |
    ///
    /// The layer answers a gRPC call (`content-type: application/grpc`,
    /// `application/grpc+proto`, ...) so by itself; a hook calls this to
    /// answer other requests as gRPC too. The layer adds the headers of its
    /// own answer the response does not set (`retry-after` and the
    /// rate-limit headers), which gRPC clients read as metadata.
    ///
    /// ```
    /// use slidegate::{Global, Policies, Policy, RateLimitLayer, store::MemoryStore};
    /// use std::time::Duration;
    ///
    /// let policies = Policies::single(Policy::new("checks", 5, Duration::from_secs(60))).unwrap();
    /// // Every answer as gRPC, whatever the request's content type.
    /// let layer = RateLimitLayer::new(MemoryStore::new(), Global, policies)
    ///     .on_rejection(|rejection, _| Some(rejection.to_grpc()));
    /// ```
    pub fn to_grpc(&self) -> Response<Bytes> {
        let (code, message, pushback) = match self {
            Self::Limited(limited) => (
                RESOURCE_EXHAUSTED,
                format!(
                    "rate limit of {} reached for policy `{}`; retry in {} s",
                    limited.limit(),
                    limited.policy(),
                    limited.retry_after().as_secs()
                ),
                Some(pushback_ms(limited.exact_retry_after())),
            ),
            Self::CostAboveLimit(denied) => (
                RESOURCE_EXHAUSTED,
                format!(
                    "this call costs {} units under policy `{}`, which allows {}: it can never be admitted",
                    denied.cost(),
                    denied.policy(),
                    denied.limit()
                ),
                Some(HeaderValue::from_static("-1")),
            ),
            Self::InvalidCredentials(refused) => (
                UNAUTHENTICATED,
                format!("invalid credentials: {}", refused.reason()),
                None,
            ),
            Self::Unidentified {
                missing_credentials: true,
                ..
            } => (UNAUTHENTICATED, "credentials are required".to_owned(), None),
            Self::Unidentified { .. } => (
                INTERNAL,
                "the rate limiter could not identify the client".to_owned(),
                None,
            ),
            Self::DenyListed(list) => (
                PERMISSION_DENIED,
                format!("the client is on a deny list ({})", list.name()),
                None,
            ),
            Self::DelayFull { retry_after } => (
                UNAVAILABLE,
                "the rate limiter holds as many waiting calls as it may".to_owned(),
                Some(pushback_ms(*retry_after)),
            ),
            // As the HTTP answer's `Retry-After: 1`: retries a second apart.
            Self::StoreUnavailable(_) => (
                UNAVAILABLE,
                "the rate limiter is unavailable".to_owned(),
                Some(HeaderValue::from_static("1000")),
            ),
        };
        status_response(code, &message, pushback)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_store_down_spaces_retries_a_second_apart() {
        let error = crate::store::StoreError::CircuitOpen;
        let response = Rejection::StoreUnavailable(&error).to_grpc();
        let headers = response.headers();
        assert_eq!(headers["grpc-status"], "14");
        assert_eq!(headers["grpc-retry-pushback-ms"], "1000");
    }
}
