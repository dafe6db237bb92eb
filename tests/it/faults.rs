//! Redis faults: killed, restarted, scripts flushed, frozen. Requests never
//! wait past the store timeout, open routes pass, closed routes get 503, and
//! enforcement comes back on its own.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::support::RedisServer;
use crate::support::proxy::TcpProxy;
use crate::support::slow_link::SlowLink;
use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use http::{Request, StatusCode};
use slidegate::{PeerIp, Policies, Policy, RateLimitLayer, policy::FailMode, store::RedisStore};
use slidegate::{
    key::Key,
    store::{Check, Store},
};
use tower::ServiceExt;

const TIMEOUT: Duration = Duration::from_millis(100);
/// Scheduling slack on a loaded two-core machine; the timeout itself is
/// what keeps a request from hanging.
const SLACK: Duration = Duration::from_millis(400);

struct Fixture {
    server: RedisServer,
    store: RedisStore,
    app: Router,
}

fn fixture() -> Fixture {
    let server = RedisServer::start();
    let store = RedisStore::builder(server.pool(8))
        .with_timeout(TIMEOUT)
        .build()
        .unwrap();
    let policies = Policies::builder()
        .with_route(
            "/open",
            Policy::new("open", 1000, Duration::from_secs(60)).with_fail_mode(FailMode::Open),
        )
        .with_route(
            "/closed",
            Policy::new("closed", 1000, Duration::from_secs(60)).with_fail_mode(FailMode::Closed),
        )
        .with_route(
            "/tight",
            Policy::new("tight", 3, Duration::from_secs(60)).with_fail_mode(FailMode::Closed),
        )
        .build()
        .unwrap();
    let app = Router::new()
        .route("/open", get(|| async { "open" }))
        .route("/closed", get(|| async { "closed" }))
        .route("/tight", get(|| async { "tight" }))
        .route_layer(RateLimitLayer::new(store.clone(), PeerIp::new(), policies));
    Fixture { server, store, app }
}

/// Sends one request from `192.0.2.<client>` to `app`; returns its status
/// and how long it took.
async fn send(app: &Router, path: &str, client: u8) -> (StatusCode, Duration) {
    let mut request = Request::get(path).body(Body::empty()).unwrap();
    request
        .extensions_mut()
        .insert(ConnectInfo(SocketAddr::from(([192, 0, 2, client], 1))));
    let started = Instant::now();
    let response = app.clone().oneshot(request).await.unwrap();
    (response.status(), started.elapsed())
}

impl Fixture {
    /// Sends one request and returns its status and how long it took.
    async fn send(&self, path: &str, client: u8) -> (StatusCode, Duration) {
        send(&self.app, path, client).await
    }

    /// Sends `count` concurrent requests to `path`; returns their statuses
    /// and the slowest latency.
    async fn burst(&self, path: &str, count: usize) -> (Vec<StatusCode>, Duration) {
        let tasks: Vec<_> = (0..count)
            .map(|i| {
                let app = self.app.clone();
                let path = path.to_owned();
                tokio::spawn(async move {
                    let mut request = Request::get(path).body(Body::empty()).unwrap();
                    request
                        .extensions_mut()
                        .insert(ConnectInfo(SocketAddr::from(([198, 51, 100, i as u8], 1))));
                    let started = Instant::now();
                    let status = app.oneshot(request).await.unwrap().status();
                    (status, started.elapsed())
                })
            })
            .collect();
        let mut statuses = Vec::new();
        let mut worst = Duration::ZERO;
        for task in tasks {
            let (status, took) = task.await.unwrap();
            statuses.push(status);
            worst = worst.max(took);
        }
        (statuses, worst)
    }

    /// Polls `/tight`-style enforcement back: the time until a request to
    /// `path` is answered by the store (200 or 429), bounded by `within`.
    async fn time_to_recover(&self, path: &str, within: Duration) -> Option<Duration> {
        let started = Instant::now();
        while started.elapsed() < within {
            let (status, _) = self.send(path, 9).await;
            if status == StatusCode::OK || status == StatusCode::TOO_MANY_REQUESTS {
                return Some(started.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        None
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_redis_fails_open_or_closed_without_waiting() {
    let mut f = fixture();
    assert_eq!(f.send("/closed", 1).await.0, StatusCode::OK);
    f.server.kill();

    let (open, open_worst) = f.burst("/open", 50).await;
    let (closed, closed_worst) = f.burst("/closed", 50).await;
    assert!(open.iter().all(|s| *s == StatusCode::OK), "{open:?}");
    assert!(
        closed.iter().all(|s| *s == StatusCode::SERVICE_UNAVAILABLE),
        "{closed:?}"
    );
    let worst = open_worst.max(closed_worst);
    println!("Redis killed: 100 requests, worst latency {worst:?} (timeout {TIMEOUT:?})");
    assert!(worst <= TIMEOUT + SLACK, "a request waited {worst:?}");

    // Restarted (empty): enforcement is back within a second.
    f.server.restart();
    let recovered = f.time_to_recover("/tight", Duration::from_secs(1)).await;
    println!("Redis restarted: enforcement back after {recovered:?}");
    assert!(
        recovered.is_some(),
        "enforcement did not come back within 1 s"
    );
    let statuses: Vec<_> = futures_statuses(&f, "/tight", 3).await;
    assert_eq!(
        statuses,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS
        ]
    );
}

/// Redis killed and restarted while requests keep coming: none waits past
/// the timeout, and enforcement is back within 5 s of the restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_and_restarted_under_load_recovers_without_a_hang() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    const WORKERS: usize = 16;
    /// Each worker stops after this many requests, or when told.
    const MAX_REQUESTS: usize = 20_000;
    let mut f = fixture();
    let app = f.app.clone();
    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicUsize::new(0));
    let load: Vec<_> = (0..WORKERS)
        .map(|worker| {
            let app = app.clone();
            let stop = stop.clone();
            let answered = answered.clone();
            tokio::spawn(async move {
                let mut worst = Duration::ZERO;
                let mut sent = 0;
                while sent < MAX_REQUESTS && !stop.load(Ordering::Relaxed) {
                    let mut request = Request::get("/open").body(Body::empty()).unwrap();
                    request
                        .extensions_mut()
                        .insert(ConnectInfo(SocketAddr::from((
                            [203, 0, 113, worker as u8],
                            1,
                        ))));
                    let started = Instant::now();
                    let status = app.clone().oneshot(request).await.unwrap().status();
                    worst = worst.max(started.elapsed());
                    assert_eq!(
                        status,
                        StatusCode::OK,
                        "a fail-open route answered {status}"
                    );
                    sent += 1;
                    answered.fetch_add(1, Ordering::Relaxed);
                }
                (worst, sent)
            })
        })
        .collect();

    // Waits until the load has had `more` answers, at most 10 s.
    let answers = |more: usize| {
        let answered = answered.clone();
        async move {
            let target = answered.load(Ordering::Relaxed) + more;
            let deadline = Instant::now() + Duration::from_secs(10);
            while answered.load(Ordering::Relaxed) < target && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
    };
    // Enforcement is on before the fault.
    answers(2_000).await;
    assert!(
        f.time_to_recover("/tight", Duration::from_secs(5))
            .await
            .is_some()
    );
    f.server.kill();
    let (closed, _) = f.send("/closed", 1).await;
    assert_eq!(closed, StatusCode::SERVICE_UNAVAILABLE);
    answers(2_000).await;
    f.server.restart();
    let recovered = f.time_to_recover("/tight", Duration::from_secs(5)).await;
    stop.store(true, Ordering::Relaxed);

    let (mut worst, mut sent) = (Duration::ZERO, 0);
    for worker in load {
        let (slowest, count) = worker.await.unwrap();
        worst = worst.max(slowest);
        sent += count;
    }
    println!(
        "Redis killed and restarted under load: {sent} requests, worst {worst:?}, enforcement back after {recovered:?}"
    );
    assert!(recovered.is_some(), "enforcement not back within 5 s");
    assert!(worst <= TIMEOUT + SLACK, "a request waited {worst:?}");
    // Client 9 made one request while recovering; two more fit, then 429.
    let statuses = futures_statuses(&f, "/tight", 3).await;
    assert_eq!(
        statuses,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS
        ]
    );
}

/// Sequential requests from client 9 (the one `time_to_recover` used).
async fn futures_statuses(f: &Fixture, path: &str, count: usize) -> Vec<StatusCode> {
    let mut statuses = Vec::new();
    for _ in 0..count {
        statuses.push(f.send(path, 9).await.0);
    }
    statuses
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn script_and_function_flushes_are_invisible_to_requests() {
    let f = fixture();
    for round in 0..5 {
        let (statuses, _) = f.burst("/closed", 20).await;
        assert!(
            statuses.iter().all(|s| *s == StatusCode::OK),
            "round {round}: {statuses:?}"
        );
        assert_eq!(f.server.cli(&["script", "flush"]).trim(), "OK");
        assert_eq!(f.server.cli(&["script", "exists", "0"]).trim(), "0");
        assert_eq!(f.server.cli(&["function", "flush"]).trim(), "OK");
        assert_eq!(f.server.cli(&["function", "list"]).trim(), "");
    }
    // Limits still hold after the flushes.
    let statuses = futures_statuses(&f, "/tight", 4).await;
    assert_eq!(statuses[..3], [StatusCode::OK; 3]);
    assert_eq!(statuses[3], StatusCode::TOO_MANY_REQUESTS);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_redis_hits_the_timeout_and_the_pool_recovers() {
    let f = fixture();
    // Warm the pool with several connections.
    let (warm, _) = f.burst("/closed", 16).await;
    assert!(warm.iter().all(|s| *s == StatusCode::OK));

    f.server.freeze();
    let (open, open_worst) = f.burst("/open", 30).await;
    let (closed, closed_worst) = f.burst("/closed", 30).await;
    f.server.thaw();

    assert!(open.iter().all(|s| *s == StatusCode::OK), "{open:?}");
    assert!(
        closed.iter().all(|s| *s == StatusCode::SERVICE_UNAVAILABLE),
        "{closed:?}"
    );
    let worst = open_worst.max(closed_worst);
    println!("Redis frozen: 60 requests, worst latency {worst:?} (timeout {TIMEOUT:?})");
    assert!(
        worst >= TIMEOUT,
        "requests must have waited for the timeout, not failed early"
    );
    assert!(worst <= TIMEOUT + SLACK, "a request waited {worst:?}");

    let recovered = f.time_to_recover("/closed", Duration::from_secs(2)).await;
    println!("Redis thawed: answering again after {recovered:?}");
    assert!(
        recovered.is_some(),
        "the pool did not recover after SIGCONT"
    );
    let (after, _) = f.burst("/closed", 16).await;
    assert!(after.iter().all(|s| *s == StatusCode::OK), "{after:?}");
    let status = f.store.pool().status();
    assert!(status.size <= status.max_size, "{status:?}");
}

/// A call that times out leaves its connection in the pool (the
/// connection is multiplexed and stays in step): a stalled Redis costs
/// slow answers, not a reconnection per timed-out request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_timed_out_mid_script_is_kept() {
    let f = fixture();
    let (warm, _) = f.burst("/closed", 8).await;
    assert!(warm.iter().all(|s| *s == StatusCode::OK));
    let before = f.store.pool().status();
    assert!(before.size > 0);
    let connections = |f: &Fixture| -> u64 {
        let stats = f.server.cli(&["info", "stats"]);
        stats
            .lines()
            .find_map(|line| line.strip_prefix("total_connections_received:"))
            .and_then(|value| value.trim().parse().ok())
            .expect("total_connections_received in INFO stats")
    };
    let connected = connections(&f);

    // Writes (so scripts) stall while PING, the pool's health check, still
    // answers: each request times out in the middle of its call.
    assert_eq!(
        f.server.cli(&["client", "pause", "1000", "write"]).trim(),
        "OK"
    );
    let (mut paused, mut worst) = (Vec::new(), Duration::ZERO);
    for _ in 0..3 {
        let (statuses, slowest) = f.burst("/closed", before.size).await;
        paused.extend(statuses);
        worst = worst.max(slowest);
    }
    let during = f.store.pool().status();
    assert_eq!(f.server.cli(&["client", "unpause"]).trim(), "OK");

    assert!(
        paused.iter().all(|s| *s == StatusCode::SERVICE_UNAVAILABLE),
        "{paused:?}"
    );
    assert!(worst <= TIMEOUT + SLACK, "a request waited {worst:?}");
    assert_eq!(
        during.size, before.size,
        "connections that timed out left the pool: {during:?}"
    );
    let recovered = f.time_to_recover("/closed", Duration::from_secs(1)).await;
    assert!(recovered.is_some());
    // Less redis-cli's own three (`client pause`, `client unpause` and this
    // count): at most one new connection per pooled one, when the pool's
    // health check queued behind a stalled call gives up, where throwing
    // away every connection that timed out made one per request.
    let reconnections = connections(&f) - connected - 3;
    assert!(
        reconnections <= before.size as u64,
        "{} timed-out calls made {reconnections} reconnections, pool of {}",
        paused.len(),
        before.size
    );
}

/// A failover behind one address (a proxy, a virtual IP): the old primary
/// becomes a replica and answers `READONLY`, new connections reach the new
/// primary. Each pooled connection to the old one is dropped at its first
/// such answer, so the pool follows within as many failures as it holds
/// connections, then checks keep succeeding.
#[tokio::test]
async fn the_pool_follows_a_failover_that_demotes_the_old_primary() {
    const POOL: usize = 4;
    let old = RedisServer::start();
    let new = RedisServer::start();
    let proxy = TcpProxy::start(old.port());
    let pool = crate::support::pool_at(&proxy.url(), POOL);
    // The timeout is not under test (the old primary answers `READONLY`
    // at once): long, so that a loaded machine counts no timeout as a
    // failure of the failover.
    let store = RedisStore::builder(pool)
        .with_timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let policy = Policy::new("failover", 1_000_000, Duration::from_secs(60));
    let check = |client: usize| [Check::new(&policy, Key::new(format!("c{client}"))).unwrap()];
    // Every pooled connection in use at once, to the old primary.
    let (a, b, c, d) = (check(0), check(1), check(2), check(3));
    let answers = tokio::join!(
        store.check(&a),
        store.check(&b),
        store.check(&c),
        store.check(&d)
    );
    for answer in [answers.0, answers.1, answers.2, answers.3] {
        assert!(answer.unwrap()[0].admitted());
    }

    old.cli(&["replicaof", "127.0.0.1", &new.port().to_string()]);
    proxy.switch_to(new.port());

    let mut failures = 0;
    while let Err(error) = store.check(&check(9)).await {
        failures += 1;
        assert!(
            failures <= POOL,
            "still failing after {failures} checks: {error}"
        );
    }
    for client in 0..20 {
        let answer = store.check(&check(client)).await;
        assert!(
            answer.is_ok(),
            "check {client} after the failover: {answer:?}"
        );
    }
    assert!(new.cli(&["dbsize"]).trim().parse::<u64>().unwrap() > 0);
}

/// A connection whose other end vanishes without closing it (the proxy
/// stops carrying bytes and closes nothing) times checks out; once it has
/// answered nothing for a second, a timeout closes it and the next check
/// reconnects, here to the new primary behind the same address. Without
/// that, every check would time out, and every request fail open, for as
/// long as the process runs.
#[tokio::test]
async fn a_connection_that_falls_silent_is_replaced() {
    let old = RedisServer::start();
    let new = RedisServer::start();
    let proxy = TcpProxy::start(old.port());
    let pool = crate::support::pool_at(&proxy.url(), 4);
    let store = RedisStore::builder(pool)
        .with_timeout(TIMEOUT)
        .build()
        .unwrap();
    let policy = Policy::new("silent", 1_000_000, Duration::from_secs(60));
    let check = [Check::new(&policy, Key::new("c")).unwrap()];
    assert!(store.check(&check).await.unwrap()[0].admitted());

    proxy.switch_to(new.port());
    proxy.silence_open_connections();
    let started = Instant::now();
    let mut timeouts = 0;
    loop {
        match store.check(&check).await {
            Ok(decisions) => {
                assert!(decisions[0].admitted());
                break;
            }
            Err(slidegate::store::StoreError::Timeout(_)) => timeouts += 1,
            Err(error) => panic!("{error}"),
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "still timing out after {timeouts} checks"
        );
    }
    let recovered = started.elapsed();
    println!("silent connection: {timeouts} timeouts, replaced after {recovered:?}");
    // Answered by the new primary: a fresh count there.
    assert_eq!(
        store.check(&check).await.unwrap()[0].remaining(),
        1_000_000 - 2
    );
    assert!(
        recovered >= Duration::from_secs(1),
        "replaced after {recovered:?}"
    );
}

/// Redis's `used_memory`, in bytes.
fn used_memory(server: &RedisServer) -> u64 {
    server
        .cli(&["info", "memory"])
        .lines()
        .find_map(|line| line.strip_prefix("used_memory:"))
        .and_then(|bytes| bytes.trim().parse().ok())
        .expect("used_memory in INFO memory")
}

/// Under `maxmemory` with `noeviction`, a check that would write to a full
/// Redis is an error (so the policy's fail mode answers), never a silent
/// write past the limit.
#[tokio::test]
async fn a_full_redis_refuses_new_counts_instead_of_growing_past_its_limit() {
    const LIMIT: u64 = 3 * 1024 * 1024;
    let server =
        RedisServer::start_with(&["--maxmemory", "3mb", "--maxmemory-policy", "noeviction"]);
    let store = RedisStore::builder(server.pool(4))
        .with_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let policy = Policy::new("oom", 100, Duration::from_secs(3600));
    let mut refused = 0;
    for client in 0..20_000 {
        if refused == 100 {
            break;
        }
        let check = [Check::new(&policy, Key::new(format!("client-{client}"))).unwrap()];
        match store.check(&check).await {
            Ok(decisions) => assert!(decisions[0].admitted()),
            Err(error) => {
                refused += 1;
                assert!(
                    matches!(error, slidegate::store::StoreError::Full(_)),
                    "{error}"
                );
            }
        }
    }
    assert!(refused > 0, "a full Redis refused nothing");
    let used = used_memory(&server);
    assert!(
        used < LIMIT + LIMIT / 4,
        "Redis grew to {used} bytes against a {LIMIT}-byte limit"
    );
}

/// A lease taken by a check that timed out is released: under `CLIENT
/// PAUSE WRITE` a request on a concurrency-limited route times out,
/// fails open (or closed) and ends; the script still runs once Redis
/// resumes and takes its lease, which the request released by its id,
/// so the client is never locked out with nothing in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_whose_check_timed_out_is_released() {
    for fail_mode in [FailMode::Open, FailMode::Closed] {
        let server = RedisServer::start();
        let store = RedisStore::builder(server.pool(4))
            .with_timeout(Duration::from_millis(50))
            .build()
            .unwrap();
        let policy = Policy::concurrency("exports", 1)
            .with_lease(Duration::from_secs(30))
            .with_fail_mode(fail_mode);
        let policies = Policies::builder()
            .with_route("/lease", policy)
            .build()
            .unwrap();
        let app = Router::new()
            .route("/lease", get(|| async { "done" }))
            .route_layer(RateLimitLayer::new(store, PeerIp::new(), policies));
        assert_eq!(
            send(&app, "/lease", 7).await.0,
            StatusCode::OK,
            "{fail_mode:?}"
        );
        assert_eq!(
            server.cli(&["client", "pause", "300", "write"]).trim(),
            "OK"
        );
        let (paused, _) = send(&app, "/lease", 7).await;
        let expected = match fail_mode {
            FailMode::Open => StatusCode::OK,
            _ => StatusCode::SERVICE_UNAVAILABLE,
        };
        assert_eq!(paused, expected, "{fail_mode:?}: the check timed out");
        // Once Redis resumes, the queued script takes the lease and the
        // release gives it back: the client is admitted again.
        let started = Instant::now();
        let mut last = StatusCode::TOO_MANY_REQUESTS;
        while started.elapsed() < Duration::from_secs(3) {
            last = send(&app, "/lease", 7).await.0;
            if last == StatusCode::OK {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(last, StatusCode::OK, "{fail_mode:?}: a lease nobody holds");
        // The last request's own lease is released as its response ends,
        // on a task of its own: no lease is left once it lands (leases
        // score their time; a release whose check never ran leaves a
        // tombstone, scored below 0, that counts for nothing).
        let started = Instant::now();
        let key = "slidegate:exports:{ip:192.0.2.7}:n";
        while server.cli(&["zcount", key, "0", "+inf"]).trim() != "0" {
            assert!(
                started.elapsed() < Duration::from_secs(3),
                "{fail_mode:?}: a lease left behind"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// A Redis without the library (fresh, restarted, `FUNCTION FLUSH`):
/// the checks that meet it wait for it to load, past the store's
/// timeout, rather than fail as though Redis were down, where a policy
/// that fails open would admit them uncounted. Over a link of 40 ms each
/// way a warm check takes 80 ms, within the store's 200 ms; one that
/// loads the library takes three round trips (240 ms), and the checks
/// queued behind it wait as long. Before the load had a budget of its own,
/// every check here timed out.
#[tokio::test]
async fn checks_that_find_the_library_missing_wait_for_it_to_load() {
    let redis = RedisServer::start();
    let link = SlowLink::start(redis.port(), Duration::from_millis(40)).await;
    let store = RedisStore::builder(link.pool(4))
        .with_timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    // The connections made before the clock starts.
    store.connect(Duration::from_secs(10)).await.unwrap();
    let policy = Policy::new("cold", 2, Duration::from_secs(60));
    for round in ["fresh", "flushed"] {
        let checks: Vec<[Check; 1]> = (0..4)
            .map(|_| [Check::new(&policy, Key::new(round)).unwrap()])
            .collect();
        // One goes alone, the others queue behind it.
        let answers =
            futures_util::future::join_all(checks.iter().map(|check| store.check(check))).await;
        let mut admitted = 0;
        for answer in answers {
            let decisions = answer.unwrap_or_else(|error| panic!("{round}: {error}"));
            admitted += usize::from(decisions[0].admitted());
        }
        assert_eq!(admitted, 2, "{round}");
        redis.cli(&["FUNCTION", "FLUSH"]);
    }
}
