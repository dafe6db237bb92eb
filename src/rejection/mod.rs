//! [`Rejection`]: why the limiter answers a request itself, as a hook set
//! with [`RateLimitLayer::on_rejection`] sees it, with a denial's details in
//! [`Limited`] and a cost no window holds in [`CostAboveLimit`]; and how the
//! hook's answer is completed.
//!
//! # What clients see
//!
//! The limiter's own answers, unless a hook answers otherwise; the headers
//! each carries (`Retry-After`, the rate-limit headers, `WWW-Authenticate`)
//! are in the [`headers`](crate::headers) module.
//!
//! | case | status and body |
//! |---|---|
//! | over the limit | `429`, `application/problem+json` with `policy`, `limit`, `window_seconds`, `retry_after_seconds` |
//! | over a concurrency limit | `429`, as above, with no `window_seconds` (its detail speaks of requests in flight) |
//! | a WebSocket (or other upgrade) over a concurrency limit, while the client's others are open | `429`, as above, instead of `101` |
//! | over a calendar quota | `429`, as above; `window_seconds` is the period's nominal length |
//! | blocked after a denial (`block`) | `429`, as above, whatever the count |
//! | denied after a settlement past the limit (an overdraft) | `429`, as above |
//! | over the limit beyond the policy's `delay` | `429`, as above (and blocked, if the policy blocks) |
//! | fits within the `delay`, with `max_delayed = 0` | `429`, as above |
//! | store down, policy fails to a local limit (`fail = "local"`), past this instance's share of the limit (`limit ÷ local_share`) | `429`, as above; within the share, the handler's |
//! | credentials from an address past its limit of refused credentials | `429`, as above, with `policy: "credential_failures"`; nothing is verified |
//! | a per-request cost above the client's limit | `422`, `application/problem+json` with `policy`, `cost`, `limit`, `window_seconds` |
//! | token present but invalid | `401`, `application/problem+json` with `reason` |
//! | unknown API key, with `unknown_api_key = "reject"` | `401`, `application/problem+json` with `reason: "unknown_api_key"` |
//! | no credentials, and every key source needs them (API keys or tokens only) | `401`, `application/problem+json` with `reason: "missing_credentials"` |
//! | a policy counted per another key (`per`) finds none, with `per_missing = "refuse"` | `401`, `application/problem+json` with `reason: "missing_credentials"` |
//! | the client on a deny list (`[deny]`, `DenyList`, or denied at run time) | `403`, `application/problem+json` with `list` (`ips`, `api_keys`, `subjects`); nothing is counted |
//! | no key source identifies the client otherwise (no peer address) | `500`, `application/problem+json` |
//! | fits within the `delay`, but the layer's places are all taken ([`with_max_delayed`], [`with_max_delayed_bytes`]) | `503`, `application/problem+json`; nothing is counted |
//! | store down, policy fails closed | `503`, `application/problem+json` |
//! | any of the above, for a gRPC call (a `POST` with `content-type: application/grpc`) | `200`, `application/grpc`, no body: `grpc-status` `8` (`RESOURCE_EXHAUSTED`) for `429` and `422`, `16` for `401`, `7` (`PERMISSION_DENIED`) for `403`, `13` for `500`, `14` for `503` (see [gRPC](#grpc)) |
//!
//! A `401` for a token never names the token's algorithm nor the allowed
//! ones; a token whose `exp`/`nbf` is not a number, or (when checked) whose
//! `iss` is not a string or `aud` not a string or array of strings, is
//! `invalid_claim`.
//!
//! # Costs no limit holds
//!
//! A request's cost can come from the request itself (a batch size, a
//! query's weight) with [`RateLimitLayer::with_request_cost`], per policy,
//! as a [`Cost`]: [`Cost::Units`]`(n)` spends `n` units (at least one: a
//! computed 0 is never free), [`Cost::Policy`] the policy's own cost, and
//! only [`Cost::Exempt`] leaves the request out of that policy. A cost the
//! client's limit could never hold is answered `422` at once
//! ([`Rejection::CostAboveLimit`]), spending nothing. A cost read from the
//! request is the client's to choose: clamp it.
//!
//! # Answering otherwise
//!
//! Every answer in the table is yours to replace with
//! [`RateLimitLayer::on_rejection`]. The hook sees a typed [`Rejection`]
//! ([`Limited`](Rejection::Limited), with the denying policy, its limit and
//! window, the client's key and the retry time;
//! [`InvalidCredentials`](Rejection::InvalidCredentials);
//! [`Unidentified`](Rejection::Unidentified);
//! [`CostAboveLimit`](Rejection::CostAboveLimit);
//! [`StoreUnavailable`](Rejection::StoreUnavailable);
//! [`DelayFull`](Rejection::DelayFull)) and the request's head (method,
//! URI, headers), and returns a response, or `None` to keep the limiter's
//! own. Its response keeps its status, headers and body, and gets the
//! headers of the limiter's answer it does not set itself: `Retry-After`,
//! the rate-limit headers, `WWW-Authenticate`. With axum,
//! `RateLimitLayer::on_rejection_into_response` takes a hook that returns
//! anything `impl IntoResponse` (its body complete at once, as `Html`,
//! `Json` and strings are): an HTML page for browsers, the limiter's JSON
//! for API clients:
//!
//! ```rust
//! use axum::{http::{StatusCode, header::ACCEPT}, response::Html};
//! use slidegate::{PeerIp, Policies, Policy, RateLimitLayer, Rejection, store::MemoryStore};
//! use std::time::Duration;
//!
//! let policies = Policies::single(Policy::new("all", 100, Duration::from_secs(60))).unwrap();
//! let layer = RateLimitLayer::new(MemoryStore::new(), PeerIp::new(), policies)
//!     .on_rejection_into_response(|rejection, request| {
//!         let Rejection::Limited(limited) = rejection else {
//!             return None; // the limiter's own answer
//!         };
//!         let accept = request.headers.get(ACCEPT)?.to_str().ok()?;
//!         accept.contains("text/html").then(|| {
//!             let wait = limited.retry_after().as_secs();
//!             (StatusCode::TOO_MANY_REQUESTS, Html(format!("<p>Try again in {wait} s.</p>")))
//!         })
//!     });
//! ```
//!
//! # gRPC
//!
//! The layer wraps a tonic server as it wraps a router: its body type works
//! as it is, and a gRPC call (`content-type: application/grpc`, or a
//! subtype such as `application/grpc+proto`) gets the limiter's answers as
//! gRPC statuses without a hook, in a Trailers-Only response:
//! `RESOURCE_EXHAUSTED` over a limit, with `retry-after` (seconds) and
//! `grpc-retry-pushback-ms` (gRPC's own retry throttling) in the metadata;
//! `RESOURCE_EXHAUSTED` with a pushback of `-1` for a cost above the limit;
//! `UNAUTHENTICATED` for credentials; `UNAVAILABLE`, with a pushback of
//! 1000 ms, for the store down, failing closed. A hook may still answer
//! otherwise; [`Rejection::to_grpc`] is the limiter's gRPC answer, for a
//! hook that wants it for every request.
//!
//! A policy's route is the method's path,
//! `POST /<package>.<Service>/<Method>`. tonic serves a call whatever its
//! HTTP method, so a `POST` route can be gone round with a `GET`: refuse
//! other methods in front of the layer, as the example below does with
//! `tower::filter` (it answers `UNIMPLEMENTED`), or write the route without
//! a method. A policy that counts failures only
//! ([`Count`](crate::policy::Count), config `count = "failures"`) reads the
//! call's `grpc-status`.
//!
//! With the `tonic` feature, [`PeerIp`](crate::PeerIp) reads the peer
//! address tonic records (`TcpConnectInfo`); a tonic server that terminates
//! TLS itself records a `TlsConnectInfo` instead: copy its address into a
//! `SocketAddr` request extension, which `PeerIp` reads too.
//!
//! ```toml
//! [dependencies]
//! slidegate = { version = "0.1", features = ["tonic"] }
//! tower = { version = "0.5", features = ["filter"] }
//! ```
//!
//! ```rust,no_run
//! use slidegate::{PeerIp, Policies, Policy, RateLimitLayer, store::MemoryStore};
//! use std::time::Duration;
//! use tonic::transport::Server;
//!
//! #[tokio::main]
//! async fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     let check = Policy::new("health-check", 5, Duration::from_secs(60));
//!     let policies = Policies::builder()
//!         .with_route("POST /grpc.health.v1.Health/Check", check)
//!         .build()?;
//!     let layer = RateLimitLayer::new(MemoryStore::new(), PeerIp::new(), policies);
//!     let (_reporter, health) = tonic_health::server::health_reporter();
//!     // Every gRPC call is a POST; tonic would serve a GET as well.
//!     let only_post = |request: http::Request<tonic::body::Body>| match *request.method() {
//!         http::Method::POST => Ok(request),
//!         _ => Err(tonic::Status::unimplemented("a gRPC call is a POST request")),
//!     };
//!     Server::builder()
//!         .layer(tower::filter::FilterLayer::new(only_post))
//!         .layer(layer)
//!         .add_service(health)
//!         .serve("127.0.0.1:50051".parse()?)
//!         .await?;
//!     Ok(())
//! }
//! ```
//!
//! The repository's `examples/grpc.rs` serves the standard health service
//! this way, five `Check` calls a minute per client IP
//! (`cargo run --example grpc`, on `127.0.0.1:50051`; `--config` takes the
//! example server's file, `--bind` another address).
//!
//! [`RateLimitLayer::on_rejection`]: crate::RateLimitLayer::on_rejection
//! [`RateLimitLayer::with_request_cost`]: crate::RateLimitLayer::with_request_cost
//! [`with_max_delayed`]: crate::RateLimitLayer::with_max_delayed
//! [`with_max_delayed_bytes`]: crate::RateLimitLayer::with_max_delayed_bytes
//! [`Cost`]: crate::policy::Cost
//! [`Cost::Units`]: crate::policy::Cost::Units
//! [`Cost::Policy`]: crate::policy::Cost::Policy
//! [`Cost::Exempt`]: crate::policy::Cost::Exempt

mod grpc;
pub(crate) mod limited;
mod listed;

pub use limited::Limited;
pub use listed::Listed;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use http::request::Parts;
use http::{HeaderMap, Response, StatusCode};

use crate::key::KeyRejection;
use crate::store::StoreError;

/// Answers the limiter's rejections in place of its defaults; see
/// [`RateLimitLayer::on_rejection`](crate::RateLimitLayer::on_rejection).
pub(crate) type OnRejection = Arc<Hook>;

/// A rejection hook, borrowed.
pub(crate) type Hook = dyn Fn(&Rejection<'_>, &Parts) -> Option<Response<Bytes>> + Send + Sync;

/// Why the limiter answers a request itself instead of passing it on.
///
/// Each case names its default answer (for a gRPC call, the status
/// [`to_grpc`](Self::to_grpc) gives); a hook set with
/// [`RateLimitLayer::on_rejection`](crate::RateLimitLayer::on_rejection)
/// may answer it otherwise.
#[derive(Debug)]
#[non_exhaustive]
pub enum Rejection<'a> {
    /// Over a limit: `429 Too Many Requests` with `Retry-After`.
    Limited(&'a Limited<'a>),
    /// Credentials that do not verify (a bad token, an unknown API key
    /// with `reject`): `401 Unauthorized` with `WWW-Authenticate` when the
    /// extractor gives a challenge.
    InvalidCredentials(&'a KeyRejection),
    /// No key extractor identified the client: `401` (reason
    /// `missing_credentials`) when every extractor of the chain needs
    /// credentials and none were sent, `500` otherwise (a server without
    /// peer addresses for `PeerIp`, say).
    Unidentified {
        /// Whether the chain keys by credentials alone, and none came.
        missing_credentials: bool,
    },
    /// The request costs more under a policy than the client may spend in
    /// a whole window, so it can never be admitted: `422 Unprocessable
    /// Content`, without `Retry-After`.
    CostAboveLimit(&'a CostAboveLimit),
    /// The store failed and a policy of the request fails closed: `503
    /// Service Unavailable` with `Retry-After: 1`.
    StoreUnavailable(&'a StoreError),
    /// A deny list names the client (see
    /// [`DenyList`](crate::layer::DenyList) and
    /// [`Changes::deny`](crate::layer::Changes::deny)): `403 Forbidden`,
    /// before any limit is counted.
    DenyListed(Listed),
    /// The store would hold the request for its policies' delay, but the
    /// layer holds as many requests as it may
    /// ([`with_max_delayed`](crate::RateLimitLayer::with_max_delayed), or
    /// their bytes): `503 Service Unavailable`, with `Retry-After` the
    /// wait it would have had. The request's units are given back: the
    /// client is not at fault, and other clients filling the layer never
    /// push it toward its block.
    DelayFull {
        /// The wait the store granted the request.
        retry_after: Duration,
    },
}

impl Rejection<'_> {
    /// The status of the limiter's own answer.
    ///
    /// ```
    /// use slidegate::{Rejection, key::KeyRejection};
    ///
    /// let refused = KeyRejection::new("expired", "the token expired");
    /// assert_eq!(Rejection::InvalidCredentials(&refused).default_status(), 401);
    /// ```
    pub fn default_status(&self) -> StatusCode {
        match self {
            Self::Limited(_) => StatusCode::TOO_MANY_REQUESTS,
            Self::InvalidCredentials(_) => StatusCode::UNAUTHORIZED,
            Self::Unidentified {
                missing_credentials: true,
                ..
            } => StatusCode::UNAUTHORIZED,
            Self::Unidentified { .. } => StatusCode::INTERNAL_SERVER_ERROR,
            Self::CostAboveLimit(_) => StatusCode::UNPROCESSABLE_ENTITY,
            Self::DenyListed(_) => StatusCode::FORBIDDEN,
            Self::StoreUnavailable(_) | Self::DelayFull { .. } => StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}

/// A request that costs more under a policy than the client may ever
/// spend in one of its windows.
#[derive(Debug)]
pub struct CostAboveLimit {
    pub(crate) policy: Arc<str>,
    pub(crate) cost: u32,
    pub(crate) limit: u32,
    pub(crate) window: Duration,
}

impl CostAboveLimit {
    /// The policy whose limit the cost is above.
    pub fn policy(&self) -> &str {
        &self.policy
    }

    /// The request's cost under the policy, in units.
    pub fn cost(&self) -> u32 {
        self.cost
    }

    /// The client's limit under the policy, in units per window.
    pub fn limit(&self) -> u32 {
        self.limit
    }

    /// The policy's window for the client.
    pub fn window(&self) -> Duration {
        self.window
    }
}

/// Adds to `custom` each of the limiter's `headers` it does not set
/// itself, but for the content headers, which describe the limiter's body.
pub(crate) fn fill_missing(custom: &mut Response<Bytes>, headers: &HeaderMap) {
    let own = custom.headers_mut();
    for (name, value) in headers {
        if *name != CONTENT_TYPE && *name != CONTENT_LENGTH && !own.contains_key(name) {
            own.insert(name, value.clone());
        }
    }
}
