//! Memory per tracked client: in Redis (`MEMORY USAGE` of every key a
//! client has) per algorithm at limits 10 to 10,000, each client at its
//! limit, with the previous script's packed ring beside them; and in
//! `MemoryStore` (growth of the resident set) at a million clients with
//! one request each.
//!
//! ```sh
//! cargo bench --bench memory
//! ```

#[path = "../tests/it/support/mod.rs"]
mod support;

use std::time::Duration;

use slidegate::{
    Policy,
    clock::FakeClock,
    key::Key,
    policy::Algorithm,
    store::{Check, MemoryStore, RedisStore, Store},
};
use support::RedisServer;

const ALGORITHMS: [(&str, Algorithm); 3] = [
    ("sliding_log", Algorithm::SlidingLog),
    ("sliding_counter", Algorithm::SlidingCounter),
    ("fixed_window", Algorithm::FixedWindow),
];
const CLIENTS: usize = 1_000_000;

/// The resident set size of this process, in bytes.
fn resident_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("Linux /proc");
    let kib: u64 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kib| kib.parse().ok())
        .expect("VmRSS in /proc/self/status");
    kib * 1024
}

fn redis_bytes_per_client(runtime: &tokio::runtime::Runtime, redis: &RedisServer) {
    println!("| algorithm | limit | Redis keys per client | bytes per client (MEMORY USAGE) |");
    println!("|---|---:|---:|---:|");
    let clock = FakeClock::new(1_700_000_000_000_000);
    let store = RedisStore::builder(redis.pool(2))
        .with_clock(clock.clone())
        .with_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    for (name, algorithm) in ALGORITHMS {
        for limit in [10u32, 100, 1_000, 10_000] {
            let policy = Policy::new(format!("m{limit}"), limit, Duration::from_secs(3600))
                .with_algorithm(algorithm);
            let client = format!("{name}-{limit}");
            for _ in 0..limit {
                clock.advance(Duration::from_millis(1));
                let check = [Check::new(&policy, Key::new(&client)).unwrap()];
                assert!(runtime.block_on(store.check(&check)).unwrap()[0].admitted());
            }
            let keys: Vec<String> = redis
                .cli(&["--scan", "--pattern", &format!("*{{user:{client}}}*")])
                .lines()
                .map(str::to_owned)
                .collect();
            let bytes = redis_bytes(redis, &keys);
            println!("| {name} | {limit} | {} | {bytes} |", keys.len());
        }
    }
    for limit in [10u32, 100, 1_000, 10_000] {
        let (keys, bytes) = previous_log_bytes(runtime, redis, limit);
        println!("| sliding_log, previous script | {limit} | {keys} | {bytes} |");
    }
}

/// The same client at its limit under the previous script, which kept a
/// sliding log as a packed ring in one string.
fn previous_log_bytes(
    runtime: &tokio::runtime::Runtime,
    redis: &RedisServer,
    limit: u32,
) -> (usize, u64) {
    use slidegate::deadpool_redis::redis::Script;

    let script = Script::new(include_str!("fixtures/check_v2.lua"));
    let key = format!("previous:{limit}:{{client}}");
    let keys = [format!("{key}:l"), key];
    let pool = redis.pool(1);
    runtime.block_on(async {
        let mut connection = pool.get().await.unwrap();
        for call in 0..u64::from(limit) {
            let reply: Vec<i64> = script
                .key(&keys[0])
                .key(&keys[1])
                .arg(1_700_000_000_000_000 + call * 1_000)
                .arg("log")
                .arg(limit)
                .arg(3_600_000_000u64)
                .arg(1)
                .invoke_async(&mut connection)
                .await
                .unwrap();
            assert_eq!(reply[0], 1);
        }
    });
    // The second key is where that version looked for an older log.
    (1, redis_bytes(redis, &keys[..1]))
}

/// `MEMORY USAGE` of `keys`, summed.
fn redis_bytes(redis: &RedisServer, keys: &[String]) -> u64 {
    keys.iter()
        .map(|key| {
            redis
                .cli(&["memory", "usage", key, "samples", "0"])
                .trim()
                .parse::<u64>()
                .unwrap()
        })
        .sum()
}

/// Each algorithm in a process of its own, so that memory one freed is not
/// reused by the next.
fn memory_store_bytes_per_client() {
    println!();
    println!("| algorithm | clients | resident growth | bytes per client |");
    println!("|---|---:|---:|---:|");
    for (name, _) in ALGORITHMS {
        let output = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--bench", "--memory-store", name])
            .output()
            .unwrap();
        assert!(output.status.success(), "{output:?}");
        print!("{}", String::from_utf8_lossy(&output.stdout));
    }
}

fn measure_memory_store(only: &str) {
    for (name, algorithm) in ALGORITHMS.into_iter().filter(|(name, _)| *name == only) {
        let policy = Policy::new("m", 100, Duration::from_secs(3600)).with_algorithm(algorithm);
        let keys: Vec<Key> = (0..CLIENTS)
            .map(|i| Key::new(format!("client-{i}")))
            .collect();
        let before = resident_bytes();
        let store = MemoryStore::builder().with_max_keys(2 * CLIENTS).build();
        for key in &keys {
            let answer = store
                .check(&[Check::new(&policy, key.clone()).unwrap()])
                .into_ready();
            assert!(
                matches!(answer, Ok(Ok(_))),
                "the memory store decides at once"
            );
        }
        let growth = resident_bytes().saturating_sub(before);
        println!(
            "| {name} | {CLIENTS} | {:.1} MiB | {} |",
            growth as f64 / (1024.0 * 1024.0),
            growth / CLIENTS as u64
        );
        assert_eq!(store.len(), CLIENTS);
    }
}

fn main() {
    // `cargo test` runs benches once as tests, with `--bench` absent: skip.
    let args: Vec<String> = std::env::args().collect();
    if !args.iter().any(|arg| arg == "--bench") {
        return;
    }
    if let Some(at) = args.iter().position(|arg| arg == "--memory-store") {
        measure_memory_store(&args[at + 1]);
        return;
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let redis = RedisServer::start();
    redis_bytes_per_client(&runtime, &redis);
    memory_store_bytes_per_client();
}
