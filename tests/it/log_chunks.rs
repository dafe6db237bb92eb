//! A long sliding log in Redis: its sealed pages lie in chunks of 64
//! pages, each a hash Redis frees at once whatever `lazyfree-*` says,
//! each with a TTL that outlives the records it holds; a chunk lost in
//! the middle keeps its units; and a log of the format that kept every
//! page in one hash counts on, then moves to chunks once it empties.

use std::time::Duration;

use crate::support::RedisServer;
use slidegate::deadpool_redis::redis;
use slidegate::{
    Policy,
    clock::FakeClock,
    key::Key,
    store::{Check, Decision, RedisStore, Store},
};

use crate::support::stores::{START, fill};

/// Fields a chunk may hold: 64 pages, the 127 blocks of the tree that
/// start and end in them, and one block a level above the sixth.
const CHUNK_FIELDS: u64 = 64 + 127 + 20;

fn store_on(server: &RedisServer, clock: &FakeClock) -> RedisStore {
    RedisStore::builder(server.pool(2))
        .with_clock(clock.clone())
        .with_timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

async fn one(store: &RedisStore, check: &Check) -> Decision {
    store.check(std::slice::from_ref(check)).await.unwrap()[0]
}

fn number(answer: &str) -> i64 {
    answer
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("not a number: {answer:?}"))
}

/// The chunks of the log at `base`: its keys but the string.
fn chunks(server: &RedisServer, base: &str) -> Vec<String> {
    let mut keys = server.keys_of(base);
    keys.retain(|key| *key != format!("{base}:l"));
    keys
}

/// Every key of a log of 40,000 records (160 pages) holds at most a
/// chunk's fields and bytes, so Redis frees any of them in well under a
/// millisecond (one hash of every page took 8 ms for a million records).
/// Each has a TTL; when a tier with a longer window counts the log, every
/// chunk is kept as long as that window asks; a reset deletes them all.
#[tokio::test]
async fn every_key_of_a_long_log_is_small_and_expires() {
    let server = RedisServer::start();
    let clock = FakeClock::new(START);
    let store = store_on(&server, &clock);
    let short = Policy::new("long", 1_000_000, Duration::from_secs(2));
    let check = Check::new(&short, Key::new("k")).unwrap();
    fill(&store, &clock, &check, 40_000, 1000).await;
    let base = store.base_key(&check);
    let chunks = chunks(&server, &base);
    assert_eq!(chunks.len(), 3, "{chunks:?}");
    for chunk in &chunks {
        let fields = number(&server.cli(&["hlen", chunk]));
        let bytes = number(&server.cli(&["memory", "usage", chunk, "samples", "0"]));
        let ttl = number(&server.cli(&["pttl", chunk]));
        println!("{chunk}: {fields} fields, {bytes} bytes, {ttl} ms to live");
        assert!(fields as u64 <= CHUNK_FIELDS, "{chunk}: {fields} fields");
        assert!(bytes <= 100 * 1024, "{chunk}: {bytes} bytes");
        // Two spans past the newest record, and the minute given to a
        // store told the time, less however long the fill took since.
        assert!((1..=64_100).contains(&ttl), "{chunk}: {ttl} ms");
    }

    let longer = Policy::new("long", 1_000_000, Duration::from_secs(600));
    assert!(
        one(&store, &Check::new(&longer, Key::new("k")).unwrap())
            .await
            .admitted()
    );
    for chunk in &chunks {
        let ttl = number(&server.cli(&["pttl", chunk]));
        assert!(
            ttl >= 1_200_000,
            "{chunk}: {ttl} ms, under two longer spans"
        );
    }

    // A reset deletes every chunk with the string.
    store.reset(std::slice::from_ref(&check)).await.unwrap();
    assert_eq!(server.keys_of(&base), Vec::<String>::new());
}

/// A chunk lost in the middle of a log (Redis evicted it, or something
/// deleted it) takes no units with it: a tier with a shorter window,
/// whose count would read the lost chunk's sums, counts every unit of the
/// sealed pages instead, as recorded just before the tail, and the log's
/// own window keeps its count.
#[tokio::test]
async fn a_chunk_lost_in_the_middle_keeps_its_units() {
    let server = RedisServer::start();
    let clock = FakeClock::new(START);
    let store = store_on(&server, &clock);
    let long = Policy::new("parts", 1_000_000, Duration::from_secs(60));
    let short = Policy::new("parts", 1_000_000, Duration::from_secs(1));
    let check = Check::new(&long, Key::new("k")).unwrap();
    // 400 ms of records, 100 a millisecond: chunks 0 to 2.
    fill(&store, &clock, &check, 40_000, 100).await;
    let base = store.base_key(&check);
    assert_eq!(chunks(&server, &base).len(), 3);
    // The short window now starts 200 ms into the log, in chunk 1.
    clock.set(START + 1_200_000);
    assert_eq!(number(&server.cli(&["del", &format!("{base}:p:1")])), 1);

    let peek = store.peek(std::slice::from_ref(&check)).await.unwrap()[0];
    assert_eq!(peek.remaining(), 1_000_000 - 40_000);
    let decision = one(&store, &Check::new(&short, Key::new("k")).unwrap()).await;
    assert!(decision.admitted(), "{decision:?}");
    assert_eq!(
        decision.remaining(),
        1_000_000 - 40_000 - 1,
        "every unit counts in the short window"
    );
    let peek = store.peek(std::slice::from_ref(&check)).await.unwrap()[0];
    assert_eq!(peek.remaining(), 1_000_000 - 40_000 - 1);
}

/// A log written in the format that kept every sealed page in the one
/// hash of its pages key (version 2) decides as the same log in chunks
/// does, refunds into sealed pages included, writing only to that hash;
/// once it has emptied it starts afresh in chunks, and the hash is gone.
#[tokio::test]
async fn a_log_in_one_hash_counts_on_and_moves_to_chunks() {
    let server = RedisServer::start();
    let clock = FakeClock::new(START);
    let store = store_on(&server, &clock);
    let policy = Policy::new("flat", 1_000_000, Duration::from_secs(10));
    let check = |client: &str| Check::new(&policy, Key::new(client)).unwrap();
    let (flat, twin) = (check("flat"), check("twin"));
    fill(&store, &clock, &flat, 20_000, 100).await;
    let (base, twin_base) = (store.base_key(&flat), store.base_key(&twin));
    server.copy_state(&base, &twin_base);
    // The log in version 2: its chunks' fields in one hash.
    let pages = format!("{base}:p");
    let mut connection = redis::Client::open(server.url())
        .unwrap()
        .get_connection()
        .unwrap();
    for chunk in chunks(&server, &base) {
        let fields: Vec<(Vec<u8>, Vec<u8>)> = redis::cmd("HGETALL")
            .arg(&chunk)
            .query(&mut connection)
            .unwrap();
        let () = redis::cmd("HSET")
            .arg(&pages)
            .arg(fields)
            .query(&mut connection)
            .unwrap();
        server.cli(&["del", &chunk]);
    }
    server.cli(&["pexpire", &pages, "600000"]);
    server.cli(&["setrange", &format!("{base}:l"), "0", "\x02"]);

    let mut recorded = Vec::new();
    for step in 0..3_000u32 {
        clock.advance(Duration::from_micros(700));
        let cost = [1, 1, 3, 300][step as usize % 4];
        let of_flat = one(&store, &flat.clone().with_cost(cost)).await;
        let of_twin = one(&store, &twin.clone().with_cost(cost)).await;
        assert_eq!(of_flat, of_twin, "step {step}");
        if let Some(at) = of_flat.recorded_at() {
            recorded.push(at);
        }
        if step % 40 == 39 {
            // A request of some pages back.
            let at = [recorded.swap_remove(recorded.len() / 3)];
            store
                .refund(std::slice::from_ref(&flat), &at)
                .await
                .unwrap();
            store
                .refund(std::slice::from_ref(&twin), &at)
                .await
                .unwrap();
        }
    }
    assert_eq!(
        server.keys_of(&base),
        [format!("{base}:l"), pages.clone()],
        "written in one hash"
    );
    let version = |base: &str| server.cli(&["getrange", &format!("{base}:l"), "0", "0"]);
    assert_eq!(version(&base).trim().as_bytes(), [2]);

    // Past the window, the log empties and starts afresh.
    clock.advance(Duration::from_secs(11));
    for _ in 0..1_000 {
        clock.advance(Duration::from_micros(100));
        assert_eq!(one(&store, &flat).await, one(&store, &twin).await);
    }
    assert_eq!(version(&base).trim().as_bytes(), [3]);
    assert_eq!(number(&server.cli(&["exists", &pages])), 0);
    assert_eq!(
        store.peek(std::slice::from_ref(&flat)).await.unwrap(),
        store.peek(std::slice::from_ref(&twin)).await.unwrap()
    );
    assert_eq!(chunks(&server, &base), [format!("{base}:p:0")]);
}
