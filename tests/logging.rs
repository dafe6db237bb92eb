//! A store outage under load is logged once a second, not once a request.

#[path = "it/support/mod.rs"]
mod support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use http::{Request, StatusCode};
use slidegate::{Global, Policies, Policy, RateLimitLayer, policy::FailMode};
use support::down_store::DownStore;
use tower::ServiceExt;
use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::{Layer, Registry};

/// The `held_back` field of every warning or error logged, in order.
#[derive(Clone, Default)]
struct Lines(Arc<Mutex<Vec<u64>>>);

struct HeldBack(Option<u64>);

impl Visit for HeldBack {
    fn record_u64(&mut self, field: &Field, value: u64) {
        if field.name() == "held_back" {
            self.0 = Some(value);
        }
    }

    fn record_debug(&mut self, _: &Field, _: &dyn std::fmt::Debug) {}
}

impl<S: tracing::Subscriber> Layer<S> for Lines {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        // The warnings and errors; each request's decision is traced at
        // debug level.
        if *event.metadata().level() > tracing::Level::WARN {
            return;
        }
        let mut held_back = HeldBack(None);
        event.record(&mut held_back);
        let held_back = held_back
            .0
            .expect("store failures say how many were held back");
        self.0.lock().unwrap().push(held_back);
    }
}

#[tokio::test]
async fn store_failures_are_logged_once_a_second_with_the_count_held_back() {
    let lines = Lines::default();
    let _guard = tracing::subscriber::set_default(Registry::default().with(lines.clone()));
    let policies = Policies::builder()
        .with_route(
            "/closed",
            Policy::new("closed", 10, Duration::from_secs(1)).with_fail_mode(FailMode::Closed),
        )
        .with_default(Policy::new("open", 10, Duration::from_secs(1)))
        .build()
        .unwrap();
    let app = Router::new()
        .route("/open", get(|| async { "open" }))
        .route("/closed", get(|| async { "closed" }))
        .route_layer(RateLimitLayer::new(DownStore, Global, policies));

    const REQUESTS: u64 = 2000;
    let started = Instant::now();
    for i in 0..REQUESTS {
        let (path, expected) = if i % 2 == 0 {
            ("/open", StatusCode::OK)
        } else {
            ("/closed", StatusCode::SERVICE_UNAVAILABLE)
        };
        let request = Request::get(path).body(Body::empty()).unwrap();
        assert_eq!(
            app.clone().oneshot(request).await.unwrap().status(),
            expected
        );
    }
    let seconds = started.elapsed().as_secs();

    let lines = lines.0.lock().unwrap().clone();
    // One line when the outage starts, then at most one per second that
    // passed; every failure is either a line or counted in a later one,
    // except those after the last line.
    assert_eq!(lines[0], 0, "the first failure is logged at once");
    assert!(
        lines.len() as u64 <= 2 + seconds,
        "{} lines in {seconds} s: {lines:?}",
        lines.len()
    );
    let accounted: u64 = lines.len() as u64 + lines.iter().sum::<u64>();
    assert!(accounted <= REQUESTS, "{lines:?}");
}
