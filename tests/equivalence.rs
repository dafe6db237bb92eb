//! `MemoryStore` and `RedisStore` decide identically for the same sequence
//! of requests, for every algorithm, mixed in one batch (a model test over
//! random sequences).

mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use proptest::prelude::*;
use slidegate::deadpool_redis::Pool;
use slidegate::{Algorithm, Check, Clock, FakeClock, Key, MemoryStore, Policy, RedisStore, Store};
use support::RedisServer;

#[derive(Debug, Clone)]
struct Step {
    advance_ms: u64,
    client: u8,
    policies: u8,
    cost: u32,
    tier: u8,
}

fn step() -> impl Strategy<Value = Step> {
    (
        prop_oneof![Just(0u64), 0u64..50, 0u64..3000],
        0u8..3,
        1u8..16,
        1u32..=3,
        prop_oneof![4 => Just(0u8), 1 => Just(1u8)],
    )
        .prop_map(|(advance_ms, client, policies, cost, tier)| Step {
            advance_ms,
            client,
            policies,
            cost,
            tier,
        })
}

/// The policies in `mask`, each under its own name: tier 0 with its usual
/// window, tier 1 with another (as a tier with a window of its own).
fn policies(mask: u8, cost: u32, tier: u8) -> Vec<Policy> {
    let ms = |usual: u64, other: u64| Duration::from_millis(if tier == 0 { usual } else { other });
    let all = [
        Policy::new("short", 4, ms(1500, 2500)),
        Policy::new("long", 9, ms(10_000, 4_000)),
        Policy::new("counter", 7, ms(2000, 3000)).algorithm(Algorithm::SlidingCounter),
        Policy::new("fixed", 5, ms(1200, 1800)).algorithm(Algorithm::FixedWindow),
    ];
    all.into_iter()
        .enumerate()
        .filter(|(i, _)| mask & (1 << i) != 0)
        .map(|(_, p)| p.cost(cost))
        .collect()
}

/// The checks of `step`'s request.
fn checks_of(step: &Step) -> Vec<Check> {
    policies(step.policies, step.cost, step.tier)
        .iter()
        .map(|p| Check::new(p, Key::new(format!("client{}", step.client))))
        .collect()
}

/// A model test's settings: `count` random cases.
fn cases(count: u32) -> ProptestConfig {
    ProptestConfig {
        cases: count,
        ..ProptestConfig::default()
    }
}

/// A current-thread runtime to drive the stores from a proptest body.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// A memory store and a Redis store (keys under `prefix`) on one fake
/// clock, which starts aligned to no window, with a sub-millisecond part.
fn twin_stores(pool: &Pool, prefix: String) -> (FakeClock, MemoryStore, RedisStore) {
    let clock = FakeClock::new(1_700_000_000_123_457);
    let memory = MemoryStore::builder().clock(clock.clone()).build();
    let redis = RedisStore::builder(pool.clone())
        .prefix(prefix)
        .unwrap()
        .clock(clock.clone())
        .timeout(Duration::from_secs(5))
        .build();
    (clock, memory, redis)
}

#[test]
fn memory_and_redis_decide_the_same() {
    let server = RedisServer::start();
    let runtime = runtime();
    let pool = server.pool(2);
    let case = AtomicU64::new(0);
    let config = cases(32);
    proptest!(config, |(steps in prop::collection::vec(step(), 1..150))| {
        let prefix = format!("case{}", case.fetch_add(1, Ordering::Relaxed));
        let (clock, memory, redis) = twin_stores(&pool, prefix);
        for step in &steps {
            clock.advance(Duration::from_millis(step.advance_ms));
            let checks = checks_of(step);
            let from_memory = runtime.block_on(memory.check(&checks)).unwrap();
            let from_redis = runtime.block_on(redis.check(&checks)).unwrap();
            prop_assert_eq!(from_memory, from_redis, "at {:?}", step);
        }
    });
}

/// What a step of [`peeks_and_refunds_agree`] does after its check.
#[derive(Debug, Clone, Copy)]
enum After {
    Nothing,
    /// Peeks at the same checks.
    Peek,
    /// Refunds the admitted request this many back (modulo their number).
    Refund(usize),
}

fn after() -> impl Strategy<Value = After> {
    prop_oneof![
        2 => Just(After::Nothing),
        1 => Just(After::Peek),
        2 => (0usize..8).prop_map(After::Refund),
    ]
}

/// Peeks and refunds, mixed with checks, leave both stores deciding the
/// same: a peek answers alike and records nothing, a refund takes back
/// the same units, whenever it comes.
#[test]
fn peeks_and_refunds_agree() {
    let server = RedisServer::start();
    let runtime = runtime();
    let pool = server.pool(2);
    let case = AtomicU64::new(0);
    let config = cases(32);
    proptest!(config, |(steps in prop::collection::vec((step(), after()), 1..150))| {
        let prefix = format!("refund{}", case.fetch_add(1, Ordering::Relaxed));
        let (clock, memory, redis) = twin_stores(&pool, prefix);
        let mut admitted: Vec<(Vec<Check>, Vec<Duration>)> = Vec::new();
        for (step, after) in &steps {
            clock.advance(Duration::from_millis(step.advance_ms));
            let checks = checks_of(step);
            let from_memory = runtime.block_on(memory.check(&checks)).unwrap();
            let from_redis = runtime.block_on(redis.check(&checks)).unwrap();
            prop_assert_eq!(&from_memory, &from_redis, "at {:?}", step);
            if from_memory[0].admitted {
                let recorded = from_memory.iter().map(|d| d.recorded_at.unwrap()).collect();
                admitted.push((checks.clone(), recorded));
            }
            match *after {
                After::Nothing => {}
                After::Peek => {
                    let from_memory = runtime.block_on(memory.peek(&checks)).unwrap();
                    let from_redis = runtime.block_on(redis.peek(&checks)).unwrap();
                    prop_assert_eq!(&from_memory, &from_redis, "peek at {:?}", step);
                    prop_assert!(from_memory.iter().all(|d| d.recorded_at.is_none()));
                }
                After::Refund(back) if !admitted.is_empty() => {
                    let (checks, recorded) = admitted.remove(admitted.len() - 1 - back % admitted.len());
                    runtime.block_on(memory.refund(&checks, &recorded)).unwrap();
                    runtime.block_on(redis.refund(&checks, &recorded)).unwrap();
                }
                After::Refund(_) => {}
            }
        }
    });
}

/// A peek records nothing, and a refund frees exactly the refunded
/// request's units, in both stores and for every algorithm.
#[test]
fn a_refund_frees_exactly_its_units() {
    let server = RedisServer::start();
    let runtime = runtime();
    let pool = server.pool(1);
    let (clock, memory, redis) = twin_stores(&pool, "exact".to_owned());
    let stores: [&dyn Store; 2] = [&memory, &redis];
    for store in stores {
        for algorithm in [
            Algorithm::SlidingLog,
            Algorithm::SlidingCounter,
            Algorithm::FixedWindow,
        ] {
            let policy = Policy::new(format!("{algorithm:?}"), 3, Duration::from_secs(60))
                .algorithm(algorithm);
            let check = [Check::new(&policy, Key::new("client"))];
            let mut recorded = Vec::new();
            for _ in 0..3 {
                let decision = runtime.block_on(store.check(&check)).unwrap()[0];
                assert!(decision.admitted);
                recorded.push(decision.recorded_at.unwrap());
                clock.advance(Duration::from_millis(5));
            }
            let peeked = runtime.block_on(store.peek(&check)).unwrap()[0];
            assert!(
                !peeked.admitted && peeked.remaining == 0,
                "{algorithm:?}: {peeked:?}"
            );
            assert!(!runtime.block_on(store.check(&check)).unwrap()[0].admitted);
            // The second request's refund frees one unit, once.
            runtime
                .block_on(store.refund(&check, &recorded[1..2]))
                .unwrap();
            let peeked = runtime.block_on(store.peek(&check)).unwrap()[0];
            assert!(
                peeked.admitted && peeked.remaining == 1,
                "{algorithm:?}: {peeked:?}"
            );
            assert!(runtime.block_on(store.check(&check)).unwrap()[0].admitted);
            assert!(!runtime.block_on(store.check(&check)).unwrap()[0].admitted);
            clock.advance(Duration::from_secs(120));
        }
    }
}

/// Requests arriving together, after the clock moves on.
#[derive(Debug, Clone)]
struct Burst {
    advance_ms: u64,
    /// Client, policy mask, cost and tier of each request.
    requests: Vec<(u8, u8, u32, u8)>,
}

fn burst() -> impl Strategy<Value = Burst> {
    (
        prop_oneof![Just(0u64), 0u64..50, 0u64..3000],
        prop::collection::vec(
            (
                0u8..3,
                1u8..16,
                1u32..=3,
                prop_oneof![4 => Just(0u8), 1 => Just(1u8)],
            ),
            1..24,
        ),
    )
        .prop_map(|(advance_ms, requests)| Burst {
            advance_ms,
            requests,
        })
}

/// Requests queued together reach Redis as one batch call, where a later
/// request of a client takes what an earlier one left instead of reading
/// it again: each decides as the memory store does one after the other.
#[test]
fn a_batch_decides_as_its_requests_one_after_the_other() {
    let server = RedisServer::start();
    let runtime = runtime();
    let pool = server.pool(2);
    let case = AtomicU64::new(0);
    let config = cases(32);
    proptest!(config, |(bursts in prop::collection::vec(burst(), 1..40))| {
        let prefix = format!("batch{}", case.fetch_add(1, Ordering::Relaxed));
        let (clock, memory, redis) = twin_stores(&pool, prefix);
        let redis = std::sync::Arc::new(redis);
        for burst in &bursts {
            clock.advance(Duration::from_millis(burst.advance_ms));
            let batches: Vec<Vec<Check>> = burst
                .requests
                .iter()
                .map(|&(client, mask, cost, tier)| {
                    policies(mask, cost, tier)
                        .iter()
                        .map(|p| Check::new(p, Key::new(format!("client{client}"))))
                        .collect()
                })
                .collect();
            let from_memory: Vec<_> = batches
                .iter()
                .map(|checks| runtime.block_on(memory.check(checks)).unwrap())
                .collect();
            let from_redis: Vec<_> = runtime.block_on(async {
                let tasks: Vec<_> = batches
                    .iter()
                    .cloned()
                    .map(|checks| {
                        let redis = redis.clone();
                        tokio::spawn(async move { redis.check(&checks).await })
                    })
                    .collect();
                let mut decisions = Vec::new();
                for task in tasks {
                    decisions.push(task.await.unwrap().unwrap());
                }
                decisions
            });
            prop_assert_eq!(from_memory, from_redis, "at {:?}", burst);
        }
    });
}

/// A step of a trace that exercises every shape of the packed log: big
/// and small costs (each cost width), long windows (wide offsets), jumps
/// past an offset's range (rebasing), bursts (growing) and lulls
/// (shrinking), and a clock stepping back a little or by more than a
/// window.
#[derive(Debug, Clone)]
struct Move {
    /// Microseconds to move the clock; negative steps it back.
    by_us: i64,
    client: u8,
    cost: u32,
}

fn move_() -> impl Strategy<Value = Move> {
    (
        prop_oneof![
            6 => Just(0i64),
            4 => 0i64..50_000,
            3 => 0i64..4_000_000,
            1 => 600_000_000i64..1_500_000_000,
            1 => 4_200_000_000i64..4_400_000_000,
            1 => -5_000i64..0,
            1 => -10_000_000i64..-3_000_000,
        ],
        0u8..2,
        prop_oneof![4 => Just(1u32), 2 => 1u32..6, 1 => 200u32..300, 1 => 65_000u32..70_000],
    )
        .prop_map(|(by_us, client, cost)| Move {
            by_us,
            client,
            cost,
        })
}

/// Checks of four sliding logs: a small limit, a limit the ring grows
/// and shrinks to, a window whose records outlive their offsets' range
/// (they are rebased), and a window of hours with a limit large enough for
/// any cost.
fn log_checks(client: u8, cost: u32) -> Vec<Check> {
    [
        Policy::new("small", 3, Duration::from_secs(1)),
        Policy::new("burst", 150, Duration::from_secs(3)),
        Policy::new("half-hour", 40, Duration::from_secs(1800)),
        Policy::new("hours", 100_000, Duration::from_secs(2 * 3600)),
    ]
    .iter()
    .map(|policy| {
        let mut check = Check::new(policy, Key::new(format!("client{client}")));
        check.cost = cost.min(check.limit);
        check
    })
    .collect()
}

#[test]
fn the_packed_log_and_memory_decide_the_same_at_every_width() {
    let server = RedisServer::start();
    let runtime = runtime();
    let pool = server.pool(2);
    let case = AtomicU64::new(0);
    let config = cases(24);
    proptest!(config, |(moves in prop::collection::vec(move_(), 1..400))| {
        let prefix = format!("wide{}", case.fetch_add(1, Ordering::Relaxed));
        let (clock, memory, redis) = twin_stores(&pool, prefix);
        for step in &moves {
            clock.set(clock.now_micros().saturating_add_signed(step.by_us));
            // Each policy alone and all together.
            let checks = log_checks(step.client, step.cost);
            let alone = checks.iter().map(std::slice::from_ref);
            for batch in alone.chain([&checks[..]]) {
                let from_memory = runtime.block_on(memory.check(batch)).unwrap();
                let from_redis = runtime.block_on(redis.check(batch)).unwrap();
                prop_assert_eq!(from_memory, from_redis, "at {:?}", step);
            }
        }
    });
}

/// A client that keeps a log alive for hours, one request every five
/// minutes against a half-hour window, outlives a 4-byte offset's range
/// (71.6 minutes) many times over: its records are rebased, never wrapped.
#[test]
fn a_log_kept_alive_for_hours_decides_as_memory_does() {
    let server = RedisServer::start();
    let runtime = runtime();
    let (clock, memory, redis) = twin_stores(&server.pool(1), "hours".to_owned());
    let policy = Policy::new("half-hour", 6, Duration::from_secs(1800));
    let check = [Check::new(&policy, Key::new("steady"))];
    let mut denied = 0;
    for minute in (0..6 * 60).step_by(5) {
        clock.set(1_700_000_000_123_457 + minute * 60_000_000);
        // Two requests at each tick: the window holds six ticks' worth.
        for _ in 0..2 {
            let from_memory = runtime.block_on(memory.check(&check)).unwrap();
            let from_redis = runtime.block_on(redis.check(&check)).unwrap();
            assert_eq!(from_memory, from_redis, "at minute {minute}");
            denied += usize::from(!from_redis[0].admitted);
        }
    }
    assert!(denied > 0, "the trace never reached the limit");
}

/// The previous script, which kept each sliding log in a sorted set and a
/// hash: the packed log must decide exactly as it did.
const PREVIOUS_SCRIPT: &str = include_str!("fixtures/check_v1.lua");
const SCRIPT: &str = include_str!("../lua/check.lua");

fn forward() -> impl Strategy<Value = (u64, u8)> {
    (
        prop_oneof![
            6 => Just(0u64),
            4 => 0u64..50_000,
            3 => 0u64..4_000_000,
            1 => 600_000_000u64..1_500_000_000,
        ],
        prop_oneof![4 => Just(1u8), 2 => 1u8..6, 1 => 200u8..=255],
    )
}

/// Runs one script for one batch of `checks`, keyed under `prefix`: the
/// previous script takes each log's sorted set and hash, the packed one
/// its string (and the sorted set it would carry over, here never
/// written).
async fn run_script(
    connection: &mut slidegate::deadpool_redis::Connection,
    script: &slidegate::deadpool_redis::redis::Script,
    previous: bool,
    prefix: &str,
    now: u64,
    checks: &[Check],
) -> Vec<i64> {
    let mut invocation = script.prepare_invoke();
    invocation.arg(now);
    for check in checks {
        let key = format!("{prefix}:{}:{{{}}}", check.policy, check.key);
        let (name, keys) = match (check.algorithm, previous) {
            (Algorithm::SlidingLog, true) => ("log", vec![key.clone(), format!("{key}:s")]),
            (Algorithm::SlidingLog, false) => ("log", vec![format!("{key}:l"), key.clone()]),
            (Algorithm::SlidingCounter, _) => ("counter", vec![format!("{key}:c")]),
            (Algorithm::FixedWindow, _) => ("fixed", vec![format!("{key}:f")]),
            (algorithm, _) => panic!("no keys known for {algorithm:?}"),
        };
        for key in keys {
            invocation.key(key);
        }
        invocation
            .arg(name)
            .arg(check.limit)
            .arg(check.window.as_micros() as u64)
            .arg(check.cost);
    }
    invocation.invoke_async(connection).await.unwrap()
}

#[test]
fn the_packed_log_decides_as_the_previous_script_did() {
    use slidegate::deadpool_redis::redis::Script;

    let server = RedisServer::start();
    let runtime = runtime();
    let pool = server.pool(1);
    let (previous, packed) = (Script::new(PREVIOUS_SCRIPT), Script::new(SCRIPT));
    let case = AtomicU64::new(0);
    let config = cases(24);
    proptest!(config, |(moves in prop::collection::vec(forward(), 1..300))| {
        let case = case.fetch_add(1, Ordering::Relaxed);
        let policies = [
            Policy::new("small", 3, Duration::from_secs(1)),
            Policy::new("burst", 150, Duration::from_secs(3)),
            Policy::new("half-hour", 40, Duration::from_secs(1800)),
            Policy::new("counter", 7, Duration::from_secs(2)).algorithm(Algorithm::SlidingCounter),
            Policy::new("fixed", 5, Duration::from_millis(1200)).algorithm(Algorithm::FixedWindow),
        ];
        let mut now = 1_700_000_000_123_457u64;
        runtime.block_on(async {
            let mut connection = pool.get().await.unwrap();
            for &(advance, cost) in &moves {
                now += advance;
                let checks: Vec<Check> = policies
                    .iter()
                    .map(|policy| {
                        let mut check = Check::new(policy, Key::new("client"));
                        check.cost = u32::from(cost).min(check.limit);
                        check
                    })
                    .collect();
                let alone = checks.iter().map(std::slice::from_ref);
                for batch in alone.chain([&checks[..]]) {
                    let before =
                        run_script(&mut connection, &previous, true, &format!("old{case}"), now, batch).await;
                    let after =
                        run_script(&mut connection, &packed, false, &format!("new{case}"), now, batch).await;
                    // The packed script adds a fifth integer per policy: the
                    // time the request was recorded at.
                    let decided: Vec<i64> = after
                        .chunks(5)
                        .flat_map(|policy| policy[..4].to_vec())
                        .collect();
                    prop_assert_eq!(before, decided, "at {}", now);
                }
            }
            Ok(())
        })?;
    });
}
