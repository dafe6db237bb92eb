//! Why the limiter answers a request itself, as a hook set with
//! [`RateLimitLayer::on_rejection`](crate::RateLimitLayer::on_rejection)
//! sees it: a [`Rejection`], with a denial's details in [`Limited`] and a
//! cost no window holds in [`CostAboveLimit`].

pub use crate::response::{CostAboveLimit, Limited, Rejection};
