//! The layer allocates nothing of its own for an admitted request on the
//! memory store: the allocations of a request through the layer are those
//! of the same request to the inner service alone.

//!
//! One test, so that nothing else allocates in the process while it counts.

use std::alloc::System;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use axum::extract::ConnectInfo;
use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{Request, Response};
use http_body_util::Full;
use slidegate::{
    PeerIp, Policies, Policy, RateLimitLayer, clock::FakeClock, headers::HeaderStyle,
    policy::Algorithm, store::MemoryStore,
};
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};
use tower::{Layer, Service, ServiceExt, service_fn};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

type Body = Full<Bytes>;

/// A handler that answers with a body and a content type, as real ones do
/// (so the response's header map exists before the layer adds to it).
async fn handler(_: Request<Body>) -> Result<Response<Body>, Infallible> {
    let mut response = Response::new(Full::new(Bytes::from_static(b"ok")));
    response
        .headers_mut()
        .insert(CONTENT_TYPE, http::HeaderValue::from_static("text/plain"));
    Ok(response)
}

fn request() -> Request<Body> {
    let mut request = Request::get("/").body(Body::default()).unwrap();
    let peer = SocketAddr::from(([192, 0, 2, 7], 5000));
    request.extensions_mut().insert(ConnectInfo(peer));
    request
}

/// Allocations made while `service` answers one request (built before
/// counting starts); the response is dropped after counting ends.
async fn allocations_of<S, B>(service: &mut S) -> usize
where
    S: Service<Request<Body>, Response = Response<B>, Error = Infallible>,
{
    let request = request();
    let ready = service.ready().await.unwrap();
    let region = Region::new(GLOBAL);
    let response = ready.call(request).await.unwrap();
    let change = region.change();
    assert!(response.status().is_success(), "{:?}", response.status());
    drop(response);
    change.allocations + change.reallocations
}

/// Runs `requests` requests through the layer on a store on `clock`,
/// moving the clock on by `step` before each, and returns the most any
/// one of the last half allocated beyond what the handler alone does.
async fn extra_allocations(
    layer: RateLimitLayer,
    requests: u32,
    step: Duration,
    clock: &FakeClock,
) -> usize {
    let mut bare = service_fn(handler);
    let mut limited = layer.layer(service_fn(handler));
    let mut most = 0;
    for n in 0..requests {
        clock.advance(step);
        let own = allocations_of(&mut bare).await;
        let with_layer = allocations_of(&mut limited).await;
        if n >= requests / 2 {
            most = most.max(with_layer.saturating_sub(own));
        }
    }
    most
}

fn layer(clock: &FakeClock, algorithm: Algorithm) -> RateLimitLayer {
    let store = MemoryStore::builder().with_clock(clock.clone()).build();
    let policy = Policy::new("api", 100, Duration::from_secs(1)).with_algorithm(algorithm);
    RateLimitLayer::new(store, PeerIp::new(), Policies::single(policy).unwrap())
}

/// [`extra_allocations`] of a layer `make` builds on a fresh clock, run
/// twice from scratch, the fewer of the two. The count is the process's:
/// another thread (the test harness's) may allocate while a request is
/// counted, at a moment no run repeats, while what the layer allocates
/// comes back in both runs, request for request.
async fn steady_extra(make: impl Fn(&FakeClock) -> RateLimitLayer) -> usize {
    let step = Duration::from_millis(20);
    let mut fewest = usize::MAX;
    for _ in 0..2 {
        let clock = FakeClock::new(1_700_000_000_000_000);
        let extra = extra_allocations(make(&clock), 400, step, &clock).await;
        fewest = fewest.min(extra);
    }
    fewest
}

#[tokio::test]
async fn an_admitted_request_allocates_nothing_of_the_layers_own() {
    for algorithm in [
        Algorithm::SlidingLog,
        Algorithm::SlidingCounter,
        Algorithm::FixedWindow,
    ] {
        // 50 requests a second against a limit of 100: always admitted,
        // and a log that has reached its steady size.
        let extra = steady_extra(|clock| layer(clock, algorithm)).await;
        assert_eq!(
            extra, 0,
            "{algorithm:?}: {extra} allocations of the layer's own"
        );
    }
    // Without rate-limit headers, nothing either.
    let quiet = |clock: &FakeClock| {
        layer(clock, Algorithm::SlidingLog).with_header_style(HeaderStyle::None)
    };
    assert_eq!(steady_extra(quiet).await, 0);
    // The count sees what the layer does allocate: the `Identity`
    // extension, when asked for, is one box per request.
    let identity =
        |clock: &FakeClock| layer(clock, Algorithm::SlidingLog).with_identity_extension(true);
    assert_eq!(steady_extra(identity).await, 1);
}
