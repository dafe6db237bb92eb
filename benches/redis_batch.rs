//! Whether batching pays on Redis: the Redis CPU per decision (`INFO cpu`,
//! the whole server, networking included) of sixteen checks sent as
//! sixteen pipelined `FCALL`s of `check`, against one `FCALL` of
//! `check_batch` deciding all sixteen (which reads `TIME` once).
//! Sliding logs of 10,000 clients, a limit never reached; the two
//! variants interleaved round by round.
//!
//! ```sh
//! cargo bench --bench redis_batch
//! ```

mod common;
#[path = "../tests/it/support/mod.rs"]
mod support;

use common::median;
use slidegate::deadpool_redis::redis::{self, Connection, Value};
use support::RedisServer;

const CLIENTS: u64 = 10_000;
const BATCH: u64 = 16;
const DECISIONS: u64 = 64_000;
const ROUNDS: usize = 5;

/// the library in `lua/` as a function library with `check` (one request) as `one` and
/// `check_batch` (several, what `RedisStore` sends when checks queue up
/// together) as `batch`.
fn library() -> String {
    common::library(
        &common::check_source(),
        "slidegate_batch_bench",
        &[("one", "check"), ("batch", "check_batch")],
    )
}

/// Seconds of CPU the server has used.
fn redis_cpu(connection: &mut Connection) -> f64 {
    let info: String = redis::cmd("INFO").arg("cpu").query(connection).unwrap();
    info.lines()
        .filter(|line| line.starts_with("used_cpu_sys:") || line.starts_with("used_cpu_user:"))
        .filter_map(|line| line.split(':').nth(1)?.trim().parse::<f64>().ok())
        .sum()
}

/// The policy of every check, as the script takes it: a sliding log of a
/// limit never reached over a minute (its burst the limit), no block, no
/// delay, and the window's span.
const POLICY: (&str, u32, u64, u32, u32, u32, u32) =
    ("log", 1_000_000_000, 60_000_000, 1_000_000_000, 0, 0, 0);

/// The keys of client `client`'s sliding log.
fn keys(client: u64) -> [String; 2] {
    let base = format!("bench:{{client-{client}}}");
    [format!("{base}:l"), format!("{base}:p")]
}

/// `DECISIONS` decisions, `BATCH` at a time, for pseudo-random clients.
fn run(connection: &mut Connection, batched: bool, seed: u64) {
    let mut client = seed;
    for _ in 0..DECISIONS / BATCH {
        let clients: Vec<u64> = (0..BATCH)
            .map(|_| {
                client = (client * 6_364_136_223_846_793_005 + 1) % (1 << 63);
                client % CLIENTS
            })
            .collect();
        let reply: Vec<i64> = if batched {
            let mut call = redis::cmd("FCALL");
            call.arg("batch").arg(clients.len() * 2);
            for &c in &clients {
                call.arg(&keys(c));
            }
            // The policy named once, then per request its place and cost.
            call.arg("").arg(1).arg(POLICY);
            for _ in &clients {
                call.arg((1, 1, 1));
            }
            let replies: Vec<Value> = call.query(connection).unwrap();
            replies.into_iter().flat_map(common::integers).collect()
        } else {
            let mut pipe = redis::pipe();
            for &c in &clients {
                pipe.cmd("FCALL")
                    .arg("one")
                    .arg(2)
                    .arg(&keys(c))
                    .arg("")
                    .arg(POLICY)
                    .arg(1);
            }
            let replies: Vec<Value> = pipe.query(connection).unwrap();
            replies.into_iter().flat_map(common::integers).collect()
        };
        assert_eq!(reply.len() as u64, BATCH * 5);
        assert!(reply.chunks(5).all(|decision| decision[0] == 1));
    }
}

fn main() {
    // `cargo test` runs benches once as tests, with `--bench` absent: skip.
    if !std::env::args().any(|arg| arg == "--bench") {
        return;
    }
    let server = RedisServer::start();
    let mut connection = redis::Client::open(server.url())
        .unwrap()
        .get_connection()
        .unwrap();
    let _: String = redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg(library())
        .query(&mut connection)
        .unwrap();
    // Every client's log exists before measuring.
    run(&mut connection, false, 1);
    let (mut pipelined, mut batched) = (Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        for batch in [round % 2 == 0, round % 2 == 1] {
            let before = redis_cpu(&mut connection);
            run(&mut connection, batch, 100 + round as u64);
            let micros = (redis_cpu(&mut connection) - before) * 1e6 / DECISIONS as f64;
            if batch {
                batched.push(micros);
            } else {
                pipelined.push(micros);
            }
        }
    }
    let (pipelined, batched) = (median(pipelined), median(batched));
    println!("| {BATCH} checks as | Redis CPU per decision | ratio |");
    println!("|---|---:|---:|");
    println!("| {BATCH} pipelined `FCALL`s | {pipelined:.2} µs | 1.000 |");
    println!(
        "| one batch `FCALL` | {batched:.2} µs | {:.3} |",
        batched / pipelined
    );
}
