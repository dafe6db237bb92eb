//! Store decisions per second: `MemoryStore` per algorithm (one hot key;
//! a million keys), and `RedisStore` at 1, 16 and 64 concurrent tasks beside
//! a raw redis-rs `EVALSHA` loop of the same script, in the same run.
//!
//! ```sh
//! cargo bench --bench stores
//! ```

mod common;
#[path = "../tests/it/support/mod.rs"]
mod support;

use std::sync::Arc;
use std::time::Duration;

use common::{
    NEVER, concurrently, multiplexed, one_worker_runtime, raw_evalsha, slidegate_checks, store_on,
    task_keys,
};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use slidegate::deadpool_redis::redis::Script;
use slidegate::{
    Policy,
    key::Key,
    policy::Algorithm,
    store::{Check, MemoryStore, Store},
};
use support::RedisServer;

const ALGORITHMS: [(&str, Algorithm); 3] = [
    ("sliding_log", Algorithm::SlidingLog),
    ("sliding_counter", Algorithm::SlidingCounter),
    ("fixed_window", Algorithm::FixedWindow),
];

fn decide_now(store: &MemoryStore, check: Check) -> bool {
    match store.check(&[check]).into_ready() {
        Ok(decisions) => decisions.unwrap()[0].admitted(),
        Err(_) => unreachable!("the memory store decides at once"),
    }
}

fn memory_store(c: &mut Criterion) {
    let mut group = c.benchmark_group("memory_store");
    group.throughput(Throughput::Elements(1));
    for (name, algorithm) in ALGORITHMS {
        let policy = Policy::new("bench", NEVER, Duration::from_secs(1)).with_algorithm(algorithm);
        let store = MemoryStore::new();
        let hot = Key::new("hot");
        group.bench_function(format!("{name}/hot_key"), |b| {
            b.iter(|| decide_now(&store, Check::new(&policy, hot.clone()).unwrap()));
        });

        let many = MemoryStore::builder().with_max_keys(2_000_000).build();
        let keys: Vec<Key> = (0..1_000_000)
            .map(|i| Key::new(format!("client-{i}")))
            .collect();
        for key in &keys {
            decide_now(&many, Check::new(&policy, key.clone()).unwrap());
        }
        let mut next = 0;
        group.bench_function(format!("{name}/1m_keys"), |b| {
            b.iter(|| {
                next = (next + 7919) % keys.len();
                decide_now(&many, Check::new(&policy, keys[next].clone()).unwrap())
            });
        });
    }
    group.finish();
}

fn redis_store(c: &mut Criterion) {
    let server = RedisServer::start();
    let runtime = one_worker_runtime();
    let _guard = runtime.enter();
    let mut group = c.benchmark_group("redis_store");
    group.throughput(Throughput::Elements(1));
    group.measurement_time(Duration::from_secs(4));
    for tasks in [1usize, 16, 64] {
        let pool = server.pool(tasks);
        let store = store_on(pool.clone());
        let keys = task_keys(tasks);
        group.bench_function(format!("slidegate/{tasks}_tasks"), |b| {
            b.to_async(&runtime).iter_custom(|iters| {
                concurrently(tasks, iters, slidegate_checks(store.clone(), keys.clone()))
            });
        });
        let script = Arc::new(Script::new(&common::check_source()));
        let connection = runtime.block_on(multiplexed(&server.url()));
        group.bench_function(format!("raw_evalsha/{tasks}_tasks"), |b| {
            b.to_async(&runtime).iter_custom(|iters| {
                concurrently(
                    tasks,
                    iters,
                    raw_evalsha(connection.clone(), script.clone()),
                )
            });
        });
    }
    group.finish();
}

criterion_group!(benches, memory_store, redis_store);
criterion_main!(benches);
