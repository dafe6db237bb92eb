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
    // Taken before the first request is sent, so before the store counts
    // it: the first handler may run late (a slow reply), the count never
    // precedes this.
    let first_sent = Instant::now();
    for _ in 0..2 {
        assert_eq!(send(&app, request()).await.status, StatusCode::OK);
    }
    let held = send(&app, request()).await;
    assert_eq!(held.status, StatusCode::OK, "held, then admitted");
    let admitted = *entries.lock().unwrap().last().unwrap();
    assert!(
        admitted.duration_since(first_sent) >= window,
        "admitted only once the first request left the window: after {:?}",
        admitted.duration_since(first_sent)
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

/// How much later than the store's admission a handler may run.
const SCHEDULING: Duration = Duration::from_millis(50);

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
    // so over `span` at most LIMIT per started window. The handlers run a
    // little after the store admits (the scheduling of 600 tasks on a busy
    // machine), which may bring two waves up to SCHEDULING closer.
    let windows = ((span + SCHEDULING).as_micros() / window.as_micros()) as usize + 1;
    assert!(
        admitted <= LIMIT * windows,
        "{admitted} admitted in {windows} windows"
    );
    // The holding worked: more than the first wave got through.
    assert!(admitted > LIMIT, "only {admitted} admitted");
    // Each wave is a window after the one before: the eleventh request
    // after any admitted one came at least a window later (less the
    // scheduling).
    for pair in times.windows(LIMIT + 1) {
        let gap = pair[LIMIT].duration_since(pair[0]);
        assert!(
            gap >= window - SCHEDULING,
            "{LIMIT} + 1 admitted within {gap:?}"
        );
    }
}
on_both_stores!(six_hundred_held_requests_never_pass_the_limit);

/// With room for one held request, a second is denied; once the client
/// of the first goes away, its place is free again, and its units are
/// given back.
async fn a_client_that_goes_away_frees_its_place(tested: StoreUnderTest) {
    let policy =
        Policy::new("one", 1, Duration::from_millis(400)).with_delay(Duration::from_secs(1));
    let layer = RateLimitLayer::new(tested.store, Global, Policies::single(policy).unwrap())
        .with_max_delayed(1);
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
        StatusCode::SERVICE_UNAVAILABLE,
        "no place left"
    );
    assert!(
        started.elapsed() < Duration::from_millis(300),
        "denied at once"
    );
    first.abort();
    let _ = first.await;
    held(&layer, 0).await;
    // Its units are back (on a task of their own): the window holds the
    // first request alone, which leaves within its 400 ms, where the
    // units held for the slot after it would have left 400 ms later.
    let key = slidegate::key::Key::parse("global").unwrap();
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let now = layer.peek("one", &key, None).await.unwrap();
        if now
            .retry_after()
            .is_some_and(|wait| wait <= Duration::from_millis(400))
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the units stayed counted: {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The place is free: this one is held, and admitted once it fits.
    assert_eq!(send(&app, request()).await.status, StatusCode::OK);
    assert_eq!(layer.delayed(), 0);
}
on_both_stores!(a_client_that_goes_away_frees_its_place);

/// Waits (at most a minute) until `layer` holds `count` requests.
async fn held(layer: &RateLimitLayer, count: usize) {
    let started = Instant::now();
    while layer.delayed() != count {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{} held, not {count}",
            layer.delayed()
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Keys each request by its `x-client` header.
fn clients() -> impl slidegate::key::KeyExtractor {
    slidegate::Header::trusted(http::HeaderName::from_static("x-client")).with_public_values(true)
}

fn request_from(client: &str) -> Request<Body> {
    Request::get("/")
        .header("x-client", client)
        .body(Body::empty())
        .unwrap()
}

/// One client cannot fill the layer's places: it holds at most what its
/// own limit can grant within the delay (5 a second, held up to a second:
/// 5), and another client's request is still held, not denied.
async fn one_client_holds_only_what_its_limit_can_grant(tested: StoreUnderTest) {
    let policy = Policy::new("fair", 5, Duration::from_secs(1)).with_delay(Duration::from_secs(1));
    let layer = RateLimitLayer::new(tested.store, clients(), Policies::single(policy).unwrap())
        .with_max_delayed(20);
    let app = app(layer.clone(), Entries::default());
    let flood: Vec<_> = (0..45)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move { send(&app, request_from("greedy")).await.status })
        })
        .collect();
    held(&layer, 5).await;
    for _ in 0..5 {
        assert_eq!(
            send(&app, request_from("other")).await.status,
            StatusCode::OK
        );
    }
    let other = tokio::spawn({
        let app = app.clone();
        async move { send(&app, request_from("other")).await.status }
    });
    held(&layer, 6).await;
    let mut statuses = Vec::new();
    for task in flood {
        statuses.push(task.await.unwrap());
    }
    let admitted = statuses.iter().filter(|s| **s == StatusCode::OK).count();
    assert_eq!(
        admitted, 10,
        "5 at once, 5 held then admitted: {statuses:?}"
    );
    assert_eq!(other.await.unwrap(), StatusCode::OK, "held, then admitted");
    assert_eq!(layer.delayed(), 0);
}
on_both_stores!(one_client_holds_only_what_its_limit_can_grant);

/// Clients that fill the layer's places (here two identities, each with
/// a request held) never push another client toward its block: each of
/// its requests the layer has no room to hold is answered 503 with its
/// units given back, where they once stayed counted (429) until its next
/// slot lay beyond the delay and a denial blocked it for a minute. Once
/// the places are free, its request is held, not blocked.
async fn others_filling_the_layer_never_block_a_client(tested: StoreUnderTest) {
    let policy = Policy::new("blocking", 1, Duration::from_secs(10))
        .with_delay(Duration::from_secs(30))
        .with_block(Duration::from_secs(60));
    let layer = RateLimitLayer::new(tested.store, clients(), Policies::single(policy).unwrap())
        .with_max_delayed(2);
    let app = app(layer.clone(), Entries::default());
    let mut fillers = Vec::new();
    for client in ["a", "b"] {
        assert_eq!(
            send(&app, request_from(client)).await.status,
            StatusCode::OK
        );
        fillers.push(tokio::spawn({
            let app = app.clone();
            async move { send(&app, request_from(client)).await }
        }));
    }
    held(&layer, 2).await;
    assert_eq!(send(&app, request_from("c")).await.status, StatusCode::OK);
    let key = slidegate::key::Key::parse("header:x-client:c").unwrap();
    for _ in 0..4 {
        let reply = send(&app, request_from("c")).await;
        assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            reply.header("retry-after"),
            Some("10"),
            "the wait it would have had"
        );
        // Its units go back on a task of their own: the window holds its
        // first request alone again before the next.
        let started = Instant::now();
        while layer
            .peek("blocking", &key, None)
            .await
            .unwrap()
            .retry_after()
            .is_none_or(|wait| wait > Duration::from_secs(10))
        {
            assert!(started.elapsed() < Duration::from_secs(60), "units kept");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    for filler in fillers {
        filler.abort();
        let _ = filler.await;
    }
    held(&layer, 0).await;
    // Held until its first request leaves the window: not answered within
    // a second, where a blocked client is denied at once.
    let waited = tokio::time::timeout(Duration::from_secs(1), send(&app, request_from("c"))).await;
    assert!(
        waited.is_err(),
        "answered at once: {:?}",
        waited.map(|r| r.status)
    );
}
on_both_stores!(others_filling_the_layer_never_block_a_client);

/// The bytes of held requests' heads are bounded: past the bound, a
/// request that could be held is denied at once.
async fn held_heads_are_bounded_in_bytes(tested: StoreUnderTest) {
    let policy =
        Policy::new("heavy", 1, Duration::from_millis(500)).with_delay(Duration::from_secs(1));
    let layer = RateLimitLayer::new(tested.store, clients(), Policies::single(policy).unwrap())
        .with_max_delayed_bytes(10 * 1024);
    let app = app(layer.clone(), Entries::default());
    let heavy = |client: &str| {
        Request::get("/")
            .header("x-client", client)
            .header("x-padding", "p".repeat(8 * 1024))
            .body(Body::empty())
            .unwrap()
    };
    for client in ["a", "b"] {
        assert_eq!(send(&app, heavy(client)).await.status, StatusCode::OK);
    }
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, heavy("a")).await.status }
    });
    held(&layer, 1).await;
    let started = Instant::now();
    assert_eq!(
        send(&app, heavy("b")).await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert!(
        started.elapsed() < Duration::from_millis(300),
        "denied at once"
    );
    assert_eq!(first.await.unwrap(), StatusCode::OK);
}
on_both_stores!(held_heads_are_bounded_in_bytes);

/// A held request is decided once, when it comes: the store records it
/// in the slot it will pass in, and it passes then without asking again.
/// So a store that stalls while requests are held lets none through
/// beyond what it granted them, even where the policy fails open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_stalls_while_requests_are_held_lets_no_more_through() {
    let server = crate::support::RedisServer::start();
    let store = slidegate::store::RedisStore::builder(server.pool(4))
        .with_timeout(Duration::from_millis(50))
        .build()
        .unwrap();
    let window = Duration::from_millis(600);
    let policy = Policy::new("stalled", 2, window)
        .with_delay(Duration::from_secs(1))
        .with_fail_mode(slidegate::policy::FailMode::Open);
    let layer = RateLimitLayer::new(store, Global, Policies::single(policy).unwrap());
    let entries = Entries::default();
    let app = app(layer.clone(), entries.clone());
    // Before the store counts the first request (its handler may run late).
    let first = Instant::now();
    for _ in 0..2 {
        assert_eq!(send(&app, request()).await.status, StatusCode::OK);
    }
    let waiting: Vec<_> = (0..6)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move { send(&app, request()).await.status })
        })
        .collect();
    // Two fit within the delay (once the first two leave the window);
    // the other four are denied at once.
    let deadline = Instant::now() + Duration::from_secs(5);
    while layer.delayed() != 2 || waiting.iter().filter(|t| t.is_finished()).count() != 4 {
        assert!(Instant::now() < deadline, "delayed {}", layer.delayed());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Writes stall until well after the held requests' slot.
    assert_eq!(
        server.cli(&["client", "pause", "2000", "write"]).trim(),
        "OK"
    );
    let mut statuses = Vec::new();
    for task in waiting {
        statuses.push(task.await.unwrap());
    }
    let passed = statuses.iter().filter(|s| **s == StatusCode::OK).count();
    let denied = statuses
        .iter()
        .filter(|s| **s == StatusCode::TOO_MANY_REQUESTS)
        .count();
    assert_eq!((passed, denied), (2, 4), "{statuses:?}");
    let entries = entries.lock().unwrap().clone();
    assert_eq!(entries.len(), 4);
    for held in &entries[2..] {
        assert!(
            held.duration_since(first) >= window,
            "a held request passed before its slot"
        );
    }
}

/// With both a delay and a block, a request the delay can hold is held,
/// not denied, and starts no block; only a request beyond the delay
/// starts it.
async fn a_request_the_delay_holds_starts_no_block(tested: StoreUnderTest) {
    let patient = Policy::new("patient", 2, Duration::from_millis(300))
        .with_delay(Duration::from_millis(500))
        .with_block(Duration::from_secs(60));
    let impatient = Policy::new("impatient", 1, Duration::from_secs(60))
        .with_delay(Duration::from_millis(100))
        .with_block(Duration::from_secs(600));
    let policies = Policies::builder()
        .with_route("/", patient)
        .with_route("/other", impatient)
        .build()
        .unwrap();
    let layer = RateLimitLayer::new(tested.store, Global, policies);
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .route("/other", get(|| async { "ok" }))
        .route_layer(layer);
    for _ in 0..2 {
        assert_eq!(send(&app, request()).await.status, StatusCode::OK);
    }
    let held = send(&app, request()).await;
    assert_eq!(held.status, StatusCode::OK, "held, then admitted: no block");
    // Beyond its delay, a denial starts the block.
    let other = || Request::get("/other").body(Body::empty()).unwrap();
    assert_eq!(send(&app, other()).await.status, StatusCode::OK);
    let denied = send(&app, other()).await;
    assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(denied.header("retry-after"), Some("600"), "blocked");
}
on_both_stores!(a_request_the_delay_holds_starts_no_block);

/// A flood on a bucket with a delay and a block: the store admits the
/// burst, holds what the delay can fit, and blocks the first request
/// beyond the delay; the client then stays blocked long after the bucket
/// refilled.
async fn a_flood_beyond_the_delay_starts_the_block(tested: StoreUnderTest) {
    let clock = tested.clock.clone().expect("a fake clock");
    let policy = Policy::new("flood", 10, Duration::from_secs(1))
        .with_algorithm(slidegate::policy::Algorithm::TokenBucket)
        .with_delay(Duration::from_millis(200))
        .with_block(Duration::from_secs(60));
    let layer = RateLimitLayer::new(tested.store, Global, Policies::single(policy).unwrap());
    let app = app(layer, Entries::default());
    let flood: Vec<_> = (0..40)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move { send(&app, request()).await.status })
        })
        .collect();
    let mut admitted = 0;
    for task in flood {
        admitted += usize::from(task.await.unwrap() == StatusCode::OK);
    }
    // The store's clock stands still: the burst of 10, and the 2 units
    // the bucket refills within the delay, in the slots it granted them.
    assert_eq!(admitted, 12);
    clock.advance(Duration::from_secs(2));
    let reply = send(&app, request()).await;
    assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS);
    let wait: u64 = reply.header("retry-after").unwrap().parse().unwrap();
    assert!((55..=60).contains(&wait), "blocked: {wait}");
    let _redis = tested.redis;
}
on_both_stores!(a_flood_beyond_the_delay_starts_the_block, fake_clock);

/// A request the store would hold but the layer has no room for is
/// answered `429`. Under a policy that blocks, its units stay counted,
/// so a flood that fills the layer still reaches its block; under one
/// that does not, they are given back.
async fn a_request_the_layer_has_no_room_for_is_denied(tested: StoreUnderTest) {
    let clock = tested.clock.clone().expect("a fake clock");
    let bucket = |name: &str| {
        Policy::new(name, 10, Duration::from_secs(1))
            .with_algorithm(slidegate::policy::Algorithm::TokenBucket)
            .with_burst(1)
            .with_delay(Duration::from_millis(500))
    };
    // A sliding log: a token bucket keeps the units of a request it holds
    // (see `a_bucket_keeps_the_units_of_a_held_request_that_leaves`).
    let spares =
        Policy::new("spares", 1, Duration::from_millis(100)).with_delay(Duration::from_millis(500));
    let policies = Policies::builder()
        .with_route("/", bucket("blocks").with_block(Duration::from_secs(60)))
        .with_route("/other", spares)
        .build()
        .unwrap();
    let layer = RateLimitLayer::new(tested.store, Global, policies).with_max_delayed(0);
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .route("/other", get(|| async { "ok" }))
        .route_layer(layer);
    assert_eq!(send(&app, request()).await.status, StatusCode::OK);
    // Each refusal keeps its 100 ms: the sixth is beyond the delay.
    let mut waits = Vec::new();
    for _ in 0..6 {
        let reply = send(&app, request()).await;
        assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS);
        waits.push(reply.header("retry-after").unwrap().to_owned());
    }
    assert_eq!(waits.last().map(String::as_str), Some("60"), "{waits:?}");
    assert!(waits[..5].iter().all(|w| w == "1"), "{waits:?}");
    // Without a block, the units go back: however many are refused, the
    // window holds the first request only.
    let other = || Request::get("/other").body(Body::empty()).unwrap();
    assert_eq!(send(&app, other()).await.status, StatusCode::OK);
    for _ in 0..10 {
        let reply = send(&app, other()).await;
        assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(reply.header("retry-after"), Some("1"));
    }
    clock.advance(Duration::from_millis(100));
    // Refunds go back on a task of their own: once they are in, the
    // first request has left the window, and nothing else is in it (a
    // refused probe gives its own back too).
    let deadline = Instant::now() + Duration::from_secs(2);
    while send(&app, other()).await.status != StatusCode::OK {
        assert!(
            Instant::now() < deadline,
            "the refused units stayed counted"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let _redis = tested.redis;
}
on_both_stores!(a_request_the_layer_has_no_room_for_is_denied, fake_clock);

async fn a_request_the_layer_has_no_room_for_gives_back_its_shadow_units(tested: StoreUnderTest) {
    let spares =
        Policy::new("spares", 1, Duration::from_millis(100)).with_delay(Duration::from_millis(500));
    let watch = Policy::new("watch", 100, Duration::from_secs(60)).with_shadow(true);
    let policies = Policies::builder()
        .with_route("/", spares)
        .with_route("/", watch)
        .build()
        .unwrap();
    let layer = RateLimitLayer::new(tested.store, Global, policies).with_max_delayed(0);
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .route_layer(layer.clone());
    assert_eq!(send(&app, request()).await.status, StatusCode::OK);
    // The store would hold each of these, and counts them under the shadow
    // policy too; the layer has no room, so each gives every unit back.
    for _ in 0..5 {
        assert_eq!(
            send(&app, request()).await.status,
            StatusCode::TOO_MANY_REQUESTS
        );
    }
    let key = slidegate::key::Key::parse("global").unwrap();
    // Refunds go back on a task of their own.
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let watched = layer.peek("watch", &key, None).await.unwrap();
        if watched.remaining() == 99 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the shadow policy kept the units of refused requests: {} left",
            watched.remaining()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let _redis = tested.redis;
}
on_both_stores!(
    a_request_the_layer_has_no_room_for_gives_back_its_shadow_units,
    fake_clock
);
