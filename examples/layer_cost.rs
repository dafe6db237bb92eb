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
//! Variants: `bare` (axum alone), `memory` (slidegate on `MemoryStore`),
//! `no-headers` (the same without rate-limit headers), `denied` (every
//! request from a denied client, answered by the deny cache).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use http::Request;
use slidegate::{DenyCache, HeaderStyle, MemoryStore, PeerIp, Policies, Policy, RateLimitLayer};
use tower::{Service, ServiceExt};

fn app(variant: &str) -> Router {
    let routes = Router::new().route("/", get(|| async { "hello" }));
    let open = Policies::single(Policy::new("bench", 1_000_000_000, Duration::from_secs(1)))
        .expect("a valid policy");
    let denied = Policies::single(Policy::new("bench", 1, Duration::from_secs(3600)))
        .expect("a valid policy");
    match variant {
        "bare" => routes,
        "memory" => {
            routes.route_layer(RateLimitLayer::new(MemoryStore::new(), PeerIp::new(), open))
        }
        "no-headers" => routes.route_layer(
            RateLimitLayer::new(MemoryStore::new(), PeerIp::new(), open)
                .header_style(HeaderStyle::None),
        ),
        "denied" => routes.route_layer(
            RateLimitLayer::new(MemoryStore::new(), PeerIp::new(), denied)
                .deny_cache(DenyCache::new(1000)),
        ),
        other => panic!("unknown variant `{other}`: bare, memory, no-headers or denied"),
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
    let peer: SocketAddr = "127.0.0.1:5000".parse().expect("an address");
    let started = Instant::now();
    for _ in 0..requests {
        let mut request = Request::get("/").body(Body::empty()).expect("a request");
        request.extensions_mut().insert(ConnectInfo(peer));
        let ready = service.ready().await.expect("the router is always ready");
        std::hint::black_box(ready.call(request).await.expect("infallible"));
    }
    let per_request = started.elapsed().as_nanos() / u128::from(requests);
    println!("{variant}: {per_request} ns/request");
}
