//! Redis CPU per decision (`INFO commandstats`), per algorithm, admitted
//! and denied: the previous script (each sliding log a packed ring in one
//! string), the library in `lua/` by `EVALSHA`, and the same source loaded once
//! as a Redis function library and run by `FCALL`. All three run on one
//! redis-server in one process, scenario by scenario, on the same trace.
//!
//! ```sh
//! cargo bench --bench redis_cpu
//! KINDS_ONLY=1 cargo bench --bench redis_cpu    # the second table alone
//! ```

mod common;
#[path = "../tests/it/support/mod.rs"]
mod support;

use slidegate::deadpool_redis::redis::{self, Script, Value};
use support::RedisServer;

const PREVIOUS: &str = include_str!("fixtures/check_v2.lua");
const CLIENTS: u64 = 20;
const WARM_UP: u64 = 4_000;
const DECISIONS: u64 = 20_000;
const ROUNDS: usize = 5;

#[derive(Clone, Copy, PartialEq)]
enum Variant {
    Previous,
    PackedEvalsha,
    PackedFcall,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Self::Previous => "previous script, EVALSHA",
            Self::PackedEvalsha => "the library, EVALSHA (the fallback)",
            Self::PackedFcall => "the library as functions, FCALL (RedisStore)",
        }
    }

    /// Where the variant's keys start, apart from the others'.
    fn prefix(self) -> &'static str {
        match self {
            Self::Previous => "previous",
            Self::PackedEvalsha => "evalsha",
            Self::PackedFcall => "fcall",
        }
    }

    fn command(self) -> &'static str {
        match self {
            Self::PackedFcall => "fcall",
            _ => "evalsha",
        }
    }
}

/// the library in `lua/` as a function library: its functions are defined once,
/// when the library loads, rather than on every call.
fn library() -> String {
    common::library(
        &common::check_source(),
        "slidegate_bench",
        &[
            (
                "slidegate_check",
                "function(keys, args) return check(keys, args) end",
            ),
            (
                "slidegate_main",
                "function(keys, args) return main(keys, args) end",
            ),
        ],
    )
}

/// The calls and microseconds `command` has taken so far.
fn command_stats(connection: &mut redis::Connection, command: &str) -> (u64, u64) {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(connection)
        .unwrap();
    let prefix = format!("cmdstat_{command}:");
    let Some(line) = info.lines().find(|line| line.starts_with(&prefix)) else {
        return (0, 0);
    };
    let field = |name: &str| -> u64 {
        line.split([':', ','])
            .find_map(|part| part.strip_prefix(&format!("{name}=")))
            .and_then(|value| value.parse().ok())
            .unwrap()
    };
    (field("calls"), field("usec"))
}

/// Runs `decisions` calls: clients in turn, the injected clock 1 ms on at
/// each call. Returns how many were admitted.
fn run(
    connection: &mut redis::Connection,
    variant: Variant,
    algorithm: &str,
    limit: u32,
    scenario: &str,
    from: u64,
    decisions: u64,
) -> u64 {
    let previous = Script::new(PREVIOUS);
    let packed = Script::new(&common::check_source());
    let mut admitted = 0;
    for call in from..from + decisions {
        let now = 1_700_000_000_000_000 + call * 1_000;
        let base = format!(
            "{}:{scenario}:{algorithm}:{{client-{}}}",
            variant.prefix(),
            call % CLIENTS
        );
        let keys = match (algorithm, variant) {
            ("log", Variant::Previous) => vec![format!("{base}:l"), base.clone()],
            ("log", _) => vec![format!("{base}:l"), format!("{base}:p")],
            // A log whose denials block the client for half a second.
            ("log+block", _) => vec![
                format!("{base}:l"),
                format!("{base}:p"),
                format!("{base}:x"),
            ],
            ("counter", _) => vec![format!("{base}:c")],
            ("bucket", _) => vec![format!("{base}:b")],
            ("lease", _) => vec![format!("{base}:n")],
            ("calendar", _) => vec![format!("{base}:q")],
            ("log+settle", _) => vec![format!("{base}:l"), format!("{base}:p")],
            _ => vec![format!("{base}:f")],
        };
        let name = match algorithm {
            // A monthly quota: its window argument is the offset from UTC.
            "calendar" => "month",
            "log+settle" => "log",
            _ => algorithm.strip_suffix("+block").unwrap_or(algorithm),
        };
        // Admitted, a month's quota admits a month of what a second of
        // the others does; denied, it denies all but its first units.
        let limit = if name == "month" && scenario == "admitted" {
            limit * 30 * 86_400
        } else {
            limit
        };
        let window = if name == "month" { 0 } else { 1_000_000u64 };
        // A lease's cost argument is its id, one per call.
        let cost = if name == "lease" { call } else { 1 };
        let args = (now, name, limit, window);
        // The current script also takes a burst (the limit), a block, a
        // delay (none) and a span (the window's), before the cost.
        let block = if algorithm.ends_with("+block") {
            500_000
        } else {
            0
        };
        let extra: &[u64] = if variant == Variant::Previous {
            &[]
        } else {
            &[u64::from(limit), block, 0, 0]
        };
        let reply: Value = match variant {
            Variant::PackedFcall => redis::cmd("FCALL")
                .arg("slidegate_check")
                .arg(keys.len())
                .arg(&keys)
                .arg(args)
                .arg(extra)
                .arg(cost)
                .query(connection)
                .unwrap(),
            _ => {
                let script = if variant == Variant::Previous {
                    &previous
                } else {
                    &packed
                };
                let mut invocation = script.prepare_invoke();
                for key in &keys {
                    invocation.key(key);
                }
                invocation
                    .arg(args)
                    .arg(extra)
                    .arg(cost)
                    .invoke(connection)
                    .unwrap()
            }
        };
        let decision = common::integers(reply);
        admitted += u64::from(decision[0] == 1);
        if algorithm == "log+settle" && decision[0] == 1 {
            // The response reported twice its reservation: one more call,
            // which gives the reservation back and charges 2.
            let _: Value = redis::cmd("FCALL")
                .arg("slidegate_main")
                .arg(keys.len())
                .arg(&keys)
                .arg((now, "settle", name, limit, window))
                .arg(extra)
                .arg((cost, decision[4], 2))
                .query(connection)
                .unwrap();
        }
    }
    admitted
}

fn main() {
    // `cargo test` runs benches once as tests, with `--bench` absent: skip.
    if !std::env::args().any(|arg| arg == "--bench") {
        return;
    }
    let server = RedisServer::start();
    let client = redis::Client::open(server.url()).unwrap();
    let mut connection = client.get_connection().unwrap();
    let _: String = redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg("REPLACE")
        .arg(library())
        .query(&mut connection)
        .unwrap();

    println!(
        "{CLIENTS} clients in turn, 1 ms apart, window 1 s; {DECISIONS} decisions per cell, median of {ROUNDS} rounds."
    );
    if std::env::var_os("KINDS_ONLY").is_some() {
        kinds(&mut connection);
        return;
    }
    println!();
    println!(
        "| algorithm | scenario | variant | admitted | µs of Redis CPU per decision | ratio to previous |"
    );
    println!("|---|---|---|---:|---:|---:|");
    // Each client calls every 20 ms: 50 a second. A limit of 100 admits
    // all of them; a limit of 10 denies four in five.
    for (scenario, limit) in [("admitted", 100u32), ("denied", 10)] {
        for algorithm in ["log", "counter", "fixed"] {
            let variants = [
                Variant::Previous,
                Variant::PackedEvalsha,
                Variant::PackedFcall,
            ];
            let mut rounds: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
            let mut admitted = vec![0; variants.len()];
            for round in 0..ROUNDS as u64 {
                for (i, &variant) in variants.iter().enumerate() {
                    let from = round * (WARM_UP + DECISIONS);
                    run(
                        &mut connection,
                        variant,
                        algorithm,
                        limit,
                        scenario,
                        from,
                        WARM_UP,
                    );
                    let (calls, usec) = command_stats(&mut connection, variant.command());
                    admitted[i] = run(
                        &mut connection,
                        variant,
                        algorithm,
                        limit,
                        scenario,
                        from + WARM_UP,
                        DECISIONS,
                    );
                    let (calls_after, usec_after) =
                        command_stats(&mut connection, variant.command());
                    rounds[i].push((usec_after - usec) as f64 / (calls_after - calls) as f64);
                }
            }
            let medians: Vec<f64> = rounds
                .into_iter()
                .map(|mut values| {
                    values.sort_by(f64::total_cmp);
                    values[values.len() / 2]
                })
                .collect();
            for (i, variant) in variants.iter().enumerate() {
                println!(
                    "| {algorithm} | {scenario} | {} | {:.0}% | {:.2} | {:.2}× |",
                    variant.name(),
                    100.0 * admitted[i] as f64 / DECISIONS as f64,
                    medians[i],
                    medians[i] / medians[0]
                );
            }
        }
    }
    kinds(&mut connection);
}

/// The kinds of check beyond the windows (a token bucket, a concurrency
/// lease, a log whose denials block, a monthly calendar quota, and a log
/// whose admitted requests are settled after the response at twice their
/// reservation, a second call each), each beside the sliding log in the
/// same run, all by `FCALL`; CPU per decision, its settlement included. A lease is taken on every admitted call and
/// never released: it expires after the window, as a crashed instance's
/// would, which is what the lease set's cleaning costs.
fn kinds(connection: &mut redis::Connection) {
    println!();
    println!(
        "| kind | scenario | admitted | µs of Redis CPU per decision | ratio to the sliding log |"
    );
    println!("|---|---|---:|---:|---:|");
    let kinds = [
        "log",
        "bucket",
        "lease",
        "log+block",
        "calendar",
        "log+settle",
    ];
    for (scenario, limit) in [("admitted", 100u32), ("denied", 10)] {
        let mut rounds: Vec<Vec<f64>> = vec![Vec::new(); kinds.len()];
        let mut admitted = vec![0; kinds.len()];
        for round in 0..ROUNDS as u64 {
            for (i, kind) in kinds.iter().enumerate() {
                let from = (round + ROUNDS as u64) * (WARM_UP + DECISIONS);
                let variant = Variant::PackedFcall;
                run(connection, variant, kind, limit, scenario, from, WARM_UP);
                let (_, usec) = command_stats(connection, variant.command());
                admitted[i] = run(
                    connection,
                    variant,
                    kind,
                    limit,
                    scenario,
                    from + WARM_UP,
                    DECISIONS,
                );
                let (_, usec_after) = command_stats(connection, variant.command());
                rounds[i].push((usec_after - usec) as f64 / DECISIONS as f64);
            }
        }
        let medians: Vec<f64> = rounds
            .into_iter()
            .map(|mut values| {
                values.sort_by(f64::total_cmp);
                values[values.len() / 2]
            })
            .collect();
        for (i, kind) in kinds.iter().enumerate() {
            println!(
                "| {kind} | {scenario} | {:.0}% | {:.2} | {:.2}× |",
                100.0 * admitted[i] as f64 / DECISIONS as f64,
                medians[i],
                medians[i] / medians[0]
            );
        }
    }
}
