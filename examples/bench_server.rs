//! One variant of a one-route axum server, for the HTTP load harness
//! (`scripts/bench-http`): bare, or behind slidegate, tower-governor or a
//! naive one-`EVALSHA` middleware.
//!
//! ```sh
//! cargo run --release --example bench_server -- memory --bind 127.0.0.1:8080
//! cargo run --release --example bench_server -- redis --redis redis://127.0.0.1:6379/
//! ```

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use clap::{Parser, ValueEnum};
use slidegate::deadpool_redis::redis::Script;
use slidegate::deadpool_redis::{Config, Pool, PoolConfig, Runtime};
use slidegate::{MemoryStore, PeerIp, Policies, Policy, RateLimitLayer, RedisStore};

/// A limit no benchmark reaches: every request is admitted and recorded.
const NEVER: u32 = 1_000_000_000;

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Variant {
    /// axum alone.
    Bare,
    /// slidegate on the in-memory store.
    Memory,
    /// tower-governor keyed by peer IP, with a quota that never denies.
    Governor,
    /// slidegate on Redis.
    Redis,
    /// One plain EVALSHA of slidegate's script per request, nothing else.
    Naive,
    /// slidegate on Redis, every request from a denied client, deny cache on.
    DeniedCached,
    /// The same with the deny cache off.
    DeniedUncached,
}

#[derive(Debug, Parser)]
struct Args {
    variant: Variant,
    #[arg(long, default_value = "127.0.0.1:8080")]
    bind: SocketAddr,
    #[arg(long, default_value = "redis://127.0.0.1:6379/")]
    redis: String,
    /// Tokio worker threads.
    #[arg(long, default_value_t = 1)]
    threads: usize,
}

fn main() {
    let args = Args::parse();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads)
        .enable_all()
        .build()
        .expect("a Tokio runtime")
        .block_on(serve(args));
}

async fn serve(args: Args) {
    let app = app(&args);
    let listener = tokio::net::TcpListener::bind(args.bind)
        .await
        .expect("bind the benchmark address");
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await
    .expect("serve");
}

fn pool(url: &str) -> Pool {
    let mut config = Config::from_url(url);
    config.pool = Some(PoolConfig::new(32));
    config
        .create_pool(Some(Runtime::Tokio1))
        .expect("a Redis pool")
}

fn app(args: &Args) -> Router {
    let routes = Router::new().route("/", get(|| async { "hello" }));
    let open = || Policies::single(Policy::new("bench", NEVER, Duration::from_secs(1))).unwrap();
    let denied = || Policies::single(Policy::new("denied", 1, Duration::from_secs(3600))).unwrap();
    let redis_store = || {
        RedisStore::builder(pool(&args.redis))
            .timeout(Duration::from_millis(200))
            .build()
    };
    match args.variant {
        Variant::Bare => routes,
        Variant::Memory => routes.route_layer(RateLimitLayer::new(
            MemoryStore::new(),
            PeerIp::new(),
            open(),
        )),
        Variant::Governor => {
            let config = tower_governor::governor::GovernorConfigBuilder::default()
                .per_nanosecond(1)
                .burst_size(u32::MAX)
                .finish()
                .expect("a governor quota");
            routes.route_layer(tower_governor::GovernorLayer::new(Arc::new(config)))
        }
        Variant::Redis => {
            routes.route_layer(RateLimitLayer::new(redis_store(), PeerIp::new(), open()))
        }
        Variant::Naive => routes.route_layer(middleware::from_fn_with_state(
            Naive {
                pool: pool(&args.redis),
                script: Arc::new(Script::new(include_str!("../lua/check.lua"))),
            },
            naive,
        )),
        Variant::DeniedCached => {
            routes.route_layer(RateLimitLayer::new(redis_store(), PeerIp::new(), denied()))
        }
        Variant::DeniedUncached => routes.route_layer(
            RateLimitLayer::new(redis_store(), PeerIp::new(), denied()).without_deny_cache(),
        ),
    }
}

/// What the naive middleware needs: a pool and the script.
#[derive(Clone)]
struct Naive {
    pool: Pool,
    script: Arc<Script>,
}

/// The hand-rolled baseline: one EVALSHA per request, keyed by peer IP; no
/// headers, no timeout, no key hashing.
async fn naive(
    State(naive): State<Naive>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    request: Request,
    next: Next,
) -> Response {
    let key = format!("naive:bench:{{{}}}", peer.ip());
    let Ok(mut connection) = naive.pool.get().await else {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    };
    let reply: Result<Vec<i64>, _> = naive
        .script
        .key(format!("{key}:l"))
        .key(&key)
        .arg("")
        .arg("log")
        .arg(NEVER)
        .arg(1_000_000)
        .arg(1)
        .invoke_async(&mut connection)
        .await;
    match reply {
        Ok(values) if values.first() == Some(&1) => next.run(request).await,
        Ok(_) => StatusCode::TOO_MANY_REQUESTS.into_response(),
        Err(_) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
    }
}
