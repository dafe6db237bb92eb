//! The layer's own cost per request, in process (no sockets), for profiling:
//! one variant per run, so that `valgrind --tool=callgrind` or `perf` sees
//! only it.
//!
//! ```sh
//! cargo build --release --example layer_cost
//! target/release/examples/layer_cost memory            # prints ns/request
//! N=20000 valgrind --tool=callgrind target/release/examples/layer_cost memory
//! ```
//!
//! Variants: `bare` (axum alone), `noop-layer` (axum with a `route_layer`
//! that does nothing, to tell axum's cost of a route layer from ours),
//! `memory` (slidegate on `MemoryStore`), `global` (the same policy beside
//! one for every client together, `Policy::per(Global)`), `no-headers` (the same without
//! rate-limit headers), `identity` (the same, handing the `Identity`
//! extension to the handler), `denied` (every request from a denied
//! client, answered by the deny cache), and the other kinds of limit at
//! the same rate: `bucket` (a token bucket), `concurrency` (a lease per
//! request, released as its body ends), `blocking` (a sliding log whose
//! denials block), `delay` (a sliding log that may hold requests),
//! `settled` (a sliding log whose requests reserve 1 and report 2 in a
//! header, settled as the body ends) and `calendar` (a monthly quota);
//! and, on a memory store that says it is remote (the layer's path for
//! Redis, with its deny cache, but no network): `remote` (the policy of
//! `memory`) and `sliced` (the same with slices of 100, answered in
//! process). `message` is not a request: each turn is one WebSocket
//! message of a client admitted by its `MessageLimit` (4,000 an hour per
//! client), the handle the layer lends the request that opened the socket.
//!
//! Requests come from 256 client addresses in turn, each allowed 4,000 an
//! hour: every request of a run (300,000 by default) is admitted, and the
//! header values stay in the range the layer keeps ready-made.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use axum::{Extension, Router};
use http::Request;
use slidegate::{
    Global, PeerIp, Policies, Policy, RateLimitLayer,
    headers::HeaderStyle,
    layer::{DenyCache, MessageLimit},
    policy::MessageRate,
    store::{Check, MemoryStore, Store, StoreFuture},
};
use tower::{Service, ServiceExt};

/// Clients the requests come from, in turn.
const CLIENTS: u32 = 256;

thread_local! {
    /// The message limits the `message` variant's requests are lent.
    static LENT: std::cell::RefCell<Vec<MessageLimit>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A memory store that says it is remote, so that the layer takes the path
/// it takes for Redis.
struct Remote(MemoryStore);

impl Store for Remote {
    fn check(&self, checks: &[Check]) -> StoreFuture {
        self.0.check(checks)
    }

    fn peek(&self, checks: &[Check]) -> StoreFuture {
        self.0.peek(checks)
    }

    fn refund(&self, checks: &[Check], recorded_at: &[Duration]) -> StoreFuture<()> {
        self.0.refund(checks, recorded_at)
    }

    fn settle(&self, checks: &[Check], recorded_at: &[Duration], costs: &[u64]) -> StoreFuture<()> {
        self.0.settle(checks, recorded_at, costs)
    }

    fn is_remote(&self) -> bool {
        true
    }
}

fn app(variant: &str) -> Router {
    let routes = Router::new().route("/", get(|| async { "hello" }));
    let reporting =
        Router::new().route("/", get(|| async { ([("x-usage-tokens", "2")], "hello") }));
    let open = Policies::single(Policy::new("bench", 4_000, Duration::from_secs(3600)))
        .expect("a valid policy");
    let denied = Policies::single(Policy::new("bench", 1, Duration::from_secs(3600)))
        .expect("a valid policy");
    let layer = |policies| RateLimitLayer::new(MemoryStore::new(), PeerIp::new(), policies);
    let kind = |policy: Policy| Policies::single(policy).expect("a valid policy");
    let open_log = || Policy::new("bench", 4_000, Duration::from_secs(3600));
    match variant {
        "bare" => routes,
        "noop-layer" => routes.route_layer(tower::layer::util::Identity::new()),
        "memory" => routes.route_layer(layer(open)),
        "no-headers" => routes.route_layer(layer(open).with_header_style(HeaderStyle::None)),
        "identity" => routes.route_layer(layer(open).with_identity_extension(true)),
        "denied" => routes.route_layer(layer(denied).with_deny_cache(DenyCache::new(1000))),
        "bucket" => routes.route_layer(layer(kind(
            open_log().with_algorithm(slidegate::policy::Algorithm::TokenBucket),
        ))),
        "concurrency" => routes.route_layer(layer(kind(Policy::concurrency("bench", 64)))),
        "blocking" => {
            routes.route_layer(layer(kind(open_log().with_block(Duration::from_secs(600)))))
        }
        "delay" => routes.route_layer(layer(kind(
            open_log().with_delay(Duration::from_millis(500)),
        ))),
        "settled" => reporting.route_layer(layer(kind(
            open_log().with_usage_header(http::HeaderName::from_static("x-usage-tokens")),
        ))),
        "remote" => routes.route_layer(RateLimitLayer::new(
            Remote(MemoryStore::new()),
            PeerIp::new(),
            kind(open_log()),
        )),
        "sliced" => routes.route_layer(RateLimitLayer::new(
            Remote(MemoryStore::new()),
            PeerIp::new(),
            kind(open_log().with_slice(100)),
        )),
        "global" => routes.route_layer(layer(
            Policies::builder()
                .with_every_route(open_log())
                .with_every_route(
                    Policy::new("everyone", 1_000_000_000, Duration::from_secs(3600)).per(Global),
                )
                .build()
                .expect("valid policies"),
        )),
        "message" => Router::new()
            .route(
                "/",
                get(|Extension(limit): Extension<MessageLimit>| async move {
                    LENT.with(|lent| lent.borrow_mut().push(limit));
                    "socket"
                }),
            )
            .route_layer(layer(kind(
                Policy::new("bench", 4_000, Duration::from_secs(3600))
                    .with_messages(MessageRate::new(4_000, Duration::from_secs(3600))),
            ))),
        "calendar" => routes.route_layer(layer(kind(Policy::calendar(
            "bench",
            4_000,
            slidegate::policy::Calendar::new(slidegate::policy::Period::Month),
        )))),
        other => panic!(
            "unknown variant `{other}`: bare, noop-layer, memory, global, no-headers, identity, \
             denied, bucket, concurrency, blocking, delay, settled, calendar, remote, sliced or \
             message"
        ),
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let variant = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "memory".to_owned());
    let requests: u32 = std::env::var("N")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(300_000);
    // As `axum::serve` does: routes are made into services once, not per
    // request.
    let mut service = app(&variant).with_state(()).into_service::<Body>();
    let peers: Vec<SocketAddr> = (0..CLIENTS)
        .map(|n| SocketAddr::from(([10, 0, (n / 256) as u8, (n % 256) as u8], 5000)))
        .collect();
    if variant == "message" {
        // One socket per client: the request that opens it, then its
        // messages in turn.
        for peer in &peers {
            let mut request = Request::get("/").body(Body::empty()).expect("a request");
            request.extensions_mut().insert(ConnectInfo(*peer));
            let ready = service.ready().await.expect("the router is always ready");
            ready.call(request).await.expect("infallible");
        }
        let sockets = LENT.with(|lent| std::mem::take(&mut *lent.borrow_mut()));
        let started = Instant::now();
        for n in 0..requests {
            let admitted = sockets[(n % CLIENTS) as usize].admit().await;
            assert!(std::hint::black_box(admitted).is_ok(), "within the rate");
        }
        let per_message = started.elapsed().as_nanos() / u128::from(requests);
        println!("{variant}: {per_message} ns/message");
        return;
    }
    let started = Instant::now();
    for n in 0..requests {
        let mut request = Request::get("/").body(Body::empty()).expect("a request");
        request
            .extensions_mut()
            .insert(ConnectInfo(peers[(n % CLIENTS) as usize]));
        let ready = service.ready().await.expect("the router is always ready");
        std::hint::black_box(ready.call(request).await.expect("infallible"));
    }
    let per_request = started.elapsed().as_nanos() / u128::from(requests);
    println!("{variant}: {per_request} ns/request");
}
