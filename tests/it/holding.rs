//! Holding a request instead of denying it, on both stores: a held
//! request is counted when it is admitted, so no window ever holds more
//! than the limit, however many wait; a client that goes away frees its
//! place; and the held requests are bounded.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::support::reply::send;
use crate::support::stores::StoreUnderTest;
use axum::Router;
use axum::body::Body;
use axum::routing::get;
use http::{Request, StatusCode};
use slidegate::{Global, Policies, Policy, RateLimitLayer};

/// When the handler was entered, request by request.
type Entries = Arc<Mutex<Vec<Instant>>>;

fn app(layer: RateLimitLayer, entries: Entries) -> Router {
    Router::new()
        .route(
            "/",
            get(move || {
                let entries = entries.clone();
                async move {
                    entries.lock().unwrap().push(Instant::now());
                    "ok"
                }
            }),
        )
        .route_layer(layer)
}

fn request() -> Request<Body> {
    Request::get("/").body(Body::empty()).unwrap()
}

async fn a_request_that_fits_soon_is_held_then_admitted(tested: StoreUnderTest) {
    let window = Duration::from_millis(300);
    let policy = Policy::new("held", 2, window).with_delay(Duration::from_millis(500));
    let layer = RateLimitLayer::new(tested.store, Global, Policies::single(policy).unwrap());
    let entries = Entries::default();
    let app = app(layer, entries.clone());
    for _ in 0..2 {
        assert_eq!(send(&app, request()).await.status, StatusCode::OK);
    }
    let first = entries.lock().unwrap()[0];
    let held = send(&app, request()).await;
    assert_eq!(held.status, StatusCode::OK, "held, then admitted");
    let admitted = *entries.lock().unwrap().last().unwrap();
    assert!(
        admitted.duration_since(first) >= window,
        "admitted only once the first request left the window"
    );
    // Counted when admitted: at most the limit in its window.
    let remaining: u32 = held
        .header("x-ratelimit-remaining")
        .unwrap()
        .parse()
        .unwrap();
    assert!(remaining < 2, "the held request is counted");
}
on_both_stores!(a_request_that_fits_soon_is_held_then_admitted);

async fn a_request_that_would_wait_too_long_is_denied_at_once(tested: StoreUnderTest) {
    let policy =
        Policy::new("long", 1, Duration::from_secs(60)).with_delay(Duration::from_millis(500));
    let layer = RateLimitLayer::new(tested.store, Global, Policies::single(policy).unwrap());
    let app = app(layer, Entries::default());
    assert_eq!(send(&app, request()).await.status, StatusCode::OK);
    let started = Instant::now();
    let denied = send(&app, request()).await;
    assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(denied.header("retry-after").is_some());
    assert!(started.elapsed() < Duration::from_millis(500), "not held");
}
on_both_stores!(a_request_that_would_wait_too_long_is_denied_at_once);

/// 600 requests at once on 10 per 300 ms, each held up to a second: those
/// admitted come in waves of at most 10 per window, never more.
async fn six_hundred_held_requests_never_pass_the_limit(tested: StoreUnderTest) {
    const LIMIT: usize = 10;
    let window = Duration::from_millis(300);
    let policy = Policy::new("waves", LIMIT as u32, window).with_delay(Duration::from_secs(1));
    let layer = RateLimitLayer::new(tested.store, Global, Policies::single(policy).unwrap());
    let entries = Entries::default();
    let app = app(layer, entries.clone());
    let tasks: Vec<_> = (0..600)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move { send(&app, request()).await })
        })
        .collect();
    let (mut admitted, mut denied) = (0, 0);
    for task in tasks {
        let reply = task.await.unwrap();
        match reply.status {
            StatusCode::OK => admitted += 1,
            StatusCode::TOO_MANY_REQUESTS => {
                assert!(reply.header("retry-after").is_some());
                denied += 1;
            }
            other => panic!("unexpected {other}"),
        }
    }
    let mut times = entries.lock().unwrap().clone();
    times.sort();
    assert_eq!(times.len(), admitted);
    let span = times.last().unwrap().duration_since(times[0]);
    eprintln!("{admitted} admitted over {span:?}, {denied} denied");
    // A sliding window of `window` admits at most LIMIT in any window,
    // so over `span` at most LIMIT per started window.
    let windows = (span.as_micros() / window.as_micros()) as usize + 1;
    assert!(
        admitted <= LIMIT * windows,
        "{admitted} admitted in {windows} windows"
    );
    // The holding worked: more than the first wave got through.
    assert!(admitted > LIMIT, "only {admitted} admitted");
    // Each wave is a window after the one before: the eleventh request
    // after any admitted one came at least a window later (less the
    // scheduling between a store's admission and the handler).
    for pair in times.windows(LIMIT + 1) {
        let gap = pair[LIMIT].duration_since(pair[0]);
        assert!(
            gap >= window - Duration::from_millis(50),
            "{LIMIT} + 1 admitted within {gap:?}"
        );
    }
}
on_both_stores!(six_hundred_held_requests_never_pass_the_limit);

/// With room for one held request, a second is denied; once the client
/// of the first goes away, its place is free again.
async fn a_client_that_goes_away_frees_its_place(tested: StoreUnderTest) {
    let policy =
        Policy::new("one", 1, Duration::from_millis(400)).with_delay(Duration::from_secs(1));
    let layer =
        RateLimitLayer::new(tested.store, Global, Policies::single(policy).unwrap()).max_delayed(1);
    let app = app(layer.clone(), Entries::default());
    assert_eq!(send(&app, request()).await.status, StatusCode::OK);
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, request()).await }
    });
    held(&layer, 1).await;
    let started = Instant::now();
    let denied = send(&app, request()).await;
    assert_eq!(
        denied.status,
        StatusCode::TOO_MANY_REQUESTS,
        "no place left"
    );
    assert!(
        started.elapsed() < Duration::from_millis(300),
        "denied at once"
    );
    first.abort();
    let _ = first.await;
    held(&layer, 0).await;
    // The place is free: this one is held, and admitted once it fits.
    assert_eq!(send(&app, request()).await.status, StatusCode::OK);
    assert_eq!(layer.held(), 0);
}
on_both_stores!(a_client_that_goes_away_frees_its_place);

/// Waits (at most five seconds) until `layer` holds `count` requests.
async fn held(layer: &RateLimitLayer, count: usize) {
    let started = Instant::now();
    while layer.held() != count {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{} held, not {count}",
            layer.held()
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}
