//! The decision's pure parts, with no store and no runtime: what is known
//! before the store is asked ([`decide`] on a store that must never be
//! asked), and the store's answer turned into the request's way on
//! ([`outcome`], given the answer).

use std::time::Duration;

use http::request::Parts;
use http::{HeaderMap, Method, Request, StatusCode};

use crate::RateLimitLayer;
use crate::key::{Global, Key, PeerIp};
use crate::layer::decide::checks::{Modes, SentChecks};
use crate::layer::decide::decide;
use crate::layer::decide::outcome::outcome;
use crate::layer::decide::priced::{Asked, Priced};
use crate::layer::future::Next;
use crate::metrics::Timer;
use crate::policy::{Cost, Policies, Policy};
use crate::store::Checks;
use crate::store::{Check, CheckOutcome, Decision, Store, StoreError, StoreFuture};

/// A store the parts under test must never ask.
#[derive(Debug)]
struct Unasked;

impl Store for Unasked {
    fn check(&self, _: &[Check]) -> StoreFuture {
        panic!("the store was asked")
    }
}

fn minute(name: &str, limit: u32) -> Policy {
    Policy::new(name, limit, Duration::from_secs(60))
}

fn layer(policies: Policies) -> RateLimitLayer {
    RateLimitLayer::new(Unasked, Global, policies)
}

fn head(method: Method, path: &str) -> Parts {
    Request::builder()
        .method(method)
        .uri(path)
        .body(())
        .unwrap()
        .into_parts()
        .0
}

/// What `layer` decides for `parts` before it would ask the store.
fn known_now(layer: &RateLimitLayer, mut parts: Parts) -> Next {
    match decide(&layer.shared, &mut parts) {
        Ok(next) => next,
        Err(_) => panic!("the request waits"),
    }
}

fn status(next: &Next) -> StatusCode {
    match next {
        Next::Call(..) => StatusCode::OK,
        Next::Answer(response) => response.status(),
    }
}

#[test]
fn a_route_no_policy_covers_passes_untouched() {
    let policies = Policies::builder()
        .with_route("GET /limited", minute("limited", 1))
        .build()
        .unwrap();
    let next = known_now(&layer(policies), head(Method::GET, "/elsewhere"));
    assert!(matches!(next, Next::Call(None, None)));
}

#[test]
fn an_exempt_request_passes_without_a_check() {
    let layer = layer(Policies::single(minute("all", 1)).unwrap()).with_exemption(|_| true);
    let next = known_now(&layer, head(Method::GET, "/"));
    assert!(matches!(next, Next::Call(None, None)));
}

#[test]
fn a_client_no_extractor_finds_is_answered_at_once() {
    // No connect info: `PeerIp` finds no address.
    let policies = Policies::single(minute("all", 1)).unwrap();
    let layer = RateLimitLayer::new(Unasked, PeerIp::new(), policies);
    let next = known_now(&layer, head(Method::GET, "/"));
    assert_eq!(status(&next), StatusCode::INTERNAL_SERVER_ERROR);
}

#[test]
fn a_cost_above_the_limit_is_refused_before_the_store_is_asked() {
    let layer = layer(Policies::single(minute("all", 10)).unwrap())
        .with_request_cost(|_: &Parts, _: &Policy| Some(11));
    let next = known_now(&layer, head(Method::GET, "/"));
    assert_eq!(status(&next), StatusCode::UNPROCESSABLE_ENTITY);
}

#[test]
fn a_request_every_policy_exempts_passes_without_a_check() {
    let layer = layer(Policies::single(minute("all", 10)).unwrap())
        .with_request_cost(|_: &Parts, _: &Policy| Cost::Exempt);
    let next = known_now(&layer, head(Method::GET, "/"));
    assert!(matches!(next, Next::Call(None, None)));
}

/// The way on of a request of `layer` whose one check (under its only
/// policy) the store answered with `answer`.
fn answered(layer: &RateLimitLayer, fail_closed: bool, answer: CheckOutcome) -> Next {
    let policies = layer.shared.policies.load();
    let plan = policies.plan_in(&Method::GET, "/", true);
    let settings = layer.shared.settings;
    let priced = Priced::of(
        plan,
        None,
        Asked::default(),
        settings.shadow,
        settings.fail_mode,
    )
    .unwrap();
    let key = Key::new("client");
    let mut checks: Checks = priced.prices.iter().map(|p| p.check(&key, None)).collect();
    let modes = priced
        .has_modes
        .then(|| Modes::new(plan, &mut checks, settings));
    let sent = SentChecks {
        checks,
        modes,
        deny_clock: 0,
        timer: Timer::start(),
        fail_closed,
    };
    let parts = head(Method::GET, "/");
    match outcome(&layer.shared, &parts, plan, None, &sent, answer).into_ready() {
        Ok(next) => next,
        Err(_) => panic!("the request waits"),
    }
}

fn written(next: Next) -> HeaderMap {
    match next {
        Next::Call(Some(headers), _) => {
            let mut map = HeaderMap::new();
            headers.write(&mut map);
            map
        }
        Next::Call(None, _) => HeaderMap::new(),
        Next::Answer(response) => response.headers().clone(),
    }
}

#[test]
fn an_admission_goes_on_with_its_headers() {
    let layer = layer(Policies::single(minute("all", 10)).unwrap());
    let admitted = Decision::new_admitted(10, 9, Duration::from_secs(60));
    let next = answered(&layer, false, Ok([admitted].into()));
    assert_eq!(status(&next), StatusCode::OK);
    let headers = written(next);
    assert_eq!(headers["x-ratelimit-limit"], "10");
    assert_eq!(headers["x-ratelimit-remaining"], "9");
}

#[test]
fn a_denial_is_a_429_with_its_retry_time() {
    let layer = layer(Policies::single(minute("all", 10)).unwrap());
    let retry = Duration::from_millis(29_500);
    let denied = Decision::new_denied(10, 0, Duration::from_secs(60), Some(retry));
    let next = answered(&layer, false, Ok([denied].into()));
    assert_eq!(status(&next), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(written(next)["retry-after"], "30");
}

#[test]
fn a_store_failure_fails_open_unless_a_policy_fails_closed() {
    let layer = layer(Policies::single(minute("all", 10)).unwrap());
    let failed = || Err(StoreError::Timeout(Duration::from_millis(50)));
    assert!(matches!(
        answered(&layer, false, failed()),
        Next::Call(None, None)
    ));
    let closed = answered(&layer, true, failed());
    assert_eq!(status(&closed), StatusCode::SERVICE_UNAVAILABLE);
}

#[test]
fn an_answer_short_of_a_decision_is_a_store_failure() {
    let layer = layer(Policies::single(minute("all", 10)).unwrap());
    let closed = answered(&layer, true, Ok(Default::default()));
    assert_eq!(status(&closed), StatusCode::SERVICE_UNAVAILABLE);
}

#[test]
fn a_shadow_policy_that_denies_lets_the_request_pass() {
    let policies = Policies::single(minute("all", 10).with_shadow(true)).unwrap();
    let layer = layer(policies);
    let denied = Decision::new_denied(10, 0, Duration::from_secs(60), Some(Duration::from_secs(5)));
    let next = answered(&layer, false, Ok([denied].into()));
    assert_eq!(status(&next), StatusCode::OK);
    assert_eq!(written(next)["x-ratelimit-remaining"], "0");
}

#[test]
fn a_delayed_admission_is_known_once_it_has_waited() {
    let policies = Policies::single(minute("all", 10).with_delay(Duration::from_secs(1))).unwrap();
    let layer = layer(policies);
    let policies = layer.shared.policies.load();
    let plan = policies.plan_in(&Method::GET, "/", true);
    let checks: Checks = [Check::new(&plan.policies[0], Key::new("client")).unwrap()]
        .into_iter()
        .collect();
    let sent = SentChecks {
        checks,
        modes: None,
        deny_clock: 0,
        timer: Timer::start(),
        fail_closed: false,
    };
    let delayed = Decision::new_admitted(10, 0, Duration::from_secs(60))
        .with_delayed_for(Duration::from_millis(300));
    let parts = head(Method::GET, "/");
    let later = outcome(
        &layer.shared,
        &parts,
        plan,
        None,
        &sent,
        Ok([delayed].into()),
    );
    let Err(waiting) = later.into_ready() else {
        panic!("a delayed request went on at once");
    };
    assert_eq!(layer.delayed(), 1, "it holds a place while it waits");
    drop(waiting);
    assert_eq!(
        layer.delayed(),
        0,
        "a request that leaves gives its place back"
    );
}
