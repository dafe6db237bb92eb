//! Operating the limiter: policies that count failures only (refunds),
//! shadow mode, and a local limit while Redis is down, on both stores.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::support::RedisServer;
use crate::support::down_store::{DownStore, FlakyStore};
use crate::support::reply::send;
use crate::support::stores::StoreUnderTest;
use axum::Router;
use axum::body::Body;
use axum::routing::{get, post};
use http::request::Parts;
use http::{HeaderMap, Request, StatusCode};
use slidegate::{
    KeyExtractor, Policies, Policy, RateLimitLayer,
    key::{Identity, Key, KeyRejection},
    policy::{Count, FailMode},
    store::{BreakerSettings, BreakerState, Check, CircuitBreaker, MemoryStore, RedisStore, Store},
};

const MINUTE: Duration = Duration::from_secs(60);

/// Every request comes from one client, whose key the tests know.
struct OneClient;

impl KeyExtractor for OneClient {
    fn extract(&self, _parts: &Parts) -> Result<Option<Identity>, KeyRejection> {
        Ok(Some(Key::new("client").into()))
    }
}

/// `POST /login`: 200 for the password `demo` (in `x-password`), 401
/// otherwise.
async fn login(headers: HeaderMap) -> StatusCode {
    match headers.get("x-password") {
        Some(password) if password == "demo" => StatusCode::OK,
        _ => StatusCode::UNAUTHORIZED,
    }
}

fn login_request(password: &str) -> Request<Body> {
    Request::post("/login")
        .header("x-password", password)
        .body(Body::empty())
        .unwrap()
}

fn failed_logins() -> Policy {
    Policy::new("logins", 3, MINUTE).with_count(Count::Failures)
}

fn login_app(store: impl Store) -> Router {
    let policies = Policies::single(failed_logins()).unwrap();
    Router::new()
        .route("/login", post(login))
        .route_layer(RateLimitLayer::new(store, OneClient, policies))
}

/// Waits (at most two seconds) until `store` shows `remaining` units of
/// the failed-logins policy: a refund to Redis lands after its response.
async fn settled(store: &dyn Store, remaining: u32) {
    let check = [Check::new(&failed_logins(), Key::new("client")).unwrap()];
    let started = Instant::now();
    loop {
        let decision = store.peek(&check).await.unwrap()[0];
        if decision.remaining() == remaining {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{remaining} units never came back: {decision:?}"
        );
        tokio::task::yield_now().await;
    }
}

async fn only_failures_count(tested: StoreUnderTest) {
    let store = tested.store;
    let app = login_app(store.clone());
    for _ in 0..10 {
        let reply = send(&app, login_request("demo")).await;
        assert_eq!(reply.status, StatusCode::OK);
        // The headers say what is left after this request: all of it.
        assert_eq!(reply.header("x-ratelimit-remaining"), Some("3"));
        assert_eq!(reply.header("x-ratelimit-reset"), Some("0"));
        settled(&*store, 3).await;
    }
    for left in (0..3).rev() {
        let reply = send(&app, login_request("guess")).await;
        assert_eq!(reply.status, StatusCode::UNAUTHORIZED);
        assert_eq!(
            reply.header("x-ratelimit-remaining"),
            Some(left.to_string().as_str())
        );
        if left == 1 {
            settled(&*store, 1).await;
            // A success between failures leaves the count as it was.
            let reply = send(&app, login_request("demo")).await;
            assert_eq!(reply.status, StatusCode::OK);
            assert_eq!(reply.header("x-ratelimit-remaining"), Some("1"));
            assert_ne!(reply.header("x-ratelimit-reset"), Some("0"));
            settled(&*store, 1).await;
        }
    }
    settled(&*store, 0).await;
    let reply = send(&app, login_request("guess")).await;
    assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(reply.header("retry-after").is_some());
    // Past three failures the client is held off, right password or not.
    let reply = send(&app, login_request("demo")).await;
    assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS);
}

on_both_stores!(only_failures_count);

/// Requests are counted when admitted and refunded after their response:
/// at no instant do more requests than the limit run in the service, while
/// refunds let many more through in all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refunds_never_let_more_than_the_limit_in_at_once() {
    const LIMIT: usize = 10;
    let server = RedisServer::start();
    // The timeout is not under test: a check that timed out would fail
    // open, uncounted, and could put more than the limit in the service.
    let store = RedisStore::builder(server.pool(8))
        .with_timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let running = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let (inside, peak) = (running.clone(), most.clone());
    let policies =
        Policies::single(Policy::new("work", LIMIT as u32, MINUTE).with_count(Count::Failures))
            .unwrap();
    let app = Router::new()
        .route(
            "/work",
            get(move || {
                let (inside, peak) = (inside.clone(), peak.clone());
                async move {
                    let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                    peak.fetch_max(now, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    inside.fetch_sub(1, Ordering::SeqCst);
                    "done"
                }
            }),
        )
        .route_layer(RateLimitLayer::new(store, OneClient, policies));

    // 200 requests from 40 senders at once, 5 each.
    let senders: Vec<_> = (0..40)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move {
                let mut admitted = 0;
                for _ in 0..5 {
                    let request = Request::get("/work").body(Body::empty()).unwrap();
                    let status = send(&app, request).await.status;
                    assert!(status == StatusCode::OK || status == StatusCode::TOO_MANY_REQUESTS);
                    admitted += usize::from(status == StatusCode::OK);
                }
                admitted
            })
        })
        .collect();
    let mut admitted = 0;
    for sender in senders {
        admitted += sender.await.unwrap();
    }
    let peak = most.load(Ordering::SeqCst);
    assert!(peak <= LIMIT, "{peak} requests ran at once, limit {LIMIT}");
    assert!(
        admitted > LIMIT,
        "refunds made room for more than the limit in all: {admitted}"
    );
}

fn shadow_app(store: impl Store, layer_shadow: bool) -> Router {
    let policies = Policies::builder()
        .with_route("/search", Policy::new("search", 5, MINUTE))
        .with_route("/search", Policy::new("trial", 2, MINUTE).with_shadow(true))
        .with_route("/shadowed", Policy::new("shadowed", 2, MINUTE))
        .build()
        .unwrap();
    Router::new()
        .route("/search", get(|| async { "results" }))
        .route("/shadowed", get(|| async { "results" }))
        .route_layer(RateLimitLayer::new(store, OneClient, policies).with_shadow(layer_shadow))
}

async fn shadow_policies_never_deny(tested: StoreUnderTest) {
    let store = tested.store;
    let app = shadow_app(store.clone(), false);
    let get = |path: &str| Request::get(path).body(Body::empty()).unwrap();
    let mut remaining = Vec::new();
    for _ in 0..5 {
        let reply = send(&app, get("/search")).await;
        assert_eq!(reply.status, StatusCode::OK);
        remaining.push(reply.header("x-ratelimit-remaining").unwrap().to_owned());
    }
    // The headers report the policy closest to denying: the shadow one.
    assert_eq!(remaining, ["1", "0", "0", "0", "0"]);
    // The enforced policy still denies the sixth.
    assert_eq!(
        send(&app, get("/search")).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    // The shadow policy counted the two it admitted, and none it denied.
    let trial = Policy::new("trial", 2, MINUTE);
    let peeked = store
        .peek(&[Check::new(&trial, Key::new("client")).unwrap()])
        .await
        .unwrap()[0];
    assert_eq!(peeked.remaining(), 0);
    let search = Policy::new("search", 5, MINUTE);
    let peeked = store
        .peek(&[Check::new(&search, Key::new("client")).unwrap()])
        .await
        .unwrap()[0];
    assert_eq!(peeked.remaining(), 0);

    // The whole layer in shadow mode: a limit of 2 lets 10 through.
    let app = shadow_app(store, true);
    for _ in 0..10 {
        let reply = send(&app, get("/shadowed")).await;
        assert_eq!(reply.status, StatusCode::OK);
        assert!(reply.header("retry-after").is_none());
    }
    let reply = send(&app, get("/shadowed")).await;
    assert_eq!(reply.header("x-ratelimit-remaining"), Some("0"));
}

on_both_stores!(shadow_policies_never_deny);

fn local_app(store: impl Store, share: u32) -> Router {
    let policies = Policies::builder()
        .with_route(
            "/local",
            Policy::new("local", 6, MINUTE).with_fail_mode(FailMode::Local),
        )
        .with_route("/open", Policy::new("open", 6, MINUTE))
        .build()
        .unwrap();
    Router::new()
        .route("/local", get(|| async { "local" }))
        .route("/open", get(|| async { "open" }))
        .route_layer(RateLimitLayer::new(store, OneClient, policies).with_local_share(share))
}

#[tokio::test]
async fn a_store_down_falls_back_to_a_share_of_the_limit() {
    let app = local_app(DownStore, 2);
    let get = |path: &str| Request::get(path).body(Body::empty()).unwrap();
    let mut statuses = Vec::new();
    for _ in 0..5 {
        statuses.push(send(&app, get("/local")).await.status);
    }
    // 6 shared by 2 instances: 3 here.
    assert_eq!(
        statuses,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS,
            StatusCode::TOO_MANY_REQUESTS,
        ]
    );
    // A policy without the local fail mode still fails open.
    for _ in 0..10 {
        assert_eq!(send(&app, get("/open")).await.status, StatusCode::OK);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_redis_is_replaced_by_the_local_limit_until_it_returns() {
    let mut server = RedisServer::start();
    let store = RedisStore::builder(server.pool(4))
        .with_timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    let app = local_app(store, 1);
    let get = |path: &str| Request::get(path).body(Body::empty()).unwrap();
    for _ in 0..2 {
        assert_eq!(send(&app, get("/local")).await.status, StatusCode::OK);
    }
    server.kill();
    let mut local = Vec::new();
    for _ in 0..8 {
        local.push(send(&app, get("/local")).await.status);
    }
    // The local count starts from the 2 Redis admitted: 4 more fit the 6.
    let admitted = local.iter().filter(|s| **s == StatusCode::OK).count();
    assert_eq!(admitted, 4, "the local limit holds: {local:?}");
    assert_eq!(local[4..], [StatusCode::TOO_MANY_REQUESTS; 4]);

    // Back on an empty Redis, which answers again (the open policy gets
    // its headers, within five seconds); the local admissions still count
    // for the window, so the client stays at its 6.
    server.restart();
    let started = Instant::now();
    loop {
        let reply = send(&app, get("/open")).await;
        if reply.header("x-ratelimit-remaining").is_some() {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "Redis not answering 5 s after it came back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for _ in 0..3 {
        assert_eq!(
            send(&app, get("/local")).await.status,
            StatusCode::TOO_MANY_REQUESTS
        );
    }
}

/// Sends `requests` requests to `/local` of `local_app(store, 1)`, the
/// next when the last is answered, pausing `pace` between them; returns
/// how many were admitted.
async fn admitted_through(store: impl Store, requests: usize, pace: Duration) -> usize {
    let app = local_app(store, 1);
    let mut admitted = 0;
    for _ in 0..requests {
        let request = Request::get("/local").body(Body::empty()).unwrap();
        if send(&app, request).await.status == StatusCode::OK {
            admitted += 1;
        }
        if !pace.is_zero() {
            tokio::time::sleep(pace).await;
        }
    }
    admitted
}

/// A store failing every other call, then one flapping every 100 ms: the
/// local and the store's counts each learn what the other admitted, so
/// one instance admits no more than the limit (6) in the window. Without
/// that, each side admits its own 6.
async fn a_flapping_store_never_adds_the_two_counts(inner: impl Fn() -> Arc<dyn Store>) {
    let every_other = FlakyStore::new(inner(), |call| call % 2 == 1);
    assert_eq!(admitted_through(every_other, 40, Duration::ZERO).await, 6);

    let started = Instant::now();
    let flapping = FlakyStore::new(inner(), move |_| {
        (started.elapsed().as_millis() / 100) % 2 == 1
    });
    // About a second: five outages, five recoveries.
    let admitted = admitted_through(flapping, 100, Duration::from_millis(10)).await;
    assert_eq!(admitted, 6);
}

#[tokio::test]
async fn a_flapping_memory_store_never_adds_the_two_counts() {
    a_flapping_store_never_adds_the_two_counts(|| Arc::new(MemoryStore::new())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flapping_redis_never_adds_the_two_counts() {
    let server = RedisServer::start();
    let pool = server.pool(4);
    a_flapping_store_never_adds_the_two_counts(|| {
        server.cli(&["FLUSHALL"]);
        Arc::new(RedisStore::new(pool.clone()))
    })
    .await;
}

/// A cost a local share of the limit cannot hold is scaled with it: 30 of
/// 100 is 8 of a quarter (25), so three requests fit, as in the store.
#[tokio::test]
async fn a_local_limit_scales_the_cost_with_the_limit() {
    let policies = Policies::single(
        Policy::new("local", 100, MINUTE)
            .with_cost(30)
            .with_fail_mode(FailMode::Local),
    )
    .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .route_layer(RateLimitLayer::new(DownStore, OneClient, policies).with_local_share(4));
    let mut statuses = Vec::new();
    for _ in 0..5 {
        let request = Request::get("/").body(Body::empty()).unwrap();
        let reply = send(&app, request).await;
        if reply.status == StatusCode::TOO_MANY_REQUESTS {
            // A true retry time: the first admission leaves the minute.
            let retry: u64 = reply.header("retry-after").unwrap().parse().unwrap();
            assert!((55..=60).contains(&retry), "{retry}");
        }
        statuses.push(reply.status);
    }
    assert_eq!(
        statuses,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS,
            StatusCode::TOO_MANY_REQUESTS,
        ]
    );
}

/// A frozen Redis (SIGSTOP): each request waits out the store timeout
/// until the breaker opens; after that, the fail mode answers at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_breaker_answers_without_waiting_for_a_frozen_redis() {
    const TIMEOUT: Duration = Duration::from_millis(100);
    let server = RedisServer::start();
    let store = RedisStore::builder(server.pool(4))
        .with_timeout(TIMEOUT)
        .build()
        .unwrap();
    let breaker = CircuitBreaker::new(store, BreakerSettings::new(5, Duration::from_secs(3600)));
    let policies = Policies::builder()
        .with_route(
            "/closed",
            Policy::new("closed", 100, MINUTE).with_fail_mode(FailMode::Closed),
        )
        .with_route(
            "/local",
            Policy::new("local", 100, MINUTE).with_fail_mode(FailMode::Local),
        )
        .build()
        .unwrap();
    let app = Router::new()
        .route("/closed", get(|| async { "closed" }))
        .route("/local", get(|| async { "local" }))
        .route_layer(RateLimitLayer::new(breaker.clone(), OneClient, policies));
    let get = |path: &str| Request::get(path).body(Body::empty()).unwrap();
    assert_eq!(send(&app, get("/closed")).await.status, StatusCode::OK);

    server.freeze();
    for _ in 0..5 {
        let started = Instant::now();
        assert_eq!(
            send(&app, get("/closed")).await.status,
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert!(started.elapsed() >= TIMEOUT, "waited for the store");
    }
    assert_eq!(breaker.state(), BreakerState::Open);

    let mut took = Vec::new();
    for n in 0..200 {
        let (path, status) = if n % 2 == 0 {
            ("/closed", StatusCode::SERVICE_UNAVAILABLE)
        } else {
            ("/local", StatusCode::OK)
        };
        let started = Instant::now();
        assert_eq!(send(&app, get(path)).await.status, status);
        took.push(started.elapsed());
    }
    server.thaw();
    // Had any of them gone to the store, it would have waited out the
    // timeout, as the first five did.
    let longest = took.iter().max().unwrap();
    assert!(
        *longest < TIMEOUT,
        "a request waited {longest:?} with the breaker open"
    );
}

/// `Count::Successes`: the mirror image, failed requests are not counted.
#[tokio::test]
async fn successes_only_leave_failures_uncounted() {
    let policies =
        Policies::single(Policy::new("exports", 2, MINUTE).with_count(Count::Successes)).unwrap();
    let app = Router::new()
        .route("/login", post(login))
        .route_layer(RateLimitLayer::new(MemoryStore::new(), OneClient, policies));
    for _ in 0..10 {
        let reply = send(&app, login_request("guess")).await;
        assert_eq!(reply.status, StatusCode::UNAUTHORIZED);
        assert_eq!(reply.header("x-ratelimit-remaining"), Some("2"));
    }
    for _ in 0..2 {
        assert_eq!(
            send(&app, login_request("demo")).await.status,
            StatusCode::OK
        );
    }
    assert_eq!(
        send(&app, login_request("demo")).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
}

/// Keys each request by its `x-client` header.
struct ClientHeader;

impl KeyExtractor for ClientHeader {
    fn extract(&self, parts: &Parts) -> Result<Option<Identity>, KeyRejection> {
        let client = parts.headers.get("x-client").expect("x-client");
        Ok(Some(Key::new(client.to_str().unwrap()).into()))
    }
}

/// The attack on a breaker: requests whose futures are polled once and
/// dropped, as hyper drops a request whose client sent its FIN with it.
/// Each would take the half-open probe with it; runs until `stop` is set
/// (or 2,000,000 requests, or 20 s). The count is only a backstop: a
/// dropped request takes about 15 µs here, so a cap of tens of thousands
/// would end the attack before the first cool-down does, and no probe
/// would ever be sent.
async fn drop_requests(app: Router, stop: Arc<std::sync::atomic::AtomicBool>) -> usize {
    use tower::ServiceExt;
    let started = Instant::now();
    let mut sent = 0;
    while !stop.load(Ordering::Relaxed)
        && sent < 2_000_000
        && started.elapsed() < Duration::from_secs(20)
    {
        let mut request = std::pin::pin!(app.clone().oneshot(attacker()));
        // Polled once, then dropped.
        std::future::poll_fn(|cx| {
            let _ = request.as_mut().poll(cx);
            std::task::Poll::Ready(())
        })
        .await;
        sent += 1;
        tokio::task::yield_now().await;
    }
    sent
}

/// A request of the attacking client.
fn attacker() -> Request<Body> {
    Request::get("/api")
        .header("x-client", "attacker")
        .body(Body::empty())
        .unwrap()
}

/// Waits (at most `within`) for the breaker to close; the time it took.
async fn closes_within(breaker: &CircuitBreaker<RedisStore>, within: Duration) -> Duration {
    let started = Instant::now();
    while breaker.state() != BreakerState::Closed {
        assert!(
            started.elapsed() < within,
            "the breaker is still {:?} {within:?} after Redis came back",
            breaker.state()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    started.elapsed()
}

/// The app of the breaker attacks: `/api`, 5 a minute per `x-client`,
/// failing open, on Redis behind a breaker that opens on one failure.
fn breaker_app(server: &RedisServer, cooldown: Duration) -> (Router, CircuitBreaker<RedisStore>) {
    let store = RedisStore::builder(server.pool(4))
        .with_timeout(Duration::from_millis(50))
        .build()
        .unwrap();
    let breaker = CircuitBreaker::new(store, BreakerSettings::new(1, cooldown));
    let policies = Policies::single(Policy::new("api", 5, MINUTE)).unwrap();
    let app = Router::new()
        .route("/api", get(|| async { "ok" }))
        .route_layer(RateLimitLayer::new(breaker.clone(), ClientHeader, policies));
    (app, breaker)
}

/// After the attack, the limit holds again for a client of its own.
async fn the_limit_holds(app: &Router) {
    let request = || {
        Request::get("/api")
            .header("x-client", "legitimate")
            .body(Body::empty())
            .unwrap()
    };
    for n in (0..5).rev() {
        let reply = send(app, request()).await;
        assert_eq!(reply.status, StatusCode::OK);
        assert_eq!(
            reply.header("x-ratelimit-remaining"),
            Some(n.to_string().as_str())
        );
    }
    let reply = send(app, request()).await;
    assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(reply.header("retry-after").is_some());
}

/// A client that keeps dropping its requests cannot hold the breaker open:
/// the probe its request carries runs to its end, and the breaker closes
/// within one cool-down of Redis answering again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_dropping_its_requests_cannot_hold_the_breaker_open() {
    const COOLDOWN: Duration = Duration::from_millis(300);
    let server = RedisServer::start();
    let (app, breaker) = breaker_app(&server, COOLDOWN);
    server.freeze();
    assert_eq!(
        send(&app, attacker()).await.status,
        StatusCode::OK,
        "fails open"
    );
    server.thaw();
    assert_eq!(breaker.state(), BreakerState::Open);

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let attack = tokio::spawn(drop_requests(app.clone(), stop.clone()));
    let took = closes_within(&breaker, COOLDOWN + Duration::from_secs(2)).await;
    stop.store(true, Ordering::Relaxed);
    let sent = attack.await.unwrap();
    eprintln!("closed {took:?} after Redis came back, under {sent} dropped requests");
    assert!(sent > 0);
    the_limit_holds(&app).await;
}

/// Sixteen tasks dropping requests while Redis recovers from a freeze: the
/// breaker still closes once Redis answers, and stays closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_breaker_closes_while_sixteen_tasks_drop_requests() {
    const COOLDOWN: Duration = Duration::from_millis(200);
    let server = RedisServer::start();
    let (app, breaker) = breaker_app(&server, COOLDOWN);
    server.freeze();
    assert_eq!(
        send(&app, attacker()).await.status,
        StatusCode::OK,
        "fails open"
    );
    assert_eq!(breaker.state(), BreakerState::Open);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let attackers: Vec<_> = (0..16)
        .map(|_| tokio::spawn(drop_requests(app.clone(), stop.clone())))
        .collect();
    // Frozen through a few cool-downs: each probe fails at the store
    // timeout and opens the breaker again.
    tokio::time::sleep(COOLDOWN * 3).await;
    server.thaw();
    closes_within(&breaker, COOLDOWN + Duration::from_secs(2)).await;
    let mut sent = 0;
    stop.store(true, Ordering::Relaxed);
    for attacker in attackers {
        sent += attacker.await.unwrap();
    }
    eprintln!("{sent} requests dropped");
    assert_eq!(breaker.state(), BreakerState::Closed);
    the_limit_holds(&app).await;
}

/// The login app on a store that is down while the flag is set, its
/// failed-logins policy falling back to a local limit.
fn local_login_app() -> (Router, Arc<std::sync::atomic::AtomicBool>) {
    let down = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let store = FlakyStore::new(MemoryStore::new(), {
        let down = down.clone();
        move |_| down.load(Ordering::Relaxed)
    });
    let policy = failed_logins().with_fail_mode(FailMode::Local);
    let app = Router::new()
        .route("/login", post(login))
        .route_layer(RateLimitLayer::new(
            store,
            OneClient,
            Policies::single(policy).unwrap(),
        ));
    (app, down)
}

/// Failed logins the store admitted are in the local count too: when the
/// store goes down, the client has only what is left of its limit, not a
/// second one (a successful login between them still takes nothing).
#[tokio::test]
async fn counted_failures_carry_into_the_local_count() {
    let (app, down) = local_login_app();
    for password in ["wrong", "demo", "wrong", "demo"] {
        let reply = send(&app, login_request(password)).await;
        assert_ne!(reply.status, StatusCode::TOO_MANY_REQUESTS);
    }
    down.store(true, Ordering::Relaxed);
    let mut statuses = Vec::new();
    for _ in 0..3 {
        statuses.push(send(&app, login_request("wrong")).await.status);
    }
    assert_eq!(
        statuses,
        [
            StatusCode::UNAUTHORIZED,
            StatusCode::TOO_MANY_REQUESTS,
            StatusCode::TOO_MANY_REQUESTS
        ],
        "two failures counted before the store went down, one left of three"
    );
}

/// Successful logins, which a failures-only policy takes back, never fill
/// its local count: when the store goes down, the client still has its
/// whole local limit for failed ones.
#[tokio::test]
async fn refunded_units_never_fill_a_local_count() {
    let (app, down) = local_login_app();
    for _ in 0..5 {
        assert_eq!(
            send(&app, login_request("demo")).await.status,
            StatusCode::OK
        );
    }
    down.store(true, Ordering::Relaxed);
    let statuses: Vec<StatusCode> = {
        let mut statuses = Vec::new();
        for _ in 0..4 {
            statuses.push(send(&app, login_request("wrong")).await.status);
        }
        statuses
    };
    assert_eq!(
        statuses,
        [
            StatusCode::UNAUTHORIZED,
            StatusCode::UNAUTHORIZED,
            StatusCode::UNAUTHORIZED,
            StatusCode::TOO_MANY_REQUESTS,
        ]
    );
}
