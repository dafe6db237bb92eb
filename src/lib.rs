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
//! # How a request flows
//!
//! 1. **Which policies.** [`Policies`] pick the plan of the route the
//!    router matched and the method; each [`Policy`] gives a limit per
//!    window, its [`Algorithm`](policy::Algorithm), its cost and its tiers'
//!    overrides ([`policy`]). A request of a route no policy covers goes
//!    on untouched. A client a [deny list](layer::DenyList) names is
//!    refused `403`; one the layer's exemption says yes to goes on
//!    untouched.
//! 2. **Who is asking.** The layer's [`KeyExtractor`] ([`PeerIp`], [`Header`],
//!    `JwtClaim`, [`Global`], or a chain of them with [`KeyExtractor::or`])
//!    turns the request head into the client's [`Key`](key::Key) and,
//!    where a token or table says so, its tier ([`key`]); a policy
//!    [counted per another key](Policy::per) reads its own. A
//!    [`RequestCost`](policy::RequestCost) may price the request, and a
//!    [limit lookup](limits) or a [change at run time](layer::Changes)
//!    give the client a limit of its own.
//! 3. **The deny cache.** A client the store denied recently is answered
//!    `429` from memory until its retry time ([`layer::DenyCache`]),
//!    without asking the store.
//! 4. **The store decides.** One [`Check`](store::Check) per policy goes
//!    to the [`Store`](store::Store), which decides them all-or-nothing:
//!    [`MemoryStore`](store::MemoryStore) in process, `RedisStore` in one
//!    script call ([`store`]). When it fails, each policy's
//!    [`FailMode`](policy::FailMode) answers (open, closed, or a local
//!    limit), and a [`CircuitBreaker`](store::CircuitBreaker) makes that
//!    answer immediate.
//! 5. **The answer.** An admitted request goes on with its rate-limit
//!    headers ([`headers`]); a denied one gets `429` with `Retry-After`,
//!    or whatever the hook set with [`RateLimitLayer::on_rejection`] makes
//!    of the [`Rejection`] ([`rejection`]).
//! 6. **What is owed when the response ends.** Units given back for a
//!    response a policy does not count ([`Count`](policy::Count)), a cost
//!    settled from what the handler reports ([`Usage`]), and a lease
//!    released when a request or WebSocket ends
//!    ([`ConnectionLease`](layer::ConnectionLease)); the messages a
//!    WebSocket carries are counted by its
//!    [`MessageLimit`](layer::MessageLimit).
//!
//! # Modules
//!
//! | module | what is in it |
//! |---|---|
//! | crate root | [`RateLimitLayer`], [`Policy`], [`Policies`], [`Rejection`], [`Usage`] and the common key extractors |
//! | [`policy`] | limits, windows, algorithms, tiers, costs, fail modes, calendars |
//! | [`key`] | who the client is: addresses, API keys, JWT claims, chains |
//! | [`store`] | the [`Store`](store::Store) trait, the memory and Redis stores, the breaker |
//! | [`layer`] | the middleware and what it keeps: deny cache, refused credentials, leases, message limits, deny lists and changes at run time, live policy changes |
//! | [`headers`] | the `X-RateLimit-*` and IETF `RateLimit` fields |
//! | [`rejection`] | why the limiter answers itself, and its `429`, `401`, `403`, `422`, `503` |
//! | [`limits`] | per-client limits: a lookup, or a static table |
//! | [`lookup`] | the one trait for asking a database while a request waits |
//! | [`clock`] | time sources, and a clock tests move |
//! | `config` | the TOML file the example server reads (feature `config`) |
//!
//! Start with the example below and [`Policy`]; then [`key`] to tell
//! clients apart, and [`store`] to share limits between instances. The
//! repository's `docs/` holds the guides: `recipes.md` (five complete
//! programs: a login limit, Redis failing closed, JWT tiers, LLM tokens,
//! WebSockets), `operations.md` (running it on
//! Redis in production, what to alert on), `configuration.md` (every key
//! of the TOML file), `redis.md` (keys and records in Redis),
//! `multi-region.md` (slices of a limit for hot keys and across regions,
//! with their bound) and `example-server.md`.
//!
//! ```
//! use axum::{Router, routing::{get, post}};
//! use slidegate::{PeerIp, Policies, Policy, RateLimitLayer, policy::FailMode, store::MemoryStore};
//! use std::time::Duration;
//!
//! let policies = Policies::builder()
//!     .with_route("POST /login", Policy::new("login", 5, Duration::from_secs(60)).with_fail_mode(FailMode::Closed))
//!     .with_default(Policy::new("default", 100, Duration::from_secs(60)))
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
//! | `test-util` | `clock::FakeClock`, a clock tests move, for the memory store and `RedisStoreBuilder::with_clock`; `store::conformance`, which checks a store of your own against the memory store | no |
//!
//! # Metrics
//!
//! With the `metrics` feature the limiter reports through the
//! [`metrics`](https://docs.rs/metrics) facade; install a recorder (the
//! example server uses metrics-exporter-prometheus and serves it at
//! `GET /metrics`) before the first request. Labels are policy names,
//! outcomes and error kinds, never a client's key.
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | `slidegate_decisions_total` | counter | `policy`, `outcome`: `admitted`, `denied`, `deny_cache`, `shadow_denied`, `failed_open`, `failed_closed`, `exempt`, `local`, `delay_full` |
//! | `slidegate_near_limit_total` | counter | `policy`: admitted with at most a fifth of the limit left |
//! | `slidegate_deny_list_total` | counter | `list`: `ips`, `api_keys`, `subjects`: refused `403` by a deny list |
//! | `slidegate_store_seconds` | histogram (a summary in metrics-exporter-prometheus unless buckets are set for it, as the example server sets them) | |
//! | `slidegate_store_errors_total` | counter | `kind`: `timeout`, `backend`, `protocol`, `internal`, `circuit_open`, `unsupported`, `full` |
//! | `slidegate_breaker_state` | gauge | 0 closed, 1 open, 2 probing |
//! | `slidegate_memory_keys` | gauge | (policy, client) pairs the memory stores track |
//!
//! ```
//! # fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let prometheus = metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder()?;
//! // ... build the layer and serve; then, in a `/metrics` handler:
//! let text = prometheus.render();
//! # Ok(())
//! # }
//! ```
//!
//! Each decided request also opens a debug-level `rate_limit` span with
//! the policy, the outcome and the store's time in microseconds.
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
mod log_lines;
pub mod lookup;
mod metrics;
pub mod policy;
pub mod rejection;
mod response;
pub mod store;

#[cfg(feature = "jwt")]
pub use key::JwtClaim;
pub use key::{Global, Header, KeyExtractor, PeerIp};
pub use layer::{PoliciesHandle, RateLimit, RateLimitLayer, Usage};
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
#[doc = include_str!("../docs/multi-region.md")]
#[doc = include_str!("../docs/operations.md")]
#[doc = include_str!("../docs/redis.md")]
struct GuideDoctests;

/// The recipes, compiled as doc tests (each serves until stopped, so none
/// is run); two need Redis and JWT support.
#[cfg(all(doctest, feature = "redis", feature = "jwt"))]
#[doc = include_str!("../docs/recipes.md")]
struct RecipeDoctests;
