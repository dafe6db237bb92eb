//! The rate-limit headers: which are sent ([`HeaderStyle`]), how their
//! reset time is written ([`ResetFormat`]), and their names.

pub use crate::response::headers::{
    HeaderStyle, RATELIMIT, RATELIMIT_POLICY, ResetFormat, X_RATELIMIT_LIMIT,
    X_RATELIMIT_REMAINING, X_RATELIMIT_RESET,
};
