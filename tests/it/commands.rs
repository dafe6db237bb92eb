//! The Redis commands a request costs inside the script, as Redis counts
//! them (`INFO commandstats`): a figure no busy machine blurs, held to the
//! request path's bars. A sliding log of 100 records and one of 5,000
//! (its older pages sealed into chunks), a token bucket, and a batch of
//! eight requests on one log. The figures are printed; BENCHMARKS.md
//! quotes them.

use std::sync::Arc;
use std::time::Duration;

use crate::support::RedisServer;
use crate::support::stores::{START, fill, in_one_batch};
use slidegate::{
    Policy,
    clock::FakeClock,
    key::Key,
    policy::Algorithm,
    store::{Check, RedisStore, Store},
};

/// Requests measured one after the other, each alone.
const ALONE: u64 = 20;

/// A store on Redis's own clock, as in production: each call reads
/// `TIME`, which counts as one of its commands.
fn store_on(server: &RedisServer) -> Arc<RedisStore> {
    Arc::new(
        RedisStore::builder(server.pool(2))
            .with_timeout(Duration::from_secs(30))
            .build()
            .unwrap(),
    )
}

/// The commands the script ran per request for `ALONE` requests of
/// `check`, one after the other.
async fn per_request_alone(server: &RedisServer, store: &RedisStore, check: &Check) -> f64 {
    server.cli(&["config", "resetstat"]);
    for _ in 0..ALONE {
        let decision = store.check(std::slice::from_ref(check)).await.unwrap()[0];
        assert!(decision.admitted(), "{decision:?}");
    }
    let (calls, commands) = server.script_work();
    assert_eq!(calls, ALONE, "one call each");
    commands as f64 / ALONE as f64
}

#[tokio::test(flavor = "current_thread")]
async fn a_request_runs_few_redis_commands() {
    let server = RedisServer::start();
    let store = store_on(&server);
    // `fill` moves a clock the store does not read: its records are at
    // Redis's time.
    let clock = FakeClock::new(START);
    let hour = Policy::new("hour", 1_000_000, Duration::from_secs(3600));
    let bucket = Policy::new("bucket", 1_000_000, Duration::from_secs(3600))
        .with_algorithm(Algorithm::TokenBucket);
    let small = Check::new(&hour, Key::new("small")).unwrap();
    let large = Check::new(&hour, Key::new("large")).unwrap();
    let batched = Check::new(&hour, Key::new("batched")).unwrap();
    fill(&store, &clock, &small, 100, 100).await;
    fill(&store, &clock, &large, 5_000, 1_000).await;
    fill(&store, &clock, &batched, 100, 100).await;
    // The first request of the bucket creates it.
    store
        .check(&[Check::new(&bucket, Key::new("bucket")).unwrap()])
        .await
        .unwrap();

    let small_log = per_request_alone(&server, &store, &small).await;
    let large_log = per_request_alone(&server, &store, &large).await;
    let bucket = Check::new(&bucket, Key::new("bucket")).unwrap();
    let bucket = per_request_alone(&server, &store, &bucket).await;

    // A batch of eight on one log, less what its lead check (alone, on a
    // log of its own) costs.
    server.cli(&["config", "resetstat"]);
    in_one_batch(&store, Vec::new()).await;
    let (_, lead) = server.script_work();
    server.cli(&["config", "resetstat"]);
    let answers = in_one_batch(&store, vec![vec![batched.clone()]; 8]).await;
    assert!(answers.iter().all(|a| a.as_ref().unwrap()[0].admitted()));
    let (calls, commands) = server.script_work();
    assert_eq!(calls, 2, "the lead, then one batch");
    let batch = (commands - lead) as f64 / 8.0;

    println!("| Redis commands per request | count | bar |");
    println!("|---|---:|---:|");
    for (name, count, bar) in [
        ("sliding log of 100 records", small_log, 5.0),
        ("sliding log of 5,000 records", large_log, 6.0),
        ("token bucket", bucket, 5.0),
        ("a batch of 8 on one log of 100 records", batch, 2.0),
    ] {
        println!("| {name} | {count:.2} | ≤ {bar} |");
        assert!(count <= bar, "{name}: {count:.2} commands a request");
    }
}
