//! Concurrency limits on both stores: at most N requests of a client in
//! the handler at once, a lease held until the response body ends or is
//! dropped, and a lease nobody releases gone within its lease time.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::support::reply::send;
use crate::support::stores::StoreUnderTest;
use axum::Router;
use axum::body::Body;
use axum::routing::get;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use slidegate::{
    Global, Policies, Policy, RateLimitLayer,
    key::Key,
    store::{Check, Store},
};
use tower::ServiceExt;

/// Requests in the handler now, and the most there ever were.
#[derive(Default)]
struct InFlight {
    now: AtomicUsize,
    most: AtomicUsize,
}

/// A router whose `/slow` handler stays 20 ms, counting who is inside,
/// limited to `in_flight` at once; `/stream` answers a body that ends
/// when its sender is dropped; `/panic` panics.
fn app(store: Arc<dyn Store>, policy: Policy, counter: Arc<InFlight>) -> Router {
    let slow = move || {
        let counter = counter.clone();
        async move {
            let now = counter.now.fetch_add(1, Ordering::SeqCst) + 1;
            counter.most.fetch_max(now, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(20)).await;
            counter.now.fetch_sub(1, Ordering::SeqCst);
            "done"
        }
    };
    let stream = || async {
        let (sender, receiver) = tokio::sync::mpsc::channel(1);
        STREAMS.lock().unwrap().push(sender);
        Body::new(ChannelBody(receiver))
    };
    let policies = Policies::single(policy).unwrap();
    Router::new()
        .route("/slow", get(slow))
        .route("/stream", get(stream))
        .route("/panic", get(failing))
        .route_layer(RateLimitLayer::new(store, Global, policies))
}

/// The senders of the streaming bodies served so far.
static STREAMS: std::sync::Mutex<Vec<tokio::sync::mpsc::Sender<Bytes>>> =
    std::sync::Mutex::new(Vec::new());

/// A body whose chunks come from a channel, ending when its sender goes.
struct ChannelBody(tokio::sync::mpsc::Receiver<Bytes>);

impl http_body::Body for ChannelBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        self.0
            .poll_recv(cx)
            .map(|chunk| chunk.map(|bytes| Ok(http_body::Frame::data(bytes))))
    }
}

async fn failing() -> &'static str {
    panic!("the handler failed")
}

fn get_request(path: &str) -> Request<Body> {
    Request::get(path).body(Body::empty()).unwrap()
}

/// The units a check of `policy` would find free now.
async fn free(store: &Arc<dyn Store>, policy: &Policy) -> u32 {
    let check = [Check::new(policy, Key::parse("global").unwrap()).unwrap()];
    store.peek(&check).await.unwrap()[0].remaining()
}

/// Waits (at most five seconds) until every lease of `policy` is back:
/// a store across the network releases them on a task of its own.
async fn all_released(store: &Arc<dyn Store>, policy: &Policy) {
    until_free(store, policy, policy.limit()).await;
}

/// Waits (at most five seconds) until exactly `expected` places of
/// `policy` are free, releases on their own task having landed.
async fn until_free(store: &Arc<dyn Store>, policy: &Policy, expected: u32) {
    let started = std::time::Instant::now();
    while free(store, policy).await != expected {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{} free of {}, not {expected}",
            free(store, policy).await,
            policy.limit()
        );
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

async fn six_hundred_requests_never_put_more_than_ten_in_the_handler(tested: StoreUnderTest) {
    let store = tested.store.clone();
    let counter = Arc::new(InFlight::default());
    let policy = Policy::concurrency("slow", 10);
    let app = app(store.clone(), policy.clone(), counter.clone());
    let tasks: Vec<_> = (0..600)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move { send(&app, get_request("/slow")).await })
        })
        .collect();
    let (mut admitted, mut denied) = (0, 0);
    for task in tasks {
        let reply = task.await.unwrap();
        match reply.status {
            StatusCode::OK => admitted += 1,
            StatusCode::TOO_MANY_REQUESTS => {
                assert_eq!(reply.header("retry-after"), Some("1"));
                denied += 1;
            }
            other => panic!("unexpected {other}"),
        }
    }
    let most = counter.most.load(Ordering::SeqCst);
    eprintln!("{admitted} admitted, {denied} denied, at most {most} in the handler");
    assert!(most <= 10, "{most} requests in the handler at once");
    assert!(admitted >= 10, "only {admitted} admitted");
    assert_eq!(admitted + denied, 600);
    all_released(&store, &policy).await;
    if let Some(redis) = &tested.redis {
        assert_eq!(
            redis.cli(&["dbsize"]).trim(),
            "0",
            "a lease was left behind"
        );
    }
}
on_both_stores!(six_hundred_requests_never_put_more_than_ten_in_the_handler);

async fn a_lease_lasts_until_the_body_ends_or_is_dropped(tested: StoreUnderTest) {
    let store = tested.store.clone();
    let policy = Policy::concurrency("stream", 1);
    let app = app(store.clone(), policy.clone(), Arc::default());
    // The first response's headers are out, its body is not.
    let response = app.clone().oneshot(get_request("/stream")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let refused = send(&app, get_request("/stream")).await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    // The answer speaks of requests in flight, not of a window.
    let problem = refused.json();
    assert_eq!(
        problem["detail"],
        "concurrency limit of 1 in flight reached for policy `stream`; retry in 1 s"
    );
    assert_eq!(
        (
            problem["limit"].as_u64(),
            problem["retry_after_seconds"].as_u64()
        ),
        (Some(1), Some(1))
    );
    assert!(problem.get("window_seconds").is_none(), "{problem}");
    // The body ends: the lease goes back.
    let sender = STREAMS.lock().unwrap().pop().unwrap();
    sender.send(Bytes::from_static(b"part")).await.unwrap();
    drop(sender);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"part");
    all_released(&store, &policy).await;
    // A response dropped before its body is read gives its lease back.
    let response = app.clone().oneshot(get_request("/stream")).await.unwrap();
    assert_eq!(free(&store, &policy).await, 0);
    drop(response);
    all_released(&store, &policy).await;
    // So does a handler that panics.
    let panicked = tokio::spawn({
        let app = app.clone();
        async move { app.oneshot(get_request("/panic")).await }
    })
    .await;
    assert!(panicked.is_err(), "the handler panicked");
    all_released(&store, &policy).await;
    // And a request whose client goes away before the answer.
    let pending = tokio::spawn({
        let app = app.clone();
        async move { app.oneshot(get_request("/slow")).await }
    });
    tokio::time::sleep(Duration::from_millis(5)).await;
    pending.abort();
    let _ = pending.await;
    all_released(&store, &policy).await;
}
on_both_stores!(a_lease_lasts_until_the_body_ends_or_is_dropped);

/// An instance that dies holding leases never releases them: they expire
/// after the lease time, and until then they count.
async fn a_lease_nobody_releases_expires_after_its_lease_time(tested: StoreUnderTest) {
    let clock = tested.clock.clone().expect("a fake clock");
    let store = tested.store.clone();
    let policy = Policy::concurrency("orphans", 2).with_lease(Duration::from_secs(30));
    let app = app(store.clone(), policy.clone(), Arc::default());
    for _ in 0..2 {
        let response = app.clone().oneshot(get_request("/stream")).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        // The process holding it is gone: nothing will ever release it.
        std::mem::forget(response);
        clock.advance(Duration::from_micros(1));
    }
    assert_eq!(
        send(&app, get_request("/slow")).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    clock.advance(Duration::from_secs(30) - Duration::from_micros(3));
    assert_eq!(
        send(&app, get_request("/slow")).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    // The first expires; the second was taken a microsecond later, and
    // expires a microsecond later.
    clock.advance(Duration::from_micros(1));
    assert_eq!(
        send(&app, get_request("/slow")).await.status,
        StatusCode::OK
    );
    // The admitted request's own lease is released once its body ends.
    until_free(&store, &policy, 1).await;
    clock.advance(Duration::from_micros(1));
    all_released(&store, &policy).await;
}
on_both_stores!(
    a_lease_nobody_releases_expires_after_its_lease_time,
    fake_clock
);
