//! The layer inside axum: headers, bodies, routing, keys and fail modes.

use crate::support::down_store::DownStore;
use crate::support::reply::send;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::{get, post};
use bytes::Bytes;
use http::request::Parts;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use slidegate::{
    Global, Header, KeyExtractor, PeerIp, Policies, Policy, RateLimit, RateLimitLayer, Rejection,
    clock::FakeClock,
    headers::{HeaderStyle, ResetFormat},
    key::Identity,
    layer::DenyCache,
    policy::{Cost, FailMode, TierLimits},
    store::{MemoryStore, RedisStore},
};
use tower::{ServiceExt, service_fn};

use crate::support::stores::START;
const MINUTE: Duration = Duration::from_secs(60);

fn request(method: &str, uri: &str, peer: &str) -> Request<Body> {
    let mut request = Request::builder()
        .method(method)
        .uri(uri)
        .body(Body::empty())
        .unwrap();
    request
        .extensions_mut()
        .insert(ConnectInfo(peer.parse::<SocketAddr>().unwrap()));
    request
}

fn get_from(uri: &str, peer: &str) -> Request<Body> {
    request("GET", uri, peer)
}

fn demo_policies() -> Policies {
    Policies::builder()
        .with_route("GET /search", Policy::new("search", 3, MINUTE))
        .with_route(
            "POST /login",
            Policy::new("login", 2, MINUTE).with_fail_mode(FailMode::Closed),
        )
        .with_route("GET /items/{id}", Policy::new("items", 2, MINUTE))
        .build()
        .unwrap()
}

fn routes() -> Router {
    Router::new()
        .route("/search", get(|| async { "results" }))
        .route("/login", post(|| async { "welcome" }))
        .route("/items/{id}", get(|| async { "item" }))
        .route("/free", get(|| async { "free" }))
        .route(
            "/whoami",
            get(|identity: Option<axum::Extension<Identity>>| async move {
                identity.map_or("none".to_owned(), |i| i.key.to_string())
            }),
        )
}

fn memory_app(clock: &FakeClock) -> Router {
    let store = MemoryStore::builder().with_clock(clock.clone()).build();
    routes().route_layer(RateLimitLayer::new(store, PeerIp::new(), demo_policies()))
}

#[tokio::test]
async fn every_limited_response_carries_the_headers() {
    let clock = FakeClock::new(START);
    let app = memory_app(&clock);
    for (remaining, reset) in [("2", "60"), ("1", "59"), ("0", "57")] {
        let reply = send(&app, get_from("/search", "192.0.2.1:1000")).await;
        assert_eq!(reply.status, StatusCode::OK);
        assert_eq!(reply.body, "results");
        assert_eq!(reply.header("x-ratelimit-limit"), Some("3"));
        assert_eq!(reply.header("x-ratelimit-remaining"), Some(remaining));
        assert_eq!(reply.header("x-ratelimit-reset"), Some(reset));
        clock.advance(Duration::from_millis(1500));
    }
    // The first request was 4.5 s ago: capacity grows in 55.5 s.
    let denied = send(&app, get_from("/search", "192.0.2.1:1000")).await;
    assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(denied.header("retry-after"), Some("56"));
    assert_eq!(denied.header("x-ratelimit-remaining"), Some("0"));
    assert_eq!(denied.header("x-ratelimit-reset"), Some("56"));
    assert_eq!(
        denied.header("content-type"),
        Some("application/problem+json")
    );
    let body = denied.json();
    assert_eq!(body["status"], 429);
    assert_eq!(body["title"], "Too Many Requests");
    assert_eq!(body["policy"], "search");
    assert_eq!(body["limit"], 3);
    assert_eq!(body["window_seconds"], 60);
    assert_eq!(body["retry_after_seconds"], 56);

    // Unlimited routes carry no headers.
    let free = send(&app, get_from("/free", "192.0.2.1:1000")).await;
    assert_eq!(free.status, StatusCode::OK);
    assert_eq!(free.header("x-ratelimit-limit"), None);
}

#[tokio::test]
async fn retry_after_rounds_up_to_at_least_one_second() {
    let clock = FakeClock::new(START);
    let app = memory_app(&clock);
    for _ in 0..3 {
        send(&app, get_from("/search", "192.0.2.1:1")).await;
    }
    clock.advance(MINUTE - Duration::from_micros(1));
    let denied = send(&app, get_from("/search", "192.0.2.1:1")).await;
    assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(denied.header("retry-after"), Some("1"));
    assert_eq!(denied.json()["retry_after_seconds"], 1);
}

/// A layer whose 429 is a gRPC-style answer: status 200 with
/// `grpc-status: 8` (resource exhausted), plain text, its own
/// `X-RateLimit-Reset`, and no `Retry-After` of its own.
fn grpc_style_layer(store: MemoryStore, cache: Option<DenyCache>) -> RateLimitLayer {
    let layer = RateLimitLayer::new(store, PeerIp::new(), demo_policies()).on_rejection(
        |rejection: &Rejection<'_>, _: &Parts| {
            let Rejection::Limited(limited) = rejection else {
                return None;
            };
            let text = format!(
                "{} allows {} per {} s; {} left; retry in {} s; you are {}",
                limited.policy(),
                limited.limit(),
                limited.window().as_secs(),
                limited.remaining(),
                limited.retry_after().as_secs(),
                limited.key(),
            );
            let response = http::Response::builder()
                .status(StatusCode::OK)
                .header("grpc-status", "8")
                .header(http::header::CONTENT_TYPE, "text/plain; charset=utf-8")
                .header("x-ratelimit-reset", "custom")
                .body(Bytes::from(text))
                .unwrap();
            Some(response)
        },
    );
    match cache {
        Some(cache) => layer.with_deny_cache(cache),
        None => layer,
    }
}

#[tokio::test]
async fn a_custom_429_keeps_its_status_and_headers_and_gets_the_limiters_it_lacks() {
    let clock = FakeClock::new(START);
    let store = MemoryStore::builder().with_clock(clock.clone()).build();
    let cache = DenyCache::with_clock(100, clock.clone());
    for cache in [None, Some(cache)] {
        let app = routes().route_layer(grpc_style_layer(store.clone(), cache.clone()));
        let peer = if cache.is_some() {
            "192.0.2.8:1"
        } else {
            "192.0.2.7:1"
        };
        for _ in 0..3 {
            assert_eq!(
                send(&app, get_from("/search", peer)).await.status,
                StatusCode::OK
            );
        }
        clock.advance(Duration::from_secs(4));
        // The second denial comes from the deny cache when there is one.
        for _ in 0..2 {
            let denied = send(&app, get_from("/search", peer)).await;
            assert_eq!(denied.status, StatusCode::OK);
            assert_eq!(denied.header("grpc-status"), Some("8"));
            assert_eq!(denied.header("retry-after"), Some("56"));
            assert_eq!(denied.header("x-ratelimit-remaining"), Some("0"));
            assert_eq!(denied.header("x-ratelimit-reset"), Some("custom"));
            assert_eq!(
                denied.header("content-type"),
                Some("text/plain; charset=utf-8")
            );
            let ip = peer.split(':').next().unwrap();
            assert_eq!(
                denied.body,
                format!("search allows 3 per 60 s; 0 left; retry in 56 s; you are ip:{ip}")
            );
        }
        if let Some(cache) = cache {
            assert_eq!(
                cache.len(),
                1,
                "the first denial was cached and answered the second"
            );
        }
    }
}

/// Every kind of rejection reaches the hook, which answers some and
/// leaves the others to the limiter.
#[tokio::test]
async fn the_rejection_hook_sees_every_kind_and_may_leave_any_to_the_limiter() {
    let hook = |rejection: &Rejection<'_>, _: &Parts| {
        let kind = match rejection {
            Rejection::StoreUnavailable(_) => "store",
            Rejection::CostAboveLimit(over) => {
                assert_eq!((over.policy(), over.cost(), over.limit()), ("rows", 11, 10));
                "cost"
            }
            _ => return None,
        };
        let response = http::Response::builder()
            .status(StatusCode::IM_A_TEAPOT)
            .body(Bytes::from(kind))
            .unwrap();
        Some(response)
    };
    let down = routes().route_layer(
        RateLimitLayer::new(DownStore, Global, demo_policies())
            .with_fail_mode(FailMode::Closed)
            .on_rejection(hook),
    );
    let unavailable = send(&down, get_from("/search", "192.0.2.1:1")).await;
    assert_eq!(unavailable.status, StatusCode::IM_A_TEAPOT);
    assert_eq!(unavailable.body, "store");
    assert_eq!(
        unavailable.header("retry-after"),
        Some("1"),
        "the limiter's Retry-After, which the hook did not set"
    );

    let clock = FakeClock::new(START);
    let policies = Policies::single(Policy::new("rows", 10, MINUTE)).unwrap();
    let store = MemoryStore::builder().with_clock(clock.clone()).build();
    let costed = routes().route_layer(
        RateLimitLayer::new(store, PeerIp::new(), policies)
            .with_request_cost(rows_cost)
            .on_rejection(hook),
    );
    let mut too_big = get_from("/search", "192.0.2.1:1");
    too_big
        .headers_mut()
        .insert("x-rows", "11".parse().unwrap());
    let reply = send(&costed, too_big).await;
    assert_eq!(
        (reply.status, reply.body.as_str()),
        (StatusCode::IM_A_TEAPOT, "cost")
    );

    // Left to the limiter: its own 429.
    let mut spend = get_from("/search", "192.0.2.1:1");
    spend.headers_mut().insert("x-rows", "10".parse().unwrap());
    assert_eq!(send(&costed, spend).await.status, StatusCode::OK);
    let denied = send(&costed, get_from("/search", "192.0.2.1:1")).await;
    assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(denied.json()["policy"], "rows");
}

/// A browser (`Accept: text/html`) gets an HTML page from an axum hook;
/// an API client, whom the hook leaves alone, the limiter's JSON. Both
/// carry the limiter's headers.
#[tokio::test]
async fn an_axum_hook_answers_by_the_request_and_the_limiter_fills_in() {
    let clock = FakeClock::new(START);
    let store = MemoryStore::builder().with_clock(clock.clone()).build();
    let layer = RateLimitLayer::new(store, PeerIp::new(), demo_policies())
        .on_rejection_into_response(|rejection, request| {
            let Rejection::Limited(limited) = rejection else {
                return None;
            };
            let accept = request.headers.get(http::header::ACCEPT)?.to_str().ok()?;
            accept.contains("text/html").then(|| {
                let page = format!(
                    "<p>{} {}: try again in {} s</p>",
                    request.method,
                    request.uri.path(),
                    limited.retry_after().as_secs()
                );
                (StatusCode::TOO_MANY_REQUESTS, axum::response::Html(page))
            })
        });
    let app = routes().route_layer(layer);
    for _ in 0..3 {
        send(&app, get_from("/search?q=1", "192.0.2.1:1")).await;
    }
    let mut browser = get_from("/search?q=1", "192.0.2.1:1");
    browser
        .headers_mut()
        .insert("accept", "text/html,application/xhtml+xml".parse().unwrap());
    let page = send(&app, browser).await;
    assert_eq!(page.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        page.header("content-type"),
        Some("text/html; charset=utf-8")
    );
    assert_eq!(page.body, "<p>GET /search: try again in 60 s</p>");
    assert_eq!(page.header("retry-after"), Some("60"));
    assert_eq!(page.header("x-ratelimit-remaining"), Some("0"));

    let api = send(&app, get_from("/search?q=1", "192.0.2.1:1")).await;
    assert_eq!(api.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(api.header("content-type"), Some("application/problem+json"));
    assert_eq!(api.json()["policy"], "search");
}

/// A gRPC call over its limit ends with `RESOURCE_EXHAUSTED` without a
/// hook; a plain request to the same route gets the HTTP `429`.
#[tokio::test]
async fn a_grpc_call_gets_a_grpc_status_without_a_hook() {
    let clock = FakeClock::new(START);
    let app = memory_app(&clock);
    let grpc = |peer: &str| {
        let mut call = request("POST", "/login", peer);
        call.headers_mut()
            .insert("content-type", "application/grpc+proto".parse().unwrap());
        call
    };
    for _ in 0..2 {
        assert_eq!(send(&app, grpc("192.0.2.1:1")).await.status, StatusCode::OK);
    }
    clock.advance(Duration::from_millis(1500));
    let exhausted = send(&app, grpc("192.0.2.1:1")).await;
    assert_eq!(exhausted.status, StatusCode::OK);
    assert_eq!(exhausted.header("content-type"), Some("application/grpc"));
    assert_eq!(exhausted.header("grpc-status"), Some("8"));
    assert_eq!(exhausted.header("grpc-retry-pushback-ms"), Some("58500"));
    assert_eq!(exhausted.header("retry-after"), Some("59"));
    assert_eq!(exhausted.header("x-ratelimit-remaining"), Some("0"));
    assert_eq!(exhausted.body, "", "Trailers-Only: no body");

    let plain = send(&app, request("POST", "/login", "192.0.2.1:1")).await;
    assert_eq!(plain.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(plain.header("grpc-status"), None);
}

/// The `x-rows` header, as the cost under the policy named `rows` only;
/// `x-rows: exempt` stands for a request the server decides not to count.
fn rows_cost(parts: &http::request::Parts, policy: &Policy) -> Cost {
    let rows = parts.headers.get("x-rows").and_then(|v| v.to_str().ok());
    match rows {
        _ if policy.name() != "rows" => Cost::Policy,
        Some("exempt") => Cost::Exempt,
        Some(rows) => rows.parse().map_or(Cost::Policy, Cost::Units),
        None => Cost::Policy,
    }
}

/// A `rows` policy of 10 a minute (50 for `pro`, named by an async tier
/// lookup on `x-plan`) whose cost is the `x-rows` header, beside a fixed
/// `calls` policy the header does not change.
fn rows_app(clock: &FakeClock) -> Router {
    let policies = Policies::builder()
        .with_route(
            "GET /search",
            Policy::new("rows", 10, MINUTE).with_tier("pro", TierLimits::new().with_limit(50)),
        )
        .with_every_route(Policy::new("calls", 100, MINUTE))
        .build()
        .unwrap();
    let store = MemoryStore::builder().with_clock(clock.clone()).build();
    let plan = |parts: &http::request::Parts, _: &Identity| {
        let pro = parts.headers.contains_key("x-plan");
        async move { pro.then(|| Arc::<str>::from("pro")) }
    };
    routes().route_layer(
        RateLimitLayer::new(store, PeerIp::new(), policies)
            .with_request_cost(rows_cost)
            .with_tier_lookup(plan),
    )
}

fn rows_request(rows: &str, peer: &str, pro: bool) -> Request<Body> {
    let mut request = get_from("/search", peer);
    request
        .headers_mut()
        .insert("x-rows", rows.parse().unwrap());
    if pro {
        request
            .headers_mut()
            .insert("x-plan", "pro".parse().unwrap());
    }
    request
}

#[tokio::test]
async fn per_request_costs_are_spent_and_a_cost_above_the_limit_is_a_clear_422() {
    let clock = FakeClock::new(START);
    let app = rows_app(&clock);
    let peer = "192.0.2.30:1";
    let statuses = |replies: &[crate::support::reply::Reply]| {
        replies
            .iter()
            .map(|r| r.status.as_u16())
            .collect::<Vec<_>>()
    };
    let mut replies = Vec::new();
    for rows in ["4", "4", "3", "2"] {
        replies.push(send(&app, rows_request(rows, peer, false)).await);
    }
    assert_eq!(
        statuses(&replies),
        [200, 200, 429, 200],
        "4 + 4 + 2 fit in 10"
    );
    assert_eq!(replies[2].header("x-ratelimit-remaining"), Some("2"));
    assert_eq!(replies[3].header("x-ratelimit-remaining"), Some("0"));

    // Exempt from `rows`, the request is counted by `calls` alone.
    let free = send(&app, rows_request("exempt", peer, false)).await;
    assert_eq!(free.status, StatusCode::OK);
    assert_eq!(free.header("x-ratelimit-limit"), Some("100"));

    // More than the limit could ever allow: 422, no Retry-After, nothing spent.
    let calls_before = free.header("x-ratelimit-remaining").unwrap().to_owned();
    let too_big = send(&app, rows_request("11", peer, false)).await;
    assert_eq!(too_big.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(too_big.header("retry-after"), None);
    assert_eq!(
        too_big.header("content-type"),
        Some("application/problem+json")
    );
    let body = too_big.json();
    assert_eq!(body["title"], "Request Cost Above Limit");
    assert_eq!(
        (&body["policy"], &body["cost"], &body["limit"]),
        (&"rows".into(), &11.into(), &10.into())
    );
    let after = send(&app, rows_request("exempt", peer, false)).await;
    assert_eq!(
        after
            .header("x-ratelimit-remaining")
            .unwrap()
            .parse::<u32>()
            .unwrap(),
        calls_before.parse::<u32>().unwrap() - 1,
        "the 422 spent nothing from `calls` either"
    );

    // The pro tier's limit is known only after the async lookup; 11 fits it.
    let pro = send(&app, rows_request("11", "192.0.2.31:1", true)).await;
    assert_eq!(pro.status, StatusCode::OK);
    assert_eq!(pro.header("x-ratelimit-limit"), Some("50"));
    let pro_too_big = send(&app, rows_request("51", "192.0.2.31:1", true)).await;
    assert_eq!(pro_too_big.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(pro_too_big.json()["limit"], 50);

    // No header: the policy's own cost of one.
    let plain = send(&app, get_from("/search", "192.0.2.32:1")).await;
    assert_eq!(plain.header("x-ratelimit-remaining"), Some("9"));
}

#[tokio::test]
async fn route_layer_never_turns_404_into_429() {
    let clock = FakeClock::new(START);
    let store = MemoryStore::builder().with_clock(clock.clone()).build();
    let policies = Policies::builder()
        .with_default(Policy::new("default", 1, MINUTE))
        .build()
        .unwrap();
    let app = routes().route_layer(RateLimitLayer::new(store, PeerIp::new(), policies));
    assert_eq!(
        send(&app, get_from("/free", "192.0.2.1:1")).await.status,
        StatusCode::OK
    );
    assert_eq!(
        send(&app, get_from("/free", "192.0.2.1:1")).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    for _ in 0..3 {
        let missing = send(&app, get_from("/missing", "192.0.2.1:1")).await;
        assert_eq!(missing.status, StatusCode::NOT_FOUND);
        assert_eq!(missing.header("x-ratelimit-limit"), None);
    }
}

#[tokio::test]
async fn router_layer_matches_route_patterns() {
    let clock = FakeClock::new(START);
    let store = MemoryStore::builder().with_clock(clock.clone()).build();
    let app = routes().layer(RateLimitLayer::new(store, PeerIp::new(), demo_policies()));
    // Two different ids share the `/items/{id}` policy.
    assert_eq!(
        send(&app, get_from("/items/1", "192.0.2.1:1")).await.status,
        StatusCode::OK
    );
    assert_eq!(
        send(&app, get_from("/items/2", "192.0.2.1:1")).await.status,
        StatusCode::OK
    );
    let third = send(&app, get_from("/items/3", "192.0.2.1:1")).await;
    assert_eq!(third.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(third.json()["policy"], "items");
    // The method is part of the route: GET /login has no policy.
    assert_eq!(
        send(&app, get_from("/login", "192.0.2.1:1")).await.status,
        StatusCode::METHOD_NOT_ALLOWED
    );
    let login = send(&app, request("POST", "/login", "192.0.2.1:1")).await;
    assert_eq!(login.header("x-ratelimit-limit"), Some("2"));
}

#[tokio::test]
async fn clients_are_counted_apart_and_identity_reaches_the_handler() {
    let clock = FakeClock::new(START);
    let store = MemoryStore::builder().with_clock(clock.clone()).build();
    let policies = Policies::single(Policy::new("all", 1, MINUTE)).unwrap();
    let layer = RateLimitLayer::new(store, PeerIp::new(), policies).with_identity_extension(true);
    let app = routes().route_layer(layer);
    let alice = send(&app, get_from("/whoami", "192.0.2.1:1")).await;
    assert_eq!(alice.body, "ip:192.0.2.1");
    let bob = send(&app, get_from("/whoami", "192.0.2.2:1")).await;
    assert_eq!(bob.status, StatusCode::OK);
    // Same /64: the same client.
    let v6a = send(&app, get_from("/whoami", "[2001:db8::1]:1")).await;
    assert_eq!(v6a.body, "ip:2001:db8::/64");
    let v6b = send(&app, get_from("/whoami", "[2001:db8::ffff:2]:1")).await;
    assert_eq!(v6b.status, StatusCode::TOO_MANY_REQUESTS);
}

/// The `Identity` extension is the handler's only when the layer is asked
/// to insert it.
#[tokio::test]
async fn identity_reaches_the_handler_only_when_asked_for() {
    let policies = || Policies::single(Policy::new("all", 5, MINUTE)).unwrap();
    let plain = routes().route_layer(RateLimitLayer::new(
        MemoryStore::new(),
        PeerIp::new(),
        policies(),
    ));
    assert_eq!(
        send(&plain, get_from("/whoami", "192.0.2.1:1")).await.body,
        "none"
    );
    let asked = routes().route_layer(
        RateLimitLayer::new(MemoryStore::new(), PeerIp::new(), policies())
            .with_identity_extension(true),
    );
    assert_eq!(
        send(&asked, get_from("/whoami", "192.0.2.1:1")).await.body,
        "ip:192.0.2.1"
    );
}

#[tokio::test]
async fn spoofed_forwarded_for_does_not_change_the_key() {
    let clock = FakeClock::new(START);
    let store = MemoryStore::builder().with_clock(clock.clone()).build();
    let policies = Policies::single(Policy::new("all", 1, MINUTE)).unwrap();
    let keys = PeerIp::new().with_trusted_proxies(["10.0.0.0/8".parse().unwrap()]);
    let app = routes()
        .route_layer(RateLimitLayer::new(store, keys, policies).with_identity_extension(true));
    let spoof = |xff: &str, peer: &str| {
        let mut r = get_from("/whoami", peer);
        r.headers_mut()
            .insert("x-forwarded-for", xff.parse().unwrap());
        r
    };
    // From an untrusted peer the header is ignored.
    let direct = send(&app, spoof("1.2.3.4", "198.51.100.7:1")).await;
    assert_eq!(direct.body, "ip:198.51.100.7");
    let again = send(&app, spoof("5.6.7.8", "198.51.100.7:1")).await;
    assert_eq!(
        again.status,
        StatusCode::TOO_MANY_REQUESTS,
        "rotating the header buys nothing"
    );
    // Through the trusted proxy the client's own prefix of hops is ignored.
    let proxied = send(&app, spoof("6.6.6.6, 203.0.113.50", "10.0.0.1:1")).await;
    assert_eq!(proxied.body, "ip:203.0.113.50");
    let rotated = send(&app, spoof("7.7.7.7, 203.0.113.50", "10.0.0.1:1")).await;
    assert_eq!(rotated.status, StatusCode::TOO_MANY_REQUESTS);
}

#[tokio::test]
async fn hostile_header_values_get_short_hashed_keys() {
    let clock = FakeClock::new(START);
    let store = MemoryStore::builder().with_clock(clock.clone()).build();
    let policies = Policies::single(Policy::new("all", 5, MINUTE)).unwrap();
    let keys = Header::trusted(http::HeaderName::from_static("x-api-key")).or(Global);
    let app = routes()
        .route_layer(RateLimitLayer::new(store, keys, policies).with_identity_extension(true));
    let values: [&[u8]; 4] = [
        b"\xff\xfe\x80binary",
        b"{slot}",
        &[b'k'; 32 * 1024],
        b"plain-secret",
    ];
    for value in values {
        let mut r = get_from("/whoami", "192.0.2.1:1");
        r.headers_mut()
            .insert("x-api-key", http::HeaderValue::from_bytes(value).unwrap());
        let reply = send(&app, r).await;
        assert_eq!(reply.status, StatusCode::OK);
        assert!(
            reply.body.starts_with("header:x-api-key:#"),
            "{}",
            reply.body
        );
        assert_eq!(reply.body.len(), "header:x-api-key:#".len() + 32);
    }
    let without = send(&app, get_from("/whoami", "192.0.2.1:1")).await;
    assert_eq!(
        without.body, "global",
        "no header falls through to the next extractor"
    );
}

#[tokio::test]
async fn unidentified_client_is_a_clear_500() {
    let store = MemoryStore::new();
    let policies = Policies::single(Policy::new("all", 5, MINUTE)).unwrap();
    let app = routes().route_layer(RateLimitLayer::new(store, PeerIp::new(), policies));
    // No ConnectInfo: the server was not served with connect info.
    let request = Request::get("/free").body(Body::empty()).unwrap();
    let reply = send(&app, request).await;
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        reply.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(reply.json()["title"], "Client Not Identified");
}

#[tokio::test]
async fn header_style_none_and_unix_reset() {
    let clock = FakeClock::new(START);
    let policies = Policies::single(Policy::new("all", 1, MINUTE)).unwrap();
    let none = routes().route_layer(
        RateLimitLayer::new(
            MemoryStore::builder().with_clock(clock.clone()).build(),
            Global,
            policies.clone(),
        )
        .with_header_style(HeaderStyle::None),
    );
    let ok = send(&none, get_from("/free", "192.0.2.1:1")).await;
    assert_eq!(ok.header("x-ratelimit-limit"), None);
    let denied = send(&none, get_from("/free", "192.0.2.1:1")).await;
    assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(denied.header("x-ratelimit-limit"), None);
    assert_eq!(denied.header("retry-after"), Some("60"));

    let unix = routes().route_layer(
        RateLimitLayer::new(MemoryStore::new(), Global, policies)
            .with_reset_format(ResetFormat::UnixSeconds),
    );
    let reply = send(&unix, get_from("/free", "192.0.2.1:1")).await;
    let reset: u64 = reply.header("x-ratelimit-reset").unwrap().parse().unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert!(
        (now + 59..=now + 61).contains(&reset),
        "reset {reset}, now {now}"
    );
}

#[tokio::test]
async fn fail_modes_decide_when_the_store_is_down() {
    let open = routes().route_layer(RateLimitLayer::new(DownStore, Global, demo_policies()));
    let passed = send(&open, get_from("/search", "192.0.2.1:1")).await;
    assert_eq!(passed.status, StatusCode::OK);
    assert_eq!(
        passed.header("x-ratelimit-limit"),
        None,
        "no made-up numbers"
    );
    let closed = send(&open, request("POST", "/login", "192.0.2.1:1")).await;
    assert_eq!(closed.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(closed.header("retry-after"), Some("1"));
    assert!(
        closed.json()["detail"]
            .as_str()
            .unwrap()
            .contains("not the client")
    );

    let all_closed = routes().route_layer(
        RateLimitLayer::new(DownStore, Global, demo_policies()).with_fail_mode(FailMode::Closed),
    );
    let search = send(&all_closed, get_from("/search", "192.0.2.1:1")).await;
    assert_eq!(search.status, StatusCode::SERVICE_UNAVAILABLE);

    // A closed policy that exempts the request does not close it.
    let policies = Policies::builder()
        .with_route(
            "GET /search",
            Policy::new("rows", 10, MINUTE).with_fail_mode(FailMode::Closed),
        )
        .with_every_route(Policy::new("calls", 100, MINUTE))
        .build()
        .unwrap();
    let costed = routes()
        .route_layer(RateLimitLayer::new(DownStore, Global, policies).with_request_cost(rows_cost));
    for (rows, status) in [
        ("exempt", StatusCode::OK),
        ("0", StatusCode::SERVICE_UNAVAILABLE),
        ("1", StatusCode::SERVICE_UNAVAILABLE),
    ] {
        let mut request = get_from("/search", "192.0.2.1:1");
        request
            .headers_mut()
            .insert("x-rows", rows.parse().unwrap());
        assert_eq!(
            send(&costed, request).await.status,
            status,
            "x-rows: {rows}"
        );
    }
}

/// Any tower service can be limited, whatever its body (here a `String`,
/// which cannot be made from bytes): its body comes back in a
/// [`ResponseBody`] that reads as it does, its error type unchanged, and
/// the limiter's answers are `ResponseBody`s too.
#[tokio::test]
async fn works_on_any_tower_service_and_keeps_its_body_and_error_types() {
    use slidegate::layer::ResponseBody;

    #[derive(Debug, PartialEq)]
    struct InnerError;
    let inner = service_fn(|request: Request<String>| async move {
        if request.uri().path() == "/fail" {
            Err(InnerError)
        } else {
            Ok::<_, InnerError>(http::Response::new("inner".to_owned()))
        }
    });
    let policies = Policies::single(Policy::new("all", 2, MINUTE)).unwrap();
    let service = RateLimit::new(inner, MemoryStore::new(), Global, policies);
    let ok: http::Response<ResponseBody<String>> = service
        .clone()
        .oneshot(Request::get("/").body(String::new()).unwrap())
        .await
        .unwrap();
    assert_eq!(ok.headers()["x-ratelimit-remaining"], "1");
    let body = ok.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"inner");
    let failed = service
        .clone()
        .oneshot(Request::get("/fail").body(String::new()).unwrap())
        .await;
    assert_eq!(failed.unwrap_err(), InnerError);
    let denied = service
        .oneshot(Request::get("/").body(String::new()).unwrap())
        .await
        .unwrap();
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    let body = denied.into_body().collect().await.unwrap().to_bytes();
    assert!(body.starts_with(b"{\"type\""), "{body:?}");
}

/// Outside axum there is no `MatchedPath`: a request's path is matched
/// against the policies' patterns as axum's router would, so
/// `/users/{id}` governs `/users/42`, and `/users/42/posts` falls to the
/// default.
#[tokio::test]
async fn outside_axum_paths_are_matched_against_the_patterns() {
    use http_body_util::Full;

    let inner = service_fn(|_: Request<String>| async {
        Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::from("ok"))))
    });
    let policies = Policies::builder()
        .with_route("GET /users/{id}", Policy::new("user", 1, MINUTE))
        .with_route("/files/{*path}", Policy::new("files", 2, MINUTE))
        .with_default(Policy::new("rest", 100, MINUTE))
        .build()
        .unwrap();
    let service = RateLimit::new(inner, MemoryStore::new(), Global, policies);
    let limit_of = |path: &'static str| {
        let service = service.clone();
        async move {
            let request = Request::get(path).body(String::new()).unwrap();
            let response = service.oneshot(request).await.unwrap();
            (
                response.status(),
                response.headers()["x-ratelimit-limit"]
                    .to_str()
                    .unwrap()
                    .to_owned(),
            )
        }
    };
    assert_eq!(
        limit_of("/users/42").await,
        (StatusCode::OK, "1".to_owned())
    );
    assert_eq!(
        limit_of("/users/7").await.0,
        StatusCode::TOO_MANY_REQUESTS,
        "one pattern, one count, whatever the id"
    );
    assert_eq!(limit_of("/files/a/b.txt").await.1, "2");
    assert_eq!(limit_of("/users/42/posts").await.1, "100");
}

#[test]
fn patterns_axum_would_refuse_are_refused_when_the_policies_are_built() {
    let conflicting = Policies::builder()
        .with_route("/users/{id}", Policy::new("by-id", 1, MINUTE))
        .with_route("/users/{name}", Policy::new("by-name", 1, MINUTE))
        .build()
        .unwrap_err();
    assert!(
        matches!(
            conflicting,
            slidegate::policy::PolicyError::InvalidPattern { .. }
        ),
        "{conflicting}"
    );
    let unclosed = Policies::builder()
        .with_route("/users/{id", Policy::new("bad", 1, MINUTE))
        .build()
        .unwrap_err();
    assert!(unclosed.to_string().contains("/users/{id"), "{unclosed}");
}

#[tokio::test]
async fn every_redis_key_written_has_a_ttl_within_two_windows() {
    let server = crate::support::RedisServer::start();
    let store = RedisStore::builder(server.pool(4))
        .with_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let policies = Policies::builder()
        .with_route("GET /search", Policy::new("search", 3, MINUTE))
        .with_every_route(Policy::new("hourly", 100, Duration::from_secs(3600)))
        .with_default(Policy::new("default", 10, Duration::from_secs(10)))
        .build()
        .unwrap();
    let app = routes().route_layer(RateLimitLayer::new(store, PeerIp::new(), policies));
    for client in 1..=5 {
        for path in ["/search", "/free", "/search", "/search", "/search"] {
            send(&app, get_from(path, &format!("192.0.2.{client}:1"))).await;
        }
    }
    let keys: Vec<String> = server.cli(&["--scan"]).lines().map(str::to_owned).collect();
    // 5 clients x 3 policies, one packed log each.
    assert_eq!(keys.len(), 15, "{keys:?}");
    for key in &keys {
        let ttl: i64 = server.cli(&["pttl", key]).trim().parse().unwrap();
        let window_ms = if key.contains(":search:") {
            60_000
        } else if key.contains(":hourly:") {
            3_600_000
        } else {
            10_000
        };
        assert!(
            ttl > 0 && ttl <= 2 * window_ms + 1,
            "{key} has TTL {ttl} ms for a {window_ms} ms window"
        );
        assert!(
            key.starts_with("slidegate:") && key.contains("{ip:192.0.2."),
            "{key}"
        );
    }
}
