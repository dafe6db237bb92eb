//! Deny lists and limits changed at run time: a static `DenyList` refuses
//! before anything is counted; a denial or a limit set on one instance
//! reaches another through the store, outlives both, and may end by
//! itself; a changed limit applies to the current window.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use http::{Request, StatusCode};
use slidegate::key::Key;
use slidegate::layer::{DenyList, LimitError};
use slidegate::{PeerIp, Policies, Policy, RateLimitLayer};

use crate::support::reply::send;
use crate::support::stores::StoreUnderTest;

const MINUTE: Duration = Duration::from_secs(60);
/// Generous: another instance reads the store every 100 ms, on a machine
/// that may be busy.
const REACHES_WITHIN: Duration = Duration::from_secs(20);

fn search(peer: &str, headers: &[(&str, &str)]) -> Request<Body> {
    let mut builder = Request::get("/search");
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    let mut request = builder.body(Body::empty()).unwrap();
    request.extensions_mut().insert(ConnectInfo(
        format!("{peer}:4000").parse::<SocketAddr>().unwrap(),
    ));
    request
}

fn layer(tested: &StoreUnderTest) -> RateLimitLayer {
    layer_of(tested, 5)
}

/// A layer of one policy, `search`, of `limit` a minute per address.
fn layer_of(tested: &StoreUnderTest, limit: u32) -> RateLimitLayer {
    let policies = Policies::single(Policy::new("search", limit, MINUTE)).unwrap();
    RateLimitLayer::new(tested.store.clone(), PeerIp::new(), policies)
}

fn app(layer: RateLimitLayer) -> Router {
    Router::new()
        .route("/search", get(|| async { "results" }))
        .route_layer(layer)
}

fn key(text: &str) -> Key {
    Key::parse(text).unwrap()
}

/// What `peer` has left under `search`, recording nothing.
async fn left(layer: &RateLimitLayer, peer: &str) -> u32 {
    let standing = layer
        .peek("search", &key(&format!("ip:{peer}")), None)
        .await;
    standing.unwrap().remaining()
}

/// Sends `peer`'s request to `app` until it is answered `status`: how
/// long that took, and how many of the requests were admitted (counted)
/// on the way.
async fn until_answered(app: &Router, peer: &str, status: StatusCode) -> (Duration, u32) {
    let started = Instant::now();
    let mut admitted = 0;
    loop {
        let answered = send(app, search(peer, &[])).await.status;
        if answered == StatusCode::OK {
            admitted += 1;
        }
        if answered == status {
            return (started.elapsed(), admitted);
        }
        assert!(
            started.elapsed() < REACHES_WITHIN,
            "{peer} was not answered {status} within {REACHES_WITHIN:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until `layer` sees `client`'s limit as `limit`, sending another
/// client's requests meanwhile (a read of the store's changes is due on a
/// request); how long that took.
async fn until_limit(layer: &RateLimitLayer, client: &Key, limit: u32) -> Duration {
    let started = Instant::now();
    let app = app(layer.clone());
    while layer.peek("search", client, None).await.unwrap().limit() != limit {
        assert!(
            started.elapsed() < REACHES_WITHIN,
            "the limit {limit} did not reach the layer"
        );
        send(&app, search("192.0.2.250", &[])).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    started.elapsed()
}

async fn a_static_deny_list_refuses_before_anything_is_counted(tested: StoreUnderTest) {
    let deny = DenyList::new()
        .with_networks(["203.0.113.0/24".parse().unwrap()])
        .with_api_keys(["leaked-key"])
        .with_keys([key("ip:192.0.2.9")]);
    let layer = layer(&tested)
        .with_deny_list(deny)
        // An exemption does not lift a denial.
        .with_exemption(|parts| parts.headers.contains_key("x-internal"));
    let app = app(layer.clone());
    for (peer, headers, list) in [
        ("203.0.113.5", vec![], "ips"),
        ("203.0.113.200", vec![("x-internal", "1")], "ips"),
        ("192.0.2.1", vec![("x-api-key", "leaked-key")], "api_keys"),
        ("192.0.2.9", vec![], "ips"),
    ] {
        let reply = send(&app, search(peer, &headers)).await;
        assert_eq!(reply.status, StatusCode::FORBIDDEN, "{peer}");
        assert_eq!(reply.json()["list"], list, "{peer}");
        assert_eq!(reply.header("x-ratelimit-limit"), None);
        assert_eq!(left(&layer, peer).await, 5, "{peer}: nothing counted");
    }
    // Everyone else is limited as ever.
    let reply = send(&app, search("192.0.2.1", &[("x-api-key", "another-key")])).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(left(&layer, "192.0.2.1").await, 4);

    // An address listed by its key is refused whoever the layer takes the
    // client for, and before the client is identified.
    let policies = Policies::single(Policy::new("everyone", 5, MINUTE)).unwrap();
    let keyed_otherwise = RateLimitLayer::new(tested.store.clone(), slidegate::Global, policies)
        .with_deny_list(DenyList::new().with_keys([key("ip:192.0.2.9")]));
    let reply = send(&self::app(keyed_otherwise), search("192.0.2.9", &[])).await;
    assert_eq!(reply.status, StatusCode::FORBIDDEN);
    assert_eq!(reply.json()["list"], "ips");
}

on_both_stores!(a_static_deny_list_refuses_before_anything_is_counted);

async fn a_denial_reaches_every_instance_and_outlives_them(tested: StoreUnderTest) {
    // Room for the requests that probe the other instance.
    let here = layer_of(&tested, 1000);
    let there = layer_of(&tested, 1000).with_runtime_changes(Duration::from_millis(100));
    let (here_app, there_app) = (app(here.clone()), app(there.clone()));
    // The other instance has read the store once already.
    assert_eq!(
        send(&there_app, search("192.0.2.7", &[])).await.status,
        StatusCode::OK
    );
    let mut admitted = 1;

    here.changes()
        .deny(&key("ip:192.0.2.7"), None)
        .await
        .unwrap();
    assert_eq!(
        send(&here_app, search("192.0.2.7", &[])).await.status,
        StatusCode::FORBIDDEN,
        "at once where it was made"
    );
    let (took, before) = until_answered(&there_app, "192.0.2.7", StatusCode::FORBIDDEN).await;
    admitted += before;
    eprintln!("a denial reached another instance in {took:?}");
    // A network, denied at run time.
    here.changes()
        .deny(&key("ip:198.51.100.0/24"), None)
        .await
        .unwrap();
    until_answered(&there_app, "198.51.100.77", StatusCode::FORBIDDEN).await;

    // An instance started afterwards reads it before its first request.
    let restarted = layer_of(&tested, 1000);
    restarted.changes().read().await.unwrap();
    let restarted_app = app(restarted);
    assert_eq!(
        send(&restarted_app, search("192.0.2.7", &[])).await.status,
        StatusCode::FORBIDDEN
    );

    here.changes()
        .remove_denial(&key("ip:192.0.2.7"))
        .await
        .unwrap();
    assert_eq!(
        send(&here_app, search("192.0.2.7", &[])).await.status,
        StatusCode::OK
    );
    let (_, after) = until_answered(&there_app, "192.0.2.7", StatusCode::OK).await;
    admitted += 1 + after;
    assert_eq!(
        1000 - left(&here, "192.0.2.7").await,
        admitted,
        "the admitted requests alone are counted, the denied ones not"
    );
}

on_both_stores!(a_denial_reaches_every_instance_and_outlives_them);

async fn a_denial_for_a_while_ends_by_itself(tested: StoreUnderTest) {
    let here = layer(&tested).with_runtime_changes(Duration::from_millis(100));
    let app = app(here.clone());
    here.changes()
        .deny(&key("ip:192.0.2.8"), Some(Duration::from_secs(1)))
        .await
        .unwrap();
    assert_eq!(
        send(&app, search("192.0.2.8", &[])).await.status,
        StatusCode::FORBIDDEN
    );
    let (took, _) = until_answered(&app, "192.0.2.8", StatusCode::OK).await;
    assert!(took >= Duration::from_millis(500), "ended after {took:?}");
}

on_both_stores!(a_denial_for_a_while_ends_by_itself);

/// An ended denial's entry is removed only while it holds what was read:
/// a denial set again meanwhile stays.
async fn an_entry_is_removed_only_while_it_holds_what_was_read(tested: StoreUnderTest) {
    let store = &tested.store;
    let fields = || async {
        let mut entries = store.entries("deny").await.unwrap();
        entries.sort();
        entries
    };
    store
        .set_entry("deny", "ip:192.0.2.8", "1000")
        .await
        .unwrap();
    store.set_entry("deny", "ip:192.0.2.8", "0").await.unwrap();
    store
        .remove_entry("deny", "ip:192.0.2.8", Some("1000"))
        .await
        .unwrap();
    assert_eq!(
        fields().await,
        [("ip:192.0.2.8".to_owned(), "0".to_owned())]
    );
    store
        .remove_entry("deny", "ip:192.0.2.8", Some("0"))
        .await
        .unwrap();
    assert_eq!(fields().await, []);
    store.set_entry("deny", "jwt:x", "5").await.unwrap();
    store.remove_entry("deny", "jwt:x", None).await.unwrap();
    assert_eq!(fields().await, []);
}

on_both_stores!(an_entry_is_removed_only_while_it_holds_what_was_read);

async fn a_limit_set_at_run_time_applies_to_the_current_window(tested: StoreUnderTest) {
    let here = layer(&tested);
    let there = layer(&tested).with_runtime_changes(Duration::from_millis(100));
    let (here_app, there_app) = (app(here.clone()), app(there.clone()));
    for _ in 0..3 {
        assert_eq!(
            send(&here_app, search("192.0.2.5", &[])).await.status,
            StatusCode::OK
        );
    }
    let client = key("ip:192.0.2.5");
    // Below the count: denied at once, nothing reset.
    here.changes()
        .set_limit("search", &client, 2)
        .await
        .unwrap();
    let denied = send(&here_app, search("192.0.2.5", &[])).await;
    assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(denied.header("x-ratelimit-limit"), Some("2"));
    let took = until_limit(&there, &client, 2).await;
    eprintln!("a limit reached another instance in {took:?}");
    let denied = send(&there_app, search("192.0.2.5", &[])).await;
    assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);

    // Above it: the client goes on from its count.
    here.changes()
        .set_limit("search", &client, 7)
        .await
        .unwrap();
    let mut statuses = Vec::new();
    for _ in 0..5 {
        statuses.push(
            send(&here_app, search("192.0.2.5", &[]))
                .await
                .status
                .as_u16(),
        );
    }
    assert_eq!(
        statuses,
        [200, 200, 200, 200, 429],
        "3 counted, 4 more of 7"
    );

    // A restarted instance reads it; cleared, the policy's 5 applies.
    let restarted = layer(&tested);
    restarted.changes().read().await.unwrap();
    assert_eq!(
        restarted
            .peek("search", &client, None)
            .await
            .unwrap()
            .limit(),
        7
    );
    let restarted_app = app(restarted);
    let reply = send(&restarted_app, search("192.0.2.5", &[])).await;
    assert_eq!(reply.header("x-ratelimit-limit"), Some("7"));
    here.changes().clear_limit("search", &client).await.unwrap();
    let reply = send(&here_app, search("192.0.2.5", &[])).await;
    assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(reply.header("x-ratelimit-limit"), Some("5"));

    // What cannot be counted is refused, naming why.
    let changes = here.changes();
    assert!(matches!(
        changes.set_limit("serch", &client, 5).await,
        Err(LimitError::UnknownPolicy(_))
    ));
    assert!(matches!(
        changes.set_limit("search", &client, 0).await,
        Err(LimitError::InvalidLimit(_))
    ));
}

on_both_stores!(a_limit_set_at_run_time_applies_to_the_current_window);

/// The config file's `[deny]`: each list refuses its clients, and a bad
/// entry stops the file naming its key.
#[tokio::test]
async fn the_config_files_deny_section_refuses_its_clients() {
    let config = slidegate::config::Config::from_toml_str(
        r#"
        [[policy]]
        name = "search"
        limit = 5
        window = "60s"

        [deny]
        ips = ["203.0.113.0/24", "198.51.100.7"]
        api_keys = ["leaked-key"]
        subjects = ["ip:192.0.2.9"]
        "#,
    )
    .unwrap();
    let app = app(config.layer(slidegate::store::MemoryStore::new()));
    for (peer, headers) in [
        ("203.0.113.1", vec![]),
        ("198.51.100.7", vec![]),
        ("192.0.2.9", vec![]),
        ("192.0.2.1", vec![("x-api-key", "leaked-key")]),
    ] {
        let status = send(&app, search(peer, &headers)).await.status;
        assert_eq!(status, StatusCode::FORBIDDEN, "{peer} {headers:?}");
    }
    assert_eq!(
        send(&app, search("192.0.2.1", &[])).await.status,
        StatusCode::OK
    );

    for (deny, key, message) in [
        ("ips = [\"203.0.113.0/33\"]", "deny.ips", "not a CIDR range"),
        ("api_keys = [\"\"]", "deny.api_keys", "must not be empty"),
        ("subjects = [\"jwt:{x}\"]", "deny.subjects", "label form"),
        ("people = []", "deny", "unknown field"),
    ] {
        let file = format!("[deny]\n{deny}\n");
        let error = slidegate::config::Config::from_toml_str(&file)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains(key) && error.contains(message),
            "{deny}: {error}"
        );
    }
}

/// A client found only once an API-key lookup has said no (the next
/// extractor's) is refused as a listed client, like any other.
#[tokio::test]
async fn a_client_found_after_a_lookup_is_refused_when_listed() {
    use slidegate::key::ApiKeyStatus;
    use slidegate::{Header, KeyExtractor};

    let unknown = |_: &[u8]| async { ApiKeyStatus::Unknown };
    let mallory = |_: &http::request::Parts| Some(Key::new("mallory"));
    let keys = Header::new(http::HeaderName::from_static("x-api-key"))
        .with_lookup(unknown)
        .or(mallory);
    let policies = Policies::single(Policy::new("search", 5, MINUTE)).unwrap();
    let store = slidegate::store::MemoryStore::new();
    let layer = RateLimitLayer::new(store, keys, policies)
        .with_deny_list(DenyList::new().with_keys([key("user:mallory")]));
    let app = app(layer);
    for headers in [vec![], vec![("x-api-key", "made-up")]] {
        let status = send(&app, search("192.0.2.1", &headers)).await.status;
        assert_eq!(status, StatusCode::FORBIDDEN, "{headers:?}");
    }
}

/// Behind a trusted proxy, an address denied at run time is refused
/// whatever identifies the client (here a known API key): the layer a
/// config file builds finds the address as its key sources do.
#[tokio::test]
async fn an_address_denied_at_run_time_is_refused_behind_a_trusted_proxy() {
    let config = slidegate::config::Config::from_toml_str(
        r#"
        [limiter]
        keys = ["api_key", "ip"]
        trusted_proxies = ["10.0.0.0/8"]

        [api_keys]
        "key-of-acme" = "pro"

        [[policy]]
        name = "search"
        limit = 5
        window = "60s"
        "#,
    )
    .unwrap();
    let layer = config.layer(slidegate::store::MemoryStore::new());
    layer
        .changes()
        .deny(&key("ip:203.0.113.9"), None)
        .await
        .unwrap();
    let app = app(layer);
    let through_the_proxy = [
        ("x-forwarded-for", "203.0.113.9"),
        ("x-api-key", "key-of-acme"),
    ];
    let reply = send(&app, search("10.0.0.1", &through_the_proxy)).await;
    assert_eq!(reply.status, StatusCode::FORBIDDEN);
    let other = [
        ("x-forwarded-for", "203.0.113.10"),
        ("x-api-key", "key-of-acme"),
    ];
    assert_eq!(
        send(&app, search("10.0.0.1", &other)).await.status,
        StatusCode::OK
    );
}

/// A change names a key as the layer matches it, however its address is
/// written; and a client keyed by its address is in a denied network
/// whatever resolves the list's own addresses (here, a layer behind a
/// proxy whose deny list was given no proxies).
#[tokio::test]
async fn addresses_are_matched_however_written_and_by_the_layers_key() {
    let policies = Policies::single(Policy::new("search", 5, MINUTE)).unwrap();
    let behind_a_proxy = PeerIp::new().with_trusted_proxies(["10.0.0.0/8".parse().unwrap()]);
    let layer = RateLimitLayer::new(
        slidegate::store::MemoryStore::new(),
        behind_a_proxy,
        policies,
    );
    let changes = layer.changes();
    changes.deny(&key("ip:2001:DB8::1"), None).await.unwrap();
    changes
        .deny(&key("ip:203.0.113.77/24"), None)
        .await
        .unwrap();
    changes
        .set_limit("search", &key("ip:198.51.100.7"), 1)
        .await
        .unwrap();
    let app = app(layer);
    let mut v6 = Request::get("/search").body(Body::empty()).unwrap();
    v6.extensions_mut().insert(ConnectInfo(
        "[2001:db8::1]:4000".parse::<SocketAddr>().unwrap(),
    ));
    assert_eq!(send(&app, v6).await.status, StatusCode::FORBIDDEN);
    let through = |client: &str| search("10.0.0.1", &[("x-forwarded-for", client)]);
    assert_eq!(
        send(&app, through("203.0.113.9")).await.status,
        StatusCode::FORBIDDEN
    );
    assert_eq!(
        send(&app, through("203.0.114.9")).await.status,
        StatusCode::OK
    );
    let reply = send(&app, through("198.51.100.7")).await;
    assert_eq!(reply.header("x-ratelimit-limit"), Some("1"));
}
