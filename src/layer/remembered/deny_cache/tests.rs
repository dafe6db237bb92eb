use super::*;
use crate::clock::FakeClock;
use crate::layer::decide::priced::{Asked, Priced};
use crate::policy::plan::Plan;
use crate::policy::{FailMode, Policy};

const SEC: Duration = Duration::from_secs(1);

fn denied(retry: Duration, remaining: u32) -> Decision {
    Decision::new_denied(10, remaining, retry, Some(retry))
}

/// The cache's answer to a request of the client `key` under
/// `policies`, at their own costs.
fn lookup(cache: &DenyCache, policies: &[&Policy], key: &str) -> Option<Denied> {
    let plan = Plan::new(policies.iter().map(|&p| Arc::new(p.clone())).collect());
    let priced = Priced::of(&plan, None, Asked::default(), false, FailMode::Open).unwrap();
    cache.lookup(&Key::new(key), None, &priced.prices).ok()
}

/// Remembers that the client `k` sent a request at `sent_at` that
/// `policy` denied for 5 s with 2 units left; returns its check.
fn remember_denial(cache: &DenyCache, policy: &Policy, sent_at: u64) -> Check {
    let check = Check::new(policy, Key::new("k")).unwrap();
    let decisions = [denied(5 * SEC, 2)];
    cache.remember(std::slice::from_ref(&check), &decisions, sent_at, |_| true);
    check
}

#[test]
fn a_denial_answers_until_its_retry_time_only() {
    let clock = FakeClock::new(1_000_000);
    let cache = DenyCache::with_clock(100, clock.clone());
    let policy = Policy::new("p", 10, 60 * SEC).with_cost(3);
    let check = remember_denial(&cache, &policy, clock.now_micros());

    clock.advance(SEC);
    let denied = lookup(&cache, &[&policy], "k").unwrap();
    assert_eq!(denied.checks[..], [check]);
    assert_eq!(denied.decisions[0].retry_after(), Some(4 * SEC));
    assert_eq!(denied.decisions[0].remaining, 2);

    clock.advance(4 * SEC - Duration::from_micros(1));
    assert!(lookup(&cache, &[&policy], "k").is_some());
    clock.advance(Duration::from_micros(1));
    assert!(lookup(&cache, &[&policy], "k").is_none());
    assert!(cache.is_empty(), "the expired denial was dropped");
}

#[test]
fn only_the_same_limits_and_at_least_the_same_cost_match() {
    let clock = FakeClock::new(0);
    let cache = DenyCache::with_clock(100, clock.clone());
    let policy = Policy::new("p", 10, 60 * SEC).with_cost(3);
    remember_denial(&cache, &policy, 0);
    let variants = [
        (
            Policy::new("p", 10, 60 * SEC).with_cost(2),
            false,
            "a cheaper request may fit",
        ),
        (
            Policy::new("p", 10, 60 * SEC).with_cost(4),
            true,
            "a dearer one cannot",
        ),
        (
            Policy::new("p", 50, 60 * SEC).with_cost(3),
            false,
            "another tier's limit",
        ),
        (
            Policy::new("p", 10, 30 * SEC).with_cost(3),
            false,
            "another window",
        ),
        (
            Policy::new("p", 10, 60 * SEC)
                .with_cost(3)
                .with_block(60 * SEC),
            false,
            "another block",
        ),
        (
            Policy::new("q", 10, 60 * SEC).with_cost(3),
            false,
            "another policy",
        ),
    ];
    for (policy, hit, why) in variants {
        assert_eq!(lookup(&cache, &[&policy], "k").is_some(), hit, "{why}");
    }
    assert!(lookup(&cache, &[&policy], "someone-else").is_none());
}

#[test]
fn a_miss_tells_the_time_it_asked_at() {
    let clock = FakeClock::new(7_000_000);
    let cache = DenyCache::with_clock(100, clock);
    let plan = Plan::new(vec![Arc::new(Policy::new("p", 10, 60 * SEC))]);
    let priced = Priced::of(&plan, None, Asked::default(), false, FailMode::Open).unwrap();
    let asked = cache.lookup(&Key::new("k"), None, &priced.prices);
    assert_eq!(asked.unwrap_err(), 7_000_000);
}

#[test]
fn a_shadow_policy_is_not_asked() {
    let cache = DenyCache::with_clock(100, FakeClock::new(0));
    let policy = Policy::new("p", 10, 60 * SEC);
    let check = Check::new(&policy, Key::new("k")).unwrap();
    cache.remember(&[check], &[denied(SEC, 0)], 0, |_| true);
    assert!(lookup(&cache, &[&policy], "k").is_some());
    assert!(lookup(&cache, &[&policy.clone().with_shadow(true)], "k").is_none());
}

#[test]
fn admitted_policies_of_a_denied_request_are_not_cached() {
    let cache = DenyCache::with_clock(100, FakeClock::new(0));
    let (tight, loose) = (
        Policy::new("tight", 1, 60 * SEC),
        Policy::new("loose", 100, 60 * SEC),
    );
    let tight_check = Check::new(&tight, Key::new("k")).unwrap();
    let loose_check = Check::new(&loose, Key::new("k")).unwrap();
    let fits = Decision {
        retry_after_us: crate::store::UNSET,
        ..denied(SEC, 50)
    };
    cache.remember(
        &[tight_check.clone(), loose_check],
        &[denied(SEC, 0), fits],
        0,
        |_| true,
    );
    assert!(lookup(&cache, &[&loose], "k").is_none());
    let denied = lookup(&cache, &[&loose, &tight], "k").unwrap();
    assert_eq!(denied.checks[..], [tight_check]);
}

#[test]
fn the_cache_stays_bounded() {
    let cache = DenyCache::with_clock(100, FakeClock::new(0));
    let policy = Policy::new("p", 10, 60 * SEC);
    for client in 0..10_000 {
        let check = Check::new(&policy, Key::new(format!("c{client}"))).unwrap();
        cache.remember(&[check], &[denied(SEC, 0)], 0, |_| true);
    }
    assert!(cache.len() <= 110, "{} entries", cache.len());
}

/// A lookup borrows its scope: it must hash and compare as the scope an
/// entry was stored under, with and without a namespace, or every lookup
/// would miss.
#[test]
fn a_borrowed_scope_hashes_and_compares_as_the_stored_one() {
    use quick_cache::Equivalent;
    use std::hash::BuildHasher;

    let hasher = quick_cache::DefaultHashBuilder::default();
    for namespace in [None, Some(Arc::<str>::from("public"))] {
        let scope: Scope = (namespace.clone(), Arc::from("search"), Key::new("alice"));
        let borrowed = ScopeRef(namespace.as_deref(), "search", scope.2.as_str());
        assert_eq!(hasher.hash_one(&borrowed), hasher.hash_one(&scope));
        assert!(borrowed.equivalent(&scope));
        let other = ScopeRef(namespace.as_deref(), "login", scope.2.as_str());
        assert!(!other.equivalent(&scope));
    }
}
