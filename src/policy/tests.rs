//! Unit tests of policies: building, validation and tiers.

use super::*;

/// A policy of `limit` a minute, for the policy modules' tests.
pub(super) fn minute(name: &str, limit: u32) -> Policy {
    Policy::new(name, limit, Duration::from_secs(60))
}

#[test]
fn cost_above_limit_is_refused() {
    let err = Policies::single(minute("p", 5).with_cost(6)).unwrap_err();
    assert_eq!(
        err,
        PolicyError::CostAboveLimit {
            name: "p".into(),
            cost: 6,
            limit: 5
        }
    );
    assert!(Policies::single(minute("p", 5).with_cost(5)).is_ok());
}

#[test]
fn invalid_settings_are_refused() {
    assert!(matches!(
        Policies::single(minute("p", 0)),
        Err(PolicyError::ZeroLimit { .. })
    ));
    assert!(matches!(
        Policies::single(minute("p", 1).with_cost(0)),
        Err(PolicyError::ZeroCost { .. })
    ));
    assert!(matches!(
        Policies::single(Policy::new("p", 1, Duration::from_micros(10))),
        Err(PolicyError::WindowTooShort { .. })
    ));
    for too_long in [Duration::MAX, MAX_WINDOW + Duration::from_micros(1)] {
        assert!(matches!(
            Policies::single(Policy::new("p", 1, too_long)),
            Err(PolicyError::WindowTooLong { .. })
        ));
    }
    assert!(Policies::single(Policy::new("p", 1, MAX_WINDOW)).is_ok());
    for bad in ["", "a:b", "{x}", "a b", &"n".repeat(65)] {
        assert!(matches!(
            Policies::single(minute(bad, 1)),
            Err(PolicyError::InvalidName { .. })
        ));
    }
    let duplicate = Policies::builder()
        .with_route("/a", minute("p", 1))
        .with_default(minute("p", 2))
        .build();
    assert!(matches!(duplicate, Err(PolicyError::DuplicateName { .. })));
    let bad_route = Policies::builder()
        .with_route("GET", minute("p", 1))
        .build();
    assert!(matches!(bad_route, Err(PolicyError::InvalidRoute { .. })));
    assert!(matches!(
        Policies::single(minute("credential_failures", 1)),
        Err(PolicyError::ReservedName { .. })
    ));
    assert!(matches!(
        Policies::single(Policy::concurrency("c", 4097)),
        Err(PolicyError::TooManyLeases { .. })
    ));
    assert!(Policies::single(Policy::concurrency("c", 4096)).is_ok());
    let tier = Policy::concurrency("c", 2).with_tier("pro", TierLimits::new().with_limit(5000));
    assert!(matches!(
        Policies::single(tier),
        Err(PolicyError::TooManyLeases { .. })
    ));
}

#[test]
fn tier_overrides_are_validated_too() {
    let bad_tier = minute("p", 10)
        .with_cost(2)
        .with_tier("free", TierLimits::new().with_limit(1));
    assert_eq!(
        Policies::single(bad_tier).unwrap_err(),
        PolicyError::CostAboveLimit {
            name: "p (tier `free`)".into(),
            cost: 2,
            limit: 1
        }
    );
    let replaced = minute("p", 10)
        .with_tier("pro", TierLimits::new().with_limit(1))
        .with_tier("pro", TierLimits::new().with_limit(20).with_cost(4));
    let pro = replaced.limits_for(Some("pro"));
    assert_eq!(
        (pro.limit, pro.cost, pro.window),
        (20, 4, Duration::from_secs(60))
    );
}

#[test]
fn sliding_counter_limits_keep_its_arithmetic_exact() {
    let counter = |limit, window| {
        Policies::single(Policy::new("c", limit, window).with_algorithm(Algorithm::SlidingCounter))
    };
    assert!(counter(1_000_000, Duration::from_secs(3600)).is_ok());
    assert!(matches!(
        counter(u32::MAX, Duration::from_secs(86_400 * 30)),
        Err(PolicyError::CounterTooLarge { .. })
    ));
    assert!(matches!(
        counter(10, Duration::from_micros(1500)),
        Err(PolicyError::CounterWindowNotWholeMillis { .. })
    ));
    // The log and the fixed window have no such bound.
    let log = Policy::new("l", u32::MAX, Duration::from_secs(86_400 * 30));
    assert!(Policies::single(log.clone()).is_ok());
    assert!(Policies::single(log.with_algorithm(Algorithm::FixedWindow)).is_ok());
}

#[test]
fn an_own_limit_passes_the_policys_own_validation() {
    let bucket =
        Policy::new("api", 10, Duration::from_secs(7200)).with_algorithm(Algorithm::TokenBucket);
    assert!(bucket.validate_own_limit(1_000).is_ok());
    // 2,562,047,789 × 7,200 s in µs is past 2^52.
    assert!(bucket.validate_own_limit(2_562_047_789).is_err());
    assert!(bucket.validate_own_limit(0).is_err());
}
