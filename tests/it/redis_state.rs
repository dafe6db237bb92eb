//! What a `RedisStore` keeps in Redis: how many bytes a sliding log takes
//! per request, that a log shrinks back when its client calms down, and
//! what Redis evicting counts (`allkeys-lru`) does to a client.

use std::time::Duration;

use crate::support::RedisServer;
use slidegate::{
    Policy,
    clock::{Clock, FakeClock},
    key::Key,
    store::{Check, RedisStore, Store},
};

use crate::support::stores::{START, fill, in_one_batch};

fn store_on(server: &RedisServer, clock: &FakeClock) -> RedisStore {
    RedisStore::builder(server.pool(2))
        .with_clock(clock.clone())
        .with_timeout(Duration::from_secs(5))
        .build()
        .unwrap()
}

fn memory_usage(server: &RedisServer, key: &str) -> u64 {
    let answer = server.cli(&["memory", "usage", key, "samples", "0"]);
    answer
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("no key {key}: {answer:?}"))
}

/// Spends `requests` single units of `policy` for `client`, one
/// millisecond apart, each admitted.
async fn spend(
    store: &RedisStore,
    clock: &FakeClock,
    policy: &Policy,
    client: &str,
    requests: u32,
) {
    let check = [Check::new(policy, Key::new(client)).unwrap()];
    for _ in 0..requests {
        clock.advance(Duration::from_millis(1));
        let decision = store.check(&check).await.unwrap()[0];
        assert!(decision.admitted(), "{client}: {decision:?}");
    }
}

/// Redis memory of every key `check`'s log has (`MEMORY USAGE`, all of
/// Redis's own overhead included), and how many keys.
fn log_bytes(server: &RedisServer, store: &RedisStore, check: &Check) -> (u64, usize) {
    let base = store.base_key(check);
    let keys = server.keys_of(&base);
    for key in &keys {
        let chunk = key.strip_prefix(&format!("{base}:p:"));
        assert!(
            *key == format!("{base}:l") || chunk.is_some_and(|n| n.parse::<u64>().is_ok()),
            "a key of another kind: {key}"
        );
    }
    (
        keys.iter().map(|key| memory_usage(server, key)).sum(),
        keys.len(),
    )
}

/// A client at its limit takes at most 8 bytes of Redis memory per
/// request from a limit of 1,000 up, with a window of a minute or of an
/// hour, and at most 16 with costs of all sizes.
#[tokio::test]
async fn a_full_sliding_log_takes_at_most_8_bytes_per_request() {
    let server = RedisServer::start();
    let clock = FakeClock::new(START);
    let store = store_on(&server, &clock);
    for window_s in [60, 3600] {
        for limit in [10u32, 100, 1_000, 10_000] {
            let name = format!("bytes-{window_s}s-{limit}");
            let policy = Policy::new(name.as_str(), limit, Duration::from_secs(window_s));
            spend(&store, &clock, &policy, "full", limit).await;
            let check = Check::new(&policy, Key::new("full")).unwrap();
            let (bytes, keys) = log_bytes(&server, &store, &check);
            let per_request = bytes as f64 / f64::from(limit);
            println!(
                "window {window_s} s, limit {limit}: {keys} keys, {bytes} bytes, {per_request:.1} per request"
            );
            if limit >= 1_000 {
                assert!(per_request <= 8.0, "{name}: {bytes} bytes");
            }
        }
    }
    // Costs from 1 to 65,536, as a client may choose them.
    let policy = Policy::new("mixed", 1_000_000_000, Duration::from_secs(3600));
    let mut check = Check::new(&policy, Key::new("mixed")).unwrap();
    let requests = 10_000;
    for n in 0..requests {
        clock.advance(Duration::from_millis(1));
        check = check.with_cost([1, 7, 300, 65_536][n % 4]);
        assert!(store.check(std::slice::from_ref(&check)).await.unwrap()[0].admitted());
    }
    let (bytes, _) = log_bytes(&server, &store, &check);
    let per_request = bytes as f64 / requests as f64;
    println!("mixed costs: {bytes} bytes, {per_request:.1} per request");
    assert!(per_request <= 16.0, "mixed costs: {bytes} bytes");
}

/// A burst grows a log to many pages; once the burst has left the window,
/// its pages are deleted a few per call, and the log is soon as small as
/// a new one again.
#[tokio::test]
async fn a_log_shrinks_back_after_a_burst() {
    let server = RedisServer::start();
    let clock = FakeClock::new(START);
    let store = store_on(&server, &clock);
    let policy = Policy::new("burst", 10_000, Duration::from_secs(10));
    let check = Check::new(&policy, Key::new("bursty")).unwrap();
    spend(&store, &clock, &policy, "bursty", 1).await;
    let calm = log_bytes(&server, &store, &check);
    spend(&store, &clock, &policy, "bursty", 5_000).await;
    let burst = log_bytes(&server, &store, &check);
    clock.advance(Duration::from_secs(10));
    // 20 pages (numbered up to 32, the tree's block), 8 deleted by each
    // call.
    spend(&store, &clock, &policy, "bursty", 4).await;
    assert!(
        burst.0 > 10 * calm.0 && burst.1 == 2,
        "a burst of 5,000 took {burst:?}"
    );
    let (after, keys) = log_bytes(&server, &store, &check);
    assert_eq!(keys, 1, "the pages are gone");
    // A few records more than the calm log, in a string that has grown.
    assert!(
        after <= 2 * calm.0,
        "the log kept {after} bytes after the burst, against {calm:?}"
    );
}

/// Under `allkeys-lru` Redis evicts whole logs, never half of one: a
/// client whose log was evicted starts afresh with its full limit, and
/// no denial ever says to retry at once.
#[tokio::test]
async fn an_evicted_log_starts_afresh_and_never_sticks() {
    let server =
        RedisServer::start_with(&["--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru"]);
    let clock = FakeClock::new(START);
    let store = store_on(&server, &clock);
    let policy = Policy::new("lru", 5, Duration::from_secs(60));
    let victim = Check::new(&policy, Key::new("victim")).unwrap();
    let key = format!("{}:l", store.base_key(&victim));
    spend(&store, &clock, &policy, "victim", 5).await;

    // New clients, 100 to a call, until Redis has evicted the victim.
    let mut flooded = 0;
    while server.cli(&["exists", &key]).trim() == "1" {
        assert!(flooded < 200_000, "the victim was never evicted");
        let checks: Vec<Check> = (flooded..flooded + 100)
            .map(|n| Check::new(&policy, Key::new(format!("flood-{n}"))).unwrap())
            .collect();
        let decisions = store.check(&checks).await.unwrap();
        assert!(decisions.iter().all(|d| d.admitted()));
        flooded += 100;
    }

    let mut admitted = 0;
    for _ in 0..8 {
        let decision = store.check(std::slice::from_ref(&victim)).await.unwrap()[0];
        if decision.admitted() {
            admitted += 1;
        } else {
            let retry = decision.retry_after().expect("a denial has a retry time");
            assert!(retry > Duration::ZERO, "{decision:?}");
        }
    }
    assert_eq!(admitted, 5, "after eviction the victim's limit is its own");
}

/// The script runs as a function, loaded once; where an ACL refuses
/// functions, the same script runs by `EVALSHA` and decides the same.
#[tokio::test]
async fn a_redis_that_refuses_functions_still_decides_exactly() {
    let server = RedisServer::start();
    let clock = FakeClock::new(START);
    let policy = Policy::new("acl", 3, Duration::from_secs(60));

    let store = store_on(&server, &clock);
    spend(&store, &clock, &policy, "with-functions", 3).await;
    assert!(
        server
            .cli(&["function", "list"])
            .contains("slidegate_check_"),
        "the library was not loaded"
    );
    server.cli(&["function", "flush"]);

    let pool = server.pool_refusing_functions();
    let store = RedisStore::builder(pool)
        .with_clock(clock.clone())
        .with_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    spend(&store, &clock, &policy, "without", 3).await;
    let denied = store
        .check(&[Check::new(&policy, Key::new("without")).unwrap()])
        .await
        .unwrap()[0];
    assert!(!denied.admitted(), "{denied:?}");
    assert_eq!(
        denied.retry_after(),
        Some(Duration::from_millis(60_000 - 2))
    );
    assert_eq!(server.cli(&["function", "list"]).trim(), "");
}

/// A log key holding anything but a log this script wrote (a future
/// format, foreign bytes) is an error, for the policy's fail mode to
/// decide: never read as an empty log.
#[tokio::test]
async fn a_log_key_holding_foreign_bytes_is_an_error_not_an_empty_log() {
    let server = RedisServer::start();
    let clock = FakeClock::new(START);
    let store = store_on(&server, &clock);
    let policy = Policy::new("foreign", 5, Duration::from_secs(60));
    let check = [Check::new(&policy, Key::new("victim")).unwrap()];
    let key = format!("{}:l", store.base_key(&check[0]));
    for foreign in ["short", &format!("\u{2}{}", "x".repeat(60))] {
        server.cli(&["set", &key, foreign]);
        let answer = store.check(&check).await;
        assert!(answer.is_err(), "{foreign:?} was read as {answer:?}");
    }
}

/// A client whose window grows (its tier changed to one with a longer
/// window) and who is denied there keeps its key alive for as long as the
/// longer window counts it: the denial moves the TTL, for every algorithm.
#[tokio::test]
async fn a_longer_window_keeps_a_denied_clients_key_alive() {
    use slidegate::policy::Algorithm;

    let server = RedisServer::start();
    let clock = FakeClock::new(START);
    let store = store_on(&server, &clock);
    for (algorithm, suffix) in [
        (Algorithm::SlidingLog, "l"),
        (Algorithm::SlidingCounter, "c"),
        (Algorithm::FixedWindow, "f"),
    ] {
        let name = format!("grown-{suffix}");
        let minute =
            Policy::new(name.as_str(), 3, Duration::from_secs(60)).with_algorithm(algorithm);
        let hour =
            Policy::new(name.as_str(), 3, Duration::from_secs(3600)).with_algorithm(algorithm);
        spend(&store, &clock, &minute, "grower", 3).await;
        let check = Check::new(&hour, Key::new("grower")).unwrap();
        let key = format!("{}:{suffix}", store.base_key(&check));
        let minute_ttl: u64 = server.cli(&["pttl", &key]).trim().parse().unwrap();
        // Two minutes and the injected clock's grace of one.
        assert!(minute_ttl <= 180_001, "{algorithm:?}: {minute_ttl} ms");

        let denied = store.check(std::slice::from_ref(&check)).await.unwrap()[0];
        assert!(!denied.admitted(), "{algorithm:?}: {denied:?}");
        let hour_ttl: u64 = server.cli(&["pttl", &key]).trim().parse().unwrap();
        // At least as long as the denial says the count is held.
        let held = denied.retry_after().unwrap().as_millis() as u64;
        assert!(held > 180_000, "{algorithm:?}: held {held} ms");
        assert!(
            hour_ttl >= held,
            "{algorithm:?}: TTL {hour_ttl} ms < {held} ms"
        );
    }
}

/// A request that fails writes nothing, alone or inside a batch: its
/// first policy's log, which it would have pruned, is left as it was,
/// byte for byte, and the other requests of the batch are decided. It
/// fails while it reads: a counter's key of another type, or a log whose
/// page has gone (found only when its denial looks for a retry time, after
/// the first policy was prepared).
#[tokio::test(flavor = "current_thread")]
async fn a_failing_request_writes_nothing_alone_or_in_a_batch() {
    let server = RedisServer::start();
    let clock = FakeClock::new(START);
    let store = std::sync::Arc::new(store_on(&server, &clock));
    let log = Policy::new("pruned", 5, Duration::from_secs(10));
    let counter = Policy::new("broken", 5, Duration::from_secs(10))
        .with_algorithm(slidegate::policy::Algorithm::SlidingCounter);
    let paged = Policy::new("paged", 1_000, Duration::from_secs(60));
    // Two records, then a window later: the next check would prune them.
    spend(&store, &clock, &log, "k", 2).await;
    spend(&store, &clock, &paged, "k", 300).await;
    clock.advance(Duration::from_secs(11));
    let pruned = Check::new(&log, Key::new("k")).unwrap();
    let broken = Check::new(&counter, Key::new("k")).unwrap();
    let mut lost = Check::new(&paged, Key::new("k")).unwrap();
    lost = lost.with_cost(paged.limit());
    server.cli(&[
        "set",
        &format!("{}:c", store.base_key(&broken)),
        "not a hash",
    ]);
    server.cli(&["hdel", &format!("{}:p:0", store.base_key(&lost)), "0"]);
    let log_key = format!("{}:l", store.base_key(&pruned));
    let before = server.cli(&["--no-raw", "get", &log_key]);

    for failing in [vec![pruned.clone(), broken], vec![pruned.clone(), lost]] {
        assert!(store.check(&failing).await.is_err(), "alone");
        assert_eq!(server.cli(&["--no-raw", "get", &log_key]), before);

        let tasks: Vec<_> = (0..5)
            .map(|i| {
                let store = store.clone();
                let checks = if i == 2 {
                    failing.clone()
                } else {
                    vec![Check::new(&log, Key::new(format!("fine{i}"))).unwrap()]
                };
                tokio::spawn(async move { store.check(&checks).await })
            })
            .collect();
        for (i, task) in tasks.into_iter().enumerate() {
            let answer = task.await.unwrap();
            assert_eq!(answer.is_err(), i == 2, "request {i}: {answer:?}");
        }
        assert_eq!(
            server.cli(&["--no-raw", "get", &log_key]),
            before,
            "in a batch"
        );
    }
}

/// A request that fails inside a batch leaves a log that an earlier
/// request of the batch wrote as that request left it: the failing
/// request's own policy (a tier's shorter window, on the same key) would
/// gather the log, whose clock stepped back, and its second policy's key
/// holds another type. The log ends byte for byte as its twin, given the
/// earlier request alone.
#[tokio::test(flavor = "current_thread")]
async fn a_failing_request_leaves_the_log_its_batch_shares_as_it_was() {
    let server = RedisServer::start();
    let clock = FakeClock::new(START);
    let store = std::sync::Arc::new(store_on(&server, &clock));
    let long = Policy::new("shared", 10_000, Duration::from_secs(100));
    let short = Policy::new("shared", 10_000, Duration::from_secs(1));
    let counter = Policy::new("broken", 5, Duration::from_secs(10))
        .with_algorithm(slidegate::policy::Algorithm::SlidingCounter);
    // Three pages of records, copied whole to the twin.
    spend(&store, &clock, &long, "k", 600).await;
    let check = |policy: &Policy, client: &str| Check::new(policy, Key::new(client)).unwrap();
    let base = store.base_key(&check(&long, "k"));
    let twin = store.base_key(&check(&long, "twin"));
    server.copy_state(&base, &twin);
    let broken = check(&counter, "k");
    server.cli(&[
        "set",
        &format!("{}:c", store.base_key(&broken)),
        "not a hash",
    ]);
    // 70 s before the newest record: more than the short window and the
    // longest delay, less than the long window and it.
    clock.set(START + 600_000 - 70_000_000);

    let batch = vec![vec![check(&long, "k")], vec![check(&short, "k"), broken]];
    let [first, failing]: [_; 2] = in_one_batch(&store, batch).await.try_into().unwrap();
    assert!(first.unwrap()[0].admitted());
    assert!(failing.is_err());
    assert!(store.check(&[check(&long, "twin")]).await.unwrap()[0].admitted());

    let mut connection = slidegate::deadpool_redis::redis::Client::open(server.url())
        .unwrap()
        .get_connection()
        .unwrap();
    // The header, and each chunk's fields under its suffix.
    type Pages = std::collections::BTreeMap<(String, Vec<u8>), Vec<u8>>;
    let mut state = |base: &str| -> (Vec<u8>, Pages) {
        let header: Vec<u8> = slidegate::deadpool_redis::redis::cmd("GET")
            .arg(format!("{base}:l"))
            .query(&mut connection)
            .unwrap();
        let mut pages = Pages::new();
        for chunk in server.keys_of(&format!("{base}:p")) {
            let fields: std::collections::BTreeMap<Vec<u8>, Vec<u8>> =
                slidegate::deadpool_redis::redis::cmd("HGETALL")
                    .arg(&chunk)
                    .query(&mut connection)
                    .unwrap();
            let suffix = chunk[base.len()..].to_owned();
            pages.extend(fields.into_iter().map(|(f, v)| ((suffix.clone(), f), v)));
        }
        (header, pages)
    };
    let (log, pages) = state(&base);
    assert!(!pages.is_empty(), "the log has pages");
    assert_eq!((log, pages), state(&twin));
}

/// Under an `allkeys-*` or `volatile-*` policy Redis may evict a log's
/// chunk of pages apart from its newest page (a chunk goes idle while
/// every request of a client below its limit touches only the string), or
/// the other way round. Without its pages, the log keeps their units, as if
/// recorded as late as they can have been: the client is never admitted
/// past its limit. Without its string, which holds the count, the log
/// starts afresh, as one evicted whole does, and never with sums of
/// pages that are gone.
#[tokio::test]
async fn a_log_that_loses_its_pages_keeps_their_units() {
    let server = RedisServer::start();
    let clock = FakeClock::new(START);
    let store = store_on(&server, &clock);
    let policy = Policy::new("parts", 1_000, Duration::from_secs(60));
    let check = Check::new(&policy, Key::new("k")).unwrap();
    let base = store.base_key(&check);

    // 700 records a millisecond apart: two sealed pages of 250, and 200
    // in the string's tail, from record 501 (at 500 ms) on.
    let first = clock.now_micros() + 1_000;
    spend(&store, &clock, &policy, "k", 700).await;
    assert_eq!(server.cli(&["del", &format!("{base}:p:0")]).trim(), "1");
    let peek = store.peek(std::slice::from_ref(&check)).await.unwrap()[0];
    assert_eq!(
        peek.remaining(),
        300,
        "the lost pages' 500 units still count"
    );
    spend(&store, &clock, &policy, "k", 300).await;
    let denied = store.check(std::slice::from_ref(&check)).await.unwrap()[0];
    assert!(!denied.admitted());
    // The 500 leave a window after the tail's first record, less 1 µs.
    let gathered_at = first + 500_000 - 1;
    let retry = gathered_at + 60_000_000 - clock.now_micros();
    assert_eq!(denied.retry_after(), Some(Duration::from_micros(retry)));
    // Once they have left, the tail's records count as they did.
    clock.set(gathered_at + 60_000_000);
    let peek = store.peek(std::slice::from_ref(&check)).await.unwrap()[0];
    assert_eq!(peek.remaining(), 500);

    server.cli(&["flushall"]);
    spend(&store, &clock, &policy, "k", 700).await;
    server.cli(&["del", &format!("{base}:l")]);
    // A fresh log: a full limit, and (past a page of its own) sums that
    // count only its own requests.
    spend(&store, &clock, &policy, "k", 600).await;
    let peek = store.peek(std::slice::from_ref(&check)).await.unwrap()[0];
    assert_eq!(peek.remaining(), 400, "after losing :l");
    let mut full = check.clone();
    full = full.with_cost(400);
    assert!(store.check(std::slice::from_ref(&full)).await.unwrap()[0].admitted());
    let denied = store.check(std::slice::from_ref(&check)).await.unwrap()[0];
    assert!(!denied.admitted());
    // The first of the fresh requests leaves first.
    assert_eq!(
        denied.retry_after(),
        Some(Duration::from_millis(60_000 - 599))
    );
}

/// Sends `requests` requests of `checks`, a millisecond apart: the first
/// `fit` are admitted, and every one after fails, its log's tail full and
/// the pages key its seal would write of another type.
async fn admitted_until_a_seal(
    store: &RedisStore,
    clock: &FakeClock,
    checks: &[Check],
    fit: usize,
    requests: usize,
) {
    for n in 0..requests {
        clock.advance(Duration::from_millis(1));
        let answer = store.check(checks).await;
        if n < fit {
            assert!(answer.unwrap()[0].admitted(), "request {n}");
        } else {
            let error = answer.expect_err("the seal would write a foreign key");
            assert!(error.to_string().contains("WRONGTYPE"), "{error}");
        }
    }
}

/// A log whose pages key holds another type fails a request before it
/// writes anything, once the request would write a page (its tail full,
/// to be sealed): its other policy's count stays as it was, where the
/// counter's write once ran before the log's page failed. Until then no
/// request writes a page, and none reads its type.
#[tokio::test]
async fn a_foreign_pages_key_fails_a_request_before_it_writes() {
    let server = RedisServer::start();
    let clock = FakeClock::new(START);
    let store = store_on(&server, &clock);
    let counter = Policy::new("counted", 1_000, Duration::from_secs(60))
        .with_algorithm(slidegate::policy::Algorithm::SlidingCounter);
    let log = Policy::new("logged", 1_000, Duration::from_secs(60));
    let checks = [
        Check::new(&counter, Key::new("k")).unwrap(),
        Check::new(&log, Key::new("k")).unwrap(),
    ];
    for _ in 0..5 {
        clock.advance(Duration::from_millis(1));
        assert!(store.check(&checks).await.unwrap()[0].admitted());
    }
    let pages = format!("{}:p:0", store.base_key(&checks[1]));
    server.cli(&["set", &pages, "not a hash"]);
    // Admitted while the tail has room; a page of four-byte records holds
    // 250, so the 251st request would seal it.
    admitted_until_a_seal(&store, &clock, &checks, 245, 300).await;
    let peek = store.peek(&checks[..1]).await.unwrap()[0];
    assert_eq!(
        peek.remaining(),
        1_000 - 250,
        "nothing counted by the failed requests"
    );
    assert_eq!(server.cli(&["get", &pages]).trim(), "not a hash");
}

/// A seal writes the sums of the tree's blocks into older chunks than
/// the tail's: one of those of another type fails the request before any
/// of its policies has written, where the counter's count once stayed
/// behind a request that then failed (and a batch sent it again alone:
/// counted twice).
#[tokio::test]
async fn a_foreign_older_chunk_fails_a_seal_before_any_policy_writes() {
    let server = RedisServer::start();
    let clock = FakeClock::new(START);
    let store = store_on(&server, &clock);
    let counter = Policy::new("counted", 1_000, Duration::from_secs(3600))
        .with_algorithm(slidegate::policy::Algorithm::SlidingCounter);
    let log = Policy::new("deep", 100_000, Duration::from_secs(3600));
    let checks = [
        Check::new(&counter, Key::new("k")).unwrap(),
        Check::new(&log, Key::new("k")).unwrap(),
    ];
    // 64 pages of 250 records fill chunk 0; the tail is page 64, in
    // chunk 1, with 100 records.
    fill(&store, &clock, &checks[1], 16_100, 700).await;
    let chunk = format!("{}:p:0", store.base_key(&checks[1]));
    assert_eq!(server.cli(&["type", &chunk]).trim(), "hash");
    server.cli(&["del", &chunk]);
    server.cli(&["set", &chunk, "not a hash"]);
    admitted_until_a_seal(&store, &clock, &checks, 150, 200).await;
    let peek = store.peek(&checks[..1]).await.unwrap()[0];
    assert_eq!(
        peek.remaining(),
        1_000 - 150,
        "nothing counted by the failed requests"
    );
}

/// A log whose page numbers reach 2^32 (written by the format that kept
/// them in 4 bytes, which it would have wrapped) is read, rewritten in
/// the current format, and keeps counting exactly past 2^32: admissions,
/// a refund in a page numbered past it, and records leaving the window.
#[tokio::test]
async fn page_numbers_carry_on_past_two_to_the_thirty_second() {
    use deadpool_redis::redis;
    const NEAR: u64 = (1 << 32) - 3;
    let server = RedisServer::start();
    let clock = FakeClock::new(START);
    let store = store_on(&server, &clock);
    let window = Duration::from_secs(60);
    let policy = Policy::new("wrap", 3000, window);
    // The old format: one record at START, in a tail numbered NEAR.
    let mut header = vec![1u8, 4, 0, 0];
    header.extend_from_slice(&(NEAR as u32).to_be_bytes());
    header.extend_from_slice(&(NEAR as u32).to_be_bytes());
    header.extend_from_slice(&0u16.to_be_bytes());
    header.extend_from_slice(&(NEAR as u32).to_be_bytes());
    header.extend_from_slice(&1u16.to_be_bytes());
    let span = window.as_micros() as u64;
    for field in [START, 1, 1, START, START, START + 2 * span, span] {
        header.extend_from_slice(&field.to_be_bytes());
    }
    assert_eq!(header.len(), 76);
    header.extend_from_slice(&0u32.to_be_bytes());
    let mut connection = server.pool(1).get().await.unwrap();
    let _: () = redis::cmd("SET")
        .arg("slidegate:wrap:{user:k}:l")
        .arg(header)
        .query_async(&mut connection)
        .await
        .unwrap();

    let check = [Check::new(&policy, Key::new("k")).unwrap()];
    let mut recorded = Vec::new();
    for i in 1..2000u64 {
        clock.advance(Duration::from_micros(1));
        let d = store.check(&check).await.unwrap()[0];
        assert!(d.admitted(), "request {i}: {d:?}");
        assert_eq!(d.remaining(), 3000 - 1 - i as u32, "request {i}");
        recorded.push(d.recorded_at().unwrap());
    }
    let version = server.cli(&["getrange", "slidegate:wrap:{user:k}:l", "0", "0"]);
    assert_eq!(
        version.trim().as_bytes(),
        [2],
        "rewritten in the current format"
    );
    let pages = server.cli(&["hkeys", "slidegate:wrap:{user:k}:p"]);
    assert!(pages.lines().any(|page| page == "4294967297"), "{pages}");
    // Request 1500 sits in a page numbered past 2^32.
    store.refund(&check, &recorded[1499..1500]).await.unwrap();
    assert_eq!(store.peek(&check).await.unwrap()[0].remaining(), 1001);
    // Records at START + 0..=1000 µs leave; 998 stay (1500 refunded).
    clock.set(START + span + 1000);
    assert_eq!(store.peek(&check).await.unwrap()[0].remaining(), 3000 - 998);
}

/// A key of another type where the library expects its own fails the
/// request with Redis's error and the place in `lua/` it comes from: the
/// file, the line and the Lua function, alone or inside a batch (which
/// sends the failed request again alone, for Redis to say where).
#[tokio::test(flavor = "current_thread")]
async fn an_error_names_the_library_file_and_function_it_comes_from() {
    let server = RedisServer::start();
    let clock = FakeClock::new(START);
    let store = std::sync::Arc::new(store_on(&server, &clock));
    let counter = Policy::new("broken", 5, Duration::from_secs(10))
        .with_algorithm(slidegate::policy::Algorithm::SlidingCounter);
    let log = Policy::new("paged", 1_000, Duration::from_secs(10));
    let broken = Check::new(&counter, Key::new("k")).unwrap();
    let paged = Check::new(&log, Key::new("k")).unwrap();
    // A full tail: the next request would seal it into the pages' key.
    fill(&store, &clock, &paged, 250, 250).await;
    server.cli(&["set", &format!("{}:c", store.base_key(&broken)), "x"]);
    server.cli(&["set", &format!("{}:p:0", store.base_key(&paged)), "x"]);

    for (check, place) in [(broken, "(lua/shared.lua:"), (paged, "(lua/log.lua:")] {
        let function = if place.contains("shared") {
            ", in hash_fields)"
        } else {
            ", in log_check_writes)"
        };
        let error = store.check(std::slice::from_ref(&check)).await.unwrap_err();
        let message = error.to_string();
        assert!(message.contains("WRONGTYPE"), "{message}");
        assert!(message.contains(place), "alone: {message}");
        assert!(message.contains(function), "alone: {message}");

        let tasks: Vec<_> = (0..4)
            .map(|i| {
                let store = store.clone();
                let checks = if i == 1 {
                    vec![check.clone()]
                } else {
                    vec![Check::new(&log, Key::new(format!("fine{i}"))).unwrap()]
                };
                tokio::spawn(async move { store.check(&checks).await })
            })
            .collect();
        for (i, task) in tasks.into_iter().enumerate() {
            match task.await.unwrap() {
                Err(error) if i == 1 => {
                    let message = error.to_string();
                    assert!(message.contains(place), "in a batch: {message}");
                    assert!(message.contains(function), "in a batch: {message}");
                }
                Ok(decisions) if i != 1 => assert!(decisions[0].admitted()),
                other => panic!("request {i}: {other:?}"),
            }
        }
    }
}
