//! A client's own limits (a limit lookup, [`Overrides`]) and looking at
//! or resetting one client's count through the layer, on both stores.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::support::reply::send;
use crate::support::stores::StoreUnderTest;
use axum::Router;
use axum::body::Body;
use axum::routing::get;
use http::{Request, StatusCode};
use slidegate::layer::LimitError;
use slidegate::{
    Header, Policies, Policy, RateLimitLayer,
    key::{Key, KeyExtractor},
    limits::Overrides,
};

const MINUTE: Duration = Duration::from_secs(60);

/// Keys each request by its `x-client` header, as `header:x-client:<name>`.
fn clients() -> impl KeyExtractor {
    Header::trusted(http::HeaderName::from_static("x-client")).with_public_values(true)
}

fn key(name: &str) -> Key {
    Key::parse(&format!("header:x-client:{name}")).unwrap()
}

fn app(layer: RateLimitLayer) -> Router {
    Router::new()
        .route("/search", get(|| async { "results" }))
        .route_layer(layer)
}

fn request(client: &str) -> Request<Body> {
    Request::get("/search")
        .header("x-client", client)
        .body(Body::empty())
        .unwrap()
}

/// How many requests of `client` are admitted in a row (at most `most`).
async fn admitted(app: &Router, client: &str, most: usize) -> usize {
    for n in 0..most {
        if send(app, request(client)).await.status != StatusCode::OK {
            return n;
        }
    }
    most
}

async fn an_override_gives_one_client_its_own_limit(tested: StoreUnderTest) {
    let policies = Policies::single(Policy::new("search", 5, MINUTE)).unwrap();
    let overrides = Overrides::new().with_limit(key("alice"), "search", 50);
    let layer = RateLimitLayer::new(tested.store, clients(), policies).with_limit_lookup(overrides);
    let app = app(layer);
    let first = send(&app, request("alice")).await;
    assert_eq!(first.header("x-ratelimit-limit"), Some("50"));
    assert_eq!(admitted(&app, "alice", 100).await, 49);
    assert_eq!(
        admitted(&app, "bob", 100).await,
        5,
        "others keep the base limit"
    );
}
on_both_stores!(an_override_gives_one_client_its_own_limit);

async fn a_lookup_is_asked_once_per_client_and_bounded_in_time(tested: StoreUnderTest) {
    let calls = Arc::new(AtomicUsize::new(0));
    let lookup = {
        let calls = calls.clone();
        move |key: &Key, _: &Policy| {
            calls.fetch_add(1, Ordering::SeqCst);
            let slow = key == &self::key("slow");
            async move {
                if slow {
                    // A database that never answers.
                    std::future::pending::<()>().await;
                }
                Some(3)
            }
        }
    };
    let policies = Policies::single(Policy::new("search", 5, MINUTE)).unwrap();
    let layer = RateLimitLayer::new(tested.store, clients(), policies)
        .with_limit_lookup(lookup)
        .with_lookup_timeout(Duration::from_millis(50));
    let app = app(layer);
    assert_eq!(admitted(&app, "quick", 10).await, 3);
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the answer is kept");
    let started = Instant::now();
    let reply = send(&app, request("slow")).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(
        reply.header("x-ratelimit-limit"),
        Some("5"),
        "the base limit"
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "bounded by the timeout"
    );
}
on_both_stores!(a_lookup_is_asked_once_per_client_and_bounded_in_time);

/// A client's own limit below what a request costs can never admit it: a
/// `422` at once, never a `429` to retry for ever.
async fn an_own_limit_below_the_cost_is_said_at_once(tested: StoreUnderTest) {
    let policies = Policies::single(Policy::new("search", 10, MINUTE).with_cost(4)).unwrap();
    let overrides = Overrides::new().with_limit(key("tiny"), "search", 3);
    let layer = RateLimitLayer::new(tested.store, clients(), policies).with_limit_lookup(overrides);
    let app = app(layer);
    let reply = send(&app, request("tiny")).await;
    assert_eq!(reply.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(reply.header("retry-after"), None);
}
on_both_stores!(an_own_limit_below_the_cost_is_said_at_once);

/// A lookup answer past what a policy can count exactly (a token bucket
/// whose burst × window passes 2^52 µs, a sliding counter whose limit ×
/// window passes 2^51 ms) is a lookup error: the policy's own limit
/// applies, alike on both stores, never a wrapped or rounded one.
async fn an_uncountable_own_limit_is_a_lookup_error(tested: StoreUnderTest) {
    const DAY: Duration = Duration::from_secs(86_400);
    let bucket =
        Policy::new("bucket", 10, DAY).with_algorithm(slidegate::policy::Algorithm::TokenBucket);
    let counter =
        Policy::new("counter", 5, DAY).with_algorithm(slidegate::policy::Algorithm::SlidingCounter);
    let lookup = |_: &Key, policy: &Policy| {
        let answer = if policy.name() == "bucket" {
            1_000_000_000
        } else {
            4_000_000_000
        };
        async move { Some(answer) }
    };
    let policies = Policies::builder()
        .with_route("GET /bucket", bucket)
        .with_route("GET /counter", counter)
        .build()
        .unwrap();
    let layer = RateLimitLayer::new(tested.store, clients(), policies).with_limit_lookup(lookup);
    let app = Router::new()
        .route("/bucket", get(|| async { "bucket" }))
        .route("/counter", get(|| async { "counter" }))
        .route_layer(layer);
    for (path, limit) in [("/bucket", 10), ("/counter", 5)] {
        let mut admitted = 0;
        for _ in 0..20 {
            let reply = send(
                &app,
                Request::get(path)
                    .header("x-client", "big")
                    .body(Body::empty())
                    .unwrap(),
            )
            .await;
            assert_eq!(
                reply.header("x-ratelimit-limit"),
                Some(&*limit.to_string()),
                "{path}"
            );
            admitted += usize::from(reply.status == StatusCode::OK);
        }
        assert_eq!(admitted, limit, "{path}: the policy's own limit");
    }
}
on_both_stores!(an_uncountable_own_limit_is_a_lookup_error);

async fn the_layer_peeks_at_and_resets_one_client(tested: StoreUnderTest) {
    let policy = Policy::new("search", 3, MINUTE).with_block(Duration::from_secs(600));
    let layer = RateLimitLayer::new(tested.store, clients(), Policies::single(policy).unwrap());
    let app = app(layer.clone());
    assert_eq!(admitted(&app, "mallory", 10).await, 3);
    let blocked = layer.peek("search", &key("mallory"), None).await.unwrap();
    assert_eq!((blocked.limit(), blocked.remaining()), (3, 0));
    assert!(!blocked.admitted());
    // Denied and blocked; the deny cache (on Redis) answers the next ones.
    assert_eq!(
        send(&app, request("mallory")).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    layer.reset("search", &key("mallory")).await.unwrap();
    let fresh = layer.peek("search", &key("mallory"), None).await.unwrap();
    assert_eq!(fresh.remaining(), 3);
    assert_eq!(
        admitted(&app, "mallory", 10).await,
        3,
        "the block is gone too"
    );
    assert!(matches!(
        layer.peek("nope", &key("mallory"), None).await,
        Err(LimitError::UnknownPolicy(_))
    ));
    assert!(matches!(
        layer.reset("nope", &key("mallory")).await,
        Err(LimitError::UnknownPolicy(_))
    ));
}
on_both_stores!(the_layer_peeks_at_and_resets_one_client);

/// A lookup that turns slow keeps a client's own limit: past its TTL the
/// last answer is still served (and refreshed in the background), so a
/// restrictive limit is never lifted to the tier's meanwhile, and no
/// request waits for the slow lookup. A client whose first lookup timed
/// out gets the tier's limit, and is not asked again for a second.
#[tokio::test(start_paused = true)]
async fn a_slow_lookup_keeps_the_last_answer_and_failures_are_remembered() {
    let calls = Arc::new(AtomicUsize::new(0));
    let lookup = {
        let calls = calls.clone();
        move |key: &Key, _: &Policy| {
            let call = calls.fetch_add(1, Ordering::SeqCst);
            let answers = key == &self::key("alice") && call == 0;
            async move {
                if !answers {
                    // The database has become slow.
                    std::future::pending::<()>().await;
                }
                Some(2)
            }
        }
    };
    let policies = Policies::single(Policy::new("search", 100, Duration::from_secs(3600))).unwrap();
    let store = slidegate::store::MemoryStore::new();
    let layer = RateLimitLayer::new(store, clients(), policies)
        .with_limit_lookup(lookup)
        .with_limit_lookup_ttl(MINUTE)
        .with_lookup_timeout(Duration::from_millis(50));
    let app = app(layer);
    assert_eq!(admitted(&app, "alice", 10).await, 2, "her own limit");
    tokio::time::advance(2 * MINUTE).await;
    let started = tokio::time::Instant::now();
    let reply = send(&app, request("alice")).await;
    assert_eq!(
        reply.status,
        StatusCode::TOO_MANY_REQUESTS,
        "still her own limit"
    );
    assert_eq!(reply.header("x-ratelimit-limit"), Some("2"));
    assert_eq!(
        started.elapsed(),
        Duration::ZERO,
        "no request waits for a refresh"
    );
    tokio::time::advance(Duration::from_millis(60)).await;
    assert_eq!(
        send(&app, request("alice")).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        calls.load(Ordering::SeqCst),
        3,
        "a refresh per lookup timeout"
    );

    // Bob's first lookup times out: the tier's limit, asked once a second.
    let before = calls.load(Ordering::SeqCst);
    let reply = send(&app, request("bob")).await;
    assert_eq!(reply.header("x-ratelimit-limit"), Some("100"));
    for _ in 0..10 {
        send(&app, request("bob")).await;
    }
    assert_eq!(
        calls.load(Ordering::SeqCst),
        before + 1,
        "the timeout is remembered"
    );
}
