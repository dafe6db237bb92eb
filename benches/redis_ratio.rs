//! `RedisStore` beside a raw redis-rs `EVALSHA` loop of the same script on
//! one shared multiplexed connection,
//! interleaved: ten rounds per concurrency, each running both (in
//! alternating order) for the same number of decisions, so that the drift
//! of a shared machine hits both alike. Prints each one's median decisions
//! per second and the median of the per-round ratios.
//!
//! ```sh
//! cargo bench --bench redis_ratio
//! ```

mod common;
#[path = "../tests/it/support/mod.rs"]
mod support;

use std::sync::Arc;
use std::time::Duration;

use common::{
    concurrently, median, multiplexed, one_worker_runtime, raw_evalsha, slidegate_checks, store_on,
    task_keys,
};
use slidegate::deadpool_redis::redis::Script;
use support::RedisServer;

const ROUNDS: usize = 10;
const DECISIONS: u64 = 4_000;

fn main() {
    // `cargo test` runs benches once as tests, with `--bench` absent: skip.
    if !std::env::args().any(|arg| arg == "--bench") {
        return;
    }
    let server = RedisServer::start();
    let runtime = one_worker_runtime();
    let script = Arc::new(Script::new(&common::check_source()));
    println!(
        "| tasks | RedisStore decisions/s | raw EVALSHA decisions/s | ratio (median of rounds) |"
    );
    println!("|---:|---:|---:|---:|");
    for tasks in [1usize, 16, 64] {
        let store = store_on(server.pool(tasks));
        let connection = runtime.block_on(multiplexed(&server.url()));
        let keys = task_keys(tasks);
        let slidegate = || {
            runtime.block_on(concurrently(
                tasks,
                DECISIONS,
                slidegate_checks(store.clone(), keys.clone()),
            ))
        };
        let raw = || {
            runtime.block_on(concurrently(
                tasks,
                DECISIONS,
                raw_evalsha(connection.clone(), script.clone()),
            ))
        };
        // Warm both up: connections, the script cache.
        slidegate();
        raw();
        let (mut ours, mut theirs, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..ROUNDS {
            let (a, b) = if round % 2 == 0 {
                let a = slidegate();
                (a, raw())
            } else {
                let b = raw();
                (slidegate(), b)
            };
            let rate = |elapsed: Duration| DECISIONS as f64 / elapsed.as_secs_f64();
            ours.push(rate(a));
            theirs.push(rate(b));
            ratios.push(rate(a) / rate(b));
        }
        println!(
            "| {tasks} | {:.0} | {:.0} | {:.3} |",
            median(ours),
            median(theirs),
            median(ratios)
        );
    }
}
