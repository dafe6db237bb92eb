//! Redis CPU per held request: requests that a policy's delay holds
//! (`with_delay`), sent at once through the layer on a real
//! `redis-server` with its own clock. Every script call's CPU (`INFO
//! commandstats`, `FCALL`) over the run, divided by the requests held
//! (admitted after a wait). A held request is decided once: one call,
//! and none again when it passes.
//!
//! ```sh
//! cargo bench --bench redis_held
//! ```

#[path = "../tests/it/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use http::{Request, StatusCode};
use slidegate::key::Header;
use slidegate::store::RedisStore;
use slidegate::{Policies, Policy, RateLimitLayer};
use support::RedisServer;
use support::reply::send;

const ROUNDS: usize = 3;

/// `clients` clients sending `each` requests at once, under a limit of
/// `limit` per 300 ms held for up to 1 s: (held requests, µs of Redis
/// CPU in script calls).
async fn round(
    server: &RedisServer,
    prefix: &str,
    clients: usize,
    each: usize,
    limit: u32,
) -> (usize, f64) {
    let store = RedisStore::builder(server.pool(8))
        .with_prefix(prefix)
        .with_timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let policy =
        Policy::new("held", limit, Duration::from_millis(300)).with_delay(Duration::from_secs(1));
    let layer = RateLimitLayer::new(
        store,
        Header::trusted(http::HeaderName::from_static("x-client")).with_public_values(true),
        Policies::single(policy).unwrap(),
    );
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .route_layer(layer);
    server.cli(&["config", "resetstat"]);
    let tasks: Vec<_> = (0..clients * each)
        .map(|i| {
            let app = app.clone();
            tokio::spawn(async move {
                let request = Request::get("/")
                    .header("x-client", format!("client{}", i % clients))
                    .body(Body::empty())
                    .unwrap();
                let started = Instant::now();
                let reply = send(&app, request).await;
                (reply.status, started.elapsed())
            })
        })
        .collect();
    let mut held = 0;
    for task in tasks {
        let (status, took) = task.await.unwrap();
        assert!(
            status == StatusCode::OK || status == StatusCode::TOO_MANY_REQUESTS,
            "{status}"
        );
        if status == StatusCode::OK && took >= Duration::from_millis(200) {
            held += 1;
        }
    }
    (held, fcall_usec(server))
}

/// The CPU (µs) Redis spent in `FCALL` since its stats were reset.
fn fcall_usec(server: &RedisServer) -> f64 {
    let stats = server.cli(&["info", "commandstats"]);
    stats
        .lines()
        .filter(|line| line.starts_with("cmdstat_fcall"))
        .filter_map(|line| {
            let usec = line
                .split(',')
                .find_map(|field| field.strip_prefix("usec="))?;
            usec.parse::<f64>().ok()
        })
        .sum()
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let server = RedisServer::start();
    println!("| scenario | µs of Redis CPU per held request, rounds | median |");
    println!("|---|---|---:|");
    for (name, clients, each, limit) in [
        ("60 clients × 10 requests, limit 5", 60, 10, 5),
        ("1 client × 40 requests, limit 10", 1, 40, 10),
    ] {
        let mut per_held = Vec::new();
        for r in 0..ROUNDS {
            let prefix = format!("held{clients}x{each}r{r}");
            let (held, usec) = runtime.block_on(round(&server, &prefix, clients, each, limit));
            assert!(held > 0, "no request was held in {name}");
            per_held.push(usec / held as f64);
        }
        let mut sorted = per_held.clone();
        sorted.sort_by(f64::total_cmp);
        let rounds: Vec<String> = per_held.iter().map(|v| format!("{v:.1}")).collect();
        println!(
            "| {name} | {} | {:.1} |",
            rounds.join(", "),
            sorted[ROUNDS / 2]
        );
    }
}
