//! `MemoryStore` and `RedisStore` decide identically for the same sequence
//! of requests, for every algorithm, mixed in one batch (a model test over
//! random sequences).

mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use proptest::prelude::*;
use slidegate::{Algorithm, Check, FakeClock, Key, MemoryStore, Policy, RedisStore, Store};
use support::RedisServer;

#[derive(Debug, Clone)]
struct Step {
    advance_ms: u64,
    client: u8,
    policies: u8,
    cost: u32,
}

fn step() -> impl Strategy<Value = Step> {
    (
        prop_oneof![Just(0u64), 0u64..50, 0u64..3000],
        0u8..3,
        1u8..16,
        1u32..=3,
    )
        .prop_map(|(advance_ms, client, policies, cost)| Step {
            advance_ms,
            client,
            policies,
            cost,
        })
}

fn policies(mask: u8, cost: u32) -> Vec<Policy> {
    let all = [
        Policy::new("short", 4, Duration::from_millis(1500)),
        Policy::new("long", 9, Duration::from_secs(10)),
        Policy::new("counter", 7, Duration::from_secs(2)).algorithm(Algorithm::SlidingCounter),
        Policy::new("fixed", 5, Duration::from_millis(1200)).algorithm(Algorithm::FixedWindow),
    ];
    all.into_iter()
        .enumerate()
        .filter(|(i, _)| mask & (1 << i) != 0)
        .map(|(_, p)| p.cost(cost))
        .collect()
}

#[test]
fn memory_and_redis_decide_the_same() {
    let server = RedisServer::start();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let pool = server.pool(2);
    let case = AtomicU64::new(0);
    let config = ProptestConfig {
        cases: 32,
        ..ProptestConfig::default()
    };
    proptest!(config, |(steps in prop::collection::vec(step(), 1..150))| {
        // Not aligned to any window, and with a sub-millisecond part.
        let clock = FakeClock::new(1_700_000_000_123_457);
        let memory = MemoryStore::builder().clock(clock.clone()).build();
        let redis = RedisStore::builder(pool.clone())
            .prefix(format!("case{}", case.fetch_add(1, Ordering::Relaxed)))
            .clock(clock.clone())
            .timeout(Duration::from_secs(5))
            .build();
        for step in &steps {
            clock.advance(Duration::from_millis(step.advance_ms));
            let checks: Vec<Check> = policies(step.policies, step.cost)
                .iter()
                .map(|p| Check::new(p, Key::new(format!("client{}", step.client))))
                .collect();
            let from_memory = runtime.block_on(memory.check(&checks)).unwrap();
            let from_redis = runtime.block_on(redis.check(&checks)).unwrap();
            prop_assert_eq!(from_memory, from_redis, "at {:?}", step);
        }
    });
}
