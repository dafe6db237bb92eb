//! [`Rejection`]: why the limiter answers a request itself, as a hook set
//! with [`RateLimitLayer::on_rejection`](crate::RateLimitLayer::on_rejection)
//! sees it, with a denial's details in [`Limited`] and a cost no window
//! holds in [`CostAboveLimit`]; and how the hook's answer is completed.

pub(crate) mod limited;

pub use limited::Limited;

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
