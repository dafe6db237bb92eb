//! The decision core through the layer, on the memory store: what is
//! decided at once, what waits, and that a request waiting on a lookup
//! is decided under the policies it started with.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use tokio::sync::Notify;
use tower::{Layer, Service, ServiceExt, service_fn};

use crate::RateLimitLayer;
use crate::headers::{X_RATELIMIT_LIMIT, X_RATELIMIT_REMAINING};
use crate::key::{Global, Identity};
use crate::policy::{Cost, Policies, Policy};
use crate::store::MemoryStore;

type Handler = tower::util::ServiceFn<
    fn(Request<()>) -> std::future::Ready<Result<Response<Bytes>, Infallible>>,
>;

fn handler() -> Handler {
    service_fn(|_| std::future::ready(Ok(Response::new(Bytes::from_static(b"ok")))))
}

fn minute(name: &str, limit: u32) -> Policy {
    Policy::new(name, limit, Duration::from_secs(60))
}

fn on_every_route(policies: impl IntoIterator<Item = Policy>) -> Policies {
    policies
        .into_iter()
        .fold(Policies::builder(), |builder, policy| {
            builder.with_every_route(policy)
        })
        .build()
        .unwrap()
}

fn header<B>(response: &Response<B>, name: &http::HeaderName) -> u32 {
    response.headers()[name].to_str().unwrap().parse().unwrap()
}

/// A tier lookup that says when it has started and answers (no tier)
/// only when released.
#[derive(Clone, Default)]
struct HeldLookup {
    started: Arc<Notify>,
    release: Arc<Notify>,
}

impl HeldLookup {
    fn layer(&self, policies: Policies) -> RateLimitLayer {
        let lookup = self.clone();
        // "second" never counts: a computed cost exempts it.
        let cost = |_: &http::request::Parts, policy: &Policy| {
            if policy.name() == "second" {
                Cost::Exempt
            } else {
                Cost::Policy
            }
        };
        RateLimitLayer::new(MemoryStore::new(), Global, policies)
            .with_request_cost(cost)
            .with_tier_lookup(move |_: &http::request::Parts, _: &Identity| {
                let lookup = lookup.clone();
                async move {
                    lookup.started.notify_one();
                    lookup.release.notified().await;
                    None
                }
            })
    }
}

#[tokio::test]
async fn a_reload_during_a_lookup_never_changes_the_request_midway() {
    let started_with = || on_every_route([minute("first", 5), minute("second", 7)]);
    let reloads = [
        (
            "more policies",
            on_every_route([
                minute("zero", 1),
                minute("first", 50),
                minute("second", 7),
                minute("third", 2),
            ]),
        ),
        ("fewer", on_every_route([minute("second", 7)])),
        (
            "reordered",
            on_every_route([minute("second", 7), minute("first", 50)]),
        ),
    ];
    for (reload, policies) in reloads {
        let lookup = HeldLookup::default();
        let layer = lookup.layer(started_with());
        let handle = layer.policies_handle();
        let service = layer.layer(handler());
        let request = tokio::spawn(service.oneshot(Request::new(())));
        lookup.started.notified().await;
        handle.replace(policies).unwrap();
        lookup.release.notify_one();
        let response = request.await.unwrap().unwrap();
        assert_eq!(response.status(), StatusCode::OK, "{reload}");
        // Decided by "first" at 5 alone, as when the request started.
        assert_eq!(header(&response, &X_RATELIMIT_LIMIT), 5, "{reload}");
        assert_eq!(header(&response, &X_RATELIMIT_REMAINING), 4, "{reload}");
    }
}

#[tokio::test]
async fn a_request_with_nothing_to_wait_for_is_decided_in_call() {
    let layer = RateLimitLayer::new(
        MemoryStore::new(),
        Global,
        on_every_route([minute("all", 1)]),
    );
    let mut service = layer.layer(handler());
    for expected in [StatusCode::OK, StatusCode::TOO_MANY_REQUESTS] {
        let ready = service.ready().await.unwrap();
        let mut future = std::pin::pin!(ready.call(Request::new(())));
        // Decided in `call`: the future is ready at its first poll.
        let mut context = std::task::Context::from_waker(std::task::Waker::noop());
        let std::task::Poll::Ready(Ok(response)) = future.as_mut().poll(&mut context) else {
            panic!("the request waited");
        };
        assert_eq!(response.status(), expected);
    }
}

#[tokio::test]
async fn the_policies_of_a_request_that_waits_are_read_once() {
    let lookup = HeldLookup::default();
    let layer = lookup.layer(on_every_route([minute("first", 2)]));
    let handle = layer.policies_handle();
    let service = layer.layer(handler());
    let mut answers = Vec::new();
    for round in 0..3 {
        let request = tokio::spawn(service.clone().oneshot(Request::new(())));
        lookup.started.notified().await;
        // Each reload comes while the request waits; none applies to it.
        handle
            .replace(on_every_route([minute("first", 100 + round)]))
            .unwrap();
        lookup.release.notify_one();
        let response = request.await.unwrap().unwrap();
        answers.push((
            response.status(),
            response.headers().get(&X_RATELIMIT_LIMIT).cloned(),
        ));
    }
    // The first request started under a limit of 2; each later one under
    // the reload before it: 100, then 101.
    assert_eq!(answers[0].1.as_ref().unwrap(), "2");
    assert_eq!(answers[1].1.as_ref().unwrap(), "100");
    assert_eq!(answers[2].1.as_ref().unwrap(), "101");
    assert!(answers.iter().all(|(status, _)| *status == StatusCode::OK));
}
