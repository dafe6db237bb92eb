//! Every call of the Redis script does bounded work, whatever the log's
//! size, the costs clients choose, the window or the time since the last
//! call: logs of 100,000 records, filled through the public `Store` API,
//! are driven down every path, and Redis's own `SLOWLOG` says how long the
//! longest call held it.
//!
//! The bound asserted is 10 ms: every one of these paths took 16 ms or
//! more at this size when the work grew with the log, and takes well under
//! the 1 ms this crate aims for now, so the test fails on work that grows,
//! not on a machine that is busy (tests run side by side on two shared
//! cores): of a path of several calls, the second-longest is judged, as
//! one call can be stretched by the machine (a 12 ms call among 300 of
//! under 1 ms was seen) while work that grows shows on every call of its
//! kind. Beside the time, the commands the calls ran (`INFO
//! commandstats`), which no busy machine changes, are held to a bound. The
//! figures are printed; BENCHMARKS.md quotes them.

use std::time::Duration;

use crate::support::RedisServer;
use slidegate::deadpool_redis::redis::{self, Value};
use slidegate::{
    Policy,
    clock::{Clock, FakeClock},
    key::Key,
    store::{Check, Decision, RedisStore, Store},
};

use crate::support::stores::START;
const RECORDS: u32 = 100_000;
const BOUND: Duration = Duration::from_millis(10);

fn store_on(server: &RedisServer, clock: &FakeClock) -> RedisStore {
    RedisStore::builder(server.pool(2))
        .with_clock(clock.clone())
        .with_timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}

/// Admits `records` requests of `check`, a thousand at a time in one
/// millisecond of the clock (the store sends them in batches), every
/// `costly`-th of cost 65,536 (none if 0).
async fn fill(store: &RedisStore, clock: &FakeClock, check: &Check, records: u32, costly: u32) {
    for thousand in 0..records / 1000 {
        clock.advance(Duration::from_millis(1));
        let tasks: Vec<_> = (0..1000)
            .map(|n| {
                let (store, mut check) = (store.clone(), check.clone());
                if costly > 0 && (thousand * 1000 + n) % costly == 0 {
                    check = check.with_cost(65_536);
                }
                tokio::spawn(async move { store.check(&[check]).await })
            })
            .collect();
        for task in tasks {
            assert!(task.await.unwrap().unwrap()[0].admitted());
        }
    }
}

async fn one(store: &RedisStore, check: &Check) -> Decision {
    store.check(std::slice::from_ref(check)).await.unwrap()[0]
}

/// The longest script call since the slow log was last reset, and how
/// many calls it holds.
async fn slowest(server: &RedisServer) -> (Duration, usize) {
    let (longest, _, calls) = slowest_two(server).await;
    (longest, calls)
}

/// The longest and second-longest script calls in the slow log, and how
/// many there were.
async fn slowest_two(server: &RedisServer) -> (Duration, Duration, usize) {
    slowest_of(server, b"fcall").await
}

/// The longest and second-longest calls of `command` in the slow log, and
/// how many there were.
async fn slowest_of(server: &RedisServer, command: &[u8]) -> (Duration, Duration, usize) {
    let client = redis::Client::open(server.url()).unwrap();
    // A plain connection, without the pool's response timeout: the log
    // may be long.
    let mut connection = client.get_connection().unwrap();
    let entries: Value = redis::cmd("SLOWLOG")
        .arg("GET")
        .arg(-1)
        .query(&mut connection)
        .unwrap();
    let Value::Array(entries) = entries else {
        panic!("SLOWLOG GET answered {entries:?}");
    };
    let (mut longest, mut second) = (Duration::ZERO, Duration::ZERO);
    let mut calls = 0;
    for entry in entries {
        let Value::Array(fields) = entry else {
            continue;
        };
        let is_command = matches!(&fields[3], Value::Array(args)
            if matches!(&args[0], Value::BulkString(name) if name.eq_ignore_ascii_case(command)));
        if let (true, Value::Int(micros)) = (is_command, &fields[2]) {
            let took = Duration::from_micros(*micros as u64);
            if took > longest {
                (longest, second) = (took, longest);
            } else {
                second = second.max(took);
            }
            calls += 1;
        }
    }
    (longest, second, calls)
}

/// Starts a slow log that keeps every call.
fn log_every_call(server: &RedisServer) {
    server.cli(&["config", "set", "slowlog-log-slower-than", "0"]);
    server.cli(&["config", "set", "slowlog-max-len", "100000"]);
    server.cli(&["slowlog", "reset"]);
}

/// The most commands one script call may run on any path: a call's
/// work is bounded whatever the log's size, the costs or the batch (a
/// call that walked the pages of a log of 100,000 records, 400 of them,
/// or deleted them one by one, would run hundreds; every path runs 5 to
/// 21 today).
const COMMANDS_A_CALL: u64 = 100;

/// Runs `path` and returns how long its calls held Redis, as judged: the
/// longest call of a path of one call, the second-longest of a path of
/// several. Work that grows with the log grows on every call of its kind
/// (each seal, each prune), so it shows in the second-longest too, while
/// one call stretched by a busy machine does not fail the test. The
/// commands a call ran, which no busy machine changes, are held to
/// `COMMANDS_A_CALL` (for a path of several calls, on average).
async fn measured(server: &RedisServer, name: &str, path: impl Future<Output = ()>) -> Duration {
    log_every_call(server);
    server.cli(&["config", "resetstat"]);
    path.await;
    let (calls, commands) = server.script_work();
    let (longest, second, logged) = slowest_two(server).await;
    let per_call = commands / calls.max(1);
    println!(
        "| {name} | {logged} | {} µs (second: {} µs) | {per_call} |",
        longest.as_micros(),
        second.as_micros()
    );
    assert!(logged > 0, "{name}: no script call was logged");
    assert!(
        per_call <= COMMANDS_A_CALL,
        "{name}: {commands} commands in {calls} calls"
    );
    if logged > 1 { second } else { longest }
}

#[tokio::test]
async fn every_path_on_a_log_of_100_000_records_holds_redis_briefly() {
    let server = RedisServer::start();
    let clock = FakeClock::new(START);
    let store = store_on(&server, &clock);
    // A quota of a million an hour, and one of four billion units an hour
    // whose requests cost 1 or 65,536; each with a tier of the same policy
    // whose window is a minute.
    let hour = Policy::new("quota", 1_000_000, Duration::from_secs(3600));
    let units = Policy::new("units", 4_000_000_000, Duration::from_secs(3600));
    let units_minute = Policy::new("units", 4_000_000_000, Duration::from_secs(60));
    let check = Check::new(&hour, Key::new("big")).unwrap();
    let mixed = Check::new(&units, Key::new("mixed")).unwrap();
    let full = |check: &Check| check.clone().with_cost(check.limit());

    log_every_call(&server);
    fill(&store, &clock, &check, RECORDS, 0).await;
    fill(&store, &clock, &mixed, RECORDS, 7).await;
    // Not bounded here: a thousand requests at once keep this machine's
    // two cores busy, and Redis waits for one.
    let (filling, calls) = slowest(&server).await;
    println!("| path | script calls | longest call | commands a call |");
    println!("|---|---:|---:|---:|");
    println!(
        "| filling two logs of 100,000 records, in batches | {calls} | {} µs | |",
        filling.as_micros()
    );
    let mut longest = Duration::ZERO;
    longest = longest.max(
        measured(&server, "300 requests one by one (pages sealed)", async {
            for _ in 0..300 {
                assert!(one(&store, &check).await.admitted());
            }
        })
        .await,
    );

    longest = longest.max(
        measured(&server, "a denial at cost = limit", async {
            let decision = one(&store, &full(&check)).await;
            assert!(!decision.admitted());
            assert!(
                decision
                    .retry_after()
                    .is_some_and(|wait| wait > Duration::from_secs(3599))
            );
            assert!(!one(&store, &full(&mixed)).await.admitted());
        })
        .await,
    );
    longest = longest.max(
        measured(&server, "a peek at cost = limit", async {
            let decision = store.peek(&[full(&check)]).await.unwrap()[0];
            assert!(!decision.admitted() && decision.remaining() == 1_000_000 - RECORDS - 300);
        })
        .await,
    );
    longest = longest.max(
        measured(
            &server,
            "a tier with a shorter window, cost = limit",
            async {
                let mut short = Check::new(&units_minute, Key::new("mixed")).unwrap();
                short = short.with_cost(units_minute.limit());
                assert!(!one(&store, &short).await.admitted());
            },
        )
        .await,
    );
    longest = longest.max(
        measured(&server, "a batch of 128 denials at cost = limit", async {
            let tasks: Vec<_> = (0..128)
                .map(|n| {
                    let store = store.clone();
                    let check = full(if n % 2 == 0 { &check } else { &mixed });
                    tokio::spawn(async move { store.check(&[check]).await })
                })
                .collect();
            for task in tasks {
                assert!(!task.await.unwrap().unwrap()[0].admitted());
            }
        })
        .await,
    );
    longest = longest.max(
        measured(
            &server,
            "refunds: the oldest, a middle and the newest request",
            async {
                for client in [&check, &mixed] {
                    let mut recorded = Vec::new();
                    let decision = one(&store, &first_of(client)).await;
                    recorded.push(decision.recorded_at().unwrap());
                    let oldest = Duration::from_micros(START + 1_000);
                    let middle = Duration::from_micros(START + 50_000);
                    for at in [oldest, middle, recorded[0]] {
                        store.refund(&[first_of(client)], &[at]).await.unwrap();
                    }
                }
            },
        )
        .await,
    );
    longest = longest.max(
        measured(
            &server,
            "widening the newest page: a cost of 65,536",
            async {
                let mut costly = check.clone();
                costly = costly.with_cost(65_536);
                assert!(one(&store, &costly).await.admitted());
            },
        )
        .await,
    );
    longest = longest.max(
        measured(
            &server,
            "widening the newest page: offsets past 2^32 µs",
            async {
                // A two-hour tier keeps every record of the mixed log live for
                // 72 minutes more, when a new record's offset from its page's
                // base no longer fits 4 bytes.
                let two_hours = Policy::new("units", 4_000_000_000, Duration::from_secs(7200));
                let long = Check::new(&two_hours, Key::new("mixed")).unwrap();
                assert!(one(&store, &long).await.admitted());
                clock.advance(Duration::from_secs(72 * 60));
                assert!(one(&store, &long).await.admitted());
            },
        )
        .await,
    );
    longest = longest.max(
        measured(
            &server,
            "a cost of 40,000 against a full log of cost-2 requests",
            async {
                let pairs = Policy::new("pairs", 2 * RECORDS, Duration::from_secs(3600));
                let pair = Check::new(&pairs, Key::new("pairs")).unwrap().with_cost(2);
                fill(&store, &clock, &pair, RECORDS, 0).await;
                log_every_call(&server);
                let decision = one(&store, &pair.clone().with_cost(40_000)).await;
                assert!(!decision.admitted() && decision.remaining() == 0);
                // The oldest 20,000 requests leave in an hour from the
                // first: the retry time counts 20,000 records in.
                let wait = decision.retry_after().unwrap();
                assert!(wait > Duration::from_secs(3500) && wait < Duration::from_secs(3600));
            },
        )
        .await,
    );
    longest = longest.max(
        measured(
            &server,
            "batches of 32 on a full log that prunes as they come",
            async {
                let fast = Policy::new("fast", RECORDS, Duration::from_secs(4));
                let hot = Check::new(&fast, Key::new("hot")).unwrap();
                fill(&store, &clock, &hot, RECORDS, 0).await;
                // The first thousand have just left.
                clock.advance(Duration::from_secs(4) - Duration::from_millis(99));
                log_every_call(&server);
                for _ in 0..50 {
                    // 32 requests take the room of the 40 that left.
                    clock.advance(Duration::from_micros(40));
                    let tasks: Vec<_> = (0..32)
                        .map(|_| {
                            let (store, hot) = (store.clone(), hot.clone());
                            tokio::spawn(async move { store.check(&[hot]).await })
                        })
                        .collect();
                    for task in tasks {
                        assert!(task.await.unwrap().unwrap()[0].admitted());
                    }
                }
            },
        )
        .await,
    );
    longest = longest.max(
        measured(&server, "pruning half of a log", async {
            fill(&store, &clock, &check, RECORDS, 0).await;
            log_every_call(&server);
            clock.advance(Duration::from_secs(3600) - Duration::from_millis(50));
            assert!(one(&store, &check).await.admitted());
        })
        .await,
    );
    longest = longest.max(
        measured(
            &server,
            "pruning every record (the client back after a quiet hour)",
            async {
                clock.advance(Duration::from_secs(3601));
                let decision = one(&store, &check).await;
                assert!(decision.admitted() && decision.remaining() == 1_000_000 - 1);
            },
        )
        .await,
    );
    longest = longest.max(
        measured(
            &server,
            "the clock stepping back by more than a window",
            async {
                fill(&store, &clock, &check, RECORDS, 0).await;
                log_every_call(&server);
                clock.set(clock.now_micros() - 2 * 3_600_000_000);
                let decision = one(&store, &check).await;
                // The gathered count: the request of the path before, the
                // 100,000, and this one.
                assert!(decision.admitted() && decision.remaining() == 1_000_000 - RECORDS - 2);
            },
        )
        .await,
    );
    println!("longest call of all, as judged: {} µs", longest.as_micros());
    assert!(longest <= BOUND, "calls held Redis for {longest:?}");
}

/// Every key of the log at `base` (copied first) is small enough that
/// Redis frees it at once when it deletes it in its main thread, as it
/// does a key that expires under `lazyfree-lazy-expire no` (Redis 7's
/// default): each holds at most a chunk's fields, and deleting each, with
/// `lazyfree-lazy-user-del no`, holds Redis briefly (one hash of every
/// page of a million-record log took 8 ms).
async fn freed_at_once(server: &RedisServer, base: &str) {
    let copy = "slidegate:deep:{user:freed}";
    server.copy_state(base, copy);
    let keys = server.keys_of(copy);
    for key in &keys {
        let kind = server.cli(&["type", key]);
        if kind.trim() == "hash" {
            let fields: u64 = server.cli(&["hlen", key]).trim().parse().unwrap();
            assert!(fields <= 64 + 127 + 20, "{key}: {fields} fields");
        }
    }
    server.cli(&["config", "set", "lazyfree-lazy-user-del", "no"]);
    log_every_call(server);
    for key in &keys {
        server.cli(&["del", key]);
    }
    let (longest, second, deleted) = slowest_of(server, b"del").await;
    println!(
        "| deleting each of the {} keys of a million-record log | {deleted} | {} µs (second: {} µs) |",
        keys.len(),
        longest.as_micros(),
        second.as_micros()
    );
    assert_eq!(deleted, keys.len());
    assert!(
        second <= BOUND,
        "a key held Redis {second:?} as it was freed"
    );
}

/// `check` at a cost of one unit.
fn first_of(check: &Check) -> Check {
    let mut one = check.clone();
    one = one.with_cost(1);
    one
}

/// One batch of 32 clients, each with a log of a million records: a call
/// never holds Redis for long however many deep logs it is given, since
/// the script defers the rest of a batch once it has done a call's worth
/// of work (the store sends them in the next call). Denials at half the
/// limit, and a prune of half of each log, both in one batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_32_logs_of_a_million_records_holds_redis_briefly() {
    const MILLION: u32 = 1_000_000;
    const CLIENTS: usize = 32;
    let server = RedisServer::start();
    let clock = FakeClock::new(START);
    let store = store_on(&server, &clock);
    let hour = Policy::new("deep", 2 * MILLION, Duration::from_secs(3600));
    let first = Check::new(&hour, Key::new("c0")).unwrap();
    let started = std::time::Instant::now();
    fill(&store, &clock, &first, MILLION, 0).await;
    // The other clients' logs are copies of the first.
    for client in 1..CLIENTS {
        server.copy_state(
            "slidegate:deep:{user:c0}",
            &format!("slidegate:deep:{{user:c{client}}}"),
        );
    }
    println!("32 logs of a million records in {:?}", started.elapsed());
    freed_at_once(&server, "slidegate:deep:{user:c0}").await;
    let checks: Vec<Check> = (0..CLIENTS)
        .map(|client| Check::new(&hour, Key::new(format!("c{client}"))).unwrap())
        .collect();
    let batch = |cost: u32| {
        let tasks: Vec<_> = checks
            .iter()
            .map(|check| {
                let (store, check) = (store.clone(), check.clone().with_cost(cost));
                tokio::spawn(async move { store.check(&[check]).await.unwrap()[0] })
            })
            .collect();
        async move {
            let mut decisions = Vec::new();
            for task in tasks {
                decisions.push(task.await.unwrap());
            }
            decisions
        }
    };
    println!("| path | script calls | longest call |");
    println!("|---|---:|---:|");
    log_every_call(&server);
    for d in batch(3 * MILLION / 2).await {
        assert!(!d.admitted() && d.remaining() == MILLION, "{d:?}");
    }
    let (denials, denial_calls) = slowest(&server).await;
    println!(
        "| 32 denials at cost 1,500,000, in one batch | {denial_calls} | {} µs |",
        denials.as_micros()
    );
    log_every_call(&server);
    clock.advance(Duration::from_secs(3600) - Duration::from_millis(500));
    for d in batch(1).await {
        assert!(d.admitted(), "{d:?}");
    }
    let (pruned, prune_calls) = slowest(&server).await;
    println!(
        "| 32 prunes of half a log, in one batch | {prune_calls} | {} µs |",
        pruned.as_micros()
    );
    // The work is shared out over several calls, whatever the timing: a
    // call that took all 32 requests on such logs held Redis 3 to 6 ms.
    assert!(
        denial_calls >= 4,
        "{denial_calls} calls for 32 deep denials"
    );
    assert!(prune_calls >= 8, "{prune_calls} calls for 32 deep prunes");
    let longest = denials.max(pruned);
    println!("longest call: {} µs", longest.as_micros());
    assert!(longest <= BOUND, "a call held Redis for {longest:?}");
}
