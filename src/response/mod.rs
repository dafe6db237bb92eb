//! The answers the limiter gives itself, which a rejection hook may
//! replace (the rate-limit headers are in [`crate::headers`], what the
//! hook sees in [`crate::rejection`]):
//!
//! * [`problem`]: the default `application/problem+json` answers;
//! * `grpc`: the answers as gRPC statuses, and how a gRPC call ended;
//! * `axum_response`: an axum response as the hook's answer.

#[cfg(feature = "axum")]
pub(crate) mod axum_response;
pub(crate) mod grpc;
pub(crate) mod problem;
