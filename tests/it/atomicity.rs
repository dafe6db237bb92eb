//! Zero over-admission under concurrency: many tasks, several independent
//! limiter instances, one Redis (or one MemoryStore across threads).

use std::sync::Arc;
use std::time::Duration;

use crate::support::RedisServer;
use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use http::{Request, StatusCode};
use slidegate::{
    PeerIp, Policies, Policy, RateLimitLayer,
    key::Key,
    store::{Check, MemoryStore, RedisStore, Store},
};
use tower::ServiceExt;

const REQUESTS: usize = 600;
const TRIALS: usize = 5;

/// A store pipelining its checks on `connections` shared connections.
fn redis_store(server: &RedisServer, connections: usize) -> RedisStore {
    // A generous timeout: this test is about exactness, not latency.
    RedisStore::builder(server.pool(16))
        .with_connections(connections)
        .with_timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_admits_exactly_the_limit_across_independent_stores() {
    let server = RedisServer::start();
    let stores = [
        Arc::new(redis_store(&server, 1)),
        Arc::new(redis_store(&server, 3)),
    ];
    for (trial, (limit, cost)) in [(100, 1), (250, 1), (1, 1), (100, 3), (599, 1)]
        .into_iter()
        .enumerate()
        .take(TRIALS)
    {
        let policy = Policy::new("atomic", limit, Duration::from_secs(60)).with_cost(cost);
        let key = Key::new(format!("trial-{trial}"));
        let tasks: Vec<_> = (0..REQUESTS)
            .map(|i| {
                let store = stores[i % 2].clone();
                let check = Check::new(&policy, key.clone()).unwrap();
                tokio::spawn(async move { store.check(&[check]).await })
            })
            .collect();
        let mut admitted = 0;
        for task in tasks {
            let decisions = task.await.unwrap().expect("no store errors");
            admitted += u32::from(decisions[0].admitted());
        }
        let expected = (limit / cost).min(REQUESTS as u32);
        println!(
            "trial {trial}: {REQUESTS} concurrent requests through 2 RedisStores, limit {limit}, cost {cost}: {admitted} admitted"
        );
        assert_eq!(admitted, expected, "trial {trial} over- or under-admitted");
    }
}

fn app(store: impl Store, limit: u32) -> Router {
    let policies = Policies::single(Policy::new("http", limit, Duration::from_secs(60))).unwrap();
    Router::new()
        .route("/", get(|| async { "ok" }))
        .route_layer(RateLimitLayer::new(store, PeerIp::new(), policies))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_layers_on_one_redis_admit_exactly_the_limit() {
    let server = RedisServer::start();
    let apps = [
        app(redis_store(&server, 2), 200),
        app(redis_store(&server, 1), 200),
    ];
    let tasks: Vec<_> = (0..REQUESTS)
        .map(|i| {
            let app = apps[i % 2].clone();
            tokio::spawn(async move {
                let mut request = Request::get("/").body(Body::empty()).unwrap();
                request
                    .extensions_mut()
                    .insert(ConnectInfo(std::net::SocketAddr::from((
                        [192, 0, 2, 1],
                        4000,
                    ))));
                app.oneshot(request).await.unwrap().status()
            })
        })
        .collect();
    let mut ok = 0;
    let mut limited = 0;
    for task in tasks {
        match task.await.unwrap() {
            StatusCode::OK => ok += 1,
            StatusCode::TOO_MANY_REQUESTS => limited += 1,
            other => panic!("unexpected status {other}"),
        }
    }
    println!(
        "{REQUESTS} concurrent HTTP requests through 2 layers: {ok} admitted, {limited} limited"
    );
    assert_eq!(ok, 200);
    assert_eq!(limited, REQUESTS - 200);
}

#[test]
fn memory_store_admits_exactly_the_limit_across_threads() {
    let store = MemoryStore::new();
    let per_key = Policy::new("endpoint", 250, Duration::from_secs(60));
    let shared = Policy::new("account", 400, Duration::from_secs(60));
    for trial in 0..TRIALS {
        let admitted: u32 = std::thread::scope(|scope| {
            let threads: Vec<_> = (0..8)
                .map(|thread| {
                    let store = store.clone();
                    let (per_key, shared) = (&per_key, &shared);
                    scope.spawn(move || {
                        let runtime = tokio::runtime::Builder::new_current_thread()
                            .build()
                            .unwrap();
                        let mut admitted = 0;
                        for i in 0..100 {
                            let a = Check::new(per_key, Key::new(format!("t{trial}"))).unwrap();
                            let b = Check::new(shared, Key::new(format!("t{trial}"))).unwrap();
                            // Alternate the order, so lock ordering is exercised.
                            let checks = if (thread + i) % 2 == 0 {
                                vec![a, b]
                            } else {
                                vec![b, a]
                            };
                            let decisions = runtime.block_on(store.check(&checks)).unwrap();
                            admitted += u32::from(decisions[0].admitted());
                        }
                        admitted
                    })
                })
                .collect();
            threads.into_iter().map(|t| t.join().unwrap()).sum()
        });
        println!(
            "trial {trial}: 800 requests on 8 threads, limits 250 and 400: {admitted} admitted"
        );
        assert_eq!(admitted, 250);
    }
}
