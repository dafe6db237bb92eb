//! Redis as it runs in production: over TLS (a private CA, mutual TLS),
//! as an ACL user in a numbered database, with connections named for
//! `CLIENT LIST`; and the config file that says so.

use std::time::{Duration, Instant};

use crate::support::RedisServer;
use crate::support::sentinel::{MASTER, SentinelSet};
use crate::support::tls::TestCerts;
use slidegate::config::{Config, RedisSettings};
use slidegate::{
    Policy,
    key::Key,
    store::{Check, RedisStore, Store, StoreError},
};

/// A bound for connecting, generous: the time it takes is not under test
/// here, and a loaded machine may take seconds (refusals come at once).
const WITHIN: Duration = Duration::from_secs(30);

/// The store of a config file written beside the certificates (so its
/// `tls` paths are relative to it), with `redis` as its `[redis]` body.
fn store_of(certs: &TestCerts, redis: &str) -> RedisStore {
    let path = certs.dir().join("slidegate.toml");
    std::fs::write(&path, format!("[redis]\ntimeout_ms = 30000\n{redis}")).unwrap();
    let config = Config::from_file(&path).unwrap();
    config.redis().unwrap().store().unwrap()
}

/// Three requests admitted, the fourth denied: the limit holds.
async fn the_limit_holds(store: &RedisStore) {
    let policy = Policy::new("tls", 3, Duration::from_secs(60));
    let check = [Check::new(&policy, Key::new("client")).unwrap()];
    for remaining in (0..3).rev() {
        let decision = store.check(&check).await.unwrap()[0];
        assert!(decision.admitted());
        assert_eq!(decision.remaining(), remaining);
    }
    assert!(!store.check(&check).await.unwrap()[0].admitted());
}

#[tokio::test]
async fn a_limit_holds_over_tls_to_a_private_ca() {
    let certs = TestCerts::new();
    let server = RedisServer::start_tls(&certs, false);
    let store = store_of(
        &certs,
        &format!("url = \"{}\"\ntls = {{ ca = \"ca.pem\" }}\n", server.url()),
    );
    store.connect(WITHIN).await.unwrap();
    the_limit_holds(&store).await;
    assert_eq!(
        server.cli(&["dbsize"]).trim(),
        "1",
        "the state is on the TLS server"
    );
}

#[tokio::test]
async fn mutual_tls_takes_a_client_certificate_and_refuses_a_client_without_one() {
    let certs = TestCerts::new();
    let server = RedisServer::start_tls(&certs, true);
    let with = store_of(
        &certs,
        &format!(
            "url = \"{}\"\ntls = {{ ca = \"ca.pem\", cert = \"client.pem\", key = \"client.key\" }}\n",
            server.url()
        ),
    );
    with.connect(WITHIN).await.unwrap();
    the_limit_holds(&with).await;

    let without = store_of(
        &certs,
        &format!("url = \"{}\"\ntls = {{ ca = \"ca.pem\" }}\n", server.url()),
    );
    let error = without.connect(WITHIN).await.unwrap_err();
    assert!(matches!(error, StoreError::Backend(_)), "{error}");
    let policy = Policy::new("tls", 3, Duration::from_secs(60));
    assert!(
        without
            .check(&[Check::new(&policy, Key::new("client")).unwrap()])
            .await
            .is_err(),
        "no check goes through without a client certificate"
    );
}

#[tokio::test]
async fn a_server_certificate_from_another_ca_is_refused_with_its_reason() {
    let certs = TestCerts::new();
    let server = RedisServer::start_tls(&certs, false);
    let store = store_of(
        &certs,
        &format!(
            "url = \"{}\"\ntls = {{ ca = \"other-ca.pem\" }}\n",
            server.url()
        ),
    );
    let error = store.connect(WITHIN).await.unwrap_err().to_string();
    assert!(
        error.contains("UnknownIssuer") || error.contains("invalid peer certificate"),
        "the reason is named: {error}"
    );
    // Without the private CA, the platform's roots do not know it either.
    let store = RedisSettings::default()
        .with_url(server.url())
        .store()
        .unwrap();
    assert!(store.connect(WITHIN).await.is_err());
}

#[test]
fn tls_settings_that_cannot_work_are_refused_at_start_up() {
    let certs = TestCerts::new();
    let at = |redis: &str| {
        let path = certs.dir().join("bad.toml");
        std::fs::write(&path, format!("[redis]\n{redis}")).unwrap();
        Config::from_file(&path)
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };
    let error = at("url = \"rediss://h/\"\ntls = { cert = \"client.pem\" }\n");
    assert!(
        error.contains("redis.tls") && error.contains("`key`"),
        "{error}"
    );
    let error = at("url = \"rediss://h/\"\ntls = { ca = \"missing.pem\" }\n");
    assert!(
        error.contains("redis.tls.ca") && error.contains("missing.pem"),
        "{error}"
    );
    std::fs::write(certs.dir().join("garbage.pem"), "not a certificate").unwrap();
    let error = at(
        "url = \"rediss://h/\"\ntls = { ca = \"ca.pem\", cert = \"garbage.pem\", key = \"garbage.pem\" }\n",
    );
    assert!(error.contains("redis.tls"), "{error}");
    let error = at("url = \"rediss://h/\"\ntls = { ca = \"ca.pem\", crl = \"x\" }\n");
    assert!(error.contains("crl"), "{error}");

    // Certificates for a plain-text URL would be silently unused.
    let path = certs.dir().join("plain.toml");
    std::fs::write(
        &path,
        "[redis]\nurl = \"redis://h/\"\ntls = { ca = \"ca.pem\" }\n",
    )
    .unwrap();
    let config = Config::from_file(&path).unwrap();
    let error = config.redis().unwrap().store().unwrap_err().to_string();
    assert!(error.contains("rediss://"), "{error}");
}

/// An ACL user in database 3: the keys land there, and every connection
/// of the store is named `slidegate` in `CLIENT LIST`.
#[tokio::test]
async fn an_acl_user_in_a_numbered_database_on_connections_named_slidegate() {
    let server = RedisServer::start();
    server.cli(&[
        "acl",
        "setuser",
        "limiter",
        "on",
        ">s3cret",
        "~slidegate:*",
        "+@all",
    ]);
    server.cli(&["acl", "setuser", "default", "off"]);
    let url = format!("redis://limiter:s3cret@127.0.0.1:{}/3", server.port());
    let store = RedisSettings::default().with_url(url).store().unwrap();
    store.connect(WITHIN).await.unwrap();
    let policy = Policy::new("acl", 2, Duration::from_secs(60));
    let check = [Check::new(&policy, Key::new("client")).unwrap()];
    assert!(store.check(&check).await.unwrap()[0].admitted());

    let admin = |args: &[&str]| {
        let mut all = vec!["--user", "limiter", "--pass", "s3cret", "--no-auth-warning"];
        all.extend_from_slice(args);
        server.cli(&all)
    };
    let clients = admin(&["client", "list"]);
    let ours: Vec<&str> = clients
        .lines()
        .filter(|line| line.contains(" name=slidegate "))
        .collect();
    assert_eq!(ours.len(), 1, "one named connection: {clients}");
    assert!(
        ours[0].contains(" user=limiter ") && ours[0].contains(" db=3 "),
        "{}",
        ours[0]
    );
    assert_eq!(admin(&["-n", "3", "dbsize"]).trim(), "1");
    assert_eq!(admin(&["-n", "0", "dbsize"]).trim(), "0");

    // A wrong password is a clear error, not a silent pass.
    let url = format!("redis://limiter:wrong@127.0.0.1:{}/3", server.port());
    let store = RedisSettings::default().with_url(url).store().unwrap();
    let error = store.connect(WITHIN).await.unwrap_err().to_string();
    assert!(
        error.to_lowercase().contains("auth") || error.contains("WRONGPASS"),
        "{error}"
    );
}

/// A store on the sentinels of `set`, from a config file's `[redis]`. Its
/// timeout is not under test: long enough for a first check (finding the
/// primary, connecting, loading the library) on a loaded machine. No call
/// here waits on a server that stays silent (a killed primary refuses at
/// once, the old one of a failover answers), so it does not slow the
/// checks that follow a failover.
fn sentinel_store(set: &SentinelSet) -> RedisStore {
    let sentinels: Vec<String> = set.urls().iter().map(|u| format!("\"{u}\"")).collect();
    let config = Config::from_toml_str(&format!(
        "[redis]\nsentinels = [{}]\nmaster = \"{MASTER}\"\ntimeout_ms = 5000\n",
        sentinels.join(", ")
    ))
    .unwrap();
    config.redis().unwrap().store().unwrap()
}

/// Takes a client to its limit of 3 and waits until the replica has it.
async fn at_its_limit(store: &RedisStore, set: &SentinelSet, check: &[Check]) {
    for _ in 0..3 {
        assert!(store.check(check).await.unwrap()[0].admitted());
    }
    assert!(!store.check(check).await.unwrap()[0].admitted());
    let primary = set.node(set.primary_port());
    assert_eq!(
        primary.cli(&["wait", "1", "30000"]).trim(),
        "1",
        "replicated"
    );
}

/// Checks until one is answered by `primary` (at most `within` after
/// `since`); every answer on the way, from whichever server, must deny.
/// How long after `since` the store was on `primary`.
async fn limited_by(
    store: &RedisStore,
    check: &[Check],
    primary: &RedisServer,
    since: Instant,
    within: Duration,
) -> Duration {
    loop {
        let r = store.check(check).await;
        eprintln!(
            "{:?} {:?}",
            since.elapsed(),
            r.as_ref().map(|d| d[0].admitted())
        );
        if let Ok(decisions) = r {
            assert!(
                !decisions[0].admitted(),
                "still at its limit: {decisions:?}"
            );
            if primary
                .cli(&["client", "list"])
                .contains(" name=slidegate ")
            {
                return since.elapsed();
            }
        }
        assert!(
            since.elapsed() < within,
            "the store is not on the new primary {within:?} after the failover"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `SENTINEL FAILOVER`: the store follows the primary to its new address,
/// and a client at its limit, replicated before, stays at its limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_follows_a_sentinel_failover_and_keeps_the_counts() {
    let set = SentinelSet::start();
    let store = sentinel_store(&set);
    store.connect(WITHIN).await.unwrap();
    let policy = Policy::new("sentinel", 3, Duration::from_secs(60));
    let check = [Check::new(&policy, Key::new("client")).unwrap()];
    at_its_limit(&store, &set, &check).await;
    let before = set.primary_port();

    set.fail_over_until("the sentinels name the replica", |set| {
        set.primary_port() != before
            && set
                .node(set.primary_port())
                .cli(&["role"])
                .starts_with("master")
    });
    let promoted = Instant::now();
    let primary = set.node(set.primary_port());
    let took = limited_by(&store, &check, primary, promoted, Duration::from_secs(1)).await;
    eprintln!("limited by the new primary {took:?} after the promotion");
}

/// The primary killed: once the sentinels have promoted the replica, the
/// store is on it within a second, with the counts it had.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_follows_a_sentinel_promotion_after_the_primary_is_killed() {
    let mut set = SentinelSet::start();
    let store = sentinel_store(&set);
    let policy = Policy::new("sentinel", 3, Duration::from_secs(60));
    let check = [Check::new(&policy, Key::new("client")).unwrap()];
    at_its_limit(&store, &set, &check).await;
    let before = set.primary_port();
    let killed = set.nodes.iter().position(|n| n.port() == before).unwrap();
    set.nodes[killed].kill();
    assert!(store.check(&check).await.is_err(), "no primary for now");

    set.wait_until("the sentinels promote the replica", |set| {
        set.primary_port() != before
    });
    let promoted = Instant::now();
    let primary = set.node(set.primary_port());
    let took = limited_by(&store, &check, primary, promoted, Duration::from_secs(1)).await;
    eprintln!("limited by the new primary {took:?} after the promotion");
}

/// A Redis of 3 MB that refuses writes once full (`noeviction`), and a
/// store on it. The timeout is not under test (a full Redis answers, with
/// an error for a new client): long, for a loaded machine.
fn filled_soon() -> (RedisServer, RedisStore) {
    let server =
        RedisServer::start_with(&["--maxmemory", "3mb", "--maxmemory-policy", "noeviction"]);
    let store = RedisStore::builder(server.pool(4))
        .with_timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    (server, store)
}

/// Redis full (`maxmemory`, `noeviction`): a flood of new identities fills
/// it, and from then on each new identity's check is refused (its policy's
/// fail mode decides), while clients Redis already holds are still decided
/// there: one at its limit stays at its limit throughout, one under it is
/// still admitted and counted. Both single calls and batches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_redis_keeps_limiting_the_clients_it_already_holds() {
    let (server, store) = filled_soon();
    let policy = Policy::new("full", 5, Duration::from_secs(600));
    let counter = Policy::new("full_counter", 5, Duration::from_secs(600))
        .with_algorithm(slidegate::policy::Algorithm::SlidingCounter);
    let checks = |key: &str| {
        vec![
            Check::new(&policy, Key::new(key)).unwrap(),
            Check::new(&counter, Key::new(key)).unwrap(),
        ]
    };
    for _ in 0..5 {
        assert!(store.check(&checks("limited")).await.unwrap()[0].admitted());
    }
    for _ in 0..2 {
        assert!(store.check(&checks("under")).await.unwrap()[0].admitted());
    }

    let mut refused = 0;
    let mut new_clients = 0u32;
    while refused < 50 {
        assert!(new_clients < 200_000, "Redis never filled up");
        // Sixteen new clients at once: batched calls.
        let mut flood = tokio::task::JoinSet::new();
        for _ in 0..16 {
            new_clients += 1;
            let (store, checks) = (store.clone(), checks(&format!("new{new_clients}")));
            flood.spawn(async move { store.check(&checks).await });
        }
        while let Some(outcome) = flood.join_next().await {
            if let Err(error) = outcome.unwrap() {
                assert!(matches!(error, StoreError::Full(_)), "{error}");
                refused += 1;
            }
        }
        if new_clients.is_multiple_of(512) || refused > 0 {
            let decisions = store.check(&checks("limited")).await.unwrap();
            assert!(
                !decisions[0].admitted(),
                "at its limit throughout: {decisions:?}"
            );
        }
    }
    let info = server.cli(&["info", "memory"]);
    assert!(info.contains("maxmemory_policy:noeviction"), "{info}");
    eprintln!("full after {new_clients} new clients");

    // Full now: a new client is refused, one held at its limit is denied,
    // one held under it is admitted and counted, alone or in a batch.
    let error = store.check(&checks("newest")).await.unwrap_err();
    assert!(error.to_string().contains("not tracked"), "{error}");
    let decisions = store.check(&checks("limited")).await.unwrap();
    assert!(!decisions[0].admitted());
    let decisions = store.check(&checks("under")).await.unwrap();
    assert!(decisions[0].admitted());
    assert_eq!((decisions[0].remaining(), decisions[1].remaining()), (2, 2));
    let mut together = tokio::task::JoinSet::new();
    for key in ["under", "limited", "newer"] {
        let (store, checks) = (store.clone(), checks(key));
        together.spawn(async move { (key, store.check(&checks).await) });
    }
    while let Some(joined) = together.join_next().await {
        let (key, outcome) = joined.unwrap();
        match key {
            "under" => assert_eq!(outcome.unwrap()[0].remaining(), 1),
            "limited" => assert!(!outcome.unwrap()[0].admitted()),
            _ => assert!(outcome.is_err(), "a new client is refused"),
        }
    }
}

/// A full Redis still denies what any existing state denies: a blocked
/// client whose count has expired, a client at its daily limit whose
/// per-second count has expired. Only a request that fits and would need
/// new state is refused as full (for its fail mode to decide), alone or
/// in a batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_redis_denies_from_any_state_that_denies() {
    let server = RedisServer::start_with(&["--maxmemory-policy", "noeviction"]);
    // The timeout is not under test (a full Redis answers, with an error
    // for a new client): long, for a loaded machine.
    let store = RedisStore::builder(server.pool(4))
        .with_timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let login =
        Policy::new("login", 2, Duration::from_secs(600)).with_block(Duration::from_secs(600));
    let second = Policy::new("second", 10, Duration::from_secs(1));
    let day = Policy::new("day", 3, Duration::from_secs(86_400));
    let blocked = [Check::new(&login, Key::new("blocked")).unwrap()];
    let daily = |key: &str| {
        [
            Check::new(&second, Key::new(key)).unwrap(),
            Check::new(&day, Key::new(key)).unwrap(),
        ]
    };
    for _ in 0..2 {
        assert!(store.check(&blocked).await.unwrap()[0].admitted());
    }
    assert!(
        !store.check(&blocked).await.unwrap()[0].admitted(),
        "blocked now"
    );
    for _ in 0..3 {
        assert!(store.check(&daily("daily")).await.unwrap()[0].admitted());
    }
    assert!(store.check(&daily("under")).await.unwrap()[0].admitted());
    // Their shorter-lived counts expire (deleted here, as expiry would).
    let deleted = server.cli(&[
        "del",
        "slidegate:login:{user:blocked}:l",
        "slidegate:second:{user:daily}:l",
        "slidegate:second:{user:under}:l",
    ]);
    assert_eq!(deleted.trim(), "3");
    // Full: far past its (lowered) `maxmemory`, so that no expiry meanwhile
    // makes room.
    server.cli(&["config", "set", "maxmemory", "100kb"]);

    let d = store.check(&blocked).await.expect("decided from its block")[0];
    assert!(!d.admitted() && d.blocked_for().is_some(), "{d:?}");
    let d = store
        .check(&daily("daily"))
        .await
        .expect("decided from its day")[0];
    assert!(!d.admitted(), "{d:?}");
    let full = store.check(&daily("under")).await.unwrap_err();
    assert!(
        matches!(full, StoreError::Full(_)),
        "needs a new key: {full}"
    );
    // The same in one batch.
    let mut together = tokio::task::JoinSet::new();
    for key in ["daily", "under", "daily"] {
        let (store, checks) = (store.clone(), daily(key));
        together.spawn(async move { (key, store.check(&checks).await) });
    }
    let (store2, blocked2) = (store.clone(), blocked.clone());
    together.spawn(async move { ("blocked", store2.check(&blocked2).await) });
    while let Some(joined) = together.join_next().await {
        match joined.unwrap() {
            ("under", outcome) => assert!(matches!(outcome, Err(StoreError::Full(_)))),
            (key, outcome) => assert!(!outcome.unwrap()[0].admitted(), "{key}"),
        }
    }
}

/// A store says what Redis evicts when full (only `noeviction` keeps every
/// count), and says nothing where `CONFIG` is refused, as on many managed
/// services.
#[tokio::test]
async fn a_store_says_what_redis_evicts() {
    let server = RedisServer::start();
    let store = RedisStore::builder(server.pool(2)).build().unwrap();
    let within = Duration::from_secs(30);
    assert_eq!(
        store.eviction_policy(within).await.unwrap().as_deref(),
        Some("noeviction")
    );
    for policy in ["allkeys-lru", "volatile-ttl"] {
        server.cli(&["config", "set", "maxmemory-policy", policy]);
        assert_eq!(
            store.eviction_policy(within).await.unwrap().as_deref(),
            Some(policy)
        );
    }
    store.connect(within).await.unwrap();
    // RESP3 answers `CONFIG GET` with a map: read as well.
    let resp3 = deadpool_redis::Config::from_url(format!("{}?protocol=resp3", server.url()))
        .create_pool(Some(deadpool_redis::Runtime::Tokio1))
        .unwrap();
    let resp3 = RedisStore::builder(resp3).build().unwrap();
    assert_eq!(
        resp3.eviction_policy(within).await.unwrap().as_deref(),
        Some("volatile-ttl")
    );
    let clients = server.cli(&["client", "list"]);
    assert!(clients.contains("resp=3"), "{clients}");
    server.cli(&[
        "acl", "setuser", "noconfig", "on", ">secret", "~*", "+@all", "-config",
    ]);
    let url = server.url().replace("redis://", "redis://noconfig:secret@");
    let pool = deadpool_redis::Config::from_url(url)
        .create_pool(Some(deadpool_redis::Runtime::Tokio1))
        .unwrap();
    let refused = RedisStore::builder(pool).build().unwrap();
    assert_eq!(refused.eviction_policy(within).await.unwrap(), None);
    refused.connect(within).await.unwrap();
}

/// Redis full: a client it does not track (new, or one whose bucket
/// expired) is refused by Redis, and a policy that fails open would admit
/// it without any limit for as long as Redis stays full. It is limited by
/// the layer's local count instead (here, the whole limit: one instance):
/// five requests a minute, then 429; and under a concurrency limit of two
/// alone, two held requests, then 429 until they end. A new client's
/// request that could never fit is denied without a block key written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_redis_never_fails_open_for_a_client_it_does_not_track() {
    use axum::{Router, routing::get};
    use tower::ServiceExt;

    let (server, store) = filled_soon();
    // A window of ten minutes: the flood's keys live past the test, so
    // Redis stays full throughout (a bucket's would expire in seconds
    // and free room while the test runs).
    let policy = Policy::new("open", 5, Duration::from_secs(600));
    let mut new_clients = 0u32;
    loop {
        assert!(new_clients < 400_000, "Redis never filled up");
        let flood: Vec<Check> = (0..100)
            .map(|n| Check::new(&policy, Key::new(format!("flood{}", new_clients + n))).unwrap())
            .collect();
        new_clients += 100;
        if let Err(error) = store.check(&flood).await {
            assert!(matches!(error, StoreError::Full(_)), "{error}");
            break;
        }
    }
    // A new client's request that no count can fit (a cost past the
    // limit) is denied, and Redis, with no room for new state, is given
    // no block key for it. (A smaller `maxmemory` keeps Redis full
    // however its own buffers shrink meanwhile.)
    server.cli(&["config", "set", "maxmemory", "1mb"]);
    let blocking =
        Policy::new("blocking", 5, Duration::from_secs(600)).with_block(Duration::from_secs(60));
    let costly = Check::new(&blocking, Key::new("fresh"))
        .unwrap()
        .with_cost(6);
    let denied = store.check(std::slice::from_ref(&costly)).await.unwrap()[0];
    assert!(!denied.admitted(), "{denied:?}");
    let block_key = format!("{}:x", store.base_key(&costly));
    assert_eq!(
        server.cli(&["exists", &block_key]).trim(),
        "0",
        "a block key"
    );

    let client =
        |parts: &http::request::Parts| Some(Key::new(parts.headers.get("x-client")?.as_bytes()));
    let layer = slidegate::RateLimitLayer::new(
        store.clone(),
        client,
        slidegate::Policies::single(policy).unwrap(),
    )
    .with_deny_cache(None);
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .route_layer(layer);
    let request = || {
        http::Request::get("/")
            .header("x-client", "fresh")
            .body(axum::body::Body::empty())
            .unwrap()
    };
    for n in 0..5 {
        let response = app.clone().oneshot(request()).await.unwrap();
        assert_eq!(response.status(), 200, "request {n}");
    }
    let response = app.clone().oneshot(request()).await.unwrap();
    assert_eq!(response.status(), 429, "limited locally, not failed open");

    // A concurrency limit alone: a new client's leases are taken in the
    // local count, and given back there when the responses end.
    let held = Policy::concurrency("held", 2);
    let layer =
        slidegate::RateLimitLayer::new(store, client, slidegate::Policies::single(held).unwrap());
    let (gate, inside) = (
        std::sync::Arc::new(tokio::sync::Semaphore::new(0)),
        std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0)),
    );
    let handler = {
        let (gate, inside) = (gate.clone(), inside.clone());
        move || async move {
            inside.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            gate.acquire().await.unwrap().forget();
            "ok"
        }
    };
    let app = Router::new().route("/", get(handler)).route_layer(layer);
    let first = tokio::spawn(app.clone().oneshot(request()));
    let second = tokio::spawn(app.clone().oneshot(request()));
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while inside.load(std::sync::atomic::Ordering::SeqCst) < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "two requests never got in"
        );
        tokio::task::yield_now().await;
    }
    // Admitted, the third would wait in the handler with the others.
    let third = tokio::time::timeout(Duration::from_secs(60), app.clone().oneshot(request()))
        .await
        .expect("a third lease was given: the limit failed open")
        .unwrap();
    assert_eq!(third.status(), 429, "a third lease, not failed open");
    gate.add_permits(3);
    for held in [first, second] {
        let response = held.await.unwrap().unwrap();
        assert_eq!(response.status(), 200);
        axum::body::to_bytes(response.into_body(), 1024)
            .await
            .unwrap();
    }
    let again = app.clone().oneshot(request()).await.unwrap();
    assert_eq!(again.status(), 200, "the leases were given back locally");
}
