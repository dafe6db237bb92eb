//! Redis time of one call of the sliding log, path by path, on logs of
//! 1,000, 100,000 and 1,000,000 records (of costs 1 and 2): the previous
//! script (each log a
//! packed ring in one string, `benches/fixtures/check_v2.lua`) beside
//! the library in `lua/` (pages and a tree of page sums), both loaded as
//! function libraries on one redis-server, as `RedisStore` loads them.
//! Each figure is the longest call of the path in `SLOWLOG` (which every
//! call enters), in microseconds.
//!
//! ```sh
//! cargo bench --bench log_paths            # every size
//! SIZES=1000,100000 cargo bench --bench log_paths
//! ```

mod common;
#[path = "../tests/it/support/mod.rs"]
mod support;

use slidegate::deadpool_redis::redis::{self, Connection, Value};
use support::RedisServer;

const PREVIOUS: &str = include_str!("fixtures/check_v2.lua");
const START: u64 = 1_700_000_000_000_000;
const LIMIT: u64 = 4_000_000;
const HOUR: u64 = 3_600_000_000;
/// Under 2^31 µs: the previous script's records keep 4-byte offsets.
const HALF_HOUR: u64 = 1_800_000_000;

#[derive(Clone, Copy, PartialEq)]
enum Variant {
    Previous,
    Current,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Self::Previous => "previous",
            Self::Current => "current",
        }
    }

    /// A log policy's arguments and a request's cost: the previous script
    /// takes four, the current one a burst (the limit, for a log), a block,
    /// a delay (none) and a span (the window's) too, before the cost.
    fn policy(self, call: &mut redis::Cmd, window: u64, cost: u64) {
        call.arg("log").arg(LIMIT).arg(window);
        if self == Self::Current {
            call.arg(LIMIT).arg(0).arg(0).arg(0);
        }
        call.arg(cost);
    }

    /// The keys of `client`'s log.
    fn keys(self, client: &str) -> [String; 2] {
        let base = format!("{}:{{{client}}}", self.name());
        match self {
            Self::Previous => [format!("{base}:l"), base],
            Self::Current => [format!("{base}:l"), format!("{base}:p")],
        }
    }
}

struct Bench {
    connection: Connection,
}

impl Bench {
    /// An `FCALL` of `variant`'s single-request function for `client` at
    /// `now`, before its other arguments.
    fn single(variant: Variant, client: &str, now: u64) -> redis::Cmd {
        let mut call = redis::cmd("FCALL");
        call.arg(format!("{}_check", variant.name()))
            .arg(2)
            .arg(&variant.keys(client))
            .arg(now);
        call
    }

    /// One request of `cost` for `client` at `now` under `window`.
    fn check(
        &mut self,
        variant: Variant,
        client: &str,
        now: u64,
        window: u64,
        cost: u64,
    ) -> Vec<i64> {
        let mut call = Self::single(variant, client, now);
        variant.policy(&mut call, window, cost);
        common::integers(call.query(&mut self.connection).unwrap())
    }

    /// Peeks at `cost` for `client` at `now` under `window`.
    fn peek(&mut self, variant: Variant, client: &str, now: u64, window: u64, cost: u64) {
        let mut call = Self::single(variant, client, now);
        call.arg("peek");
        variant.policy(&mut call, window, cost);
        let _: Value = call.query(&mut self.connection).unwrap();
    }

    /// `requests` requests for `client`, in one batch call, the n-th of
    /// cost `cost(n)`.
    fn batch(
        &mut self,
        variant: Variant,
        client: &str,
        now: u64,
        window: u64,
        requests: u64,
        cost: impl Fn(u64) -> u64,
    ) {
        let keys = variant.keys(client);
        let mut call = redis::cmd("FCALL");
        call.arg(format!("{}_batch", variant.name()))
            .arg(2 * requests);
        for _ in 0..requests {
            call.arg(&keys);
        }
        call.arg(now);
        if variant == Variant::Current {
            // The policy named once, then each request's place of it and cost.
            call.arg(1).arg(("log", LIMIT, window, LIMIT, 0, 0, 0));
            for n in 0..requests {
                call.arg((1, 1, cost(n)));
            }
        } else {
            for n in 0..requests {
                call.arg(1);
                variant.policy(&mut call, window, cost(n));
            }
        }
        let _: Value = call.query(&mut self.connection).unwrap();
    }

    /// Takes back one unit recorded at `at` for `client`.
    fn refund(&mut self, variant: Variant, client: &str, now: u64, at: u64) {
        let mut call = Self::single(variant, client, now);
        call.arg("refund");
        variant.policy(&mut call, HOUR, 1);
        let _: Value = call.arg(at).query(&mut self.connection).unwrap();
    }

    /// Fills `client`'s log with `records` requests, of costs 1 and 2 in
    /// turn (so records carry their costs), under `window`, in batches,
    /// from START on; returns the time after.
    fn fill(&mut self, variant: Variant, client: &str, records: u64, window: u64) -> u64 {
        let mut now = START;
        let mut left = records;
        while left > 0 {
            let requests = left.min(512);
            self.batch(variant, client, now, window, requests, |n| 1 + n % 2);
            left -= requests;
            now += requests;
        }
        now
    }

    /// On a log of its own, filled with `records` under `filled_under`:
    /// the longest call of one request, under a window of an hour, at the
    /// time `at` gives from the time the fill ended.
    fn fresh(
        &mut self,
        variant: Variant,
        records: u64,
        filled_under: u64,
        at: impl Fn(u64) -> u64,
    ) -> u64 {
        self.forget();
        let filled = self.fill(variant, "c", records, filled_under);
        self.measured(|b| {
            b.check(variant, "c", at(filled), HOUR, 1);
        })
    }

    /// Runs `path` with every call logged; the longest, in µs.
    fn measured(&mut self, path: impl FnOnce(&mut Self)) -> u64 {
        redis::cmd("SLOWLOG")
            .arg("RESET")
            .query::<()>(&mut self.connection)
            .unwrap();
        path(self);
        let entries: Value = redis::cmd("SLOWLOG")
            .arg("GET")
            .arg(-1)
            .query(&mut self.connection)
            .unwrap();
        let Value::Array(entries) = entries else {
            return 0;
        };
        entries
            .iter()
            .filter_map(|entry| match entry {
                Value::Array(fields) => match (&fields[2], &fields[3]) {
                    (Value::Int(micros), Value::Array(args))
                        if matches!(&args[0], Value::BulkString(name) if name.eq_ignore_ascii_case(b"fcall")) =>
                    {
                        Some(*micros as u64)
                    }
                    _ => None,
                },
                _ => None,
            })
            .max()
            .unwrap_or(0)
    }

    fn forget(&mut self) {
        redis::cmd("FLUSHALL")
            .query::<()>(&mut self.connection)
            .unwrap();
    }
}

/// The previous script's ring grows when a record finds it full: at
/// these counts, from a first capacity of 4 (each growth to twice the
/// records plus one).
fn growth_point(near: u64) -> u64 {
    let mut capacity = 4;
    while 2 * (capacity + 1) <= near {
        capacity = 2 * (capacity + 1);
    }
    capacity
}

fn main() {
    // `cargo test` runs benches once as tests, with `--bench` absent: skip.
    if !std::env::args().any(|arg| arg == "--bench") {
        return;
    }
    let sizes: Vec<u64> = std::env::var("SIZES")
        .map(|sizes| {
            sizes
                .split(',')
                .map(|s| s.trim().parse().unwrap())
                .collect()
        })
        .unwrap_or_else(|_| vec![1_000, 100_000, 1_000_000]);
    let server = RedisServer::start_with(&["--busy-reply-threshold", "60000"]);
    let mut bench = Bench {
        connection: redis::Client::open(server.url())
            .unwrap()
            .get_connection()
            .unwrap(),
    };
    let current = common::check_source();
    for (source, name) in [(PREVIOUS, "previous"), (current.as_str(), "current")] {
        redis::cmd("FUNCTION")
            .arg("LOAD")
            .arg(common::library(
                source,
                name,
                &[
                    (&format!("{name}_check"), "main"),
                    (&format!("{name}_batch"), "check_batch"),
                ],
            ))
            .query::<()>(&mut bench.connection)
            .unwrap();
    }
    redis::cmd("CONFIG")
        .arg("SET")
        .arg("slowlog-log-slower-than")
        .arg(0)
        .query::<()>(&mut bench.connection)
        .unwrap();
    redis::cmd("CONFIG")
        .arg("SET")
        .arg("slowlog-max-len")
        .arg(100_000)
        .query::<()>(&mut bench.connection)
        .unwrap();

    println!("| path | records | previous | current |");
    println!("|---|---:|---:|---:|");
    for &size in &sizes {
        let mut rows: Vec<(String, [u64; 2])> = Vec::new();
        let put =
            |rows: &mut Vec<(String, [u64; 2])>, path: &str, column: usize, micros: u64| match rows
                .iter_mut()
                .find(|(name, _)| name == path)
            {
                Some((_, figures)) => figures[column] = micros,
                None => {
                    let mut figures = [0; 2];
                    figures[column] = micros;
                    rows.push((path.to_owned(), figures));
                }
            };
        for (column, variant) in [Variant::Previous, Variant::Current]
            .into_iter()
            .enumerate()
        {
            bench.forget();
            let now = bench.fill(variant, "c", size, HOUR);
            let full = LIMIT;
            let micros = bench.measured(|b| {
                assert_eq!(b.check(variant, "c", now, HOUR, full)[0], 0);
            });
            put(&mut rows, "a denial, cost = limit", column, micros);
            let micros = bench.measured(|b| b.peek(variant, "c", now, HOUR, full));
            put(&mut rows, "a peek, cost = limit", column, micros);
            for requests in [32, 128] {
                let micros =
                    bench.measured(|b| b.batch(variant, "c", now, HOUR, requests, |_| full));
                put(
                    &mut rows,
                    &format!("a batch call of {requests} denials, cost = limit"),
                    column,
                    micros,
                );
            }
            let micros = bench.measured(|b| {
                let recorded = b.check(variant, "c", now, HOUR, 1)[4] as u64;
                b.refund(variant, "c", now, recorded);
            });
            put(
                &mut rows,
                "a refund of the newest request (`count = \"failures\"`)",
                column,
                micros,
            );
            let micros =
                bench.measured(|b| b.refund(variant, "c", now, START + size / 2 / 512 * 512));
            put(
                &mut rows,
                "a refund of a request in the middle",
                column,
                micros,
            );
            let micros = bench.measured(|b| {
                for n in 0..300 {
                    b.check(variant, "c", now + n, HOUR, 1);
                }
            });
            put(
                &mut rows,
                "300 requests one by one (pages sealed)",
                column,
                micros,
            );
            let micros = bench.measured(|b| {
                b.check(variant, "c", now + 300, HOUR, 65_536);
            });
            put(
                &mut rows,
                "a cost of 65,536 (a wider record)",
                column,
                micros,
            );
            let micros = bench.measured(|b| {
                b.check(variant, "c", now + 301, 2 * HOUR, 1);
            });
            put(&mut rows, "a tier with a longer window", column, micros);
            let micros = bench.measured(|b| {
                b.check(variant, "c", now + 3 * HOUR, HOUR, 1);
            });
            put(
                &mut rows,
                "every record pruned (back after a quiet window)",
                column,
                micros,
            );

            let growth = if variant == Variant::Previous {
                growth_point(size)
            } else {
                size
            };
            // Each on a log of its own.
            let micros = bench.fresh(variant, size, HOUR, |filled| filled - HOUR - 1_000_000);
            put(
                &mut rows,
                "the clock stepping back by more than a window",
                column,
                micros,
            );
            let micros = bench.fresh(variant, size, HALF_HOUR, |filled| filled);
            put(
                &mut rows,
                "a window over 2^31 µs on a log kept under a shorter one",
                column,
                micros,
            );
            let micros = bench.fresh(variant, growth, HOUR, |filled| filled);
            put(
                &mut rows,
                "the ring full and growing (the previous script, at its nearest growth)",
                column,
                micros,
            );
        }
        for (path, [previous, current]) in rows {
            println!("| {path} | {size} | {previous} µs | {current} µs |");
        }
    }
}
