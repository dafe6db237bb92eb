//! `RedisStore` on a real local Redis Cluster (three primaries, three
//! replicas): every algorithm, requests of several policies in one slot,
//! exactness under concurrency, requests across slots all or nothing, and
//! slot migration.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use crate::support::RedisCluster;
use slidegate::{
    Policy,
    clock::FakeClock,
    key::Key,
    policy::Algorithm,
    store::{Check, Decisions, RedisStore, Store, StoreError},
};

use crate::support::stores::{START, all_at_once, fill};
const MINUTE: Duration = Duration::from_secs(60);

fn store(cluster: &RedisCluster, clock: &FakeClock) -> RedisStore {
    RedisStore::builder(cluster.pool(4))
        .with_clock(clock.clone())
        .with_timeout(Duration::from_secs(5))
        .build()
        .unwrap()
}

async fn check(store: &RedisStore, policies: &[&Policy], key: &str) -> Decisions {
    let checks = policies
        .iter()
        .map(|p| Check::new(p, Key::new(key)).unwrap())
        .collect::<Vec<_>>();
    store.check(&checks).await.expect("the cluster answers")
}

fn slot(cluster: &RedisCluster, key: &str) -> String {
    cluster.nodes()[0].cli(&["cluster", "keyslot", key])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_algorithm_and_mixed_batches_work_on_a_cluster() {
    let cluster = RedisCluster::start();
    let clock = FakeClock::new(START);
    let store = store(&cluster, &clock);
    let log = Policy::new("c-log", 5, MINUTE);
    let counter = Policy::new("c-counter", 4, MINUTE).with_algorithm(Algorithm::SlidingCounter);
    let fixed = Policy::new("c-fixed", 3, MINUTE).with_algorithm(Algorithm::FixedWindow);

    // Many clients, so their keys spread over every primary.
    for client in 0..30 {
        let key = format!("client-{client}");
        for _ in 0..3 {
            let d = check(&store, &[&log, &counter, &fixed], &key).await;
            assert!(d.iter().all(|d| d.admitted()), "{key}: {d:?}");
        }
        // The fixed window is spent: the request is denied as a whole.
        let denied = check(&store, &[&log, &counter, &fixed], &key).await;
        assert!(denied.iter().all(|d| !d.admitted()));
        assert!(denied[2].retry_after().is_some());
        assert_eq!((denied[0].remaining(), denied[1].remaining()), (2, 1));
        // Each policy alone keeps exact counts.
        assert_eq!(check(&store, &[&log], &key).await[0].remaining(), 1);
        assert_eq!(check(&store, &[&counter], &key).await[0].remaining(), 0);
        assert!(!check(&store, &[&counter], &key).await[0].admitted());
    }

    // Every key of one client is on one primary, in one slot; the clients
    // spread over all three primaries; every key has a TTL.
    let keys = cluster.keys_by_primary();
    assert_eq!(keys.len(), 30 * 3, "log, counter, fixed per client");
    let mut primaries = HashSet::new();
    for client in 0..30 {
        let tag = format!("{{user:client-{client}}}");
        let mine: Vec<&(String, &crate::support::RedisServer)> =
            keys.iter().filter(|(k, _)| k.contains(&tag)).collect();
        assert_eq!(mine.len(), 3, "{mine:?}");
        let slots: HashSet<String> = mine.iter().map(|(k, _)| slot(&cluster, k)).collect();
        assert_eq!(slots.len(), 1, "{tag} spans slots {slots:?}");
        let nodes: HashSet<u16> = mine.iter().map(|(_, node)| node.port()).collect();
        assert_eq!(nodes.len(), 1);
        primaries.extend(nodes);
        for (key, node) in mine {
            let ttl: i64 = node.cli(&["pttl", key]).trim().parse().unwrap();
            assert!(ttl > 0, "{key} has no TTL");
        }
    }
    assert_eq!(primaries.len(), 3, "30 clients land on all three primaries");
}

/// A log long enough for two chunks of sealed pages keeps them in its
/// client's slot (the script reaches them by name, beside the keys it is
/// given), counts exactly, and gives each a TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_log_keeps_its_chunks_in_its_slot() {
    let cluster = RedisCluster::start();
    let clock = FakeClock::new(START);
    let store = store(&cluster, &clock);
    let long = Policy::new("c-long", 100_000, MINUTE);
    let check = Check::new(&long, Key::new("deep")).unwrap();
    fill(&store, &clock, &check, 20_000, 1000).await;
    let peek = store.peek(std::slice::from_ref(&check)).await.unwrap()[0];
    assert_eq!(peek.remaining(), 80_000);

    let base = store.base_key(&check);
    let mine: Vec<(String, &crate::support::RedisServer)> = cluster
        .keys_by_primary()
        .into_iter()
        .filter(|(key, _)| key.starts_with(&base))
        .collect();
    let mut names: Vec<&str> = mine.iter().map(|(key, _)| &key[base.len()..]).collect();
    names.sort();
    assert_eq!(names, [":l", ":p:0", ":p:1"]);
    let slots: HashSet<String> = mine.iter().map(|(key, _)| slot(&cluster, key)).collect();
    assert_eq!(slots.len(), 1, "{slots:?}");
    for (key, node) in &mine {
        let ttl: i64 = node.cli(&["pttl", key]).trim().parse().unwrap();
        assert!(ttl > 0, "{key} has no TTL");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_checks_through_two_cluster_pools_admit_exactly_the_limit() {
    let cluster = RedisCluster::start();
    let stores = [
        RedisStore::builder(cluster.pool(8))
            .with_timeout(Duration::from_secs(5))
            .build()
            .unwrap(),
        RedisStore::builder(cluster.pool(8))
            .with_timeout(Duration::from_secs(5))
            .build()
            .unwrap(),
    ];
    for (limit, algorithm) in [
        (100, Algorithm::SlidingLog),
        (150, Algorithm::SlidingCounter),
        (50, Algorithm::FixedWindow),
    ] {
        let policy = Arc::new(
            Policy::new("hot", limit, Duration::from_secs(3600)).with_algorithm(algorithm),
        );
        let key = format!("hot-{algorithm:?}");
        let mut tasks = Vec::new();
        for i in 0..400 {
            let store = stores[i % 2].clone();
            let check = Check::new(&policy, Key::new(&key)).unwrap();
            tasks.push(tokio::spawn(async move { store.check(&[check]).await }));
        }
        let mut admitted = 0;
        for task in tasks {
            admitted += u32::from(task.await.unwrap().expect("the cluster answers")[0].admitted());
        }
        eprintln!("{algorithm:?}: 400 concurrent requests, limit {limit}: {admitted} admitted");
        assert_eq!(admitted, limit, "{algorithm:?}");
    }
}

/// Two clients whose keys are in different slots.
fn in_two_slots(cluster: &RedisCluster) -> (String, String) {
    (0..)
        .map(|i| (format!("a{i}"), format!("b{i}")))
        .find(|(a, b)| {
            slot(cluster, &format!("{{user:{a}}}")) != slot(cluster, &format!("{{user:{b}}}"))
        })
        .unwrap()
}

/// A request whose checks span slots (a policy per client beside one for
/// everyone) is asked slot by slot: admitted in both, or counted in
/// neither, whichever slot denies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_across_slots_is_counted_in_all_of_them_or_in_none() {
    let cluster = RedisCluster::start();
    let clock = FakeClock::new(START);
    let store = store(&cluster, &clock);
    let per_client = Policy::new("cross-client", 3, MINUTE);
    let everyone = Policy::new("cross-all", 4, MINUTE).with_algorithm(Algorithm::SlidingCounter);
    let (client, all) = in_two_slots(&cluster);
    let request = |client: &str| {
        vec![
            Check::new(&per_client, Key::new(client)).unwrap(),
            Check::new(&everyone, Key::new(&all)).unwrap(),
        ]
    };
    let remaining = |decisions: &Decisions| (decisions[0].remaining(), decisions[1].remaining());
    let first = store.check(&request(&client)).await.unwrap();
    assert!(first.iter().all(|d| d.admitted()));
    assert_eq!(remaining(&first), (2, 3));
    for _ in 0..2 {
        assert!(
            store
                .check(&request(&client))
                .await
                .unwrap()
                .iter()
                .all(|d| d.admitted())
        );
    }
    // The first slot denies: the second is not counted.
    let denied = store.check(&request(&client)).await.unwrap();
    assert!(!denied[0].admitted() && denied[0].retry_after().is_some());
    let peeked = store.peek(&request(&client)).await.unwrap();
    assert_eq!(remaining(&peeked), (0, 1), "everyone's count holds 3");

    // Another client takes the last unit everyone has; the next request
    // is denied by the second slot, and what the first granted is given
    // back.
    let (other, _) = in_two_slots(&cluster);
    let other = format!("{other}-2");
    assert!(
        store
            .check(&request(&other))
            .await
            .unwrap()
            .iter()
            .all(|d| d.admitted())
    );
    let denied = store.check(&request(&other)).await.unwrap();
    assert!(denied[0].admitted(), "the first slot granted it");
    assert!(!denied[1].admitted(), "the second denied it");
    let peeked = store.peek(&request(&other)).await.unwrap();
    assert_eq!(
        peeked[0].remaining(),
        2,
        "the grant was given back: one request counted"
    );
}

/// Many clients at once against a limit per client and one for everyone,
/// in other slots: neither is ever passed, and each count holds exactly
/// the requests admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_across_slots_never_pass_either_limit_under_concurrency() {
    let cluster = RedisCluster::start();
    let clock = FakeClock::new(START);
    let store = Arc::new(store(&cluster, &clock));
    let per_client = Policy::new("conc-client", 3, MINUTE);
    let everyone = Policy::new("conc-all", 20, MINUTE);
    let clients: Vec<String> = (0..12).map(|i| format!("c{i}")).collect();
    let requests: Vec<Vec<Check>> = (0..120)
        .map(|i| {
            vec![
                Check::new(&per_client, Key::new(&clients[i % clients.len()])).unwrap(),
                Check::new(&everyone, Key::new("everyone")).unwrap(),
            ]
        })
        .collect();
    let answers = all_at_once(&store, requests).await;
    let mut admitted_per_client = vec![0u32; clients.len()];
    for (i, answer) in answers.iter().enumerate() {
        let decisions = answer.as_ref().expect("decided");
        if decisions.iter().all(|d| d.admitted()) {
            admitted_per_client[i % clients.len()] += 1;
        }
    }
    let admitted: u32 = admitted_per_client.iter().sum();
    assert_eq!(
        admitted, 20,
        "everyone's limit, exactly: {admitted_per_client:?}"
    );
    assert!(
        admitted_per_client.iter().all(|&n| n <= 3),
        "{admitted_per_client:?}"
    );
    // What the counts hold is what was admitted: no grant left behind.
    let all = store
        .peek(&[Check::new(&everyone, Key::new("everyone")).unwrap()])
        .await
        .unwrap();
    assert_eq!(all[0].remaining(), 0);
    for (client, admitted) in clients.iter().zip(&admitted_per_client) {
        let peeked = store
            .peek(&[Check::new(&per_client, Key::new(client)).unwrap()])
            .await
            .unwrap();
        assert_eq!(peeked[0].remaining(), 3 - admitted, "{client}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counts_follow_a_slot_migrated_to_another_primary() {
    let cluster = RedisCluster::start();
    let clock = FakeClock::new(START);
    let store = store(&cluster, &clock);
    let policy = Policy::new("moving", 10, MINUTE);
    for remaining in (6..10).rev() {
        assert_eq!(
            check(&store, &[&policy], "mover").await[0].remaining(),
            remaining
        );
    }
    let from = cluster.primary_of("{mover}").port();
    let to = cluster.migrate_slot_of("{mover}");
    assert_ne!(from, to);
    assert_eq!(cluster.primary_of("{mover}").port(), to);
    // The client follows MOVED to the new primary, where the log now is.
    for remaining in (0..6).rev() {
        let d = check(&store, &[&policy], "mover").await;
        assert!(d[0].admitted());
        assert_eq!(d[0].remaining(), remaining);
    }
    assert!(!check(&store, &[&policy], "mover").await[0].admitted());
}

/// A node that lost the script and its function library (a restart
/// without persistence, `SCRIPT FLUSH`, `FUNCTION FLUSH`) gets them back
/// from the check that needs them, even while another node of the cluster
/// is down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_script_comes_back_while_another_node_is_down() {
    let mut cluster = RedisCluster::start();
    let clock = FakeClock::new(START);
    let store = store(&cluster, &clock);
    let policy = Policy::new("c-reload", 100, MINUTE);
    for client in 0..10 {
        check(&store, &[&policy], &format!("r{client}")).await;
    }
    cluster.kill_a_replica();
    for primary in cluster.primaries() {
        primary.cli(&["script", "flush"]);
        primary.cli(&["function", "flush"]);
    }
    for client in 0..10 {
        let checks = [Check::new(&policy, Key::new(format!("r{client}"))).unwrap()];
        let answer = store.check(&checks).await;
        assert!(answer.is_ok(), "client {client}: {answer:?}");
        assert_eq!(answer.unwrap()[0].remaining(), 98);
    }
}

/// `CLUSTER FAILOVER` promotes a replica while a client is counted: its
/// next checks go to the new primary, which has its count and the
/// function library (both replicated), and no request sees an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_failover_is_invisible_to_requests() {
    let cluster = RedisCluster::start();
    let clock = FakeClock::new(START);
    let store = store(&cluster, &clock);
    let policy = Policy::new("c-failover", 5, MINUTE);
    let checks = [Check::new(&policy, Key::new("moving")).unwrap()];
    for _ in 0..3 {
        assert!(store.check(&checks).await.unwrap()[0].admitted());
    }
    let key = format!("{}:l", store.base_key(&checks[0]));
    let old_primary = cluster.primary_of(&key).port();
    // The count has reached the replica before it takes over.
    assert_eq!(
        cluster.primary_of(&key).cli(&["wait", "1", "5000"]).trim(),
        "1"
    );
    let new_primary = cluster.fail_over_primary_of(&key);
    assert_ne!(new_primary, old_primary);

    let mut admitted = Vec::new();
    for _ in 0..3 {
        let answer = store.check(&checks).await;
        assert!(answer.is_ok(), "a request saw the failover: {answer:?}");
        admitted.push(answer.unwrap()[0].admitted());
    }
    assert_eq!(
        admitted,
        [true, true, false],
        "the count moved with the key"
    );
    assert_eq!(cluster.primary_of(&key).port(), new_primary);
}

/// The FCALLs the cluster's primaries have run since their statistics were
/// reset.
fn fcalls(cluster: &RedisCluster) -> u64 {
    cluster
        .primaries()
        .iter()
        .map(|node| {
            node.cli(&["info", "commandstats"])
                .lines()
                .find_map(|line| line.strip_prefix("cmdstat_fcall:calls="))
                .and_then(|rest| rest.split(',').next()?.parse::<u64>().ok())
                .unwrap_or(0)
        })
        .sum()
}

/// Checks queued together on a cluster batch per slot: the first of a
/// slot goes at once, and the requests of one busy client that arrive
/// while it is in flight share the next call, decided in arrival order.
#[tokio::test(flavor = "current_thread")]
async fn checks_queued_together_on_a_cluster_share_a_call_per_slot() {
    let cluster = RedisCluster::start();
    let clock = FakeClock::new(START);
    let store = Arc::new(store(&cluster, &clock));
    let policy = Policy::new("grouped", 10, MINUTE);
    let one = |key: &str| vec![Check::new(&policy, Key::new(key)).unwrap()];
    // Loads the library on every primary, so that what follows is counted
    // from a steady state.
    for client in 0..30 {
        check(&store, &[&policy], &format!("warm{client}")).await;
    }
    for node in cluster.primaries() {
        node.cli(&["config", "resetstat"]);
    }
    let mut requests: Vec<Vec<Check>> = Vec::new();
    for i in 0..20 {
        requests.push(one("busy"));
        requests.push(one(&format!("other{i}")));
    }
    let slots: HashSet<String> = (0..20)
        .map(|i| slot(&cluster, &format!("{{user:other{i}}}")))
        .chain([slot(&cluster, "{user:busy}")])
        .collect();

    let answers = all_at_once(&store, requests).await;
    for (n, answer) in answers.iter().step_by(2).enumerate() {
        let decision = answer.as_ref().expect("decided")[0];
        assert_eq!(decision.admitted(), n < 10, "busy request {n}");
    }
    assert!(
        answers
            .iter()
            .skip(1)
            .step_by(2)
            .all(|a| a.as_ref().unwrap()[0].admitted())
    );
    // One call per slot, and one more for the busy client's first
    // request, which went alone while the rest queued while it was in
    // flight.
    assert_eq!(fcalls(&cluster), slots.len() as u64 + 1);
}

/// A cluster store built from the configuration keeps a timeout longer
/// than redis-rs's own default of 500 ms: a reply 800 ms late is still
/// taken. And its connections are named `slidegate` on the nodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configured_timeout_past_half_a_second_is_the_one_that_counts_on_a_cluster() {
    let cluster = RedisCluster::start();
    let mut settings = slidegate::config::RedisSettings::default().with_url(cluster.cluster_url());
    settings.timeout = Duration::from_secs(3);
    let store = settings.store().unwrap();
    store.connect(Duration::from_secs(5)).await.unwrap();
    let policy = Policy::new("patient", 10, MINUTE);
    let check = [Check::new(&policy, Key::new("c")).unwrap()];
    store.check(&check).await.unwrap();
    let primary = cluster.primary_of(&store.base_key(&check[0]));
    assert!(
        primary
            .cli(&["client", "list"])
            .contains(" name=slidegate "),
        "the store's connection is named on the node it calls"
    );

    let sleeper = primary.keep_busy("0.8");
    let started = std::time::Instant::now();
    let answer = store.check(&check).await;
    let waited = started.elapsed();
    assert!(sleeper.join().unwrap());
    assert_eq!(
        answer.unwrap()[0].remaining(),
        8,
        "after waiting {waited:?}"
    );
    assert!(
        waited > Duration::from_millis(500),
        "the node was busy, yet {waited:?}"
    );

    // And a timeout shorter than the node's stall still ends the call.
    settings.timeout = Duration::from_millis(100);
    let hasty = settings.store().unwrap();
    hasty.check(&check).await.unwrap();
    let sleeper = primary.keep_busy("0.5");
    let answer = hasty.check(&check).await;
    assert!(sleeper.join().unwrap());
    assert!(matches!(answer, Err(StoreError::Timeout(_))), "{answer:?}");
}

/// Requests across slots dropped at any moment (a client gone, a timeout
/// of the caller's): each is counted in every slot or in none, never in
/// the first slot alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_across_slots_dropped_midway_is_counted_everywhere_or_nowhere() {
    let cluster = RedisCluster::start();
    let clock = FakeClock::new(START);
    let store = store(&cluster, &clock);
    let per_client = Policy::new("dropped-client", 1000, MINUTE);
    let everyone = Policy::new("dropped-all", 1000, MINUTE);
    let (client, all) = in_two_slots(&cluster);
    let request = || {
        vec![
            Check::new(&per_client, Key::new(&client)).unwrap(),
            Check::new(&everyone, Key::new(&all)).unwrap(),
        ]
    };
    // Warm: the library loaded on both primaries.
    store.check(&request()).await.unwrap();
    for trial in 0..60u64 {
        // Dropped after 0 to 3 ms: before, between or after the slots.
        let within = Duration::from_micros(trial % 4 * 1000);
        let _ = tokio::time::timeout(within, store.check(&request())).await;
    }
    let counted = |policy: &Policy, key: &str| {
        let check = Check::new(policy, Key::new(key)).unwrap();
        let store = &store;
        async move { store.peek(&[check]).await.unwrap()[0].remaining() }
    };
    let started = std::time::Instant::now();
    loop {
        let (mine, everyones) = (
            counted(&per_client, &client).await,
            counted(&everyone, &all).await,
        );
        if mine == everyones {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the client's count left {mine}, everyone's {everyones}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A request that one slot would hold for a delay and another would admit
/// at once is given back in both and refused with the wait: each slot
/// records it at the time it would pass there, and the earlier record
/// would let the next request of that count in before its time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_held_in_one_slot_alone_is_refused_with_its_wait() {
    let cluster = RedisCluster::start();
    let clock = FakeClock::new(START);
    let store = store(&cluster, &clock);
    let per_client = Policy::new("held-client", 100, MINUTE);
    let everyone = Policy::new("held-all", 1, Duration::from_millis(400))
        .with_delay(Duration::from_millis(500));
    let (client, all) = in_two_slots(&cluster);
    let request = || {
        vec![
            Check::new(&per_client, Key::new(&client)).unwrap(),
            Check::new(&everyone, Key::new(&all)).unwrap(),
        ]
    };
    let first = store.check(&request()).await.unwrap();
    assert!(
        first
            .iter()
            .all(|d| d.admitted() && d.delayed_for().is_none())
    );
    let second = store.check(&request()).await.unwrap();
    assert!(second[0].admitted(), "the client's slot admits it at once");
    assert!(!second[1].admitted(), "refused, not held");
    let wait = second[1].retry_after().unwrap();
    assert!(
        wait > Duration::ZERO && wait <= Duration::from_millis(400),
        "{wait:?}"
    );
    let peeked = store.peek(&request()).await.unwrap();
    assert_eq!(
        peeked[0].remaining(),
        99,
        "the client's grant was given back"
    );
    assert!(
        peeked[1].retry_after().is_some(),
        "everyone's count holds the first alone"
    );
}
