//! Checks in flight together share the store's held connections and are
//! pipelined on them: each still gets its own answer, its own deadline and
//! its own fail mode.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::RedisServer;
use slidegate::{
    Policy,
    key::Key,
    store::{Check, RedisStore, Store, StoreError},
};

/// The clients Redis has, less the `redis-cli` that asks.
fn clients(server: &RedisServer) -> usize {
    server.cli(&["client", "list"]).lines().count() - 1
}

/// A store on `server` with its defaults and a timeout no test reaches.
fn patient_store(server: &RedisServer) -> Arc<RedisStore> {
    Arc::new(
        RedisStore::builder(server.pool(4))
            .with_timeout(Duration::from_secs(5))
            .build()
            .unwrap(),
    )
}

async fn check_all(store: &Arc<RedisStore>, checks: Vec<Check>) -> Vec<slidegate::store::Decision> {
    let tasks: Vec<_> = checks
        .into_iter()
        .map(|check| {
            let store = store.clone();
            tokio::spawn(async move { store.check(&[check]).await })
        })
        .collect();
    let mut decisions = Vec::new();
    for task in tasks {
        decisions.push(task.await.unwrap().expect("no store errors")[0]);
    }
    decisions
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checks_in_flight_share_the_connections_the_store_holds() {
    let server = RedisServer::start();
    let policy = Policy::new("shared", 10, Duration::from_secs(60));
    for (held, batch) in [(1, false), (3, false), (3, true)] {
        server.cli(&["flushall"]);
        let store = Arc::new(
            RedisStore::builder(server.pool(16))
                .with_connections(held)
                .with_batch(batch)
                .with_timeout(Duration::from_secs(5))
                .build()
                .unwrap(),
        );
        let checks = (0..300)
            .map(|i| Check::new(&policy, Key::new(format!("c{i}"))).unwrap())
            .collect();
        let decisions = check_all(&store, checks).await;
        assert!(decisions.iter().all(|d| d.admitted() && d.remaining() == 9));
        let size = store.pool().status().size;
        if batch {
            // Batches go to the lanes in turn, as many as there are flushes.
            assert!((1..=held).contains(&size), "{size} connections");
        } else {
            // Every lane took its connection, and only one.
            assert_eq!(size, held, "300 checks took {size} connections");
        }
        assert_eq!(clients(&server), size);
        drop(store);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipeline_mixing_clients_denies_only_the_client_over_its_limit() {
    let server = RedisServer::start();
    let store = patient_store(&server);
    let policy = Policy::new("mixed", 3, Duration::from_secs(60));
    let spent = Check::new(&policy, Key::new("spent")).unwrap();
    for _ in 0..3 {
        assert!(store.check(std::slice::from_ref(&spent)).await.unwrap()[0].admitted());
    }
    // Ten requests of the spent client among fifty of fresh ones, in flight
    // together.
    let checks: Vec<_> = (0..60)
        .map(|i| {
            if i % 6 == 0 {
                spent.clone()
            } else {
                Check::new(&policy, Key::new(format!("fresh{i}"))).unwrap()
            }
        })
        .collect();
    let decisions = check_all(&store, checks).await;
    for (i, decision) in decisions.iter().enumerate() {
        if i % 6 == 0 {
            assert!(
                !decision.admitted(),
                "request {i} of the spent client admitted"
            );
            assert!(decision.retry_after().is_some());
        } else {
            assert!(decision.admitted(), "fresh client {i} denied: {decision:?}");
            assert_eq!(decision.remaining(), 2);
        }
    }
}

/// The ids of the connections whose last command was a script call.
fn script_connections(server: &RedisServer) -> Vec<String> {
    server
        .cli(&["client", "list"])
        .lines()
        .filter(|line| line.contains("cmd=fcall"))
        .filter_map(|line| line.split(' ').next().map(str::to_owned))
        .collect()
}

/// A check whose deadline passes while Redis is busy fails with a timeout;
/// the checks sent after it on the same connection, still within their own
/// deadlines, each get their own answer once Redis answers again: the late
/// reply of the abandoned call goes to nobody.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_timing_out_in_a_pipeline_leaves_the_checks_behind_it_their_answers() {
    // Redis busy for SLEEP; a check sent at its start times out at TIMEOUT,
    // and checks sent then are answered at SLEEP, within their deadline of
    // 2 × TIMEOUT: both with 200 ms to spare. (TIMEOUT stays below
    // redis-rs's own response timeout of 500 ms.)
    const SLEEP: &str = "0.7";
    const TIMEOUT: Duration = Duration::from_millis(450);
    let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
    let store = Arc::new(
        RedisStore::builder(server.pool(4))
            .with_timeout(TIMEOUT)
            .build()
            .unwrap(),
    );
    let policy = Policy::new("pipeline", 10, Duration::from_secs(60));
    let check = |name: &str| Check::new(&policy, Key::new(name)).unwrap();
    // Client d{i} has made i requests.
    for i in 0..8 {
        for _ in 0..i {
            store.check(&[check(&format!("d{i}"))]).await.unwrap();
        }
    }

    let connections = script_connections(&server);
    assert_eq!(connections.len(), 1);

    let sleeper = server.keep_busy(SLEEP);

    let abandoned = store.check(&[check("a")]).await;
    assert!(
        matches!(abandoned, Err(StoreError::Timeout(_))),
        "{abandoned:?}"
    );
    let behind = check_all(&store, (0..8).map(|i| check(&format!("d{i}"))).collect()).await;
    for (i, decision) in behind.iter().enumerate() {
        assert!(decision.admitted());
        assert_eq!(
            decision.remaining(),
            10 - i as u32 - 1,
            "client d{i} got another check's answer"
        );
    }
    assert!(sleeper.join().unwrap());
    assert_eq!(
        script_connections(&server),
        connections,
        "the connection was replaced after a timeout"
    );

    // The abandoned check ran once Redis woke: a request answered by its
    // fail mode may still have been counted, never the other way round.
    let after = store.check(&[check("a")]).await.unwrap();
    assert_eq!(after[0].remaining(), 8);
}

/// The calls of `command` Redis has run since its statistics were reset.
fn calls(server: &RedisServer, command: &str) -> u64 {
    server
        .cli(&["info", "commandstats"])
        .lines()
        .find_map(|line| line.strip_prefix(&format!("cmdstat_{command}:calls=")))
        .and_then(|rest| rest.split(',').next()?.parse().ok())
        .unwrap_or(0)
}

/// Checks that arrive while a call is in flight go to Redis together (in
/// calls of at most 32 policies, one after the other), and each gets its
/// own decision, in arrival order.
#[tokio::test(flavor = "current_thread")]
async fn checks_queued_together_are_decided_by_one_call_in_arrival_order() {
    let server = RedisServer::start();
    let store = patient_store(&server);
    let policy = Policy::new("batched", 40, Duration::from_secs(60));
    let check = |name: &str| Check::new(&policy, Key::new(name)).unwrap();
    // Loads the library, so that what follows is one call.
    store.check(&[check("warm")]).await.unwrap();
    server.cli(&["config", "resetstat"]);

    // Sixty checks of one client with a limit of 40, among sixty of other
    // clients, all queued before any is sent.
    let checks = (0..120)
        .map(|i| {
            if i % 2 == 0 {
                check("hot")
            } else {
                check(&format!("c{i}"))
            }
        })
        .collect();
    let decisions = check_all(&store, checks).await;
    // The first goes at once; the 119 that queue while it is in flight, in calls of 32.
    assert_eq!(calls(&server, "fcall"), 5, "120 checks queued together");
    let hot: Vec<_> = decisions.iter().step_by(2).collect();
    for (n, decision) in hot.iter().enumerate() {
        // The first 40 in arrival order are admitted, with what was left.
        assert_eq!(decision.admitted(), n < 40, "hot request {n}");
        assert_eq!(decision.remaining(), 40u32.saturating_sub(n as u32 + 1));
    }
    assert!(
        decisions
            .iter()
            .skip(1)
            .step_by(2)
            .all(|d| d.admitted() && d.remaining() == 39)
    );
}

/// A request that fails inside a batch (its log key holds foreign bytes)
/// fails alone: the others in the same call are decided and recorded. It
/// is sent again on its own, for Redis to name the line that failed,
/// which a batch call, catching the error, cannot.
#[tokio::test(flavor = "current_thread")]
async fn a_request_failing_inside_a_batch_leaves_the_others_decided() {
    let server = RedisServer::start();
    let store = patient_store(&server);
    let policy = Policy::new("isolated", 5, Duration::from_secs(60));
    let check = |name: &str| Check::new(&policy, Key::new(name)).unwrap();
    store.check(&[check("warm")]).await.unwrap();
    let broken = check("broken");
    server.cli(&["set", &format!("{}:l", store.base_key(&broken)), "short"]);
    server.cli(&["config", "resetstat"]);

    let tasks: Vec<_> = (0..9)
        .map(|i| {
            let store = store.clone();
            let check = if i == 4 {
                broken.clone()
            } else {
                check(&format!("fine{i}"))
            };
            tokio::spawn(async move { store.check(&[check]).await })
        })
        .collect();
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.unwrap());
    }
    // The first at once, then the eight that queued while it was in flight, then the
    // failed one alone.
    assert_eq!(calls(&server, "fcall"), 3, "the batch, then the failed one");
    for (i, answer) in answers.iter().enumerate() {
        if i == 4 {
            let error = answer.as_ref().expect_err("foreign bytes read");
            assert!(error.to_string().contains("(lua/log.lua:"), "{error}");
        } else {
            let decision = answer.as_ref().expect("the others are decided")[0];
            assert!(
                decision.admitted() && decision.remaining() == 4,
                "{decision:?}"
            );
        }
    }
    // Recorded: a second request of a fine client has one fewer left.
    let again = store.check(&[check("fine0")]).await.unwrap();
    assert_eq!(again[0].remaining(), 3);
}

/// Where an ACL refuses functions, the first batch is answered check by
/// check by `EVALSHA`, exactly, and later checks are no longer queued.
#[tokio::test(flavor = "current_thread")]
async fn a_batch_refused_functions_is_decided_check_by_check() {
    let server = RedisServer::start();
    let pool = server.pool_refusing_functions();
    let store = Arc::new(
        RedisStore::builder(pool)
            .with_timeout(Duration::from_secs(5))
            .build()
            .unwrap(),
    );
    let policy = Policy::new("refused", 5, Duration::from_secs(60));
    for round in 0..2 {
        let checks = (0..12)
            .map(|_| Check::new(&policy, Key::new(format!("client{round}"))).unwrap())
            .collect();
        let decisions = check_all(&store, checks).await;
        let admitted: Vec<bool> = decisions.iter().map(|d| d.admitted()).collect();
        assert_eq!(admitted, [[true; 5].as_slice(), &[false; 7]].concat());
    }
    assert_eq!(calls(&server, "fcall"), 0, "no FCALL ran");
    assert!(calls(&server, "evalsha") + calls(&server, "eval") >= 24);
}

/// A store built from the configuration keeps a timeout longer than
/// redis-rs's own default of 500 ms: a reply 800 ms late is still taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configured_timeout_past_half_a_second_is_the_one_that_counts() {
    let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
    let mut settings = slidegate::config::RedisSettings::default().with_url(server.url());
    settings.timeout = Duration::from_secs(3);
    let store = settings.store().unwrap();
    let policy = Policy::new("patient", 10, Duration::from_secs(60));
    let check = [Check::new(&policy, Key::new("c")).unwrap()];
    store.check(&check).await.unwrap();

    let sleeper = server.keep_busy("0.8");
    let started = Instant::now();
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
        "Redis was busy, yet {waited:?}"
    );
}

/// A flood of checks queued together goes as several calls of at most 32
/// policies each, so that no one script holds Redis for long; every check
/// is still decided exactly, in arrival order. A request of many policies
/// counts as their number.
#[tokio::test(flavor = "current_thread")]
async fn a_flood_of_queued_checks_is_split_into_calls_of_at_most_32_policies() {
    let server = RedisServer::start();
    let store = patient_store(&server);
    let policy = Policy::new("flood", 100, Duration::from_secs(60));
    store
        .check(&[Check::new(&policy, Key::new("warm")).unwrap()])
        .await
        .unwrap();
    server.cli(&["config", "resetstat"]);
    let checks = (0..300)
        .map(|_| Check::new(&policy, Key::new("flooded")).unwrap())
        .collect();
    let decisions = check_all(&store, checks).await;
    // The first at once, the 299 that queued while it was in flight in calls of 32.
    assert_eq!(calls(&server, "fcall"), 11, "300 checks in calls of 32");
    let admitted: Vec<bool> = decisions.iter().map(|d| d.admitted()).collect();
    assert_eq!(admitted, [vec![true; 100], vec![false; 200]].concat());
    // Twelve requests of three policies each: 36 policies, two calls.
    let three = [
        Policy::new("a", 100, Duration::from_secs(60)),
        Policy::new("b", 100, Duration::from_secs(60)),
        Policy::new("c", 100, Duration::from_secs(60)),
    ];
    server.cli(&["config", "resetstat"]);
    let tasks: Vec<_> = (0..12)
        .map(|_| {
            let store = store.clone();
            let checks: Vec<Check> = three
                .iter()
                .map(|p| Check::new(p, Key::new("many")).unwrap())
                .collect();
            tokio::spawn(async move { store.check(&checks).await })
        })
        .collect();
    for task in tasks {
        assert!(task.await.unwrap().unwrap()[0].admitted());
    }
    // The first request's three at once, the 33 that queued while it was in flight in
    // calls of 32 and 3 (requests are not split).
    assert_eq!(calls(&server, "fcall"), 3, "36 policies in calls of 32");
}

/// A client whose tier changes the window of a log between two requests of
/// one batch (same policy name, same key, another window) cannot spend the
/// limit twice: the later request writes the earlier one's header before
/// reading the log again.
#[tokio::test(flavor = "current_thread")]
async fn a_window_changing_inside_a_batch_never_admits_past_a_logs_limit() {
    let server = RedisServer::start();
    let store = patient_store(&server);
    let warm = Policy::new("warm", 5, Duration::from_secs(60));
    store
        .check(&[Check::new(&warm, Key::new("warm")).unwrap()])
        .await
        .unwrap();
    let short = Policy::new("tiered", 5, Duration::from_secs(60));
    let long = Policy::new("tiered", 5, Duration::from_secs(120));
    let checks = (0..12)
        .map(|i| Check::new(if i % 2 == 0 { &short } else { &long }, Key::new("tiered")).unwrap())
        .collect();
    server.cli(&["config", "resetstat"]);
    let decisions = check_all(&store, checks).await;
    // The first at once, the eleven that queued while it was in flight in one batch.
    assert_eq!(calls(&server, "fcall"), 2, "one batch");
    let admitted = decisions.iter().filter(|d| d.admitted()).count();
    assert_eq!(admitted, 5, "{admitted} admitted at a limit of 5");
}

/// A check that went at once and whose request is dropped while its call
/// is in flight (a client gone) leaves the checks that queued beside it
/// to be sent and decided, and the next check decided too.
#[tokio::test(flavor = "current_thread")]
async fn a_dropped_check_in_flight_leaves_the_checks_behind_it_decided() {
    let server = RedisServer::start();
    let store = patient_store(&server);
    let policy = Policy::new("dropped", 10, Duration::from_secs(60));
    let check = |name: &str| Check::new(&policy, Key::new(name)).unwrap();
    store.check(&[check("warm")]).await.unwrap();

    let mut first = store.check(&[check("gone")]);
    assert!(
        futures_util::poll!(&mut first).is_pending(),
        "sent, in flight"
    );
    let behind: Vec<_> = (0..5)
        .map(|i| {
            let (store, check) = (store.clone(), check(&format!("behind{i}")));
            tokio::spawn(async move { store.check(&[check]).await })
        })
        .collect();
    // Each queues beside the call in flight.
    tokio::task::yield_now().await;
    drop(first);
    for task in behind {
        let decision = task.await.unwrap().expect("decided")[0];
        assert!(
            decision.admitted() && decision.remaining() == 9,
            "{decision:?}"
        );
    }
    let next = store.check(&[check("next")]).await.unwrap()[0];
    assert!(next.admitted() && next.remaining() == 9);
}
