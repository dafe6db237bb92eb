//! `MemoryStore` and `RedisStore` decide identically for the same sequence
//! of requests, for every algorithm, mixed in one request (a model test over
//! random sequences).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::support::RedisServer;
use crate::support::stores::in_one_batch;
use proptest::prelude::*;
use slidegate::deadpool_redis::Pool;
use slidegate::{
    Policy,
    clock::{Clock, FakeClock},
    key::Key,
    policy::{Algorithm, Calendar, Period},
    store::{Check, MemoryStore, RedisStore, Store, StoreFuture, conformance::Conformance},
};

/// The longest delay a policy may hold a request for (`Policy::with_delay`).
const MAX_DELAY: Duration = Duration::from_secs(60);

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
        1u8..128,
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
    let delay = Duration::from_millis;
    // All but "long" hold a request that fits within their delay (some
    // beyond a window, into the next one).
    let all = [
        Policy::new("short", 4, ms(1500, 2500)).with_delay(delay(800)),
        Policy::new("long", 9, ms(10_000, 4_000)),
        Policy::new("counter", 7, ms(2000, 3000))
            .with_algorithm(Algorithm::SlidingCounter)
            .with_delay(delay(2500)),
        Policy::new("fixed", 5, ms(1200, 1800))
            .with_algorithm(Algorithm::FixedWindow)
            .with_delay(delay(1000)),
        // 3 per window in a bucket of 5; its debt re-measured when a tier
        // changes the window.
        Policy::new("bucket", 3, ms(1000, 1700))
            .with_algorithm(Algorithm::TokenBucket)
            .with_burst(5)
            .with_delay(delay(600)),
        // Denied once, blocked for 700 ms; a request the delay holds is
        // not denied.
        Policy::new("blocking", 4, ms(900, 1300))
            .with_block(Duration::from_millis(700))
            .with_delay(delay(200)),
        // Days at UTC+01:46, which end 40 s after the clock starts.
        Policy::calendar(
            "calendar",
            6,
            Calendar::new(Period::Day).with_east_of_utc(Duration::from_secs(106 * 60)),
        ),
    ];
    all.into_iter()
        .enumerate()
        .filter(|(i, _)| mask & (1 << i) != 0)
        .map(|(_, p)| p.with_cost(cost))
        .collect()
}

/// The checks of `step`'s request.
fn checks_of(step: &Step) -> Vec<Check> {
    policies(step.policies, step.cost, step.tier)
        .iter()
        .map(|p| Check::new(p, Key::new(format!("client{}", step.client))).unwrap())
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
    let memory = MemoryStore::builder().with_clock(clock.clone()).build();
    let redis = RedisStore::builder(pool.clone())
        .with_prefix(prefix)
        .with_clock(clock.clone())
        .with_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
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
    /// Settles the admitted request this many back at this cost.
    Settle(usize, u64),
}

fn after() -> impl Strategy<Value = After> {
    prop_oneof![
        2 => Just(After::Nothing),
        1 => Just(After::Peek),
        2 => (0usize..8).prop_map(After::Refund),
        2 => (0usize..8, prop_oneof![0u64..4, 0u64..40, Just(u64::MAX)]).prop_map(|(back, cost)| After::Settle(back, cost)),
    ]
}

/// Peeks, refunds and settlements, mixed with checks, leave both stores
/// deciding the same: a peek answers alike and records nothing, a refund
/// takes back the same units, whenever it comes, and a settlement charges
/// the same past the limit.
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
            if from_memory[0].admitted() {
                let recorded = from_memory.iter().map(|d| d.recorded_at().unwrap()).collect();
                admitted.push((checks.clone(), recorded));
            }
            match *after {
                After::Nothing => {}
                After::Peek => {
                    let from_memory = runtime.block_on(memory.peek(&checks)).unwrap();
                    let from_redis = runtime.block_on(redis.peek(&checks)).unwrap();
                    prop_assert_eq!(&from_memory, &from_redis, "peek at {:?}", step);
                    prop_assert!(from_memory.iter().all(|d| d.recorded_at().is_none()));
                }
                After::Refund(back) if !admitted.is_empty() => {
                    let (checks, recorded) = admitted.remove(admitted.len() - 1 - back % admitted.len());
                    runtime.block_on(memory.refund(&checks, &recorded)).unwrap();
                    runtime.block_on(redis.refund(&checks, &recorded)).unwrap();
                }
                After::Settle(back, cost) if !admitted.is_empty() => {
                    let (checks, recorded) = admitted.remove(admitted.len() - 1 - back % admitted.len());
                    let costs = vec![cost; checks.len()];
                    runtime.block_on(memory.settle(&checks, &recorded, &costs)).unwrap();
                    runtime.block_on(redis.settle(&checks, &recorded, &costs)).unwrap();
                }
                After::Refund(_) | After::Settle(..) => {}
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
            Algorithm::TokenBucket,
        ] {
            let policy = Policy::new(format!("{algorithm:?}"), 3, Duration::from_secs(60))
                .with_algorithm(algorithm);
            let check = [Check::new(&policy, Key::new("client")).unwrap()];
            let mut recorded = Vec::new();
            for _ in 0..3 {
                let decision = runtime.block_on(store.check(&check)).unwrap()[0];
                assert!(decision.admitted());
                recorded.push(decision.recorded_at().unwrap());
                clock.advance(Duration::from_millis(5));
            }
            let peeked = runtime.block_on(store.peek(&check)).unwrap()[0];
            assert!(
                !peeked.admitted() && peeked.remaining() == 0,
                "{algorithm:?}: {peeked:?}"
            );
            assert!(!runtime.block_on(store.check(&check)).unwrap()[0].admitted());
            // The second request's refund frees one unit, once.
            runtime
                .block_on(store.refund(&check, &recorded[1..2]))
                .unwrap();
            let peeked = runtime.block_on(store.peek(&check)).unwrap()[0];
            assert!(
                peeked.admitted() && peeked.remaining() == 1,
                "{algorithm:?}: {peeked:?}"
            );
            assert!(runtime.block_on(store.check(&check)).unwrap()[0].admitted());
            assert!(!runtime.block_on(store.check(&check)).unwrap()[0].admitted());
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
                1u8..64,
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
                        .map(|p| Check::new(p, Key::new(format!("client{client}"))).unwrap())
                        .collect()
                })
                .collect();
            let from_memory: Vec<_> = batches
                .iter()
                .map(|checks| runtime.block_on(memory.check(checks)).unwrap())
                .collect();
            let from_redis: Vec<_> = runtime
                .block_on(in_one_batch(&redis, batches))
                .into_iter()
                .map(Result::unwrap)
                .collect();
            prop_assert_eq!(from_memory, from_redis, "at {:?}", burst);
        }
    });
}

/// In one batch call, requests of one client under a policy's window and
/// under a tier's shorter one (one log) each count their own window, as
/// the memory store does one after the other.
#[test]
fn a_batch_counts_each_window_of_a_shared_log_on_its_own() {
    let server = RedisServer::start();
    let runtime = runtime();
    let (clock, memory, redis) = twin_stores(&server.pool(2), "windows".into());
    let redis = std::sync::Arc::new(redis);
    let long = Policy::new("shared", 50, Duration::from_secs(10));
    let short = Policy::new("shared", 50, Duration::from_secs(2));
    let check = |policy: &Policy| vec![Check::new(policy, Key::new("client")).unwrap()];
    // A request a second for six seconds: the short window sees the last two.
    for _ in 0..6 {
        let from_memory = runtime.block_on(memory.check(&check(&long))).unwrap();
        let from_redis = runtime.block_on(redis.check(&check(&long))).unwrap();
        assert_eq!(from_memory, from_redis);
        clock.advance(Duration::from_secs(1));
    }
    let batch = [check(&long), check(&short), check(&long), check(&short)];
    let from_memory: Vec<_> = batch
        .iter()
        .map(|checks| runtime.block_on(memory.check(checks)).unwrap())
        .collect();
    let from_redis: Vec<_> = runtime
        .block_on(in_one_batch(&redis, batch.to_vec()))
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(from_memory, from_redis);
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
        Check::new(policy, Key::new(format!("client{client}")))
            .unwrap()
            .with_cost(cost.min(policy.limit()))
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
            for request in alone.chain([&checks[..]]) {
                let from_memory = runtime.block_on(memory.check(request)).unwrap();
                let from_redis = runtime.block_on(redis.check(request)).unwrap();
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
    let check = [Check::new(&policy, Key::new("steady")).unwrap()];
    let mut denied = 0;
    for minute in (0..6 * 60).step_by(5) {
        clock.set(1_700_000_000_123_457 + minute * 60_000_000);
        // Two requests at each tick: the window holds six ticks' worth.
        for _ in 0..2 {
            let from_memory = runtime.block_on(memory.check(&check)).unwrap();
            let from_redis = runtime.block_on(redis.check(&check)).unwrap();
            assert_eq!(from_memory, from_redis, "at minute {minute}");
            denied += usize::from(!from_redis[0].admitted());
        }
    }
    assert!(denied > 0, "the trace never reached the limit");
}

/// The sliding log's rules, as a plain list of records: what both stores
/// must decide, however they keep the log.
#[derive(Debug, Default)]
struct ModelLog {
    /// (time, cost), oldest first.
    records: Vec<(u64, u64)>,
    span: u64,
    newest: u64,
    /// The records of the check being decided.
    window: Vec<(u64, u64)>,
}

impl ModelLog {
    fn prepare(&mut self, now: u64, window: u64, limit: u32, cost: u32) -> bool {
        if !self.records.is_empty() {
            let span = self.span;
            self.records.retain(|&(time, _)| time + span > now);
            if self.records.is_empty() {
                *self = Self::default();
            }
        }
        // Records of held requests lie ahead by at most the longest delay.
        let ahead = MAX_DELAY.as_micros() as u64;
        if !self.records.is_empty() && self.newest > now + window + ahead {
            let sum = self.records.iter().map(|&(_, cost)| cost).sum();
            self.records = vec![(now, sum)];
            self.newest = now;
        }
        if !self.records.is_empty() {
            self.span = self.span.max(window);
        }
        self.window = self
            .records
            .iter()
            .copied()
            .filter(|&(time, _)| time + window > now)
            .collect();
        self.count() + u64::from(cost) <= u64::from(limit)
    }

    fn count(&self) -> u64 {
        self.window.iter().map(|&(_, cost)| cost).sum()
    }

    fn record(&mut self, now: u64, window: u64, cost: u32) -> u64 {
        let time = if self.records.is_empty() {
            self.span = window;
            now
        } else {
            now.max(self.newest + 1)
        };
        self.records.push((time, u64::from(cost)));
        self.window.push((time, u64::from(cost)));
        self.newest = time;
        time
    }

    fn refund(&mut self, at: u64, cost: u32) {
        if let Some(index) = self.records.iter().position(|&(time, _)| time == at)
            && self.records[index].1 == u64::from(cost)
        {
            self.records.remove(index);
            if self.records.is_empty() {
                *self = Self::default();
            }
        }
    }

    fn decision(
        &self,
        now: u64,
        window: u64,
        limit: u32,
        cost: u32,
        admitted: bool,
    ) -> (bool, u32, u64, Option<u64>) {
        let count = self.count();
        let remaining = u64::from(limit).saturating_sub(count) as u32;
        let reset = self
            .window
            .first()
            .map_or(0, |&(time, _)| time + window - now);
        let fits = count + u64::from(cost) <= u64::from(limit);
        let retry = (!admitted && !fits).then(|| {
            let need = count + u64::from(cost) - u64::from(limit);
            let mut freed = 0;
            let leaves = self.window.iter().find_map(|&(time, cost)| {
                freed += cost;
                (freed >= need).then_some(time)
            });
            leaves.map_or(window, |time| time + window - now)
        });
        (admitted, remaining, reset, retry)
    }
}

/// What a step of [`both_stores_keep_the_logs_rules`] does.
#[derive(Debug, Clone)]
enum LogStep {
    /// Moves the clock by this many microseconds (back, if negative),
    /// then checks (or peeks) at one of two tiers' windows, at a cost.
    Check {
        by_us: i64,
        long: bool,
        cost: u32,
        peek: bool,
    },
    /// Refunds the admitted request this many back, once or twice.
    Refund { back: usize, twice: bool },
}

fn log_step() -> impl Strategy<Value = LogStep> {
    let check = (
        prop_oneof![
            1000 => 0i64..200,
            2 => 0i64..2_000_000,
            1 => -400_000i64..0,
            1 => -6_000_000i64..-2_500_000,
            // Past a window and the longest delay: the log is gathered.
            1 => -66_000_000i64..-62_500_000,
        ],
        prop_oneof![9 => Just(true), 1 => Just(false)],
        prop_oneof![20 => Just(1u32), 3 => 2u32..400, 1 => Just(600u32), 1 => Just(70_000u32), 1 => Just(1_201u32)],
        prop_oneof![9 => Just(false), 1 => Just(true)],
    )
        .prop_map(|(by_us, long, cost, peek)| LogStep::Check { by_us, long, cost, peek });
    prop_oneof![
        12 => check,
        1 => (0usize..400, prop_oneof![4 => Just(false), 1 => Just(true)])
            .prop_map(|(back, twice)| LogStep::Refund { back, twice }),
    ]
}

/// Both stores keep the sliding log's rules, as a plain list of records
/// keeps them, over logs of thousands of records (many pages on Redis):
/// tiers with a window of their own, costs from 1 to above the limit,
/// peeks, refunds of old and new requests (and of one twice), and a clock
/// that steps back a little or by more than a window.
#[test]
fn both_stores_keep_the_logs_rules() {
    let server = RedisServer::start();
    let runtime = runtime();
    let pool = server.pool(1);
    let case = AtomicU64::new(0);
    let config = cases(12);
    proptest!(config, |(steps in prop::collection::vec(log_step(), 1..4000))| {
        let prefix = format!("rules{}", case.fetch_add(1, Ordering::Relaxed));
        let (clock, memory, redis) = twin_stores(&pool, prefix);
        let long = Policy::new("log", 1_200, Duration::from_secs(3));
        let short = Policy::new("log", 300, Duration::from_millis(400));
        let mut model = ModelLog::default();
        let mut admitted: Vec<(Check, Duration)> = Vec::new();
        for step in &steps {
            match *step {
                LogStep::Check { by_us, long: is_long, cost, peek } => {
                    clock.set(clock.now_micros().saturating_add_signed(by_us));
                    let now = clock.now_micros();
                    let mut check = Check::new(if is_long { &long } else { &short }, Key::new("c")).unwrap();
                    check = check.with_cost(cost);
                    let window = check.window().as_micros() as u64;
                    let fits = model.prepare(now, window, check.limit(), cost);
                    let checks = [check.clone()];
                    let (from_memory, from_redis) = if peek {
                        (runtime.block_on(memory.peek(&checks)).unwrap(), runtime.block_on(redis.peek(&checks)).unwrap())
                    } else {
                        (runtime.block_on(memory.check(&checks)).unwrap(), runtime.block_on(redis.check(&checks)).unwrap())
                    };
                    prop_assert_eq!(&from_memory, &from_redis, "at {:?}", step);
                    let recorded = (fits && !peek).then(|| model.record(now, window, cost));
                    let (admitted_now, remaining, reset, retry) = model.decision(now, window, check.limit(), cost, fits && !peek);
                    let decision = from_redis[0];
                    prop_assert_eq!(
                        (decision.admitted() && !peek, decision.remaining(), decision.reset().as_micros() as u64, decision.retry_after().map(|d| d.as_micros() as u64)),
                        (admitted_now, remaining, reset, retry),
                        "at {:?}", step
                    );
                    prop_assert_eq!(decision.recorded_at().map(|d| d.as_micros() as u64), recorded);
                    if let Some(at) = decision.recorded_at() {
                        admitted.push((check, at));
                    }
                }
                LogStep::Refund { back, twice } if !admitted.is_empty() => {
                    let index = admitted.len() - 1 - back % admitted.len();
                    let (check, at) = admitted.remove(index);
                    let now = clock.now_micros();
                    for _ in 0..if twice { 2 } else { 1 } {
                        model.prepare(now, check.window().as_micros() as u64, check.limit(), check.cost());
                        model.refund(at.as_micros() as u64, check.cost());
                        let checks = [check.clone()];
                        runtime.block_on(memory.refund(&checks, &[at])).unwrap();
                        runtime.block_on(redis.refund(&checks, &[at])).unwrap();
                    }
                }
                LogStep::Refund { .. } => {}
            }
        }
    });
}

/// One long trace, deep where the proptest is broad: logs of thousands of
/// records (tens of pages, several levels of page sums on Redis), at two
/// tiers' windows, with refunds of old and new requests, peeks, costs up
/// to the limit and beyond, and the clock stepping back now and then; both
/// stores against the plain list at every step.
#[test]
fn both_stores_keep_the_logs_rules_over_thousands_of_records() {
    use rand::{Rng, SeedableRng};

    let server = RedisServer::start();
    let runtime = runtime();
    let pool = server.pool(1);
    let (clock, memory, redis) = twin_stores(&pool, "deep".to_owned());
    let long = Policy::new("log", 100_000, Duration::from_secs(10));
    let short = Policy::new("log", 8_000, Duration::from_secs(2));
    let mut random = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let mut model = ModelLog::default();
    let mut admitted: Vec<(Check, Duration)> = Vec::new();
    let (mut most, mut denied, mut refunded) = (0, 0, 0);
    for step in 0..20_000 {
        let by_us: i64 = match random.gen_range(0..10_000) {
            0 => -random.gen_range(10_000_000..12_000_000),
            // Past a window and the longest delay: the log is gathered.
            1 => -random.gen_range(70_000_000..72_000_000),
            2..=9 => -random.gen_range(0..400_000),
            10..=30 => random.gen_range(0..3_000_000),
            _ => random.gen_range(0..120),
        };
        clock.set(clock.now_micros().saturating_add_signed(by_us));
        let now = clock.now_micros();
        if random.gen_range(0..10) == 0 && !admitted.is_empty() {
            let back = if random.gen_bool(0.5) {
                random.gen_range(0..admitted.len())
            } else {
                random.gen_range(0..admitted.len().min(5))
            };
            let (check, at) = admitted.remove(admitted.len() - 1 - back);
            let times = if random.gen_range(0..5) == 0 { 2 } else { 1 };
            for _ in 0..times {
                model.prepare(
                    now,
                    check.window().as_micros() as u64,
                    check.limit(),
                    check.cost(),
                );
                model.refund(at.as_micros() as u64, check.cost());
                let checks = [check.clone()];
                runtime.block_on(memory.refund(&checks, &[at])).unwrap();
                runtime.block_on(redis.refund(&checks, &[at])).unwrap();
            }
            refunded += 1;
            continue;
        }
        let policy = if random.gen_range(0..10) == 0 {
            &short
        } else {
            &long
        };
        let cost = match random.gen_range(0..200) {
            0 => policy.limit() + 1,
            1 => policy.limit(),
            2..=5 => random.gen_range(2..50),
            _ => 1,
        };
        let check = Check::new(policy, Key::new("c")).unwrap().with_cost(cost);
        let peek = random.gen_range(0..20) == 0;
        let window = check.window().as_micros() as u64;
        let fits = model.prepare(now, window, check.limit(), check.cost());
        let checks = [check.clone()];
        let (from_memory, from_redis) = if peek {
            (
                runtime.block_on(memory.peek(&checks)).unwrap(),
                runtime.block_on(redis.peek(&checks)).unwrap(),
            )
        } else {
            (
                runtime.block_on(memory.check(&checks)).unwrap(),
                runtime.block_on(redis.check(&checks)).unwrap(),
            )
        };
        assert_eq!(from_memory, from_redis, "step {step}");
        let recorded = (fits && !peek).then(|| model.record(now, window, check.cost()));
        let expected = model.decision(now, window, check.limit(), check.cost(), fits && !peek);
        let decision = from_redis[0];
        let micros = |d: Duration| d.as_micros() as u64;
        assert_eq!(
            (
                decision.admitted() && !peek,
                decision.remaining(),
                micros(decision.reset()),
                decision.retry_after().map(micros)
            ),
            expected,
            "step {step}"
        );
        assert_eq!(decision.recorded_at().map(micros), recorded, "step {step}");
        if let Some(at) = decision.recorded_at() {
            admitted.push((check, at));
        }
        denied += usize::from(decision.retry_after().is_some());
        most = most.max(model.records.len());
    }
    assert!(
        most > 3_000 && denied > 100 && refunded > 1_000,
        "a shallow trace: {most} records at most, {denied} denied, {refunded} refunds"
    );
}

/// The counters place a check no earlier than the latest time a unit was
/// counted at, in both stores: peeks and denials place nothing, so a
/// clock that steps back after them decides alike.
#[test]
fn counters_agree_when_the_clock_steps_back_around_peeks_and_denials() {
    let server = RedisServer::start();
    let runtime = runtime();
    let pool = server.pool(1);
    let case = AtomicU64::new(0);
    let config = cases(32);
    let moves = (
        prop_oneof![
            4 => 0i64..600_000,
            2 => -300_000i64..0,
            1 => -3_000_000i64..-1_000_000,
        ],
        prop_oneof![3 => Just(false), 2 => Just(true)],
        any::<bool>(),
        1u32..=3,
    );
    proptest!(config, |(steps in prop::collection::vec(moves, 1..120))| {
        let prefix = format!("steps{}", case.fetch_add(1, Ordering::Relaxed));
        let (clock, memory, redis) = twin_stores(&pool, prefix);
        let counter = Policy::new("counter", 4, Duration::from_secs(1)).with_algorithm(Algorithm::SlidingCounter);
        let fixed = Policy::new("fixed", 3, Duration::from_millis(800)).with_algorithm(Algorithm::FixedWindow);
        for (by_us, peek, both, cost) in &steps {
            clock.set(clock.now_micros().saturating_add_signed(*by_us));
            let mut checks = vec![Check::new(&counter, Key::new("c")).unwrap().with_cost(*cost)];
            if *both {
                checks.push(Check::new(&fixed, Key::new("c")).unwrap().with_cost(*cost));
            }
            let (from_memory, from_redis) = if *peek {
                (runtime.block_on(memory.peek(&checks)).unwrap(), runtime.block_on(redis.peek(&checks)).unwrap())
            } else {
                (runtime.block_on(memory.check(&checks)).unwrap(), runtime.block_on(redis.check(&checks)).unwrap())
            };
            prop_assert_eq!(from_memory, from_redis, "at {:?}", (by_us, peek, both, cost));
        }
    });
}

/// Requests held for their delay pass only in the slots the stores
/// granted them, and those slots never exceed the limit: in any sliding
/// window for a log, in any fixed window, and within the burst plus the
/// rate for a bucket, whatever arrives meanwhile and whoever leaves
/// before passing. Both stores grant the same slots.
#[test]
fn held_requests_pass_within_the_limit() {
    let server = RedisServer::start();
    let runtime = runtime();
    let pool = server.pool(2);
    let case = AtomicU64::new(0);
    let window = Duration::from_secs(1);
    let policies = [
        Policy::new("log", 3, window).with_delay(Duration::from_millis(1500)),
        Policy::new("fixed", 3, window)
            .with_algorithm(Algorithm::FixedWindow)
            .with_delay(Duration::from_millis(900)),
        Policy::new("bucket", 3, window)
            .with_algorithm(Algorithm::TokenBucket)
            .with_burst(2)
            .with_delay(Duration::from_millis(1200)),
    ];
    let arrivals = prop::collection::vec((0u64..400, 1u32..=2, prop::bool::weighted(0.2)), 1..60);
    proptest!(cases(24), |(steps in arrivals)| {
        let prefix = format!("held{}", case.fetch_add(1, Ordering::Relaxed));
        let (clock, memory, redis) = twin_stores(&pool, prefix);
        for policy in &policies {
            // (pass time, cost) of every request that passes.
            let mut passes: Vec<(u64, u32)> = Vec::new();
            for &(advance_ms, cost, leaves) in &steps {
                clock.advance(Duration::from_millis(advance_ms));
                let now = clock.now_micros();
                let check = [Check::new(&policy.clone().with_cost(cost), Key::new("c")).unwrap()];
                let from_memory = runtime.block_on(memory.check(&check)).unwrap();
                let from_redis = runtime.block_on(redis.check(&check)).unwrap();
                prop_assert_eq!(&from_memory, &from_redis);
                let decision = from_memory[0];
                if !decision.admitted() {
                    continue;
                }
                let wait = decision.delayed_for().unwrap_or_default();
                if leaves && !wait.is_zero() {
                    // Gone before its slot: its units go back.
                    let at = [decision.recorded_at().unwrap()];
                    runtime.block_on(memory.refund(&check, &at)).unwrap();
                    runtime.block_on(redis.refund(&check, &at)).unwrap();
                    continue;
                }
                prop_assert!(wait <= policy.delay().unwrap());
                passes.push((now + wait.as_micros() as u64, cost));
            }
            passes.sort_unstable();
            let w = window.as_micros() as u64;
            for (i, &(end, _)) in passes.iter().enumerate() {
                let units: u32 = match policy.algorithm() {
                    Algorithm::SlidingLog => passes[..=i]
                        .iter()
                        .filter(|(t, _)| *t + w > end)
                        .map(|(_, c)| c)
                        .sum(),
                    Algorithm::FixedWindow => passes
                        .iter()
                        .filter(|(t, _)| t / w == end / w)
                        .map(|(_, c)| c)
                        .sum(),
                    _ => 0,
                };
                prop_assert!(units <= 3, "{:?}: {} units in the window ending at {}", policy.algorithm(), units, end);
                if policy.algorithm() == Algorithm::TokenBucket {
                    // Units passing in [start, end] fit the burst plus what
                    // refills in between (3 a second).
                    for j in 0..=i {
                        let start = passes[j].0;
                        let units: u64 = passes[j..=i].iter().map(|(_, c)| u64::from(*c)).sum();
                        let refilled = (end - start) * 3 / w;
                        prop_assert!(units <= 2 + refilled, "{} units in [{}, {}]", units, start, end);
                    }
                }
            }
            clock.advance(Duration::from_secs(10));
        }
    });
}

/// A log of hundreds of pages, spread over several chunks of pages in
/// Redis, decides as memory does while it grows, while a tier with a
/// shorter window counts across chunk boundaries, while refunds reach
/// back into sealed pages, once it has emptied and numbers its pages on,
/// and after the clock steps back by more than a window. Costs of every
/// width; a fixed sequence from a seeded generator, each step compared.
#[test]
fn a_log_of_many_chunks_decides_as_memory_does() {
    let server = RedisServer::start();
    let runtime = runtime();
    let (clock, memory, redis) = twin_stores(&server.pool(1), "chunks".to_owned());
    let long = Policy::new("chunked", 1_000_000, Duration::from_secs(60));
    let short = Policy::new("chunked", 1_000_000, Duration::from_secs(5));
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut random = move |below: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % below
    };
    let base = redis.base_key(&Check::new(&long, Key::new("deep")).unwrap());
    let mut recorded: Vec<(Check, Duration)> = Vec::new();
    let (mut admitted, mut refunds) = (0u32, 0u32);
    // (steps, the clock's move before them in µs, the largest move
    // between two steps in µs)
    let phases: [(u32, i64, u64); 5] = [
        (40_000, 0, 250),
        (8_000, 30_000_000, 400),
        (8_000, 61_000_000, 250),
        (4_000, -2 * 3_600_000_000, 100),
        (2_000, 3_000_000, 5_000),
    ];
    for (phase, &(steps, jump, gap)) in phases.iter().enumerate() {
        clock.set(clock.now_micros().saturating_add_signed(jump));
        for step in 0..steps {
            clock.set(clock.now_micros() + random(gap));
            let policy = if random(3) == 0 { &long } else { &short };
            let cost = match random(100) {
                0 => 70_000,
                1..=4 => 300,
                5..=14 => 3,
                _ => 1,
            };
            let check = [Check::new(policy, Key::new("deep"))
                .unwrap()
                .with_cost(cost)];
            if random(50) == 0 && !recorded.is_empty() {
                let (refunded, at) = recorded.swap_remove(random(recorded.len() as u64) as usize);
                let refunded = std::slice::from_ref(&refunded);
                runtime.block_on(memory.refund(refunded, &[at])).unwrap();
                runtime.block_on(redis.refund(refunded, &[at])).unwrap();
                refunds += 1;
            }
            let from_memory = runtime.block_on(memory.check(&check)).unwrap();
            let from_redis = runtime.block_on(redis.check(&check)).unwrap();
            assert_eq!(from_memory, from_redis, "phase {phase}, step {step}");
            if let Some(at) = from_redis[0].recorded_at() {
                admitted += 1;
                recorded.push((check[0].clone(), at));
                if recorded.len() > 5_000 {
                    recorded.swap_remove(0);
                }
            }
        }
        let keys = server.keys_of(&base);
        println!("after phase {phase}: {keys:?}");
        if phase == 0 {
            assert!(keys.len() >= 4, "the log spans three chunks: {keys:?}");
        }
    }
    let steps: u32 = phases.iter().map(|phase| phase.0).sum();
    println!("{admitted} of {steps} admitted, {refunds} refunds");
    assert!(
        admitted > 25_000 && steps - admitted > 1_000 && refunds > 1_000,
        "{admitted} admitted, {refunds} refunds: the trace misses a path"
    );
}

/// The conformance trace a store written outside the crate runs
/// ([`Conformance`](slidegate::store::conformance::Conformance)) holds the
/// Redis store to the memory store's decisions, over every algorithm.
#[test]
fn the_conformance_trace_holds_the_redis_store_to_the_model() {
    let server = RedisServer::start();
    let runtime = runtime();
    let pool = server.pool(1);
    for seed in 1..=3 {
        let clock = FakeClock::new(Conformance::START);
        let redis = RedisStore::builder(pool.clone())
            .with_prefix(format!("conformance{seed}"))
            .with_clock(clock.clone())
            .with_timeout(Duration::from_secs(5))
            .build()
            .unwrap();
        let outcome = runtime.block_on(Conformance::new(seed).run(&redis, &clock));
        assert_eq!(outcome, Ok(()), "seed {seed}");
    }
}

/// A store that forgets refunds (it answers them, and takes nothing
/// back) fails the conformance trace, at the first decision a refund
/// changes.
#[test]
fn the_conformance_trace_finds_a_store_that_forgets_refunds() {
    struct Forgetful(MemoryStore);

    impl Store for Forgetful {
        fn check(&self, checks: &[Check]) -> StoreFuture {
            self.0.check(checks)
        }

        fn peek(&self, checks: &[Check]) -> StoreFuture {
            self.0.peek(checks)
        }

        fn refund(&self, _: &[Check], _: &[Duration]) -> StoreFuture<()> {
            StoreFuture::ready(Ok(()))
        }
    }

    let clock = FakeClock::new(Conformance::START);
    let store = Forgetful(MemoryStore::builder().with_clock(clock.clone()).build());
    let mismatch = runtime()
        .block_on(Conformance::new(1).run(&store, &clock))
        .expect_err("a store that forgets refunds admits too much");
    assert!(mismatch.starts_with("step "), "{mismatch}");
    assert!(!mismatch.starts_with("step 0 "), "{mismatch}");
    assert!(mismatch.contains("the model answered"), "{mismatch}");
}
