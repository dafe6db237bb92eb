//! No secret reaches the logs: API keys and bearer tokens, good or forged,
//! stay out of every line the layer traces, a store outage's included.
//!
//! A test binary of its own: `tracing` caches per callsite whether anyone
//! listens, and tests on other threads hitting the same callsites while
//! this one's subscriber comes and goes made it miss events.

#[path = "it/support/mod.rs"]
mod support;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use http::Request;
use jsonwebtoken::{Algorithm, EncodingKey, Header as JwtHeader, encode};
use serde_json::json;
use slidegate::{
    Header, JwtClaim, KeyExtractor, PeerIp, Policies, Policy, RateLimitLayer, store::RedisStore,
};
use support::RedisServer;
use support::reply::send;

const SECRET: &[u8] = b"test-secret-of-the-api";

/// A `tracing` writer into a shared buffer.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// An HS256 token for `alice`, signed with `secret`, valid for an hour.
fn token(secret: &[u8]) -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let claims = json!({ "sub": "alice", "exp": now + 3600 });
    let header = JwtHeader::new(Algorithm::HS256);
    slidegate::JwtClaim::install_crypto_provider();
    encode(&header, &claims, &EncodingKey::from_secret(secret)).unwrap()
}

/// A GET of `/search` from 192.0.2.7 with `headers`.
fn search(headers: &[(&str, &str)]) -> Request<Body> {
    let mut builder = Request::get("/search");
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    let mut request = builder.body(Body::empty()).unwrap();
    request
        .extensions_mut()
        .insert(ConnectInfo("192.0.2.7:5000".parse::<SocketAddr>().unwrap()));
    request
}

#[test]
fn secrets_never_reach_the_logs() {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(move || writer.clone())
        .finish();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (good, forged) = (token(SECRET), token(b"guessed"));
    tracing::subscriber::with_default(subscriber, || {
        runtime.block_on(async {
            // A store that is down makes the layer trace a warning.
            let redis = RedisServer::start();
            let store = RedisStore::new(redis.pool(2));
            drop(redis);
            let jwt = JwtClaim::builder()
                .with_secret(SECRET)
                .with_algorithms(["HS256"])
                .build()
                .unwrap();
            let api_keys = Header::new(http::HeaderName::from_static("x-api-key"))
                .with_tiers([("key-of-a-pro", "pro")]);
            let policies =
                Policies::single(Policy::new("search", 5, Duration::from_secs(60))).unwrap();
            let layer = RateLimitLayer::new(store, jwt.or(api_keys).or(PeerIp::new()), policies);
            let app = Router::new()
                .route("/search", get(|| async { "results" }))
                .route_layer(layer);
            let (good, bad) = (format!("Bearer {good}"), format!("Bearer {forged}"));
            for headers in [
                [("x-api-key", "key-of-a-pro")],
                [("authorization", good.as_str())],
                [("authorization", bad.as_str())],
            ] {
                send(&app, search(&headers)).await;
            }
        });
    });
    let logs = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    assert!(
        logs.contains("failing open"),
        "the store-down warning was traced: {logs}"
    );
    assert!(logs.contains("credentials refused"), "{logs}");
    for secret in ["key-of-a-pro", good.as_str(), forged.as_str()] {
        assert!(!logs.contains(secret), "`{secret}` was logged: {logs}");
    }
}
