//! Slices (`Policy::with_slice`): an instance answers a hot client from
//! units taken from Redis ahead, within the bound the policy's docs
//! state, and close to the client across a slow link.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use http::{Request, StatusCode};
use slidegate::deadpool_redis::Pool;
use slidegate::policy::{Algorithm, Count, FailMode};
use slidegate::{Global, Policies, Policy, RateLimitLayer, store::RedisStore};

use crate::deny_cache::script_calls;
use crate::support::RedisServer;
use crate::support::reply::send;
use crate::support::slow_link::SlowLink;

fn app_on(pool: Pool, policy: Policy) -> Router {
    router(layer_on(pool, policy))
}

fn layer_on(pool: Pool, policy: Policy) -> RateLimitLayer {
    let store = RedisStore::builder(pool)
        .with_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    RateLimitLayer::new(store, Global, Policies::single(policy).unwrap())
}

fn router(layer: RateLimitLayer) -> Router {
    Router::new()
        .route("/", get(|| async { "ok" }))
        .route_layer(layer)
}

async fn get_status(app: &Router) -> (StatusCode, Option<u32>) {
    let reply = send(app, Request::get("/").body(Body::empty()).unwrap()).await;
    let remaining = reply
        .header("x-ratelimit-remaining")
        .map(|value| value.parse().unwrap());
    (reply.status, remaining)
}

/// `count` requests at once, each on its task: every one admitted.
async fn all_admitted_at_once(app: &Router, count: usize) {
    let requests: Vec<_> = (0..count)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move { get_status(&app).await.0 })
        })
        .collect();
    for request in requests {
        assert_eq!(request.await.unwrap(), StatusCode::OK);
    }
}

#[tokio::test]
async fn a_hot_client_costs_one_store_call_per_slice() {
    let redis = RedisServer::start();
    let policy = Policy::new("hot", 100_000, Duration::from_secs(60)).with_slice(100);
    let app = app_on(redis.pool(4), policy);
    let before = script_calls(&redis);
    let mut last = u32::MAX;
    for _ in 0..1_000 {
        let (status, remaining) = get_status(&app).await;
        assert_eq!(status, StatusCode::OK);
        let remaining = remaining.unwrap();
        assert!(
            remaining < last,
            "remaining counts down: {remaining} after {last}"
        );
        last = remaining;
    }
    let calls = script_calls(&redis) - before;
    // One call per slice of 100, and a give-back for each slice that
    // ages out (a second) before it is spent: a slow machine sees a few;
    // without slices, 1,000 calls.
    assert!(
        (10..=30).contains(&calls),
        "{calls} store calls for 1,000 requests"
    );
    assert_eq!(
        last,
        100_000 - 1_000,
        "what the store had left, and the slice"
    );
}

#[tokio::test]
async fn concurrent_requests_that_find_no_slice_wait_for_one_call() {
    let redis = RedisServer::start();
    let policy = Policy::new("hot", 10_000, Duration::from_secs(60)).with_slice(100);
    let app = app_on(redis.pool(8), policy);
    let before = script_calls(&redis);
    all_admitted_at_once(&app, 50).await;
    assert_eq!(
        script_calls(&redis) - before,
        1,
        "one slice for 50 requests"
    );
}

#[tokio::test]
async fn near_the_limit_a_slice_is_what_the_store_has_left() {
    let redis = RedisServer::start();
    let policy = || Policy::new("hot", 25, Duration::from_secs(60)).with_slice(10);
    let (one, other) = (
        app_on(redis.pool(2), policy()),
        app_on(redis.pool(2), policy()),
    );
    // Two slices of 10 each, then the last 5 units as one smaller slice.
    for _ in 0..10 {
        assert_eq!(get_status(&one).await.0, StatusCode::OK);
    }
    for _ in 0..10 {
        assert_eq!(get_status(&other).await.0, StatusCode::OK);
    }
    for _ in 0..5 {
        assert_eq!(get_status(&one).await.0, StatusCode::OK);
    }
    assert_eq!(get_status(&one).await.0, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(get_status(&other).await.0, StatusCode::TOO_MANY_REQUESTS);
}

/// Units unused in a slice go back when it ages out (a tenth of the
/// window, at most a second), long before they would leave the window.
#[tokio::test]
async fn unused_units_go_back_when_the_slice_ages_out() {
    let redis = RedisServer::start();
    let window = Duration::from_secs(20);
    let policy = || Policy::new("hot", 20, window).with_slice(15);
    let one = app_on(redis.pool(2), policy());
    let other = router(layer_on(redis.pool(2), policy()).with_deny_cache(None));
    let start = Instant::now();
    assert_eq!(get_status(&one).await.0, StatusCode::OK);
    // The other instance can take the 5 left now, and the 14 `one` did
    // not use once its slice has aged out.
    let (status, remaining) = get_status(&other).await;
    assert_eq!((status, remaining), (StatusCode::OK, Some(4)));
    let mut admitted = 1;
    while admitted < 19 {
        assert!(
            start.elapsed() < window / 2,
            "{admitted} admitted: the unused units did not come back"
        );
        match get_status(&other).await.0 {
            StatusCode::OK => admitted += 1,
            StatusCode::TOO_MANY_REQUESTS => tokio::time::sleep(Duration::from_millis(20)).await,
            status => panic!("{status}"),
        }
    }
    assert_eq!(get_status(&other).await.0, StatusCode::TOO_MANY_REQUESTS);
}

/// While Redis is down, the slice in hand is spent; then the policy's fail
/// mode answers.
#[tokio::test]
async fn a_store_that_goes_down_leaves_the_slice_in_hand_then_the_fail_mode() {
    let mut redis = RedisServer::start();
    let policy = Policy::new("hot", 1_000, Duration::from_secs(60))
        .with_slice(20)
        .with_fail_mode(FailMode::Closed);
    let app = app_on(redis.pool(2), policy);
    assert_eq!(get_status(&app).await.0, StatusCode::OK);
    redis.kill();
    for _ in 0..19 {
        assert_eq!(get_status(&app).await.0, StatusCode::OK);
    }
    assert_eq!(get_status(&app).await.0, StatusCode::SERVICE_UNAVAILABLE);
}

/// Under `count = "failures"`, every success is refunded: the units of a
/// request answered from a slice go back into it, and those of a request
/// the store decided alone (more requests at once than a slice's worth)
/// go back to the store. Once the slices have aged out, nothing is
/// counted.
#[tokio::test]
async fn successes_not_counted_go_back_whichever_way_they_were_admitted() {
    let redis = RedisServer::start();
    let policy = Policy::new("hot", 10_000, Duration::from_secs(60))
        .with_slice(5)
        .with_count(Count::Failures);
    let layer = layer_on(redis.pool(8), policy);
    let app = router(layer.clone());
    all_admitted_at_once(&app, 40).await;
    let key = slidegate::key::Key::parse("global").unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let left = layer.peek("hot", &key, None).await.unwrap().remaining();
        if left == 10_000 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{} successes still counted",
            10_000 - left
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Times of one admitted request: it was decided between them.
#[derive(Clone, Copy)]
struct Admitted {
    sent: Instant,
    answered: Instant,
}

/// Requests from `clients` tasks on each app for `duration`, bounded in
/// count too: the admitted ones, and every request's wait.
async fn load(
    apps: &[Router],
    clients: usize,
    duration: Duration,
) -> (Vec<Admitted>, Vec<Duration>) {
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for app in apps {
        for _ in 0..clients {
            let (app, stop) = (app.clone(), stop.clone());
            tasks.push(tokio::spawn(async move {
                let (mut admitted, mut waits) = (Vec::new(), Vec::new());
                for _ in 0..200_000 {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let sent = Instant::now();
                    let (status, _) = get_status(&app).await;
                    let answered = Instant::now();
                    waits.push(answered - sent);
                    match status {
                        StatusCode::OK => admitted.push(Admitted { sent, answered }),
                        StatusCode::TOO_MANY_REQUESTS => {}
                        status => panic!("{status}"),
                    }
                }
                (admitted, waits)
            }));
        }
    }
    tokio::time::sleep(duration).await;
    stop.store(true, Ordering::Relaxed);
    let (mut admitted, mut waits) = (Vec::new(), Vec::new());
    for task in tasks {
        let (a, w) = task.await.unwrap();
        admitted.extend(a);
        waits.extend(w);
    }
    admitted.sort_by_key(|a| a.sent);
    (admitted, waits)
}

/// The most requests surely admitted within one window: sent and
/// answered inside it, over the windows starting at each request.
fn most_in_a_window(admitted: &[Admitted], window: Duration) -> usize {
    (0..admitted.len())
        .map(|i| {
            let end = admitted[i].sent + window;
            admitted[i..]
                .iter()
                .take_while(|a| a.sent < end)
                .filter(|a| a.answered <= end)
                .count()
        })
        .max()
        .unwrap_or(0)
}

fn median(mut waits: Vec<Duration>) -> Duration {
    waits.sort();
    waits[waits.len() / 2]
}

/// Two instances on one Redis, each hammering one client's sliced limit:
/// every window admits at most `L + I × (n − 1)`, and `k` whole windows
/// at least `k × (L − 2 × I × n)`, as `Policy::with_slice` states.
#[tokio::test]
async fn two_instances_stay_within_the_stated_bound() {
    const LIMIT: u32 = 100;
    const SLICE: u32 = 10;
    const INSTANCES: u32 = 2;
    let window = Duration::from_secs(2);
    let redis = RedisServer::start();
    for algorithm in [Algorithm::SlidingLog, Algorithm::TokenBucket] {
        redis.cli(&["flushall"]);
        let policy = || {
            Policy::new("shared", LIMIT, window)
                .with_algorithm(algorithm)
                .with_slice(SLICE)
        };
        let apps: Vec<_> = (0..INSTANCES)
            .map(|_| app_on(redis.pool(4), policy()))
            .collect();
        let run = Duration::from_secs(5);
        let (admitted, _) = load(&apps, 4, run).await;
        let most = most_in_a_window(&admitted, window);
        // A bucket may admit its burst and a window's refill within one
        // window.
        let burst = if algorithm == Algorithm::TokenBucket {
            LIMIT
        } else {
            0
        };
        let over = (burst + LIMIT + INSTANCES * (SLICE - 1)) as usize;
        assert!(
            most <= over,
            "{algorithm:?}: {most} admitted in a window, bound {over}"
        );
        let whole_windows = (run.as_secs_f64() / window.as_secs_f64()).floor() as usize;
        let under = whole_windows * (LIMIT - 2 * INSTANCES * SLICE) as usize;
        eprintln!(
            "{algorithm:?}: at most {most} in a window (bound {over}), {} in {run:?} (bound {under})",
            admitted.len()
        );
        assert!(
            admitted.len() >= under,
            "{algorithm:?}: {} admitted over {whole_windows} windows, bound {under}",
            admitted.len()
        );
        assert!(
            most >= LIMIT as usize / 2,
            "{algorithm:?}: the load reached the limit"
        );
    }
}

/// Three regions reach one Redis over links of 60 ms each way: with a
/// slice, a request's median wait is local and the count stays within
/// the bound; without, every request waits a round trip.
#[tokio::test]
async fn three_regions_on_a_slow_link_wait_locally_within_the_bound() {
    const LIMIT: u32 = 300;
    const SLICE: u32 = 20;
    const REGIONS: u32 = 3;
    let delay = Duration::from_millis(60);
    let window = Duration::from_secs(3);
    let redis = RedisServer::start();
    let links = [
        SlowLink::start(redis.port(), delay).await,
        SlowLink::start(redis.port(), delay).await,
        SlowLink::start(redis.port(), delay).await,
    ];
    let regions = |slice: Option<u32>| -> Vec<Router> {
        links
            .iter()
            .map(|link| {
                let policy = Policy::new("global", LIMIT, window);
                let policy = match slice {
                    Some(slice) => policy.with_slice(slice),
                    None => policy,
                };
                app_on(link.pool(4), policy)
            })
            .collect()
    };

    let sliced = regions(Some(SLICE));
    let (admitted, waits) = load(&sliced, 4, Duration::from_secs(5)).await;
    let most = most_in_a_window(&admitted, window);
    let over = (LIMIT + REGIONS * (SLICE - 1)) as usize;
    assert!(most <= over, "{most} admitted in a window, bound {over}");
    assert!(
        most >= LIMIT as usize / 2,
        "the load reached the limit: {most}"
    );
    let sliced_wait = median(waits);
    assert!(
        sliced_wait < delay,
        "median wait with slices {sliced_wait:?}"
    );

    redis.cli(&["flushall"]);
    let exact = regions(None);
    let (_, waits) = load(&exact, 2, Duration::from_secs(2)).await;
    let exact_wait = median(waits);
    assert!(
        exact_wait >= 2 * delay,
        "median wait without slices {exact_wait:?}"
    );
    eprintln!(
        "median wait: {sliced_wait:?} with slices, {exact_wait:?} without; most in a window {most}"
    );
}

/// A policy in shadow mode takes and spends slices like any other, and
/// lets every request through.
#[tokio::test]
async fn a_shadow_policy_with_a_slice_counts_and_never_denies() {
    let redis = RedisServer::start();
    let policy = Policy::new("watched", 5, Duration::from_secs(60))
        .with_slice(2)
        .with_shadow(true);
    let app = app_on(redis.pool(2), policy);
    let before = script_calls(&redis);
    let mut remaining = Vec::new();
    for _ in 0..8 {
        let (status, left) = get_status(&app).await;
        assert_eq!(status, StatusCode::OK);
        remaining.push(left.unwrap());
    }
    // Slices of 2, 2 and the last 1, then denials counted and let through.
    assert_eq!(remaining[..5], [4, 3, 2, 1, 0]);
    assert!(remaining[5..].iter().all(|&left| left == 0));
    assert!(script_calls(&redis) - before >= 3);
}

/// On the memory store a slice changes nothing: two layers on one store
/// count exactly, request by request.
#[tokio::test]
async fn on_the_memory_store_a_slice_changes_nothing() {
    let store = slidegate::store::MemoryStore::new();
    let policy = || Policies::single(Policy::new("hot", 6, Duration::from_secs(60)).with_slice(3));
    let one = router(RateLimitLayer::new(
        store.clone(),
        Global,
        policy().unwrap(),
    ));
    let other = router(RateLimitLayer::new(store, Global, policy().unwrap()));
    for left in (0..6).rev() {
        let app = if left % 2 == 0 { &one } else { &other };
        assert_eq!(get_status(app).await, (StatusCode::OK, Some(left)));
    }
    assert_eq!(get_status(&one).await.0, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(get_status(&other).await.0, StatusCode::TOO_MANY_REQUESTS);
}

/// A layer whose policies take no slice calls the store for every
/// request; a reload that brings a slice puts the slices in front of the
/// store at once: from the next request on, one call serves a slice.
#[tokio::test]
async fn a_reload_that_brings_a_slice_serves_slices_from_the_next_request() {
    let redis = RedisServer::start();
    let plain = Policy::new("reloaded", 100_000, Duration::from_secs(60));
    let layer = layer_on(redis.pool(4), plain.clone());
    let handle = layer.policies_handle();
    let app = router(layer);
    let before = script_calls(&redis);
    for _ in 0..20 {
        assert_eq!(get_status(&app).await.0, StatusCode::OK);
    }
    assert_eq!(script_calls(&redis) - before, 20, "a call per request");

    handle
        .replace(Policies::single(plain.with_slice(100)).unwrap())
        .unwrap();
    let before = script_calls(&redis);
    for _ in 0..50 {
        assert_eq!(get_status(&app).await.0, StatusCode::OK);
    }
    // One call for the slice, and on a slow machine a give-back and a
    // new slice for each second the 50 requests took; without slices, 50.
    let calls = script_calls(&redis) - before;
    assert!(
        calls <= 10,
        "{calls} calls for 50 requests in slices of 100"
    );
}
