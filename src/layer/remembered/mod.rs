//! What a layer remembers between requests: denied clients
//! ([`deny_cache`]), refused credentials per address
//! ([`credential_failures`]), the local counts of policies that fall back
//! to a local limit ([`local_fallback`]), and which policy names the
//! process's layers give which store ([`policy_names`]).

pub(crate) mod credential_failures;
pub(crate) mod deny_cache;
pub(crate) mod local_fallback;
pub(crate) mod policy_names;
