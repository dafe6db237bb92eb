//! Several layers on one store: in namespaces they count apart; without,
//! a policy name is one budget when its policies count alike, and two
//! limits under one name are refused instead of mixed.

use std::net::SocketAddr;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use http::{Request, StatusCode};
use slidegate::policy::PolicyError;
use slidegate::store::{MemoryStore, RedisStore, Store};
use slidegate::{PeerIp, Policies, Policy, RateLimitLayer};
use tower::ServiceExt;

use crate::support::RedisServer;

const MINUTE: Duration = Duration::from_secs(60);

fn api(limit: u32) -> Policies {
    Policies::single(Policy::new("api", limit, MINUTE)).unwrap()
}

fn app(layer: RateLimitLayer) -> Router {
    Router::new()
        .route("/", get(|| async { "ok" }))
        .route_layer(layer)
}

async fn status(app: &Router) -> StatusCode {
    let mut request = Request::get("/").body(Body::empty()).unwrap();
    let peer: SocketAddr = "192.0.2.1:1".parse().unwrap();
    request.extensions_mut().insert(ConnectInfo(peer));
    app.clone().oneshot(request).await.unwrap().status()
}

/// The statuses of `count` requests to `app`, as `200`s admitted.
async fn admitted(app: &Router, count: usize) -> usize {
    let mut admitted = 0;
    for _ in 0..count {
        if status(app).await == StatusCode::OK {
            admitted += 1;
        }
    }
    admitted
}

async fn count_apart_in_namespaces(store: impl Store + Clone) {
    let public =
        app(RateLimitLayer::new(store.clone(), PeerIp::new(), api(5)).with_namespace("public"));
    let admin = app(RateLimitLayer::new(store, PeerIp::new(), api(2)).with_namespace("admin"));
    assert_eq!(admitted(&admin, 4).await, 2, "the admin limit");
    assert_eq!(
        admitted(&public, 7).await,
        5,
        "the admin layer's requests are not the public layer's"
    );
}

#[tokio::test]
async fn layers_in_namespaces_count_apart_in_memory() {
    count_apart_in_namespaces(MemoryStore::new()).await;
}

#[tokio::test]
async fn layers_in_namespaces_count_apart_on_redis_under_their_own_keys() {
    let server = RedisServer::start();
    let store = RedisStore::new(server.pool(4));
    count_apart_in_namespaces(store).await;
    let mut keys: Vec<String> = server
        .cli(&["--scan", "--pattern", "slidegate:*"])
        .lines()
        .map(str::to_owned)
        .collect();
    keys.sort();
    assert_eq!(
        keys,
        [
            "slidegate:admin:api:{ip:192.0.2.1}:l",
            "slidegate:public:api:{ip:192.0.2.1}:l"
        ]
    );
}

#[tokio::test]
async fn layers_with_policies_that_count_alike_share_one_budget() {
    let store = MemoryStore::new();
    let first = app(RateLimitLayer::new(store.clone(), PeerIp::new(), api(4)));
    let second = app(RateLimitLayer::new(store, PeerIp::new(), api(4)));
    assert_eq!(admitted(&first, 3).await, 3);
    assert_eq!(admitted(&second, 3).await, 1, "one budget of 4 in all");
}

#[test]
fn a_second_layer_giving_a_name_another_limit_is_refused_while_the_first_lives() {
    let store = MemoryStore::new();
    let first = app(RateLimitLayer::new(store.clone(), PeerIp::new(), api(100)));
    let clash = RateLimitLayer::new(store.clone(), PeerIp::new(), api(10));
    let refused = catch_unwind(AssertUnwindSafe(|| app(clash.clone())))
        .expect_err("the second layer is refused");
    let message = refused
        .downcast_ref::<String>()
        .expect("a formatted panic message");
    assert!(
        message.contains("policy `api` counts as 100 per 1m (SlidingLog) in another layer")
            && message.contains("would count as 10 per 1m (SlidingLog) here")
            && message.contains("RateLimitLayer::with_namespace"),
        "{message}"
    );

    // Another store, or another namespace, is another place.
    let _elsewhere = app(RateLimitLayer::new(
        MemoryStore::new(),
        PeerIp::new(),
        api(10),
    ));
    let _apart = app(clash.clone().with_namespace("admin"));

    // Once the first layer is gone, nothing shares the name.
    drop(first);
    let _second = app(clash);
}

#[test]
fn a_reload_that_would_mix_two_limits_is_refused_and_changes_nothing() {
    let store = MemoryStore::new();
    let first = RateLimitLayer::new(store.clone(), PeerIp::new(), api(100));
    let second = RateLimitLayer::new(store, PeerIp::new(), api(100));
    let _served = (app(first.clone()), app(second.clone()));

    let handle = second.policies_handle();
    let conflict = handle.replace(api(10)).unwrap_err();
    assert!(
        matches!(&conflict, PolicyError::SharedName { name, .. } if name == "api"),
        "{conflict}"
    );
    assert_eq!(conflict.field(), "name");
    assert_eq!(handle.current().iter().next().unwrap().limit(), 100);

    // A change that keeps the meaning, or a new name, is taken.
    let other = Policies::single(Policy::new("other", 10, MINUTE)).unwrap();
    handle.replace(other).unwrap();
    assert_eq!(handle.current().iter().next().unwrap().name(), "other");
}

#[test]
fn a_bad_namespace_is_refused_with_its_rules() {
    let layer = RateLimitLayer::new(MemoryStore::new(), PeerIp::new(), api(1));
    let refused = catch_unwind(AssertUnwindSafe(|| layer.with_namespace("a:b")))
        .expect_err("a colon would blur the key's parts");
    let message = refused.downcast_ref::<String>().unwrap();
    assert!(message.contains("namespace `a:b` must be"), "{message}");
}
