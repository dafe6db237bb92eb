//! The deny cache: a flood from one denied client reaches Redis at most once
//! per retry period per process, and never denies what Redis would admit.

use std::time::Duration;

use crate::support::RedisServer;
use crate::support::reply::send;
use crate::support::stores::StoreUnderTest;
use axum::Router;
use axum::body::Body;
use axum::routing::get;
use http::{Request, StatusCode};
use slidegate::{
    Global, Policies, Policy, RateLimitLayer, clock::FakeClock, layer::DenyCache, policy::Cost,
    store::RedisStore,
};

use crate::support::stores::START;
const WINDOW: Duration = Duration::from_secs(10);

/// `FCALL` (or `EVALSHA`) calls that ran the script, from `INFO
/// commandstats` (the first call fails, for want of the function, and is
/// sent again after loading it).
pub(crate) fn script_calls(redis: &RedisServer) -> u64 {
    let stats = redis.cli(&["info", "commandstats"]);
    ["cmdstat_fcall:", "cmdstat_evalsha:"]
        .iter()
        .filter_map(|command| stats.lines().find_map(|line| line.strip_prefix(command)))
        .map(|line| {
            let field = |name: &str| -> u64 {
                line.trim()
                    .split(',')
                    .find_map(|pair| pair.strip_prefix(name)?.strip_prefix('='))
                    .map_or(0, |value| value.parse().unwrap())
            };
            field("calls") - field("failed_calls")
        })
        .sum()
}

/// A Redis store on `redis`, on `clock`.
fn store_on(redis: &RedisServer, clock: &FakeClock) -> RedisStore {
    RedisStore::builder(redis.pool(4))
        .with_clock(clock.clone())
        .with_timeout(Duration::from_secs(5))
        .build()
        .unwrap()
}

fn app(redis: &RedisServer, clock: &FakeClock, cache: bool) -> Router {
    let store = store_on(redis, clock);
    let policies = Policies::single(Policy::new("flood", 5, WINDOW)).unwrap();
    let layer = RateLimitLayer::new(store, Global, policies);
    let layer = if cache {
        layer.with_deny_cache(DenyCache::with_clock(1000, clock.clone()))
    } else {
        layer.with_deny_cache(None)
    };
    Router::new()
        .route("/", get(|| async { "ok" }))
        .route_layer(layer)
}

async fn get_status(app: &Router) -> StatusCode {
    send(app, Request::get("/").body(Body::empty()).unwrap())
        .await
        .status
}

#[tokio::test]
async fn a_denied_flood_reaches_redis_once_per_retry_period() {
    let redis = RedisServer::start();
    let clock = FakeClock::new(START);
    let app = app(&redis, &clock, true);
    // A flood of 1000 requests a second for 30 s from one client allowed
    // 5 per 10 s: denied most of the time, with a retry period of 10 s.
    let before = script_calls(&redis);
    let (mut admitted, mut denied) = (0u64, 0u64);
    for _ in 0..30_000 {
        match get_status(&app).await {
            StatusCode::OK => admitted += 1,
            StatusCode::TOO_MANY_REQUESTS => denied += 1,
            other => panic!("unexpected {other}"),
        }
        clock.advance(Duration::from_millis(1));
    }
    let calls = script_calls(&redis) - before;
    eprintln!(
        "30,000 requests in 30 s from one client, limit 5 per 10 s: {admitted} admitted, \
         {denied} denied, {calls} script calls"
    );
    assert_eq!(admitted, 15, "three windows' worth");
    // Each admitted request is a call; each 10 s retry period one more.
    assert_eq!(calls, admitted + 3, "one round trip per denial period");

    // The same flood without the cache: every request is a round trip.
    let uncached = app_without_cache(&redis, &clock);
    let before = script_calls(&redis);
    for _ in 0..1000 {
        get_status(&uncached).await;
    }
    assert_eq!(script_calls(&redis) - before, 1000);
}

fn app_without_cache(redis: &RedisServer, clock: &FakeClock) -> Router {
    app(redis, clock, false)
}

#[tokio::test]
async fn the_cache_answers_until_the_retry_time_and_not_a_microsecond_longer() {
    let redis = RedisServer::start();
    let clock = FakeClock::new(START);
    let app = app(&redis, &clock, true);
    for _ in 0..5 {
        assert_eq!(get_status(&app).await, StatusCode::OK);
    }
    let denied = send(&app, Request::get("/").body(Body::empty()).unwrap()).await;
    assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(denied.header("retry-after"), Some("10"));

    clock.advance(Duration::from_secs(4));
    let calls = script_calls(&redis);
    let cached = send(&app, Request::get("/").body(Body::empty()).unwrap()).await;
    assert_eq!(script_calls(&redis), calls, "answered from the cache");
    assert_eq!(cached.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(cached.header("retry-after"), Some("6"), "counts down");
    assert_eq!(cached.header("x-ratelimit-remaining"), Some("0"));
    assert_eq!(cached.json()["policy"], "flood");

    clock.advance(Duration::from_secs(6) - Duration::from_micros(1));
    assert_eq!(get_status(&app).await, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(script_calls(&redis), calls);
    clock.advance(Duration::from_micros(1));
    assert_eq!(get_status(&app).await, StatusCode::OK, "Redis admits at T");
    assert_eq!(script_calls(&redis), calls + 1);
}

/// `GET /` on a route that always fails (401), under `policy`.
fn failing_app(layer: RateLimitLayer) -> Router {
    Router::new()
        .route("/", get(|| async { StatusCode::UNAUTHORIZED }))
        .route_layer(layer)
}

/// A client blocked by a policy that counts failures only is answered
/// from the cache while its block lasts: a refund frees a count, never a
/// block, so 50 requests while blocked cost no script call.
#[tokio::test]
async fn a_block_under_count_failures_is_cached_while_it_lasts() {
    let redis = RedisServer::start();
    let clock = FakeClock::new(START);
    let store = store_on(&redis, &clock);
    let policy = Policy::new("login", 3, WINDOW)
        .with_count(slidegate::policy::Count::Failures)
        .with_block(Duration::from_secs(60));
    let layer = RateLimitLayer::new(store, Global, Policies::single(policy).unwrap())
        .with_deny_cache(DenyCache::with_clock(1000, clock.clone()));
    let app = failing_app(layer);
    for _ in 0..3 {
        assert_eq!(get_status(&app).await, StatusCode::UNAUTHORIZED);
    }
    assert_eq!(get_status(&app).await, StatusCode::TOO_MANY_REQUESTS);
    let before = script_calls(&redis);
    for _ in 0..50 {
        assert_eq!(get_status(&app).await, StatusCode::TOO_MANY_REQUESTS);
        clock.advance(Duration::from_secs(1));
    }
    assert_eq!(
        script_calls(&redis) - before,
        0,
        "the block is answered locally"
    );
    // 50 s into a block of 60: the cache answers until its last µs.
    clock.advance(Duration::from_secs(10) - Duration::from_micros(1));
    assert_eq!(get_status(&app).await, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(script_calls(&redis) - before, 0);
    clock.advance(Duration::from_micros(1));
    assert_eq!(
        get_status(&app).await,
        StatusCode::UNAUTHORIZED,
        "the block is over"
    );
    assert_eq!(script_calls(&redis) - before, 1);
}

/// A reload that takes `block` off a policy lifts its blocks on both
/// stores alike, and the deny cache does not answer for the old policy.
async fn a_reload_without_block_lifts_blocks(tested: StoreUnderTest) {
    let clock = tested.clock.clone().expect("a fake clock");
    let second = Duration::from_secs(1);
    let blocking = Policy::new("lifted", 2, second).with_block(Duration::from_secs(600));
    let layer = RateLimitLayer::new(tested.store, Global, Policies::single(blocking).unwrap())
        .with_deny_cache(DenyCache::with_clock(1000, clock.clone()));
    let handle = layer.policies_handle();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .route_layer(layer);
    assert_eq!(get_status(&app).await, StatusCode::OK);
    assert_eq!(get_status(&app).await, StatusCode::OK);
    assert_eq!(get_status(&app).await, StatusCode::TOO_MANY_REQUESTS);
    clock.advance(2 * second);
    assert_eq!(
        get_status(&app).await,
        StatusCode::TOO_MANY_REQUESTS,
        "blocked"
    );
    handle
        .replace(Policies::single(Policy::new("lifted", 2, second)).unwrap())
        .unwrap();
    assert_eq!(get_status(&app).await, StatusCode::OK, "no block any more");
    let _redis = tested.redis;
}
on_both_stores!(a_reload_without_block_lifts_blocks, fake_clock);

/// Two layers of other namespaces sharing one deny cache keep their
/// denials apart: one client denied under `admin` is not denied under
/// `public` for a policy of the same name.
#[tokio::test]
async fn one_cache_keeps_namespaces_apart() {
    let redis = RedisServer::start();
    let clock = FakeClock::new(START);
    let store = store_on(&redis, &clock);
    let cache = DenyCache::with_clock(1000, clock.clone());
    let layer = |namespace: &str| {
        let policies = Policies::single(Policy::new("api", 1, WINDOW)).unwrap();
        RateLimitLayer::new(store.clone(), Global, policies)
            .with_namespace(namespace)
            .with_deny_cache(cache.clone())
    };
    let admin = Router::new()
        .route("/", get(|| async { "ok" }))
        .route_layer(layer("admin"));
    let public = Router::new()
        .route("/", get(|| async { "ok" }))
        .route_layer(layer("public"));
    assert_eq!(get_status(&admin).await, StatusCode::OK);
    assert_eq!(get_status(&admin).await, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(get_status(&public).await, StatusCode::OK, "its own count");
}

/// What is answered before a cached denial: a cost above the limit (422,
/// since waiting would not help) and a request every policy exempts (it
/// passes). Neither reaches Redis, and neither is taken for the cached
/// denial; every other request of the client is the cache's to answer.
#[tokio::test]
async fn a_cost_above_the_limit_and_an_exempt_request_come_before_a_cached_denial() {
    let redis = RedisServer::start();
    let clock = FakeClock::new(START);
    let store = store_on(&redis, &clock);
    let cost = |parts: &http::request::Parts, _: &Policy| match parts.headers.get("x-cost") {
        Some(value) if value == "exempt" => Cost::Exempt,
        Some(value) => Cost::Units(value.to_str().unwrap().parse().unwrap()),
        None => Cost::Policy,
    };
    let layer = RateLimitLayer::new(
        store,
        Global,
        Policies::single(Policy::new("api", 2, WINDOW)).unwrap(),
    )
    .with_request_cost(cost)
    .with_deny_cache(DenyCache::with_clock(1000, clock.clone()));
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .route_layer(layer);
    let costing = |cost: Option<&str>| {
        let request = Request::get("/");
        let request = match cost {
            Some(cost) => request.header("x-cost", cost),
            None => request,
        };
        request.body(Body::empty()).unwrap()
    };
    assert_eq!(send(&app, costing(None)).await.status, StatusCode::OK);
    assert_eq!(send(&app, costing(None)).await.status, StatusCode::OK);
    assert_eq!(
        send(&app, costing(None)).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    let before = script_calls(&redis);
    let answers = [
        (
            Some("3"),
            StatusCode::UNPROCESSABLE_ENTITY,
            "above the limit",
        ),
        (Some("exempt"), StatusCode::OK, "exempt"),
        (None, StatusCode::TOO_MANY_REQUESTS, "the policy's cost"),
        (Some("1"), StatusCode::TOO_MANY_REQUESTS, "one unit"),
        (Some("2"), StatusCode::TOO_MANY_REQUESTS, "the whole limit"),
    ];
    for (cost, status, why) in answers {
        assert_eq!(send(&app, costing(cost)).await.status, status, "{why}");
    }
    assert_eq!(script_calls(&redis), before, "Redis was not asked");
}
