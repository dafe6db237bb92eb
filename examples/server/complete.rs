//! `POST /api/complete?tokens=N`: a stand-in for an LLM completion, whose
//! cost (the tokens generated) is known only once it has answered.

use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::extract::Query;
use axum::http::{HeaderValue, StatusCode, header, request::Parts};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use slidegate::Policy;
use slidegate::policy::Cost;

/// The header that reports the tokens a completion used.
pub(crate) const USAGE_HEADER: &str = "x-usage-tokens";

/// The most tokens one completion may ask for.
const MOST_TOKENS: u32 = 100_000;

#[derive(serde::Deserialize)]
pub(crate) struct CompleteQuery {
    tokens: Option<String>,
}

/// The policy that counts completions' tokens.
const TOKENS_POLICY: &str = "tokens";

impl CompleteQuery {
    /// The tokens asked for: a whole number from 1 to 100,000.
    fn tokens(&self) -> Option<u32> {
        self.tokens
            .as_deref()
            .and_then(|tokens| tokens.parse::<u32>().ok())
            .filter(|tokens| (1..=MOST_TOKENS).contains(tokens))
    }
}

/// What a completion reserves under the `tokens` policy: the tokens it
/// asks for, as an LLM API's `max_tokens`, so that one asking for more
/// than the limit is refused (`422`) before it runs, and settles down to
/// what its response reports. A request that asks for no valid number
/// reserves the policy's cost; it is answered `400` and costs nothing.
pub(crate) fn reservation(parts: &Parts, policy: &Policy) -> Cost {
    if policy.name() != TOKENS_POLICY {
        return Cost::Policy;
    }
    Query::<CompleteQuery>::try_from_uri(&parts.uri)
        .ok()
        .and_then(|Query(query)| query.tokens())
        .map_or(Cost::Policy, Cost::Units)
}

/// `200` with `x-usage-tokens: N`, streaming the JSON `{"tokens":N}` in
/// three chunks; `400` unless `tokens` is a whole number from 1 to
/// 100,000, with `x-usage-tokens: 0`, as nothing was generated (the
/// `tokens` policy gives its reservation back).
pub(crate) async fn complete(Query(query): Query<CompleteQuery>) -> Response {
    let Some(tokens) = query.tokens() else {
        let error = format!("tokens must be a whole number from 1 to {MOST_TOKENS}");
        return (
            StatusCode::BAD_REQUEST,
            [(USAGE_HEADER, HeaderValue::from(0))],
            axum::Json(json!({ "error": error })),
        )
            .into_response();
    };
    let chunks = [
        Bytes::from_static(b"{\"tokens\":"),
        Bytes::from(tokens.to_string()),
        Bytes::from_static(b"}"),
    ];
    let body = Body::from_stream(futures_util::stream::iter(chunks.map(Ok::<_, Infallible>)));
    let mut response = Response::new(body);
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    headers.insert(USAGE_HEADER, HeaderValue::from(tokens));
    response
}
