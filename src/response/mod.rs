//! What the limiter writes: the rate-limit headers on every answer, and
//! the answers it gives itself, which a rejection hook may replace.
//!
//! * [`headers`]: `X-RateLimit-*` and the IETF fields;
//! * [`problem`]: the default `application/problem+json` answers;
//! * [`rejection`]: [`Rejection`], what the hook sees, and how its answer
//!   is completed;
//! * [`limited`]: [`Limited`], a denial as the hook sees it;
//! * `grpc`: the answers as gRPC statuses, and how a gRPC call ended;
//! * `axum_response`: an axum response as the hook's answer.

#[cfg(feature = "axum")]
pub(crate) mod axum_response;
pub(crate) mod grpc;
pub(crate) mod headers;
pub(crate) mod limited;
pub(crate) mod problem;
pub(crate) mod rejection;

pub use limited::Limited;
pub use rejection::{CostAboveLimit, Rejection};
