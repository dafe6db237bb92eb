//! The layer's setters behave as their neighbours do: each holds whatever
//! order it is called in, and a switch turns off as it turns on.

use std::time::Duration;

use crate::key::Global;
use crate::layer::DenyCache;
use crate::limits::Overrides;
use crate::policy::{Policies, Policy};
use crate::store::MemoryStore;
use crate::{Header, KeyExtractor, RateLimitLayer};

fn layer() -> RateLimitLayer {
    let policies = Policies::single(Policy::new("all", 10, Duration::from_secs(1))).unwrap();
    RateLimitLayer::new(MemoryStore::new(), Global, policies)
}

#[test]
fn a_limit_lookup_ttl_holds_whether_set_before_or_after_the_lookup() {
    let ttl = Duration::from_secs(5);
    let before = layer()
        .with_limit_lookup_ttl(ttl)
        .with_limit_lookup(Overrides::new());
    let after = layer()
        .with_limit_lookup(Overrides::new())
        .with_limit_lookup_ttl(ttl);
    for layer in [before, after] {
        let limits = layer.shared.client_limits.as_ref().unwrap();
        assert_eq!(limits.ttl(), ttl);
    }
}

#[test]
fn the_deny_cache_is_set_and_taken_away_through_one_setter() {
    let cached = layer().with_deny_cache(DenyCache::new(16));
    assert!(cached.shared.deny_cache.is_some());
    assert!(cached.with_deny_cache(None).shared.deny_cache.is_none());
}

#[test]
fn a_switch_turns_off_as_it_turns_on() {
    let tokens = Policy::new("tokens", 1_000, Duration::from_secs(60)).with_max_unsettled(4);
    assert!(tokens.is_settled_after_response());
    assert!(!tokens.with_settlement(false).is_settled_after_response());

    let name = http::HeaderName::from_static("x-api-key");
    let keys = Header::new(name).with_keys(["sk_live_abc"]);
    let (parts, _) = http::Request::builder()
        .header("x-api-key", "guess")
        .body(())
        .unwrap()
        .into_parts();
    let rejected = keys.clone().with_unknown_rejected(true);
    assert!(rejected.extract(&parts).is_err());
    let passed = rejected.with_unknown_rejected(false);
    assert!(matches!(passed.extract(&parts), Ok(None)));
    assert!(matches!(keys.extract(&parts), Ok(None)));
}
