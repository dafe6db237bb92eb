//! Which policy the `X-RateLimit-*` headers describe when several apply:
//! the one that leaves the fewest requests of this request's cost, not
//! the fewest raw units.

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use http::{Request, StatusCode};
use slidegate::{Global, Policies, Policy, RateLimitLayer};

use crate::support::reply::send;
use crate::support::stores::StoreUnderTest;

const HOUR: Duration = Duration::from_secs(3600);

/// A completion costs 3,000 of 10,000 tokens an hour, beside a count of
/// 600 requests an hour.
fn app(tested: &StoreUnderTest) -> Router {
    let policies = Policies::builder()
        .with_route(
            "GET /complete",
            Policy::new("tokens", 10_000, HOUR).with_cost(3_000),
        )
        .with_every_route(Policy::new("requests", 600, HOUR))
        .build()
        .unwrap();
    let layer = RateLimitLayer::new(tested.store.clone(), Global, policies);
    Router::new()
        .route("/complete", get(|| async { "done" }))
        .route_layer(layer)
}

async fn the_headers_describe_the_policy_with_the_fewest_requests_left(tested: StoreUnderTest) {
    let app = app(&tested);
    let complete = || Request::get("/complete").body(Body::empty()).unwrap();
    let mut described = Vec::new();
    for _ in 0..3 {
        let reply = send(&app, complete()).await;
        assert_eq!(reply.status, StatusCode::OK);
        let header = |name| reply.header(name).unwrap().to_owned();
        described.push((header("x-ratelimit-limit"), header("x-ratelimit-remaining")));
    }
    // 2, 1 and 0 completions left of the tokens, against 599, 598 and 597
    // requests: the tokens are what the client meets first.
    let tokens = |left: &str| ("10000".to_owned(), left.to_owned());
    assert_eq!(described, [tokens("7000"), tokens("4000"), tokens("1000")]);
    let refused = send(&app, complete()).await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.header("x-ratelimit-limit"), Some("10000"));
}

on_both_stores!(the_headers_describe_the_policy_with_the_fewest_requests_left);
