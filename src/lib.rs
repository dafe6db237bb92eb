//! Exact sliding-window rate limiting for [Tower] and [axum] services, on
//! Redis or in memory.
//!
//! Wrap a router in a [`RateLimitLayer`]: a [`KeyExtractor`] says who the
//! client is, [`Policies`] say how much each route allows, and a
//! [`Store`](store::Store) ([`MemoryStore`](store::MemoryStore) in one
//! process, `RedisStore` across many) decides atomically. Clients can be
//! told apart by address, API key or a verified JWT claim, and each policy
//! can give each tier its own limits. Responses carry `X-RateLimit-*`
//! headers; a denied request gets `429 Too Many Requests` with
//! `Retry-After`; when the store is down each policy fails open, fails
//! closed, or holds a local limit.
//!
//! The crate root has the layer, [`Policy`] and [`Policies`], the
//! [`Rejection`] a hook sees, and the common key extractors; the rest is
//! in [`policy`], [`key`], [`store`] (the [`Store`](store::Store) trait
//! and both stores), [`headers`], [`rejection`] and [`layer`], and
//! `config` (feature `config`).
//!
//! ```
//! use axum::{Router, routing::{get, post}};
//! use slidegate::{PeerIp, Policies, Policy, RateLimitLayer, policy::FailMode, store::MemoryStore};
//! use std::time::Duration;
//!
//! let policies = Policies::builder()
//!     .route("POST /login", Policy::new("login", 5, Duration::from_secs(60)).with_fail_mode(FailMode::Closed))
//!     .default_policy(Policy::new("default", 100, Duration::from_secs(60)))
//!     .build()
//!     .expect("valid policies");
//! let app: Router = Router::new()
//!     .route("/login", post(|| async { "welcome" }))
//!     .route("/videos", get(|| async { "videos" }))
//!     // route_layer: unmatched paths stay 404, never 429.
//!     .route_layer(RateLimitLayer::new(MemoryStore::new(), PeerIp::new(), policies));
//! // Serve with `app.into_make_service_with_connect_info::<std::net::SocketAddr>()`
//! // so `PeerIp` sees the client address.
//! ```
//!
//! # Features
//!
//! | feature | gives | default |
//! |---|---|---|
//! | `axum` | routes by axum's `MatchedPath`, peer addresses from `ConnectInfo`, hooks answering `impl IntoResponse` | yes |
//! | `redis` | `RedisStore` on a deadpool-redis pool: standalone, Cluster or Sentinel, plain or TLS | no |
//! | `jwt` | `JwtClaim`: clients and tiers from verified bearer tokens | no |
//! | `jwt-rust-crypto` | verifies tokens with RustCrypto (pure Rust); nothing without `jwt` | yes |
//! | `jwt-aws-lc` | verifies tokens with AWS-LC instead (turns on `jwt`; needs a C compiler); chosen when both are on | no |
//! | `config` | the TOML configuration file (`config`); its `[jwt]` section needs `jwt` | no |
//! | `tonic` | `PeerIp` reads the peer address a tonic server records (`TcpConnectInfo`) | no |
//! | `metrics` | counters, a histogram and gauges through the `metrics` facade | no |
//! | `test-util` | `clock::FakeClock`, a clock tests move, for the memory store and `RedisStoreBuilder::with_clock` | no |
//!
//! # Supported versions
//!
//! Rust 1.88 or later; axum 0.8, and any Tower service whose requests
//! and responses are `http` 1 types.
//!
//! [Tower]: https://docs.rs/tower
//! [axum]: https://docs.rs/axum

#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod clock;
#[cfg(feature = "config")]
pub mod config;
pub mod headers;
pub mod key;
pub mod layer;
pub mod limits;
pub mod lookup;
mod metrics;
pub mod policy;
pub mod rejection;
mod response;
pub mod store;
mod throttle;

#[cfg(feature = "jwt")]
pub use key::JwtClaim;
pub use key::{Global, Header, KeyExtractor, PeerIp};
pub use layer::{PoliciesHandle, RateLimit, RateLimitLayer, ResponseFuture, Usage};
pub use policy::{Policies, Policy};
pub use rejection::Rejection;

#[cfg(feature = "redis")]
pub use deadpool_redis;

/// The README's examples, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

/// The guides' examples, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../docs/configuration.md")]
#[doc = include_str!("../docs/example-server.md")]
struct GuideDoctests;
