//! Exact sliding-window rate limiting for [Tower] and [axum] services, on
//! Redis or in memory.
//!
//! Wrap a router in a [`RateLimitLayer`]: a [`KeyExtractor`] says who the
//! client is, [`Policies`] say how much each route allows, and a [`Store`]
//! ([`MemoryStore`] in one process, `RedisStore` across many) decides
//! atomically. Clients can be told apart by address, API key or a verified
//! JWT claim, and each policy can give each tier its own limits. Responses carry `X-RateLimit-*` headers; a denied request gets
//! `429 Too Many Requests` with `Retry-After`; when the store is down each
//! policy fails open or closed.
//!
//! ```
//! use axum::{Router, routing::{get, post}};
//! use slidegate::{FailMode, MemoryStore, PeerIp, Policies, Policy, RateLimitLayer};
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
//! [Tower]: https://docs.rs/tower
//! [axum]: https://docs.rs/axum

#![cfg_attr(docsrs, feature(doc_cfg))]

mod clock;
#[cfg(feature = "config")]
pub mod config;
mod key;
mod layer;
mod metrics;
mod policy;
mod response;
mod store;
mod throttle;
mod tier;

pub use clock::{Clock, FakeClock, SystemClock};
pub use key::{
    ApiKeyFuture, ApiKeyLookup, ApiKeyStatus, Extracted, ForwardedHeader, Global, Header, Identity,
    Key, KeyExtractor, KeyRejection, Or, PeerIp,
};
#[cfg(feature = "jwt")]
pub use key::{JwtClaim, JwtClaimBuilder, JwtError};
pub use layer::credentials::CredentialFailures;
pub use layer::deny_cache::DenyCache;
pub use layer::{PoliciesHandle, RateLimit, RateLimitLayer, ResponseFuture};
pub use policy::{
    Algorithm, Cost, Count, FailMode, Limits, MAX_WINDOW, Policies, PoliciesBuilder, Policy,
    PolicyError, RequestCost, Route, TierLimits,
};
pub use response::{
    CostAboveLimit, HeaderStyle, Limited, RATELIMIT, RATELIMIT_POLICY, Rejection, ResetFormat,
    X_RATELIMIT_LIMIT, X_RATELIMIT_REMAINING, X_RATELIMIT_RESET,
};
pub use store::{
    BreakerSettings, BreakerState, Check, CheckFuture, CheckOutcome, CircuitBreaker, Decision,
    Decisions, MemoryStore, MemoryStoreBuilder, Store, StoreError,
};
#[cfg(feature = "redis")]
pub use store::{
    ClusterClientPool, ClusterManager, PrefixError, RedisPool, RedisStore, RedisStoreBuilder,
    SentinelConnection, SentinelManager, SentinelPool,
};
pub use tier::{TierFuture, TierLookup};

#[cfg(feature = "redis")]
pub use deadpool_redis;

/// The README's examples, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
