//! Costs settled after the response, in the stores, on a fake clock, run
//! identically against `MemoryStore` and a real `redis-server`: a
//! reservation replaced by the real cost, given back or charged past the
//! limit, with exact retry times.

use std::sync::Arc;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::support::stores::StoreUnderTest;
use crate::window::Subject;
use slidegate::Policy;
use slidegate::clock::Clock;
use slidegate::key::Key;
use slidegate::policy::{Algorithm, Calendar, Period};
use slidegate::store::{Check, Decision};

const SEC: Duration = Duration::from_secs(1);
const MINUTE: Duration = Duration::from_secs(60);

/// 1,000 tokens a minute, reserving 100 a request.
fn tokens(algorithm: Algorithm) -> Policy {
    Policy::new("tokens", 1_000, MINUTE)
        .with_cost(100)
        .with_algorithm(algorithm)
}

impl Subject {
    /// Admits a request of `policy` for `key` and returns its decision.
    async fn reserve(&self, policy: &Policy, key: &str) -> Decision {
        let d = self.one(policy, key).await;
        assert!(d.admitted(), "{d:?}");
        d
    }

    /// Settles the request `reserved` decided at `cost`.
    async fn settle(&self, policy: &Policy, key: &str, reserved: &Decision, cost: u64) {
        let check = Check::new(policy, Key::new(key)).unwrap();
        self.store
            .settle(&[check], &[reserved.recorded_at().unwrap()], &[cost])
            .await
            .expect("the store settles");
    }
}

/// Settled at 1,500 (past the limit) 10 s after it was reserved, a
/// sliding log's request leaves the client denied until that charge
/// leaves the window: 60 s after the settlement, to the µs.
async fn a_charge_past_the_limit_denies_until_it_leaves(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    let policy = tokens(Algorithm::SlidingLog);
    let reserved = s.reserve(&policy, "alice").await;
    assert_eq!(reserved.remaining(), 900);
    s.advance(10 * SEC);
    s.settle(&policy, "alice", &reserved, 1_500).await;
    let d = s.one(&policy, "alice").await;
    assert!(!d.admitted());
    assert_eq!((d.remaining(), d.retry_after()), (0, Some(MINUTE)));
    s.advance(MINUTE - Duration::from_micros(1));
    assert!(!s.one(&policy, "alice").await.admitted());
    s.advance(Duration::from_micros(1));
    assert_eq!(s.reserve(&policy, "alice").await.remaining(), 900);
}
on_both_stores!(a_charge_past_the_limit_denies_until_it_leaves, fake_clock);

/// Settled below its reservation, a request gives the difference back.
async fn a_smaller_cost_gives_the_difference_back(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    for algorithm in [
        Algorithm::SlidingLog,
        Algorithm::SlidingCounter,
        Algorithm::FixedWindow,
        Algorithm::Calendar(Calendar::new(Period::Day)),
    ] {
        let policy = tokens(algorithm);
        let reserved = s.reserve(&policy, "bob").await;
        s.settle(&policy, "bob", &reserved, 30).await;
        let d = s.reserve(&policy, "bob").await;
        assert_eq!(d.remaining(), 1_000 - 30 - 100, "{algorithm:?}");
        s.advance(2 * 86_400 * SEC);
    }
}
on_both_stores!(a_smaller_cost_gives_the_difference_back, fake_clock);

/// Every algorithm that settles keeps the client denied after a charge
/// past the limit; a token bucket for as long as its whole debt takes to
/// repay (3,000 units at 1,000 a minute, less the 900 the next request
/// may find free: 126 s).
async fn every_algorithm_holds_an_overdraft(tested: StoreUnderTest) {
    let s = Subject::from(tested);
    let cases = [
        (Algorithm::FixedWindow, MINUTE - 10 * SEC),
        (
            Algorithm::Calendar(Calendar::new(Period::Day)),
            Duration::ZERO,
        ),
        (Algorithm::TokenBucket, 126 * SEC),
    ];
    for (algorithm, expected) in cases {
        // Windows aligned to the minute (and the day), 10 s in.
        let now = s.clock.now_micros();
        let day = 86_400_000_000;
        s.clock.set((now / day + 1) * day + 10_000_000);
        let policy = tokens(algorithm);
        let reserved = s.reserve(&policy, "carol").await;
        s.settle(&policy, "carol", &reserved, 3_000).await;
        let d = s.one(&policy, "carol").await;
        assert!(!d.admitted(), "{algorithm:?}");
        let expected = if expected.is_zero() {
            86_400 * SEC - 10 * SEC
        } else {
            expected
        };
        assert_eq!(d.retry_after(), Some(expected), "{algorithm:?}");
        assert_eq!(d.remaining(), 0, "{algorithm:?}");
    }
}
on_both_stores!(every_algorithm_holds_an_overdraft, fake_clock);

/// 600 requests reserved and settled at once, each at a cost of its own:
/// the count is exactly the sum of those costs.
async fn concurrent_settlements_sum_exactly(tested: StoreUnderTest) {
    let s = Arc::new(Subject::from(tested));
    let policy = Arc::new(Policy::new("tokens", 1_000_000, MINUTE).with_cost(100));
    let mut rng = ChaCha8Rng::seed_from_u64(600);
    let costs: Vec<u64> = (0..600).map(|_| rng.gen_range(1..=1_000)).collect();
    let tasks: Vec<_> = costs
        .iter()
        .map(|&cost| {
            let (s, policy) = (s.clone(), policy.clone());
            tokio::spawn(async move {
                let reserved = s.reserve(&policy, "dave").await;
                tokio::task::yield_now().await;
                s.settle(&policy, "dave", &reserved, cost).await;
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let spent: u64 = costs.iter().sum();
    let left = s.check_only(&policy, "dave").await;
    assert_eq!(u64::from(left), 1_000_000 - spent);
}
on_both_stores!(concurrent_settlements_sum_exactly, fake_clock);

/// Through the layer: a route whose handler reports its tokens in a
/// header, in a trailer, on the `Usage` handle as it streams, or not at
/// all.
mod through_the_layer {
    use std::convert::Infallible;
    use std::time::Duration;

    use axum::body::{Body, Bytes};
    use axum::extract::Query;
    use axum::routing::post;
    use axum::{Extension, Router};
    use futures_util::stream;
    use http::{HeaderMap, HeaderValue, Request, StatusCode};
    use http_body::Frame;
    use http_body_util::{BodyExt, StreamBody};
    use tower::ServiceExt;

    use super::*;
    use crate::support::reply::send;
    use slidegate::key::{Identity, KeyRejection};
    use slidegate::{KeyExtractor, Policies, RateLimitLayer, Usage};

    /// Every request comes from the client `client`.
    struct OneClient;

    impl KeyExtractor for OneClient {
        fn extract(&self, _parts: &http::request::Parts) -> Result<Option<Identity>, KeyRejection> {
            Ok(Some(Key::new("client").into()))
        }
    }

    #[derive(serde::Deserialize)]
    struct Tokens {
        tokens: String,
    }

    fn usage_headers(tokens: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert("x-usage-tokens", HeaderValue::from_str(tokens).unwrap());
        headers
    }

    async fn in_header(Query(query): Query<Tokens>) -> (HeaderMap, &'static str) {
        (usage_headers(&query.tokens), "done")
    }

    async fn in_trailer(Query(query): Query<Tokens>) -> Body {
        let frames = [
            Frame::data(Bytes::from_static(b"done")),
            Frame::trailers(usage_headers(&query.tokens)),
        ];
        Body::new(StreamBody::new(stream::iter(
            frames.map(Ok::<_, Infallible>),
        )))
    }

    /// 100 tokens a chunk, reported as each is produced, for ten chunks.
    async fn streamed(Extension(usage): Extension<Usage>) -> Body {
        let chunks = stream::unfold(0, move |sent| {
            let usage = usage.clone();
            async move {
                (sent < 10).then(|| {
                    usage.add(100);
                    (Ok::<_, Infallible>(Bytes::from_static(b"chunk ")), sent + 1)
                })
            }
        });
        Body::from_stream(chunks)
    }

    /// Reports its tokens in the head, then a body that never ends.
    async fn held(Query(query): Query<Tokens>) -> (HeaderMap, Body) {
        let body = Body::from_stream(stream::pending::<Result<Bytes, Infallible>>());
        (usage_headers(&query.tokens), body)
    }

    async fn silent() -> &'static str {
        "done"
    }

    /// Where `on_a_thread` parks the way to its thread, for the test to
    /// tell it what to report (after the response has ended): one per
    /// app, so that tests running at once never signal each other's.
    #[derive(Clone, Default)]
    pub(super) struct Parked(
        Arc<std::sync::Mutex<Option<std::sync::mpsc::Sender<u64>>>>,
        Arc<std::sync::Mutex<Vec<Usage>>>,
        Arc<std::sync::Mutex<Option<std::thread::JoinHandle<()>>>>,
    );

    impl Parked {
        /// Tells the thread to report `units` more and keep its handle.
        pub(super) fn add(&self, units: u64) {
            let thread = self.0.lock().unwrap();
            thread
                .as_ref()
                .expect("the handler ran")
                .send(units)
                .unwrap();
        }

        /// Tells the thread to report `units` more and let go of its
        /// handle, and returns once it has.
        pub(super) fn report(&self, units: u64) {
            self.add(units);
            self.0.lock().unwrap().take();
            let thread = self.2.lock().unwrap().take().expect("the handler ran");
            thread.join().unwrap();
        }

        /// Lets go of the handle `kept` keeps longest.
        fn let_go(&self) {
            drop(self.1.lock().unwrap().remove(0));
        }
    }

    /// Keeps its request's handle, reporting nothing, until the test lets
    /// go of it.
    async fn kept(
        Extension(usage): Extension<Usage>,
        Extension(parked): Extension<Parked>,
    ) -> &'static str {
        parked.1.lock().unwrap().push(usage);
        "kept"
    }

    /// Hands the handle to a thread of no runtime, which reports what the
    /// test says and lets go.
    async fn on_a_thread(
        Extension(usage): Extension<Usage>,
        Extension(parked): Extension<Parked>,
    ) -> &'static str {
        let (go, wait) = std::sync::mpsc::channel::<u64>();
        parked.0.lock().unwrap().replace(go);
        let thread = std::thread::spawn(move || {
            while let Ok(units) = wait.recv() {
                usage.add(units);
            }
        });
        parked.2.lock().unwrap().replace(thread);
        "started"
    }

    fn app(s: &Subject) -> Router {
        app_of(s, tokens(Algorithm::SlidingLog))
    }

    fn app_of(s: &Subject, policy: Policy) -> Router {
        routes(layer_of(s, policy), &Parked::default())
    }

    /// The layer of `policy`, its cost in the `x-usage-tokens` header.
    pub(super) fn layer_of(s: &Subject, policy: Policy) -> RateLimitLayer {
        let policy = policy.with_usage_header(http::HeaderName::from_static("x-usage-tokens"));
        RateLimitLayer::new(
            s.store.clone(),
            OneClient,
            Policies::single(policy).unwrap(),
        )
        .with_deny_cache(None)
    }

    /// The layer of `policy`, its cost from the `Usage` handle alone.
    pub(super) fn handle_layer_of(s: &Subject, policy: Policy) -> RateLimitLayer {
        RateLimitLayer::new(
            s.store.clone(),
            OneClient,
            Policies::single(policy.with_settlement(true)).unwrap(),
        )
        .with_deny_cache(None)
    }

    pub(super) fn routes(layer: RateLimitLayer, parked: &Parked) -> Router {
        Router::new()
            .route("/header", post(in_header))
            .route("/trailer", post(in_trailer))
            .route("/stream", post(streamed))
            .route("/silent", post(silent))
            .route("/held", post(held))
            .route("/kept", post(kept))
            .route("/thread", post(on_a_thread))
            .route_layer(layer)
            .layer(Extension(parked.clone()))
    }

    pub(super) fn post_to(path: &str) -> Request<Body> {
        Request::post(path).body(Body::empty()).unwrap()
    }

    /// Waits until `left` units are free under the sliding log: a
    /// settlement runs on a task of its own.
    pub(super) async fn until_left(s: &Subject, left: u32) {
        until_left_of(s, &tokens(Algorithm::SlidingLog), left).await;
    }

    /// Waits (at most a minute, for a busy machine) until `left` units
    /// of `policy` are free.
    async fn until_left_of(s: &Subject, policy: &Policy, left: u32) {
        let started = std::time::Instant::now();
        loop {
            let now = s.check_only(policy, "client").await;
            if now == left {
                return;
            }
            assert!(started.elapsed() < MINUTE, "{now} units left, not {left}");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// A header reporting 1,500 tokens of a 1,000 a minute: the client
    /// is denied for a minute from then, to the second.
    async fn a_usage_header_past_the_limit_denies_a_minute(tested: StoreUnderTest) {
        let s = Subject::from(tested);
        let app = app(&s);
        let reply = send(&app, post_to("/header?tokens=1500")).await;
        assert_eq!(reply.status, StatusCode::OK);
        assert_eq!(
            reply.header("x-ratelimit-remaining"),
            Some("900"),
            "reserved"
        );
        until_left(&s, 0).await;
        let denied = send(&app, post_to("/header?tokens=1")).await;
        assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(denied.header("retry-after"), Some("60"));
        s.advance(MINUTE);
        let reply = send(&app, post_to("/header?tokens=1")).await;
        assert_eq!(reply.status, StatusCode::OK);
        assert_eq!(reply.header("x-ratelimit-remaining"), Some("900"));
    }
    on_both_stores!(a_usage_header_past_the_limit_denies_a_minute, fake_clock);

    /// A usage header in the head is charged as the head passes: a client
    /// that holds the body back (an HTTP/2 stream with its window shut)
    /// holds no reservation. Ten such requests of 700 tokens each: the
    /// first is charged 700, the second overdraws, the third is denied.
    async fn a_usage_header_is_charged_as_the_head_passes(tested: StoreUnderTest) {
        let s = Subject::from(tested);
        let app = app(&s);
        let first = app
            .clone()
            .oneshot(post_to("/held?tokens=700"))
            .await
            .unwrap();
        assert_eq!(first.status(), StatusCode::OK);
        until_left(&s, 300).await;
        let second = app
            .clone()
            .oneshot(post_to("/held?tokens=700"))
            .await
            .unwrap();
        assert_eq!(second.status(), StatusCode::OK);
        until_left(&s, 0).await;
        let third = app
            .clone()
            .oneshot(post_to("/held?tokens=700"))
            .await
            .unwrap();
        assert_eq!(third.status(), StatusCode::TOO_MANY_REQUESTS);
        // The bodies are still held.
        drop((first, second));
    }
    on_both_stores!(a_usage_header_is_charged_as_the_head_passes, fake_clock);

    /// A trailer reports the cost as the header would; a request that
    /// reports nothing, or no integer, keeps its reservation.
    async fn trailers_settle_and_silence_keeps_the_reservation(tested: StoreUnderTest) {
        let s = Subject::from(tested);
        let app = app(&s);
        assert_eq!(
            send(&app, post_to("/trailer?tokens=40")).await.status,
            StatusCode::OK
        );
        until_left(&s, 960).await;
        assert_eq!(send(&app, post_to("/silent")).await.status, StatusCode::OK);
        until_left(&s, 860).await;
        let reply = send(&app, post_to("/header?tokens=lots")).await;
        assert_eq!(reply.status, StatusCode::OK);
        let reply = send(&app, post_to("/header?tokens=-5")).await;
        assert_eq!(reply.status, StatusCode::OK);
        // Both reservations stand: settling them would have moved the count.
        assert_eq!(
            send(&app, post_to("/trailer?tokens=0")).await.status,
            StatusCode::OK
        );
        until_left(&s, 660).await;
    }
    on_both_stores!(
        trailers_settle_and_silence_keeps_the_reservation,
        fake_clock
    );

    /// A client that reads two chunks of a stream and goes away is
    /// charged the tokens reported by then.
    async fn a_stream_dropped_midway_is_charged_what_it_reported(tested: StoreUnderTest) {
        let s = Subject::from(tested);
        let app = app(&s);
        let response = app.clone().oneshot(post_to("/stream")).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        let mut body = response.into_body();
        for _ in 0..2 {
            let frame = body.frame().await.expect("a chunk").unwrap();
            assert!(frame.is_data());
        }
        drop(body);
        until_left(&s, 800).await;
        // One read to its end is charged its ten chunks.
        let reply = send(&app, post_to("/stream")).await;
        assert_eq!(reply.body.len(), 60);
        until_left(&s, 0).await;
    }
    on_both_stores!(
        a_stream_dropped_midway_is_charged_what_it_reported,
        fake_clock
    );

    /// 600 requests at once through the layer, each reporting its own
    /// cost in a header: the count is exactly the sum of those costs.
    async fn six_hundred_responses_settle_to_the_sum_they_report(tested: StoreUnderTest) {
        let s = Subject::from(tested);
        let policy = Policy::new("tokens", 1_000_000, MINUTE).with_cost(100);
        let app = app_of(&s, policy.clone());
        let mut rng = ChaCha8Rng::seed_from_u64(601);
        let costs: Vec<u64> = (0..600).map(|_| rng.gen_range(0..=2_000)).collect();
        let tasks: Vec<_> = costs
            .iter()
            .map(|cost| {
                let app = app.clone();
                let request = post_to(&format!("/header?tokens={cost}"));
                tokio::spawn(async move { send(&app, request).await.status })
            })
            .collect();
        for task in tasks {
            assert_eq!(task.await.unwrap(), StatusCode::OK);
        }
        let spent: u64 = costs.iter().sum();
        let expected = u32::try_from(1_000_000 - spent).unwrap();
        let started = std::time::Instant::now();
        loop {
            let left = s.check_only(&policy, "client").await;
            if left == expected {
                break;
            }
            assert!(started.elapsed() < 5 * SEC, "{left} left, not {expected}");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    on_both_stores!(
        six_hundred_responses_settle_to_the_sum_they_report,
        fake_clock
    );

    /// A handle kept by a thread of no runtime past the response: the
    /// request is settled when the thread lets go, at what it reported.
    async fn a_handle_let_go_off_the_runtime_settles(tested: StoreUnderTest) {
        let s = Subject::from(tested);
        let parked = Parked::default();
        let app = routes(layer_of(&s, tokens(Algorithm::SlidingLog)), &parked);
        assert_eq!(send(&app, post_to("/thread")).await.status, StatusCode::OK);
        until_left(&s, 900).await;
        parked.report(500);
        until_left(&s, 500).await;
    }
    on_both_stores!(a_handle_let_go_off_the_runtime_settles, fake_clock);

    /// A handle's reports are charged as they come (at most once a
    /// second), not only when the request lets go of it: a task that goes
    /// on generating (while its client holds the body back, say) is
    /// charged the 700 it reported at once; the settlement then counts
    /// the rest, to the 900 reported in all.
    async fn reports_are_charged_as_they_come(tested: StoreUnderTest) {
        let s = Subject::from(tested);
        let parked = Parked::default();
        let app = routes(handle_layer_of(&s, tokens(Algorithm::SlidingLog)), &parked);
        assert_eq!(send(&app, post_to("/thread")).await.status, StatusCode::OK);
        until_left(&s, 900).await;
        parked.add(700);
        until_left(&s, 300).await;
        parked.report(200);
        until_left(&s, 100).await;
    }
    on_both_stores!(reports_are_charged_as_they_come, fake_clock);

    /// A client holds at most `max_unsettled` reservations at once: past
    /// them a request is answered 429 (`Retry-After: 1`) and its units
    /// given back, so requests held open cannot pile up reservations (and
    /// the overdrafts their settlements may bring); once one is settled,
    /// its place is free.
    async fn a_client_holds_at_most_its_unsettled_reservations(tested: StoreUnderTest) {
        let s = Subject::from(tested);
        let parked = Parked::default();
        let policy = tokens(Algorithm::SlidingLog).with_max_unsettled(2);
        let app = routes(handle_layer_of(&s, policy), &parked);
        for _ in 0..2 {
            assert_eq!(send(&app, post_to("/kept")).await.status, StatusCode::OK);
        }
        let refused = send(&app, post_to("/kept")).await;
        assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(refused.header("retry-after"), Some("1"));
        until_left(&s, 800).await;
        parked.let_go();
        assert_eq!(send(&app, post_to("/kept")).await.status, StatusCode::OK);
        until_left(&s, 700).await;
    }
    on_both_stores!(
        a_client_holds_at_most_its_unsettled_reservations,
        fake_clock
    );

    /// A shadow policy settled after the response counts its
    /// reservations but never denies, past `max_unsettled` too.
    async fn a_shadow_policy_never_denies_for_its_unsettled_reservations(tested: StoreUnderTest) {
        let s = Subject::from(tested);
        let parked = Parked::default();
        let policy = tokens(Algorithm::SlidingLog)
            .with_max_unsettled(1)
            .with_shadow(true);
        let app = routes(handle_layer_of(&s, policy), &parked);
        for _ in 0..3 {
            assert_eq!(send(&app, post_to("/kept")).await.status, StatusCode::OK);
        }
        until_left(&s, 700).await;
    }
    on_both_stores!(
        a_shadow_policy_never_denies_for_its_unsettled_reservations,
        fake_clock
    );

    /// A reload that makes the settled policy a token bucket while a
    /// request holds its reservation in the sliding log: the cost the
    /// request reports once it ends is charged to the bucket, which the
    /// policy counts in now (the log's reservation, read no more, may be
    /// lost; the charge may not).
    async fn a_reload_to_another_algorithm_keeps_the_charge(tested: StoreUnderTest) {
        let s = Subject::from(tested);
        let parked = Parked::default();
        let layer = layer_of(&s, tokens(Algorithm::SlidingLog));
        let app = routes(layer.clone(), &parked);
        assert_eq!(send(&app, post_to("/thread")).await.status, StatusCode::OK);
        until_left(&s, 900).await;
        let bucket = tokens(Algorithm::TokenBucket);
        let reloaded = bucket
            .clone()
            .with_usage_header(http::HeaderName::from_static("x-usage-tokens"));
        layer
            .policies_handle()
            .replace(Policies::single(reloaded).unwrap())
            .unwrap();
        parked.report(700);
        until_left_of(&s, &bucket, 300).await;
        // Three reservations of 100 fit in what is left; a fourth waits.
        for _ in 0..3 {
            let reply = send(&app, post_to("/silent")).await;
            assert_eq!(reply.status, StatusCode::OK);
        }
        let denied = send(&app, post_to("/silent")).await;
        assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
    }
    on_both_stores!(a_reload_to_another_algorithm_keeps_the_charge, fake_clock);

    /// A reservation that reports exactly what it reserved, across the
    /// same reload: no settlement was needed before, but its units lie
    /// in keys no longer read, so they are charged to the bucket.
    async fn a_reload_moves_a_reservation_that_stands(tested: StoreUnderTest) {
        let s = Subject::from(tested);
        let parked = Parked::default();
        let layer = layer_of(&s, tokens(Algorithm::SlidingLog));
        let app = routes(layer.clone(), &parked);
        assert_eq!(send(&app, post_to("/thread")).await.status, StatusCode::OK);
        let bucket = tokens(Algorithm::TokenBucket);
        let reloaded = bucket
            .clone()
            .with_usage_header(http::HeaderName::from_static("x-usage-tokens"));
        layer
            .policies_handle()
            .replace(Policies::single(reloaded).unwrap())
            .unwrap();
        parked.report(100);
        until_left_of(&s, &bucket, 900).await;
    }
    on_both_stores!(a_reload_moves_a_reservation_that_stands, fake_clock);
}

/// A settlement sent while Redis is down is sent again once it answers:
/// the cost reported is charged (to a Redis restarted empty: 700 of
/// 1,000), where the reservation alone would have stood.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settlement_that_failed_is_sent_again_once_the_store_answers() {
    use through_the_layer::{Parked, layer_of, post_to, routes, until_left};

    let mut tested = StoreUnderTest::redis(true);
    let mut redis = tested.redis.take().unwrap();
    let s = Subject::from(tested);
    let parked = Parked::default();
    let app = routes(layer_of(&s, tokens(Algorithm::SlidingLog)), &parked);
    let reply = crate::support::reply::send(&app, post_to("/thread")).await;
    assert_eq!(reply.status, http::StatusCode::OK);
    until_left(&s, 900).await;
    redis.kill();
    parked.report(700);
    // Long enough for the first sending to meet the dead server (refused
    // at once); the charge below lands whenever Redis is back.
    tokio::time::sleep(Duration::from_secs(1)).await;
    redis.restart();
    until_left(&s, 300).await;
}

/// A settlement lost on its way (sent on a connection that fell silent)
/// times out, and is sent again until it lands, on the connection that
/// replaces it: the cost reported is charged once (700 of 1,000). Before,
/// a settlement that timed out was never sent again, and the reservation
/// alone stood (900 left).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settlement_that_timed_out_is_sent_again_and_counted_once() {
    use crate::support::proxy::TcpProxy;
    use slidegate::clock::FakeClock;
    use slidegate::store::RedisStore;
    use through_the_layer::{Parked, layer_of, post_to, routes, until_left};

    let redis = crate::support::RedisServer::start();
    let proxy = TcpProxy::start(redis.port());
    let pool = crate::support::pool_at(&proxy.url(), 4);
    let clock = FakeClock::new(crate::support::stores::START);
    let store = RedisStore::builder(pool)
        .with_clock(clock.clone())
        .with_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let s = Subject::from(StoreUnderTest {
        store: Arc::new(store),
        clock: Some(clock.clone()),
        redis: None,
    });
    // Counts read on a connection of their own, not through the proxy.
    let observer = Subject::from(StoreUnderTest {
        store: Arc::new(
            RedisStore::builder(redis.pool(1))
                .with_clock(clock)
                .build()
                .unwrap(),
        ),
        clock: Some(FakeClock::new(0)),
        redis: None,
    });
    let parked = Parked::default();
    let app = routes(layer_of(&s, tokens(Algorithm::SlidingLog)), &parked);
    let reply = crate::support::reply::send(&app, post_to("/thread")).await;
    assert_eq!(reply.status, http::StatusCode::OK);
    until_left(&observer, 900).await;
    proxy.silence_open_connections();
    parked.report(700);
    until_left(&observer, 300).await;
    // However often it was sent, it counted once.
    tokio::time::sleep(Duration::from_secs(2)).await;
    until_left(&observer, 300).await;
}

/// A settlement made while a charge as the handle reported is still on
/// its way waits for it, and counts what it landed once: with Redis
/// frozen, 700 is charged, then 900 in all reported; once it thaws, the
/// client has spent 900, not the 700 charged and the 900 settled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settlement_waits_for_the_charge_on_its_way() {
    use through_the_layer::{Parked, handle_layer_of, post_to, routes, until_left};

    let mut tested = StoreUnderTest::redis(true);
    let redis = tested.redis.take().unwrap();
    let s = Subject::from(tested);
    let parked = Parked::default();
    let app = routes(handle_layer_of(&s, tokens(Algorithm::SlidingLog)), &parked);
    let reply = crate::support::reply::send(&app, post_to("/thread")).await;
    assert_eq!(reply.status, http::StatusCode::OK);
    until_left(&s, 900).await;
    redis.freeze();
    parked.add(700);
    parked.report(200);
    redis.thaw();
    until_left(&s, 100).await;
}

/// With Redis down, a policy that falls back to a local limit settles in
/// the local counts too: a completion that reports 700 of its 100
/// reserved leaves the client 300 there, three more reservations, where
/// the reservation alone would have left it nine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_limit_settles_locally() {
    use slidegate::policy::FailMode;
    use through_the_layer::{Parked, layer_of, post_to, routes};

    let mut tested = StoreUnderTest::redis(true);
    let mut redis = tested.redis.take().unwrap();
    redis.kill();
    let s = Subject::from(tested);
    let policy = tokens(Algorithm::SlidingLog).with_fail_mode(FailMode::Local);
    let app = routes(layer_of(&s, policy), &Parked::default());
    let send = |path: &'static str| {
        let app = app.clone();
        async move {
            crate::support::reply::send(&app, post_to(path))
                .await
                .status
        }
    };
    assert_eq!(send("/header?tokens=700").await, http::StatusCode::OK);
    for _ in 0..3 {
        assert_eq!(send("/silent").await, http::StatusCode::OK);
    }
    assert_eq!(send("/silent").await, http::StatusCode::TOO_MANY_REQUESTS);
}
