//! One variant of a one-route axum server, for the HTTP load harness
//! (`scripts/bench-http`): bare, or behind slidegate, tower-governor or a
//! naive hand-written Redis middleware.
//!
//! ```sh
//! cargo run --release --example bench_server -- memory --bind 127.0.0.1:8080
//! cargo run --release --example bench_server -- redis --redis redis://127.0.0.1:6379/
//! cargo run --release --example bench_server -- naive --scenario many \
//!     --cluster redis://127.0.0.1:7000/,redis://127.0.0.1:7001/,redis://127.0.0.1:7002/
//! ```

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use clap::{Parser, ValueEnum};
use slidegate::deadpool_redis::redis::aio::{ConnectionLike, MultiplexedConnection};
use slidegate::deadpool_redis::redis::cluster::ClusterClient;
use slidegate::deadpool_redis::redis::cluster_async::ClusterConnection;
use slidegate::deadpool_redis::redis::{Client, Script};
use slidegate::deadpool_redis::{Config, PoolConfig, Runtime, cluster};
use slidegate::{
    Global, PeerIp, Policies, Policy, RateLimitLayer,
    store::{MemoryStore, RedisPool, RedisStore},
};

/// A limit no benchmark reaches: every request is admitted and recorded.
const NEVER: u32 = 1_000_000_000;

/// The sliding log a user writes by hand: a sorted set of request times,
/// pruned, counted and added to in one script.
const NAIVE_SCRIPT: &str = r"
local t = redis.call('TIME')
local now = t[1] * 1000000 + t[2]
local window = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[1]) then
  redis.call('ZADD', KEYS[1], now, ARGV[3])
  redis.call('PEXPIRE', KEYS[1], math.ceil(window / 1000))
  return 1
end
return 0
";

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Variant {
    /// axum alone.
    Bare,
    /// axum with a `route_layer` that does nothing: axum's own cost of a
    /// route layer, apart from ours.
    NoopLayer,
    /// slidegate on the in-memory store.
    Memory,
    /// tower-governor keyed by peer IP, with a quota that never denies.
    Governor,
    /// slidegate on Redis.
    Redis,
    /// slidegate on Redis, the per-client policy beside one for every
    /// client together (`Policy::per(Global)`), which never denies.
    RedisGlobal,
    /// `RedisGlobal` with the count for everyone in slices of 100
    /// (`Policy::with_slice`): a hot key answered in process.
    RedisGlobalSliced,
    /// slidegate on the in-memory store, per client and for everyone.
    MemoryGlobal,
    /// slidegate on Redis, each instance taking slices of 100 units
    /// (`Policy::with_slice`).
    RedisSliced,
    /// slidegate on Redis, every check its own script call.
    RedisUnbatched,
    /// slidegate on Redis without the deny cache: every request asks Redis.
    RedisUncached,
    /// A hand-written sorted-set sliding log, one EVALSHA per request on
    /// one shared multiplexed (or cluster) connection.
    Naive,
    /// slidegate on Redis, every request from a denied client, deny cache on.
    DeniedCached,
    /// The same with the deny cache off.
    DeniedUncached,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Scenario {
    /// Every request from one client, under a limit it never reaches.
    One,
    /// Clients named by `X-Forwarded-For` from a trusted 127.0.0.1,
    /// 100 requests per 60 s each, so that admits and denies mix.
    Many,
}

#[derive(Debug, Parser)]
struct Args {
    variant: Variant,
    #[arg(long, value_enum, default_value = "one")]
    scenario: Scenario,
    #[arg(long, default_value = "127.0.0.1:8080")]
    bind: SocketAddr,
    #[arg(long, default_value = "redis://127.0.0.1:6379/")]
    redis: String,
    /// Redis Cluster seed URLs, comma-separated; replaces `--redis`.
    #[arg(long, value_delimiter = ',')]
    cluster: Vec<String>,
    /// Tokio worker threads.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Connections `RedisStore` holds and shares.
    #[arg(long, default_value_t = 1)]
    connections: usize,
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
    let app = app(&args).await;
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

impl Args {
    fn pool(&self) -> RedisPool {
        if self.cluster.is_empty() {
            let mut config = Config::from_url(&self.redis);
            config.pool = Some(PoolConfig::new(32));
            config
                .create_pool(Some(Runtime::Tokio1))
                .expect("a Redis pool")
                .into()
        } else {
            let mut config = cluster::Config::from_urls(self.cluster.clone());
            config.pool = Some(PoolConfig::new(32));
            config
                .create_pool(Some(Runtime::Tokio1))
                .expect("a Redis Cluster pool")
                .into()
        }
    }

    fn limit(&self) -> (u32, Duration) {
        match self.scenario {
            Scenario::One => (NEVER, Duration::from_secs(1)),
            Scenario::Many => (100, Duration::from_secs(60)),
        }
    }

    fn peer_ip(&self) -> PeerIp {
        match self.scenario {
            Scenario::One => PeerIp::new(),
            Scenario::Many => PeerIp::new().with_trusted_proxies(["127.0.0.1/32".parse().unwrap()]),
        }
    }
}

async fn app(args: &Args) -> Router {
    let routes = Router::new().route("/", get(|| async { "hello" }));
    let (limit, window) = args.limit();
    let policies = || Policies::single(Policy::new("bench", limit, window)).unwrap();
    let denied = || Policies::single(Policy::new("denied", 1, Duration::from_secs(3600))).unwrap();
    // A login's two limits: per client, and for everyone (one key every
    // request touches), both sliding logs, as `per = "global"` writes it.
    let with_everyone_in = |slice: Option<u32>| {
        let mut everyone = Policy::new("everyone", NEVER, Duration::from_secs(1)).per(Global);
        if let Some(slice) = slice {
            everyone = everyone.with_slice(slice);
        }
        Policies::builder()
            .with_every_route(Policy::new("bench", limit, window))
            .with_every_route(everyone)
            .build()
            .unwrap()
    };
    let with_everyone = || with_everyone_in(None);
    let batched_store = || redis_store(args, true);
    match args.variant {
        Variant::Bare => routes,
        Variant::NoopLayer => routes.route_layer(tower::layer::util::Identity::new()),
        Variant::Memory => routes.route_layer(RateLimitLayer::new(
            MemoryStore::new(),
            args.peer_ip(),
            policies(),
        )),
        Variant::Governor => {
            let config = tower_governor::governor::GovernorConfigBuilder::default()
                .per_nanosecond(1)
                .burst_size(u32::MAX)
                .finish()
                .expect("a governor quota");
            routes.route_layer(tower_governor::GovernorLayer::new(Arc::new(config)))
        }
        Variant::RedisUncached => routes.route_layer(
            RateLimitLayer::new(batched_store(), args.peer_ip(), policies()).with_deny_cache(None),
        ),
        Variant::RedisUnbatched => routes.route_layer(RateLimitLayer::new(
            redis_store(args, false),
            args.peer_ip(),
            policies(),
        )),
        Variant::Redis => routes.route_layer(RateLimitLayer::new(
            batched_store(),
            args.peer_ip(),
            policies(),
        )),
        Variant::RedisGlobal => routes.route_layer(RateLimitLayer::new(
            batched_store(),
            args.peer_ip(),
            with_everyone(),
        )),
        Variant::RedisGlobalSliced => routes.route_layer(RateLimitLayer::new(
            batched_store(),
            args.peer_ip(),
            with_everyone_in(Some(100)),
        )),
        Variant::MemoryGlobal => routes.route_layer(RateLimitLayer::new(
            MemoryStore::new(),
            args.peer_ip(),
            with_everyone(),
        )),
        Variant::RedisSliced => routes.route_layer(RateLimitLayer::new(
            batched_store(),
            args.peer_ip(),
            Policies::single(Policy::new("bench", limit, window).with_slice(limit.min(100)))
                .unwrap(),
        )),
        Variant::Naive => {
            let connection = if args.cluster.is_empty() {
                let client = Client::open(args.redis.as_str()).expect("a Redis URL");
                let connection = client
                    .get_multiplexed_async_connection()
                    .await
                    .expect("connect to Redis");
                NaiveConnection::Standalone(connection)
            } else {
                let client = ClusterClient::new(args.cluster.clone()).expect("cluster URLs");
                let connection = client
                    .get_async_connection()
                    .await
                    .expect("connect to the cluster");
                NaiveConnection::Cluster(connection)
            };
            routes.route_layer(middleware::from_fn_with_state(
                Naive {
                    connection,
                    script: Arc::new(Script::new(NAIVE_SCRIPT)),
                    limit,
                    window_micros: window.as_micros() as u64,
                    sequence: Arc::new(AtomicU64::new(0)),
                },
                naive,
            ))
        }
        Variant::DeniedCached => routes.route_layer(RateLimitLayer::new(
            batched_store(),
            PeerIp::new(),
            denied(),
        )),
        Variant::DeniedUncached => routes.route_layer(
            RateLimitLayer::new(batched_store(), PeerIp::new(), denied()).with_deny_cache(None),
        ),
    }
}

fn redis_store(args: &Args, batch: bool) -> RedisStore {
    RedisStore::builder(args.pool())
        .with_connections(args.connections)
        .with_batch(batch)
        .with_timeout(Duration::from_millis(200))
        .build()
        .unwrap()
}

/// One connection shared by every request: clones are handles on it.
#[derive(Clone)]
enum NaiveConnection {
    Standalone(MultiplexedConnection),
    Cluster(ClusterConnection),
}

/// What the naive middleware needs.
#[derive(Clone)]
struct Naive {
    connection: NaiveConnection,
    script: Arc<Script>,
    limit: u32,
    window_micros: u64,
    /// Makes each request's sorted-set member unique.
    sequence: Arc<AtomicU64>,
}

/// The hand-rolled baseline: one EVALSHA per request, keyed by the first
/// `X-Forwarded-For` address or else the peer IP; no headers, no timeout,
/// no key hashing.
async fn naive(
    State(naive): State<Naive>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    request: Request,
    next: Next,
) -> Response {
    let client = request
        .headers()
        .get("x-forwarded-for")
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.split(',').next())
        .and_then(|first| first.trim().parse::<IpAddr>().ok())
        .unwrap_or(peer.ip());
    let member = naive.sequence.fetch_add(1, Ordering::Relaxed);
    let mut invocation = naive.script.key(format!("naive:{{{client}}}"));
    invocation
        .arg(naive.limit)
        .arg(naive.window_micros)
        .arg(member);
    let reply: Result<i64, _> = match naive.connection.clone() {
        NaiveConnection::Standalone(mut connection) => invoke(&invocation, &mut connection).await,
        NaiveConnection::Cluster(mut connection) => invoke(&invocation, &mut connection).await,
    };
    match reply {
        Ok(1) => next.run(request).await,
        Ok(_) => StatusCode::TOO_MANY_REQUESTS.into_response(),
        Err(_) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
    }
}

async fn invoke(
    invocation: &slidegate::deadpool_redis::redis::ScriptInvocation<'_>,
    connection: &mut (impl ConnectionLike + Send),
) -> slidegate::deadpool_redis::redis::RedisResult<i64> {
    invocation.invoke_async(connection).await
}
