//! The limiter tried as an attacker would: each test is a way around a
//! limit, or a way to switch the limiter off, and shows it closed.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::support::RedisServer;
use crate::support::reply::{Reply, send};
use crate::support::stores::StoreUnderTest;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::{get, post};
use axum::{Extension, Router};
use http::{HeaderName, Request, StatusCode};
use jsonwebtoken::{Algorithm, EncodingKey, Header as JwtHeader, encode};
use serde_json::{Value, json};
use slidegate::config::Config;
use slidegate::{
    Header, JwtClaim, KeyExtractor, PeerIp, Policies, Policy, RateLimitLayer, Rejection,
    clock::FakeClock,
    key::{ApiKeyStatus, Identity, Key},
    layer::CredentialFailures,
    lookup::Lookup,
    store::{MemoryStore, RedisStore, Store},
};

const MINUTE: Duration = Duration::from_secs(60);
const SECRET: &[u8] = b"secret-of-the-abuse-tests";

fn request(method: &str, uri: &str, peer: &str, headers: &[(&str, &[u8])]) -> Request<Body> {
    let mut builder = Request::builder().method(method).uri(uri);
    for (name, value) in headers {
        builder = builder.header(*name, http::HeaderValue::from_bytes(value).unwrap());
    }
    let mut request = builder.body(Body::empty()).unwrap();
    request
        .extensions_mut()
        .insert(ConnectInfo(peer.parse::<SocketAddr>().unwrap()));
    request
}

/// Sends `count` requests made by `make` and returns their statuses.
async fn statuses(
    app: &Router,
    count: usize,
    mut make: impl FnMut(usize) -> Request<Body>,
) -> Vec<u16> {
    let mut statuses = Vec::with_capacity(count);
    for index in 0..count {
        statuses.push(send(app, make(index)).await.status.as_u16());
    }
    statuses
}

/// `/` answering "ok", behind `layer`.
fn root_app(layer: RateLimitLayer) -> Router {
    Router::new()
        .route("/", get(|| async { "ok" }))
        .route_layer(layer)
}

/// `GET /` from `peer` with the `Authorization` value `token`.
async fn with_token(app: &Router, peer: &str, token: &str) -> Reply {
    send(
        app,
        request("GET", "/", peer, &[("authorization", token.as_bytes())]),
    )
    .await
}

// ------------------------------------------------------------ HEAD is GET

fn search_app(store: impl Store) -> Router {
    let policies = Policies::builder()
        .with_route("GET /api/search", Policy::new("search", 5, MINUTE))
        .build()
        .unwrap();
    Router::new()
        .route("/api/search", get(|| async { "results" }))
        .route_layer(RateLimitLayer::new(store, PeerIp::new(), policies).with_deny_cache(None))
}

async fn head_on_a_get_route_is_counted_as_the_get(tested: StoreUnderTest) {
    let store = tested.store;
    let app = search_app(store);
    let heads = statuses(&app, 8, |_| {
        request("HEAD", "/api/search?q=a", "192.0.2.1:1", &[])
    })
    .await;
    assert_eq!(heads, [200, 200, 200, 200, 200, 429, 429, 429]);
    let get = send(&app, request("GET", "/api/search?q=a", "192.0.2.1:1", &[])).await;
    assert_eq!(get.status, StatusCode::TOO_MANY_REQUESTS);

    // HEAD then GET from another client: one count.
    let head = send(&app, request("HEAD", "/api/search", "192.0.2.2:1", &[])).await;
    assert_eq!(head.header("x-ratelimit-remaining"), Some("4"));
    let get = send(&app, request("GET", "/api/search", "192.0.2.2:1", &[])).await;
    assert_eq!(get.header("x-ratelimit-remaining"), Some("3"));
}
on_both_stores!(head_on_a_get_route_is_counted_as_the_get);

// ------------------------------------------------- forwarding header bytes

#[tokio::test]
async fn a_non_ascii_forwarding_element_does_not_key_the_client_as_its_proxy() {
    let policies = Policies::single(Policy::new("all", 2, MINUTE)).unwrap();
    let keys = PeerIp::new().with_trusted_proxies(["10.0.0.0/8".parse().unwrap()]);
    let app = root_app(RateLimitLayer::new(MemoryStore::new(), keys, policies));
    // Two clients behind one proxy, each with a junk byte of its own in
    // front of the address the proxy appended.
    let from = |client: &str| {
        let line = [b"\x80, ".as_slice(), client.as_bytes()].concat();
        request("GET", "/", "10.0.0.1:1", &[("x-forwarded-for", &line)])
    };
    let first = statuses(&app, 3, |_| from("203.0.113.9")).await;
    assert_eq!(first, [200, 200, 429]);
    let second = statuses(&app, 2, |_| from("198.51.100.4")).await;
    assert_eq!(
        second,
        [200, 200],
        "another client is not the proxy's bucket"
    );
}

// ------------------------------------------- wrong-typed registered claims

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

fn hs256(claims: &Value) -> String {
    slidegate::JwtClaim::install_crypto_provider();
    let token = encode(
        &JwtHeader::new(Algorithm::HS256),
        claims,
        &EncodingKey::from_secret(SECRET),
    )
    .unwrap();
    format!("Bearer {token}")
}

#[tokio::test]
async fn validly_signed_tokens_with_wrong_typed_claims_are_refused() {
    let jwt = JwtClaim::builder()
        .with_secret(SECRET)
        .with_algorithms(["HS256"])
        .with_issuers(["https://auth.example"])
        .with_audiences(["video-api"])
        .build()
        .unwrap();
    let policies = Policies::single(Policy::new("all", 100, MINUTE)).unwrap();
    let app = root_app(RateLimitLayer::new(MemoryStore::new(), jwt, policies));
    let valid = json!({
        "sub": "alice",
        "exp": now() + 3600,
        "iss": "https://auth.example",
        "aud": "video-api",
    });
    let with = |claim: &str, value: Value| {
        let mut claims = valid.clone();
        claims[claim] = value;
        hs256(&claims)
    };
    let ok = send(
        &app,
        request(
            "GET",
            "/",
            "192.0.2.1:1",
            &[("authorization", hs256(&valid).as_bytes())],
        ),
    )
    .await;
    assert_eq!(ok.status, StatusCode::OK, "{}", ok.body);
    for token in [
        with("aud", json!(1)),
        with("aud", json!(["video-api", 5])),
        with("aud", json!({"video-api": true})),
        with("iss", json!(1)),
        with("iss", json!({"a": 1})),
        with("exp", json!("never")),
        with("nbf", json!("now")),
    ] {
        let reply = with_token(&app, "192.0.2.1:1", &token).await;
        assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{}", reply.body);
        assert_eq!(reply.json()["reason"], "invalid_claim", "{}", reply.body);
    }
}

#[tokio::test]
async fn a_refused_algorithm_is_not_echoed_nor_the_allowed_ones_listed() {
    let jwt = JwtClaim::builder()
        .with_secret(SECRET)
        .with_algorithms(["HS256"])
        .build()
        .unwrap();
    let policies = Policies::single(Policy::new("all", 100, MINUTE)).unwrap();
    let app = root_app(RateLimitLayer::new(MemoryStore::new(), jwt, policies));
    let token = encode(
        &JwtHeader::new(Algorithm::HS512),
        &json!({"sub": "a", "exp": now() + 60}),
        &EncodingKey::from_secret(SECRET),
    )
    .unwrap();
    let reply = send(
        &app,
        request(
            "GET",
            "/",
            "192.0.2.1:1",
            &[("authorization", format!("Bearer {token}").as_bytes())],
        ),
    )
    .await;
    assert_eq!(reply.status, StatusCode::UNAUTHORIZED);
    assert_eq!(reply.json()["reason"], "algorithm_not_allowed");
    assert!(!reply.body.contains("HS512"), "{}", reply.body);
    assert!(!reply.body.contains("HS256"), "{}", reply.body);
}

// ------------------------------------------------- a computed cost of zero

async fn a_client_derived_cost_of_zero_is_never_free(tested: StoreUnderTest) {
    let store = tested.store;
    let policies = Policies::single(Policy::new("rows", 3, MINUTE)).unwrap();
    // The shape of cost function a user writes: a header's number.
    let rows = |parts: &http::request::Parts, _: &Policy| {
        parts
            .headers
            .get("x-rows")?
            .to_str()
            .ok()?
            .parse::<u32>()
            .ok()
    };
    let app = root_app(
        RateLimitLayer::new(store, PeerIp::new(), policies)
            .with_request_cost(rows)
            .with_deny_cache(None),
    );
    let zeros = statuses(&app, 6, |_| {
        request("GET", "/", "192.0.2.1:1", &[("x-rows", b"0")])
    })
    .await;
    assert_eq!(zeros, [200, 200, 200, 429, 429, 429]);
}
on_both_stores!(a_client_derived_cost_of_zero_is_never_free);

// ----------------------------------------------------- unknown API keys

fn login_app(store: Arc<dyn Store>, keys: impl KeyExtractor) -> Router {
    let policies = Policies::builder()
        .with_route("POST /api/login", Policy::new("login", 3, MINUTE))
        .build()
        .unwrap();
    Router::new()
        .route("/api/login", post(|| async { "welcome" }))
        .route_layer(RateLimitLayer::new(store, keys, policies).with_deny_cache(None))
}

/// `POST /api/login` from 192.0.2.9 with `headers`.
async fn login(app: &Router, headers: &[(&str, &[u8])]) -> Reply {
    send(app, request("POST", "/api/login", "192.0.2.9:1", headers)).await
}

fn api_keys() -> Header {
    Header::new(HeaderName::from_static("x-api-key")).with_tiers([("key-of-acme", "pro")])
}

/// A fresh random API key per request, as an attacker would send.
fn random_key(index: usize) -> Vec<u8> {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!("random-{index}-{nanos}").into_bytes()
}

async fn random_api_keys_are_limited_by_the_clients_address(tested: StoreUnderTest) {
    let store = tested.store;
    let app = login_app(store, api_keys().or(PeerIp::new()));
    let replies = statuses(&app, 6, |index| {
        let key = random_key(index);
        request("POST", "/api/login", "192.0.2.9:1", &[("x-api-key", &key)])
    })
    .await;
    assert_eq!(replies, [200, 200, 200, 429, 429, 429]);
    // The known key is its own client, with its own count.
    let known = login(&app, &[("x-api-key", b"key-of-acme")]).await;
    assert_eq!(known.status, StatusCode::OK);
}
on_both_stores!(random_api_keys_are_limited_by_the_clients_address);

#[tokio::test]
async fn unknown_api_keys_can_be_refused_outright() {
    let app = login_app(
        Arc::new(MemoryStore::new()),
        api_keys().with_unknown_rejected(true).or(PeerIp::new()),
    );
    let reply = login(&app, &[("x-api-key", b"guess")]).await;
    assert_eq!(reply.status, StatusCode::UNAUTHORIZED);
    assert_eq!(
        reply.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(reply.json()["reason"], "unknown_api_key");
    assert_eq!(
        reply.header("www-authenticate"),
        Some("ApiKey header=\"x-api-key\"")
    );

    // The same from a configuration file.
    let config = Config::from_toml_str(
        r#"
        [limiter]
        keys = ["api_key", "ip"]
        unknown_api_key = "reject"

        [api_keys]
        "key-of-acme" = "pro"

        [[policy]]
        name = "login"
        route = "POST /api/login"
        limit = 3
        window = "60s"
        "#,
    )
    .unwrap();
    let app = Router::new()
        .route("/api/login", post(|| async { "welcome" }))
        .route_layer(config.layer(MemoryStore::new()));
    let guess = login(&app, &[("x-api-key", b"guess")]).await;
    assert_eq!(guess.status, StatusCode::UNAUTHORIZED);
    assert_eq!(guess.json()["reason"], "unknown_api_key");
    let known = login(&app, &[("x-api-key", b"key-of-acme")]).await;
    assert_eq!(known.status, StatusCode::OK);
}

#[tokio::test]
async fn a_credentials_only_chain_answers_a_request_without_any_401() {
    let app = login_app(Arc::new(MemoryStore::new()), api_keys());
    let bare = login(&app, &[]).await;
    assert_eq!(bare.status, StatusCode::UNAUTHORIZED);
    assert_eq!(bare.json()["reason"], "missing_credentials");
    let unknown = login(&app, &[("x-api-key", b"guess")]).await;
    assert_eq!(
        unknown.status,
        StatusCode::UNAUTHORIZED,
        "unknown is no identity either"
    );

    // The answer is the layer's to choose.
    let policies = Policies::single(Policy::new("all", 3, MINUTE)).unwrap();
    let custom = root_app(
        RateLimitLayer::new(MemoryStore::new(), api_keys(), policies).on_rejection(
            |rejection, _| {
                let Rejection::Unidentified {
                    missing_credentials: true,
                } = rejection
                else {
                    return None;
                };
                let response = http::Response::builder()
                    .status(StatusCode::FORBIDDEN)
                    .body(bytes::Bytes::from_static(b"send an API key"))
                    .unwrap();
                Some(response)
            },
        ),
    );
    let reply = send(&custom, request("GET", "/", "192.0.2.9:1", &[])).await;
    assert_eq!(reply.status, StatusCode::FORBIDDEN);
    assert_eq!(reply.body, "send an API key");
}

// ------------------------------------------------------------ key labels

#[tokio::test]
async fn no_closure_or_header_can_spend_another_sources_bucket() {
    let policies = Policies::single(Policy::new("all", 2, MINUTE)).unwrap();
    let store = MemoryStore::new();
    let victim = "192.0.2.7:1";
    // The victim, keyed by address, spends its two requests... after an
    // attacker tried to spend them through keys that spell its bucket.
    let forged = |parts: &http::request::Parts| {
        parts
            .headers
            .get("x-tenant")
            .map(|value| Key::new(value.as_bytes()))
    };
    let tenant = Header::trusted(HeaderName::from_static("x-tenant")).with_public_values(true);
    let app = root_app(RateLimitLayer::new(
        store.clone(),
        forged.or(tenant).or(PeerIp::new()),
        policies.clone(),
    ));
    let by_closure = statuses(&app, 3, |_| {
        request(
            "GET",
            "/",
            "198.51.100.1:1",
            &[("x-tenant", b"ip:192.0.2.7")],
        )
    })
    .await;
    assert_eq!(by_closure, [200, 200, 429]);
    let header_only = root_app(RateLimitLayer::new(
        store.clone(),
        Header::trusted(HeaderName::from_static("x-tenant")).with_public_values(true),
        policies.clone(),
    ));
    for forged in [&b"ip:192.0.2.7"[..], b"global", b"jwt:alice"] {
        let replies = statuses(&header_only, 3, |_| {
            request("GET", "/", "198.51.100.1:1", &[("x-tenant", forged)])
        })
        .await;
        assert_eq!(replies, [200, 200, 429]);
    }
    let by_address = root_app(RateLimitLayer::new(store, PeerIp::new(), policies));
    let replies = statuses(&by_address, 3, |_| request("GET", "/", victim, &[])).await;
    assert_eq!(replies, [200, 200, 429], "the victim's bucket is untouched");
}

// ------------------------------------------------ a flood of new clients

#[tokio::test]
async fn a_flood_of_new_keys_never_fails_open_nor_forgets_an_active_client() {
    let clock = FakeClock::new(1_700_000_000_000_000);
    let store = MemoryStore::builder()
        .with_clock(clock.clone())
        .with_max_keys(64)
        .build();
    let policies = Policies::single(Policy::new("all", 5, MINUTE)).unwrap();
    let app = root_app(RateLimitLayer::new(store.clone(), PeerIp::new(), policies));
    let flooder = |n: usize| format!("10.1.{}.{}:1", n / 256, n % 256);
    // The store is full before the active client arrives.
    let filled = statuses(&app, 64, |n| request("GET", "/", &flooder(n), &[])).await;
    assert!(filled.iter().all(|&s| s == 200));
    let active = "192.0.2.50:1";
    let spent = statuses(&app, 6, |_| request("GET", "/", active, &[])).await;
    assert_eq!(spent, [200, 200, 200, 200, 200, 429]);

    // A thousand one-request keys; the active client keeps sending.
    for n in 64..1064 {
        let reply = send(&app, request("GET", "/", &flooder(n), &[])).await;
        assert_eq!(reply.status, StatusCode::OK);
        assert_eq!(
            reply.header("x-ratelimit-remaining"),
            Some("4"),
            "each flood key is counted, not waved through"
        );
        if n % 5 == 0 {
            let again = send(&app, request("GET", "/", active, &[])).await;
            assert_eq!(
                again.status,
                StatusCode::TOO_MANY_REQUESTS,
                "after flood key {n}"
            );
        }
        assert!(store.len() <= 64);
    }

    // A new client after the flood is counted like anyone else.
    let newcomer = statuses(&app, 6, |_| request("GET", "/", "192.0.2.60:1", &[])).await;
    assert_eq!(newcomer, [200, 200, 200, 200, 200, 429]);
}

// ------------------------------------------- refused credentials, counted

/// The RS256 extractor of the tests, counting the tokens it verifies.
#[derive(Clone)]
struct CountingJwt {
    jwt: JwtClaim,
    verified: Arc<AtomicUsize>,
}

impl KeyExtractor for CountingJwt {
    fn extract(
        &self,
        parts: &http::request::Parts,
    ) -> Result<Option<slidegate::key::Identity>, slidegate::key::KeyRejection> {
        if self.jwt.presents_credentials(parts) {
            self.verified.fetch_add(1, Ordering::SeqCst);
        }
        self.jwt.extract(parts)
    }

    fn presents_credentials(&self, parts: &http::request::Parts) -> bool {
        self.jwt.presents_credentials(parts)
    }

    fn needs_credentials(&self) -> bool {
        true
    }
}

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(format!("{}/fixtures/{name}", env!("CARGO_MANIFEST_DIR"))).unwrap()
}

fn rs256(private_pem: &str, sub: &str) -> String {
    let key = EncodingKey::from_rsa_pem(&fixture(private_pem)).unwrap();
    let claims = json!({ "sub": sub, "exp": now() + 3600 });
    slidegate::JwtClaim::install_crypto_provider();
    let token = encode(&JwtHeader::new(Algorithm::RS256), &claims, &key).unwrap();
    format!("Bearer {token}")
}

async fn a_flood_of_forged_tokens_is_limited_before_verification(tested: StoreUnderTest) {
    let store = tested.store;
    let verified = Arc::new(AtomicUsize::new(0));
    let jwt = CountingJwt {
        jwt: JwtClaim::builder()
            .with_public_key_pem(&fixture("rsa_public.pem"))
            .with_algorithms(["RS256"])
            .build()
            .unwrap(),
        verified: verified.clone(),
    };
    let policies = Policies::single(Policy::new("all", 1000, MINUTE)).unwrap();
    let app = root_app(
        RateLimitLayer::new(store, jwt.or(PeerIp::new()), policies)
            .with_credential_failures(CredentialFailures::new(10, MINUTE)),
    );
    // Well-formed tokens signed with another key: bad signatures.
    let forged = rs256("rsa_other_private.pem", "alice");
    let attacker = "192.0.2.66:1";
    let mut replies = Vec::new();
    for _ in 0..30 {
        replies.push(with_token(&app, attacker, &forged).await);
    }
    let codes: Vec<u16> = replies.iter().map(|r| r.status.as_u16()).collect();
    assert_eq!(codes[..10], [401; 10]);
    assert_eq!(codes[10..], [429; 20]);
    assert_eq!(replies[0].json()["reason"], "bad_signature");
    let blocked = &replies[10];
    let retry: u64 = blocked.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=60).contains(&retry), "Retry-After {retry}");
    assert_eq!(blocked.json()["policy"], "credential_failures");
    assert_eq!(
        verified.load(Ordering::SeqCst),
        10,
        "nothing past the limit was verified"
    );

    // Any credential from that address waits, a valid one too...
    let valid = rs256("rsa_private.pem", "alice");
    let reply = with_token(&app, attacker, &valid).await;
    assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS);
    // ...while requests without credentials, and other addresses, go on.
    let bare = send(&app, request("GET", "/", attacker, &[])).await;
    assert_eq!(bare.status, StatusCode::OK);
    let elsewhere = with_token(&app, "192.0.2.67:1", &valid).await;
    assert_eq!(elsewhere.status, StatusCode::OK);
    assert_eq!(verified.load(Ordering::SeqCst), 11);
}
on_both_stores!(a_flood_of_forged_tokens_is_limited_before_verification);

#[tokio::test]
async fn refused_api_keys_count_too_and_the_count_can_be_switched_off() {
    let source = |failures: &str| {
        format!(
            r#"
            [limiter]
            keys = ["api_key", "ip"]
            unknown_api_key = "reject"
            {failures}

            [api_keys]
            "key-of-acme" = "pro"

            [default]
            limit = 100
            window = "60s"
            "#
        )
    };
    for (failures, expected_429s) in [
        ("", 4),
        ("credential_failures = { limit = 3, window = \"1m\" }", 11),
        ("credential_failures = false", 0),
    ] {
        let config = Config::from_toml_str(&source(failures)).unwrap();
        let app = root_app(config.layer(MemoryStore::new()));
        let codes = statuses(&app, 14, |n| {
            let key = random_key(n);
            request("GET", "/", "192.0.2.70:1", &[("x-api-key", &key)])
        })
        .await;
        let denied = codes.iter().filter(|&&c| c == 429).count();
        assert_eq!(denied, expected_429s, "{failures:?}: {codes:?}");
        assert!(codes.iter().all(|&c| c == 401 || c == 429));
    }
}

// ------------------------------------------ API keys kept in a database

/// `/` echoing the identity the limiter resolved, 3 a minute.
fn whoami_app(layer: RateLimitLayer) -> Router {
    Router::new()
        .route(
            "/",
            get(|Extension(identity): Extension<Identity>| async move {
                json!({ "key": identity.key.as_str(), "tier": identity.tier.as_deref() })
                    .to_string()
            }),
        )
        .route_layer(layer.with_identity_extension(true))
}

/// Keys starting `db-` exist, `db-pro` of tier `pro`; counts its calls.
fn database(calls: Arc<AtomicUsize>) -> impl for<'a> Lookup<&'a [u8], Answer = ApiKeyStatus> {
    move |key: &[u8]| {
        calls.fetch_add(1, Ordering::SeqCst);
        let status = match key {
            b"db-pro" => ApiKeyStatus::Known(Some(Arc::from("pro"))),
            key if key.starts_with(b"db-") => ApiKeyStatus::Known(None),
            _ => ApiKeyStatus::Unknown,
        };
        async move {
            tokio::task::yield_now().await;
            status
        }
    }
}

async fn an_async_lookup_confirms_keys_outside_the_table(tested: StoreUnderTest) {
    let store = tested.store;
    let calls = Arc::new(AtomicUsize::new(0));
    let keys = api_keys()
        .with_lookup(database(calls.clone()))
        .or(PeerIp::new());
    let policies = Policies::single(Policy::new("all", 3, MINUTE)).unwrap();
    let app = whoami_app(RateLimitLayer::new(store, keys, policies).with_deny_cache(None));
    let get = |key: &'static [u8]| request("GET", "/", "192.0.2.80:1", &[("x-api-key", key)]);

    let pro = send(&app, get(b"db-pro")).await.json();
    assert!(pro["key"].as_str().unwrap().starts_with("key:#"), "{pro}");
    assert_eq!(pro["tier"], "pro");
    let table = send(&app, get(b"key-of-acme")).await.json();
    assert_eq!(table["tier"], "pro");
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "keys in the table are not looked up"
    );

    // Random keys the database does not know: the address decides.
    let codes = statuses(&app, 5, |n| {
        let key = random_key(n);
        request("GET", "/", "192.0.2.80:1", &[("x-api-key", &key)])
    })
    .await;
    assert_eq!(codes, [200, 200, 200, 429, 429]);
    assert_eq!(calls.load(Ordering::SeqCst), 6);
    let unknown = send(
        &app,
        request("GET", "/", "192.0.2.81:1", &[("x-api-key", b"nope")]),
    )
    .await;
    assert_eq!(unknown.json()["key"], "ip:192.0.2.81");
}
on_both_stores!(an_async_lookup_confirms_keys_outside_the_table);

#[tokio::test]
async fn an_unknown_key_falls_through_the_whole_chain_or_is_refused() {
    let calls = Arc::new(AtomicUsize::new(0));
    let other = Header::new(HeaderName::from_static("x-other-key")).with_keys(["other-known"]);
    let keys = api_keys()
        .with_lookup(database(calls.clone()))
        .or(other)
        .or(PeerIp::new());
    let policies = Policies::single(Policy::new("all", 3, MINUTE)).unwrap();
    let app = whoami_app(RateLimitLayer::new(MemoryStore::new(), keys, policies));
    let both = send(
        &app,
        request(
            "GET",
            "/",
            "192.0.2.82:1",
            &[("x-api-key", b"nope"), ("x-other-key", b"other-known")],
        ),
    )
    .await
    .json();
    assert!(both["key"].as_str().unwrap().starts_with("key:#"), "{both}");
    let only_ip = send(
        &app,
        request("GET", "/", "192.0.2.82:1", &[("x-api-key", b"nope")]),
    )
    .await;
    assert_eq!(only_ip.json()["key"], "ip:192.0.2.82");

    // With reject_unknown, the database's "no" is a 401, and it counts as
    // a refused credential.
    let refusing = api_keys()
        .with_lookup(database(calls))
        .with_unknown_rejected(true)
        .or(PeerIp::new());
    let policies = Policies::single(Policy::new("all", 100, MINUTE)).unwrap();
    let app = whoami_app(
        RateLimitLayer::new(MemoryStore::new(), refusing, policies)
            .with_credential_failures(CredentialFailures::new(2, MINUTE)),
    );
    let codes = statuses(&app, 4, |_| {
        request("GET", "/", "192.0.2.83:1", &[("x-api-key", b"nope")])
    })
    .await;
    assert_eq!(codes, [401, 401, 429, 429]);
    let known = send(
        &app,
        request("GET", "/", "192.0.2.84:1", &[("x-api-key", b"db-x")]),
    )
    .await;
    assert_eq!(known.status, StatusCode::OK);
}

#[tokio::test]
async fn a_lookup_that_hangs_counts_the_key_as_unknown() {
    let hangs = |_: &[u8]| std::future::pending::<ApiKeyStatus>();
    let keys = api_keys().with_lookup(hangs).or(PeerIp::new());
    let policies = Policies::single(Policy::new("all", 3, MINUTE)).unwrap();
    let app = whoami_app(
        RateLimitLayer::new(MemoryStore::new(), keys, policies)
            .with_lookup_timeout(Duration::from_millis(20)),
    );
    let reply = send(
        &app,
        request("GET", "/", "192.0.2.85:1", &[("x-api-key", b"db-slow")]),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.json()["key"], "ip:192.0.2.85");
}

// ------------------------------------------------------------ exemptions

/// Exempt clients (an internal network, a partner's API key) pass
/// untouched: never limited, no rate-limit headers, and nothing counted in
/// the store; everyone else is limited as before.
#[tokio::test]
async fn exempt_clients_are_never_limited_and_leave_no_key() {
    let server = RedisServer::start();
    let store = RedisStore::builder(server.pool(2))
        .with_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let config = Config::from_toml_str(
        r#"
[limiter]
keys = ["api_key", "ip"]
exempt = ["192.0.2.0/28", "2001:db8::/32"]
exempt_api_keys = ["internal-key"]

[[policy]]
name = "all"
limit = 2
window = "60s"
"#,
    )
    .unwrap();
    let app = root_app(config.layer(store));
    let exempt = |n: usize| match n % 3 {
        0 => request("GET", "/", "192.0.2.9:1", &[]),
        1 => request("GET", "/", "[2001:db8::7]:1", &[]),
        _ => request(
            "GET",
            "/",
            "198.51.100.7:1",
            &[("x-api-key", b"internal-key")],
        ),
    };
    for n in 0..15 {
        let reply = send(&app, exempt(n)).await;
        assert_eq!(reply.status, StatusCode::OK, "request {n}");
        assert_eq!(reply.header("x-ratelimit-limit"), None, "request {n}");
    }
    assert_eq!(
        server.cli(&["dbsize"]).trim(),
        "0",
        "nothing is counted for exempt clients"
    );
    // A forwarding header naming an exempt address, from a peer that is
    // no trusted proxy, exempts nothing.
    let spoofed = statuses(&app, 3, |_| {
        request(
            "GET",
            "/",
            "198.51.100.10:1",
            &[("x-forwarded-for", b"192.0.2.9")],
        )
    })
    .await;
    assert_eq!(spoofed, [200, 200, 429]);
    // Next door to the exempt network, and with another key: limited.
    for peer in ["192.0.2.16:1", "198.51.100.8:1"] {
        let codes = statuses(&app, 3, |_| request("GET", "/", peer, &[])).await;
        assert_eq!(codes, [200, 200, 429], "{peer}");
    }
    let codes = statuses(&app, 3, |_| {
        request(
            "GET",
            "/",
            "198.51.100.9:1",
            &[("x-api-key", b"internal-key-2")],
        )
    })
    .await;
    assert_eq!(codes, [200, 200, 429]);
}

/// An exempt network holding the trusted proxy: the clients the proxy
/// names are exempt when their address is, and a request whose client it
/// cannot name (`for=unknown`, no header) never is, since nothing is known
/// of who sent it.
#[tokio::test]
async fn a_client_the_proxy_cannot_name_is_never_exempt() {
    let config = Config::from_toml_str(
        r#"
[limiter]
keys = ["ip"]
trusted_proxies = ["10.0.0.0/24"]
forwarded_header = "forwarded"
exempt = ["10.0.0.0/8"]

[[policy]]
name = "all"
limit = 2
window = "60s"
"#,
    )
    .unwrap();
    let app = root_app(config.layer(MemoryStore::new()));
    let named = statuses(&app, 4, |_| {
        request("GET", "/", "10.0.0.1:1", &[("forwarded", b"for=10.9.9.9")])
    })
    .await;
    assert_eq!(named, [200; 4], "an exempt client the proxy names");
    let unknown = statuses(&app, 3, |n| {
        let headers: &[(&str, &[u8])] = if n == 0 {
            &[]
        } else {
            &[("forwarded", b"for=unknown")]
        };
        request("GET", "/", "10.0.0.1:1", headers)
    })
    .await;
    assert_eq!(unknown, [200, 200, 429]);
}

#[test]
fn an_empty_exempt_api_key_is_refused() {
    let error = Config::from_toml_str("[limiter]\nexempt_api_keys = [\"ok\", \"\"]\n").unwrap_err();
    assert_eq!(error.key(), Some("limiter.exempt_api_keys"), "{error}");
    assert_eq!(error.line(), Some(2));
    assert!(error.to_string().contains("must not be empty"), "{error}");
}

#[test]
fn a_bad_exempt_network_names_its_key() {
    let error = Config::from_toml_str("[limiter]\nexempt = [\"10.1.0.0/33\"]\n").unwrap_err();
    assert_eq!(error.key(), Some("limiter.exempt[0]"), "{error}");
    assert_eq!(error.line(), Some(2));
}
