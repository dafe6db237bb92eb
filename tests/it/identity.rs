//! Who the client is: verified JWT claims, API keys with tiers, the fallback
//! chain, per-tier limits on memory and Redis, and the IETF header fields.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::support::reply::{Reply, send};
use crate::support::stores::StoreUnderTest;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use axum::{Extension, Router};
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use http::{Request, StatusCode};
use jsonwebtoken::{Algorithm, EncodingKey, Header as JwtHeader, encode};
use serde_json::{Value, json};
use slidegate::{
    Header, JwtClaim, KeyExtractor, PeerIp, Policies, Policy, RateLimitLayer,
    headers::HeaderStyle,
    key::Identity,
    policy::TierLimits,
    store::{MemoryStore, Store},
};

const SECRET: &[u8] = b"test-secret-of-the-api";
const MINUTE: Duration = Duration::from_secs(60);

fn fixture(name: &str) -> Vec<u8> {
    let path = format!("{}/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

fn sign(algorithm: Algorithm, key: &EncodingKey, claims: &Value) -> String {
    slidegate::JwtClaim::install_crypto_provider();
    encode(&JwtHeader::new(algorithm), claims, key).unwrap()
}

fn hs256(claims: &Value) -> String {
    sign(Algorithm::HS256, &EncodingKey::from_secret(SECRET), claims)
}

fn rs256(private_pem: &str, claims: &Value) -> String {
    let key = EncodingKey::from_rsa_pem(&fixture(private_pem)).unwrap();
    sign(Algorithm::RS256, &key, claims)
}

/// Valid claims for `sub`, expiring in an hour.
fn claims(sub: &str) -> Value {
    json!({ "sub": sub, "exp": now() + 3600 })
}

fn b64(value: &Value) -> String {
    URL_SAFE_NO_PAD.encode(value.to_string())
}

/// The extractor most tests use: HS256 with the test secret, RS256 with the
/// test RSA key, a `tier` claim, issuer and audience unchecked.
fn jwt() -> JwtClaim {
    JwtClaim::builder()
        .with_secret(SECRET)
        .with_public_key_pem(&fixture("rsa_public.pem"))
        .with_algorithms(["HS256", "RS256"])
        .with_tier_claim("tier")
        .build()
        .unwrap()
}

fn api_keys() -> Header {
    Header::new(http::HeaderName::from_static("x-api-key"))
        .with_tiers([("key-of-a-pro", "pro"), ("key-of-a-free-user", "free")])
}

/// `/search`: 5 a minute, 50 for `pro`, and for `team` 100 units at a cost
/// of 4 (25 searches). `/whoami` echoes the identity.
fn tiered_policies() -> Policies {
    Policies::builder()
        .with_route(
            "GET /search",
            Policy::new("search", 5, MINUTE)
                .with_tier("pro", TierLimits::new().with_limit(50))
                .with_tier("team", TierLimits::new().with_limit(100).with_cost(4)),
        )
        .with_route("GET /whoami", Policy::new("whoami", 1000, MINUTE))
        .build()
        .unwrap()
}

fn app(store: impl Store, keys: impl KeyExtractor) -> Router {
    app_with(RateLimitLayer::new(store, keys, tiered_policies()))
}

fn app_with(layer: RateLimitLayer) -> Router {
    Router::new()
        .route("/search", get(|| async { "results" }))
        .route(
            "/whoami",
            get(|Extension(identity): Extension<Identity>| async move {
                json!({ "key": identity.key.as_str(), "tier": identity.tier.as_deref() })
                    .to_string()
            }),
        )
        .route_layer(layer.with_identity_extension(true))
}

/// A GET from 192.0.2.7 with `headers`.
fn get_with(uri: &str, headers: &[(&str, &str)]) -> Request<Body> {
    let mut builder = Request::get(uri);
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    let mut request = builder.body(Body::empty()).unwrap();
    request
        .extensions_mut()
        .insert(ConnectInfo("192.0.2.7:5000".parse::<SocketAddr>().unwrap()));
    request
}

fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

async fn whoami(app: &Router, headers: &[(&str, &str)]) -> Reply {
    send(app, get_with("/whoami", headers)).await
}

/// Sends `/search` `attempts` times and counts the 200s.
async fn admitted(app: &Router, headers: &[(&str, &str)], attempts: usize) -> usize {
    let mut admitted = 0;
    for _ in 0..attempts {
        let reply = send(app, get_with("/search", headers)).await;
        match reply.status {
            StatusCode::OK => admitted += 1,
            StatusCode::TOO_MANY_REQUESTS => {}
            other => panic!("unexpected {other}: {}", reply.body),
        }
    }
    admitted
}

#[tokio::test]
async fn valid_tokens_of_every_key_type_identify_the_subject() {
    let ec = JwtClaim::builder()
        .with_public_key_pem(&fixture("ec_public.pem"))
        .with_algorithms(["ES256"])
        .build()
        .unwrap();
    let ed = JwtClaim::builder()
        .with_public_key_pem(&fixture("ed_public.pem"))
        .with_algorithms(["EdDSA"])
        .build()
        .unwrap();
    let ec_token = sign(
        Algorithm::ES256,
        &EncodingKey::from_ec_pem(&fixture("ec_private.pem")).unwrap(),
        &claims("alice"),
    );
    let ed_token = sign(
        Algorithm::EdDSA,
        &EncodingKey::from_ed_pem(&fixture("ed_private.pem")).unwrap(),
        &claims("alice"),
    );
    let cases: [(Box<dyn KeyExtractor>, String); 4] = [
        (Box::new(jwt()), hs256(&claims("alice"))),
        (Box::new(jwt()), rs256("rsa_private.pem", &claims("alice"))),
        (Box::new(ec), ec_token),
        (Box::new(ed), ed_token),
    ];
    for (keys, token) in cases {
        let app = app(MemoryStore::new(), keys);
        let reply = whoami(&app, &[("authorization", &bearer(&token))]).await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
        assert_eq!(reply.json()["key"], "jwt:alice");
    }
    // A numeric subject works too; an unsafe one is hashed, never raw.
    let app = app(MemoryStore::new(), jwt());
    let numeric = json!({ "sub": 42, "exp": now() + 60 });
    let reply = whoami(&app, &[("authorization", &bearer(&hs256(&numeric)))]).await;
    assert_eq!(reply.json()["key"], "jwt:42");
    let braces = json!({ "sub": "{slot}", "exp": now() + 60 });
    let reply = whoami(&app, &[("authorization", &bearer(&hs256(&braces)))]).await;
    let key = reply.json()["key"].as_str().unwrap().to_owned();
    assert!(key.starts_with("jwt:#") && !key.contains('{'), "{key}");
}

/// One refused token: what it is, how it is sent, and the reason expected.
struct Refused {
    case: &'static str,
    authorization: Vec<String>,
    reason: &'static str,
}

fn refused(case: &'static str, token: String, reason: &'static str) -> Refused {
    Refused {
        case,
        authorization: vec![bearer(&token)],
        reason,
    }
}

fn invalid_tokens() -> Vec<Refused> {
    let header = |alg: &str| b64(&json!({ "alg": alg, "typ": "JWT" }));
    let body = b64(&claims("mallory"));
    let valid = hs256(&claims("mallory"));
    let (head_and_body, signature) = valid.rsplit_once('.').unwrap();
    // Change the first character: its six bits are all signature bits (the
    // last character's low bits are padding, and changing them makes the
    // base64 itself invalid).
    let first = if signature.starts_with('A') { "B" } else { "A" };
    let tampered_signature = format!("{first}{}", &signature[1..]);
    let rsa_public_as_secret = EncodingKey::from_secret(&fixture("rsa_public.pem"));
    vec![
        refused("not a JWT", "abc".into(), "malformed"),
        refused("two segments", "a.b".into(), "malformed"),
        refused("four segments", format!("{valid}.x"), "malformed"),
        refused(
            "header not base64url",
            format!("!!!.{body}.sig"),
            "malformed",
        ),
        refused(
            "header not JSON",
            format!("{}.{body}.sig", URL_SAFE_NO_PAD.encode("nope")),
            "malformed",
        ),
        refused(
            "header without alg",
            format!("{}.{body}.sig", b64(&json!({ "typ": "JWT" }))),
            "malformed",
        ),
        refused(
            "payload not JSON",
            hs256_raw(&format!(
                "{}.{}",
                header("HS256"),
                URL_SAFE_NO_PAD.encode("[1,")
            )),
            "malformed",
        ),
        Refused {
            case: "empty bearer token",
            authorization: vec!["Bearer    ".into()],
            reason: "malformed",
        },
        Refused {
            case: "two Authorization headers",
            authorization: vec![bearer(&valid), bearer(&valid)],
            reason: "malformed",
        },
        refused(
            "16 KiB token",
            format!("{valid}{}", "A".repeat(16 * 1024)),
            "malformed",
        ),
        refused(
            "alg none, no signature",
            format!("{}.{body}.", header("none")),
            "algorithm_not_allowed",
        ),
        refused(
            "alg NONE, signed",
            hs256_raw(&format!("{}.{body}", header("NONE"))),
            "algorithm_not_allowed",
        ),
        refused(
            "HS512 outside the allow-list, right secret",
            sign(
                Algorithm::HS512,
                &EncodingKey::from_secret(SECRET),
                &claims("mallory"),
            ),
            "algorithm_not_allowed",
        ),
        refused(
            "ES256 outside the allow-list",
            sign(
                Algorithm::ES256,
                &EncodingKey::from_ec_pem(&fixture("ec_private.pem")).unwrap(),
                &claims("mallory"),
            ),
            "algorithm_not_allowed",
        ),
        refused(
            "HS256 signed with another secret",
            sign(
                Algorithm::HS256,
                &EncodingKey::from_secret(b"guessed"),
                &claims("mallory"),
            ),
            "bad_signature",
        ),
        refused(
            "signature tampered",
            format!("{head_and_body}.{tampered_signature}"),
            "bad_signature",
        ),
        refused(
            "payload swapped under a valid signature",
            format!(
                "{}.{}.{signature}",
                header("HS256"),
                b64(&json!({ "sub": "admin", "exp": now() + 3600 }))
            ),
            "bad_signature",
        ),
        refused(
            "RS256 signed by another RSA key",
            rs256("rsa_other_private.pem", &claims("mallory")),
            "bad_signature",
        ),
        refused(
            "HS256 keyed with the RSA public key (algorithm confusion)",
            sign(Algorithm::HS256, &rsa_public_as_secret, &claims("mallory")),
            "bad_signature",
        ),
        refused(
            "expired an hour ago",
            hs256(&json!({ "sub": "mallory", "exp": now() - 3600 })),
            "expired",
        ),
        refused(
            "expired beyond the 5 s leeway",
            hs256(&json!({ "sub": "mallory", "exp": now() - 30 })),
            "expired",
        ),
        refused(
            "nbf in an hour",
            hs256(&json!({ "sub": "mallory", "exp": now() + 7200, "nbf": now() + 3600 })),
            "not_yet_valid",
        ),
        refused(
            "no exp",
            hs256(&json!({ "sub": "mallory" })),
            "missing_claim",
        ),
        refused(
            "exp not a number",
            hs256(&json!({ "sub": "mallory", "exp": "tomorrow" })),
            "invalid_claim",
        ),
        refused(
            "exp null",
            hs256(&json!({ "sub": "mallory", "exp": null })),
            "invalid_claim",
        ),
        refused(
            "no sub",
            hs256(&json!({ "exp": now() + 60, "tier": "pro" })),
            "missing_claim",
        ),
        refused(
            "empty sub",
            hs256(&json!({ "sub": "", "exp": now() + 60 })),
            "invalid_claim",
        ),
        refused(
            "sub is an object",
            hs256(&json!({ "sub": { "id": 1 }, "exp": now() + 60 })),
            "malformed",
        ),
    ]
}

/// Signs `header.payload` with the test secret, whatever the header says.
fn hs256_raw(signing_input: &str) -> String {
    use hmac::{Hmac, Mac};
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(SECRET).unwrap();
    mac.update(signing_input.as_bytes());
    let signature = URL_SAFE_NO_PAD.encode(mac.finalize().into_bytes());
    format!("{signing_input}.{signature}")
}

#[tokio::test]
async fn every_invalid_token_class_is_a_401_naming_its_reason() {
    // jwt → api_key → ip: a refused token must never fall through to the
    // API key or the address.
    let app = app(MemoryStore::new(), jwt().or(api_keys()).or(PeerIp::new()));
    for case in invalid_tokens() {
        let mut request = get_with("/whoami", &[("x-api-key", "key-of-a-pro")]);
        for value in &case.authorization {
            request
                .headers_mut()
                .append("authorization", value.parse().unwrap());
        }
        let reply = send(&app, request).await;
        eprintln!("{:<58} -> {} {}", case.case, reply.status.as_u16(), {
            let body = reply.json();
            body["reason"].as_str().unwrap_or("-").to_owned()
        });
        assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{}", case.case);
        assert_eq!(
            reply.header("content-type"),
            Some("application/problem+json"),
            "{}",
            case.case
        );
        assert_eq!(
            reply.header("www-authenticate"),
            Some("Bearer error=\"invalid_token\"")
        );
        let body = reply.json();
        assert_eq!(body["status"], 401);
        assert_eq!(body["reason"], case.reason, "{}: {}", case.case, reply.body);
        assert!(!body["detail"].as_str().unwrap().is_empty());
        assert_eq!(reply.header("x-ratelimit-limit"), None);
    }
}

#[tokio::test]
async fn leeway_accepts_a_token_just_expired() {
    let app = app(MemoryStore::new(), jwt());
    let just_expired = hs256(&json!({ "sub": "alice", "exp": now() - 2 }));
    let reply = whoami(&app, &[("authorization", &bearer(&just_expired))]).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    let strict = JwtClaim::builder()
        .with_secret(SECRET)
        .with_algorithms(["HS256"])
        .with_leeway(Duration::ZERO)
        .build()
        .unwrap();
    let app = app_with(RateLimitLayer::new(
        MemoryStore::new(),
        strict,
        tiered_policies(),
    ));
    let reply = whoami(&app, &[("authorization", &bearer(&just_expired))]).await;
    assert_eq!(reply.json()["reason"], "expired");
}

#[tokio::test]
async fn issuer_and_audience_are_checked_when_configured() {
    let keys = JwtClaim::builder()
        .with_secret(SECRET)
        .with_algorithms(["HS256"])
        .with_issuers(["https://auth.example"])
        .with_audiences(["video-api"])
        .build()
        .unwrap();
    let app = app(MemoryStore::new(), keys);
    let token = |iss: Option<&str>, aud: Option<Value>| {
        let mut claims = claims("alice");
        if let Some(iss) = iss {
            claims["iss"] = iss.into();
        }
        if let Some(aud) = aud {
            claims["aud"] = aud;
        }
        bearer(&hs256(&claims))
    };
    let cases = [
        (
            token(Some("https://auth.example"), Some(json!("video-api"))),
            None,
        ),
        (
            token(
                Some("https://auth.example"),
                Some(json!(["billing", "video-api"])),
            ),
            None,
        ),
        (
            token(Some("https://evil.example"), Some(json!("video-api"))),
            Some("wrong_issuer"),
        ),
        (
            token(Some("https://auth.example"), Some(json!("billing"))),
            Some("wrong_audience"),
        ),
        (token(None, Some(json!("video-api"))), Some("missing_claim")),
        (
            token(Some("https://auth.example"), None),
            Some("missing_claim"),
        ),
    ];
    for (authorization, reason) in cases {
        let reply = whoami(&app, &[("authorization", &authorization)]).await;
        match reason {
            None => assert_eq!(reply.status, StatusCode::OK, "{}", reply.body),
            Some(reason) => {
                assert_eq!(reply.status, StatusCode::UNAUTHORIZED);
                assert_eq!(reply.json()["reason"], reason, "{}", reply.body);
            }
        }
    }
    // Without an audience configured, a token naming one is still accepted.
    let lenient = app_with(RateLimitLayer::new(
        MemoryStore::new(),
        jwt(),
        tiered_policies(),
    ));
    let reply = whoami(
        &lenient,
        &[("authorization", &token(None, Some(json!("x"))))],
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
}

#[tokio::test]
async fn an_algorithm_that_does_not_fit_the_key_is_refused() {
    // ES384 is allowed but the only EC key is P-256: a P-384 token cannot
    // be checked against it.
    let keys = JwtClaim::builder()
        .with_public_key_pem(&fixture("ec_public.pem"))
        .with_algorithms(["ES256", "ES384"])
        .build()
        .unwrap();
    let app = app(MemoryStore::new(), keys);
    let token = sign(
        Algorithm::ES384,
        &EncodingKey::from_ec_pem(&fixture("ec384_private.pem")).unwrap(),
        &claims("mallory"),
    );
    let reply = whoami(&app, &[("authorization", &bearer(&token))]).await;
    assert_eq!(reply.status, StatusCode::UNAUTHORIZED);
    let reason = reply.json()["reason"].as_str().unwrap().to_owned();
    eprintln!("ES384 token against a P-256 key -> 401 {reason}");
    assert!(
        reason == "wrong_key_type" || reason == "bad_signature",
        "{reason}"
    );
}

#[tokio::test]
async fn hs_rs_confusion_is_refused_when_only_rsa_is_configured() {
    // The classic attack: the server holds an RSA public key; the attacker
    // HMAC-signs with that public key's PEM as the secret.
    let keys = JwtClaim::builder()
        .with_public_key_pem(&fixture("rsa_public.pem"))
        .with_algorithms(["RS256"])
        .build()
        .unwrap();
    let app = app(MemoryStore::new(), keys);
    let forged = sign(
        Algorithm::HS256,
        &EncodingKey::from_secret(&fixture("rsa_public.pem")),
        &claims("admin"),
    );
    let reply = whoami(&app, &[("authorization", &bearer(&forged))]).await;
    assert_eq!(reply.status, StatusCode::UNAUTHORIZED);
    assert_eq!(reply.json()["reason"], "algorithm_not_allowed");
    let genuine = rs256("rsa_private.pem", &claims("alice"));
    let reply = whoami(&app, &[("authorization", &bearer(&genuine))]).await;
    assert_eq!(reply.json()["key"], "jwt:alice");
}

#[test]
fn building_refuses_an_allowed_algorithm_without_a_key() {
    let error = JwtClaim::builder()
        .with_public_key_pem(&fixture("rsa_public.pem"))
        .with_algorithms(["RS256", "HS256"])
        .build()
        .unwrap_err();
    assert!(error.to_string().contains("HS256"), "{error}");
    assert!(JwtClaim::builder().with_secret(SECRET).build().is_err());
    assert!(
        JwtClaim::builder()
            .with_public_key_pem(&fixture("rsa_private.pem"))
            .with_algorithms(["RS256"])
            .build()
            .is_err(),
        "a private key is not a verification key"
    );
}

#[tokio::test]
async fn the_chain_takes_the_first_extractor_that_yields() {
    let app = app(MemoryStore::new(), jwt().or(api_keys()).or(PeerIp::new()));
    let token = bearer(&hs256(&claims("alice")));
    let both = whoami(
        &app,
        &[("authorization", &token), ("x-api-key", "key-of-a-pro")],
    )
    .await;
    assert_eq!(both.json()["key"], "jwt:alice");

    let api_key = whoami(&app, &[("x-api-key", "key-of-a-pro")]).await.json();
    let key = api_key["key"].as_str().unwrap();
    assert!(
        key.starts_with("key:#") && !key.contains("key-of-a-pro"),
        "{key}"
    );
    assert_eq!(api_key["tier"], "pro");

    // Another scheme is not a bearer token: it falls through.
    let basic = whoami(
        &app,
        &[
            ("authorization", "Basic dXNlcjpwdw=="),
            ("x-api-key", "key-of-a-pro"),
        ],
    )
    .await;
    assert_eq!(basic.json()["tier"], "pro");

    let nothing = whoami(&app, &[]).await.json();
    assert_eq!(nothing["key"], "ip:192.0.2.7");
    assert_eq!(nothing["tier"], Value::Null);
}

async fn tiers_get_their_own_limits(store: impl Store) {
    let app = app(store, jwt().or(api_keys()).or(PeerIp::new()));
    let token = |sub: &str, tier: Option<&str>| {
        let mut claims = claims(sub);
        if let Some(tier) = tier {
            claims["tier"] = tier.into();
        }
        bearer(&hs256(&claims))
    };
    let free = token("free-user", None);
    let pro = token("pro-user", Some("pro"));
    let team = token("team-user", Some("team"));
    let unknown = token("gold-user", Some("gold"));
    assert_eq!(admitted(&app, &[("authorization", &free)], 60).await, 5);
    assert_eq!(admitted(&app, &[("authorization", &pro)], 60).await, 50);
    assert_eq!(
        admitted(&app, &[("authorization", &team)], 60).await,
        25,
        "100 units at cost 4"
    );
    assert_eq!(
        admitted(&app, &[("authorization", &unknown)], 60).await,
        5,
        "unknown tier: base limits"
    );
    assert_eq!(
        admitted(&app, &[("x-api-key", "key-of-a-pro")], 60).await,
        50
    );
    assert_eq!(
        admitted(&app, &[("x-api-key", "key-of-a-free-user")], 60).await,
        5
    );
    assert_eq!(admitted(&app, &[], 60).await, 5, "by IP, no tier");

    let reply = send(&app, get_with("/search", &[("authorization", &pro)])).await;
    assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(reply.header("x-ratelimit-limit"), Some("50"));
    assert_eq!(reply.json()["limit"], 50);
}

async fn tiers_get_their_own_limits_on_both(tested: StoreUnderTest) {
    tiers_get_their_own_limits(tested.store).await;
    if let Some(redis) = tested.redis {
        // API keys are secrets: no Redis key holds one.
        let keys = redis.cli(&["--scan"]);
        assert!(keys.contains("slidegate:search:{key:#"), "{keys}");
        assert!(!keys.contains("key-of-a"), "{keys}");
    }
}
on_both_stores!(tiers_get_their_own_limits_on_both);

#[tokio::test]
async fn an_async_lookup_names_tiers_the_extractor_did_not() {
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = calls.clone();
    let lookup = move |_: &http::request::Parts, identity: &Identity| {
        seen.fetch_add(1, Ordering::SeqCst);
        let pro = identity.key.as_str() == "ip:192.0.2.7";
        async move {
            tokio::task::yield_now().await;
            pro.then(|| Arc::<str>::from("pro"))
        }
    };
    let layer = RateLimitLayer::new(
        MemoryStore::new(),
        jwt().or(PeerIp::new()),
        tiered_policies(),
    )
    .with_tier_lookup(lookup);
    let app = app_with(layer);
    let reply = whoami(&app, &[]).await.json();
    assert_eq!(reply["tier"], "pro");
    assert_eq!(admitted(&app, &[], 60).await, 50);

    // A token that names a tier is not looked up again.
    let before = calls.load(Ordering::SeqCst);
    let mut claims = claims("alice");
    claims["tier"] = "team".into();
    let reply = whoami(&app, &[("authorization", &bearer(&hs256(&claims)))]).await;
    assert_eq!(reply.json()["tier"], "team");
    assert_eq!(calls.load(Ordering::SeqCst), before);
}

#[tokio::test]
async fn a_lookup_that_hangs_gives_the_base_limits_after_its_timeout() {
    let hangs = |_: &http::request::Parts, _: &Identity| std::future::pending::<Option<Arc<str>>>();
    let layer = RateLimitLayer::new(MemoryStore::new(), PeerIp::new(), tiered_policies())
        .with_tier_lookup(hangs)
        .with_lookup_timeout(Duration::from_millis(20));
    let app = app_with(layer);
    let started = std::time::Instant::now();
    let reply = whoami(&app, &[]).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.json()["tier"], Value::Null);
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(admitted(&app, &[], 10).await, 5);
}

fn ietf_app(style: HeaderStyle) -> Router {
    let policies = Policies::builder()
        .with_route(
            "GET /search",
            Policy::new("burst", 2, Duration::from_secs(10)),
        )
        .with_every_route(Policy::new("hourly", 100, Duration::from_secs(3600)))
        .build()
        .unwrap();
    Router::new()
        .route("/search", get(|| async { "results" }))
        .route_layer(
            RateLimitLayer::new(MemoryStore::new(), PeerIp::new(), policies)
                .with_header_style(style),
        )
}

/// The items of a structured-field list header, as (name, parameters).
fn sf_list(reply: &Reply, header: &str) -> Vec<(String, Vec<(String, i64)>)> {
    use sfv::{BareItem, FieldType, ListEntry, Parser};
    let text = reply
        .header(header)
        .unwrap_or_else(|| panic!("no {header}"));
    let list = Parser::new(text)
        .parse::<sfv::List>()
        .unwrap_or_else(|e| panic!("{header}: {text}: {e}"));
    // Serialising the parsed list gives the same text: canonical form.
    assert_eq!(
        list.serialize().as_deref(),
        Some(text),
        "{header} is not canonical"
    );
    list.into_iter()
        .map(|entry| {
            let ListEntry::Item(item) = entry else {
                panic!("{header}: inner list in {text}")
            };
            let BareItem::String(name) = item.bare_item else {
                panic!("{header}: the item must be a String: {text}")
            };
            let params = item
                .params
                .into_iter()
                .map(|(key, value)| {
                    let BareItem::Integer(value) = value else {
                        panic!("{header}: {key} must be an Integer: {text}")
                    };
                    (key.as_str().to_owned(), i64::from(value))
                })
                .collect();
            (name.as_str().to_owned(), params)
        })
        .collect()
}

fn param(params: &[(String, i64)], key: &str) -> i64 {
    params
        .iter()
        .find(|(k, _)| k == key)
        .unwrap_or_else(|| panic!("no `{key}` in {params:?}"))
        .1
}

#[tokio::test]
async fn ietf_fields_parse_as_structured_fields() {
    let app = ietf_app(HeaderStyle::Ietf);
    let first = send(&app, get_with("/search", &[])).await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(first.header("x-ratelimit-limit"), None);
    let policies = sf_list(&first, "ratelimit-policy");
    assert_eq!(policies.len(), 2, "one item per policy that applied");
    assert_eq!(policies[0].0, "burst");
    assert_eq!(param(&policies[0].1, "q"), 2);
    assert_eq!(param(&policies[0].1, "w"), 10);
    assert_eq!(policies[1].0, "hourly");
    assert_eq!(param(&policies[1].1, "q"), 100);
    assert_eq!(param(&policies[1].1, "w"), 3600);
    let state = sf_list(&first, "ratelimit");
    assert_eq!(state[0].0, "burst");
    assert_eq!(param(&state[0].1, "r"), 1);
    assert_eq!(param(&state[0].1, "t"), 10);
    assert_eq!(param(&state[1].1, "r"), 99);
    assert_eq!(param(&state[1].1, "t"), 3600);

    send(&app, get_with("/search", &[])).await;
    let denied = send(&app, get_with("/search", &[])).await;
    assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
    let retry_after: i64 = denied.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=10).contains(&retry_after));
    for (name, params) in sf_list(&denied, "ratelimit") {
        // "hourly" frees capacity only in an hour, but a t later than
        // Retry-After would contradict it.
        assert!(
            param(&params, "t") <= retry_after,
            "{name}: t {} after Retry-After {retry_after}",
            param(&params, "t")
        );
    }
    assert_eq!(param(&sf_list(&denied, "ratelimit")[0].1, "r"), 0);
}

#[tokio::test]
async fn both_and_none_header_styles() {
    let both = ietf_app(HeaderStyle::Both);
    let reply = send(&both, get_with("/search", &[])).await;
    assert_eq!(reply.header("x-ratelimit-limit"), Some("2"));
    assert_eq!(sf_list(&reply, "ratelimit").len(), 2);

    let none = ietf_app(HeaderStyle::None);
    for _ in 0..2 {
        let reply = send(&none, get_with("/search", &[])).await;
        assert_eq!(reply.status, StatusCode::OK);
        for header in ["ratelimit", "ratelimit-policy", "x-ratelimit-limit"] {
            assert_eq!(reply.header(header), None);
        }
    }
    let denied = send(&none, get_with("/search", &[])).await;
    assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(denied.header("retry-after").is_some());
    assert_eq!(denied.header("ratelimit"), None);
}

/// A token signed with `key` whose header names `kid`.
fn with_kid(algorithm: Algorithm, kid: &str, key: &EncodingKey, claims: &Value) -> String {
    let mut header = JwtHeader::new(algorithm);
    header.kid = Some(kid.to_owned());
    slidegate::JwtClaim::install_crypto_provider();
    encode(&header, claims, key).unwrap()
}

/// Rotating keys, from the config file: tokens of each `kid` verify with
/// their own key, one naming a `kid` no key has is refused `unknown_key`,
/// and one signed with another `kid`'s key does not verify.
#[tokio::test]
async fn rotated_keys_are_chosen_by_kid() {
    let dir = std::env::temp_dir().join(format!("slidegate-kid-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("rsa.pem"), fixture("rsa_public.pem")).unwrap();
    let config = format!(
        r#"
[limiter]
keys = ["jwt"]

[jwt]
[[jwt.keys]]
kid = "2026-10"
algorithm = "HS256"
secret = "the old secret"

[[jwt.keys]]
kid = "2026-11"
algorithm = "RS256"
public_key_pem = "{}"

[[policy]]
name = "all"
limit = 100
window = "60s"
"#,
        dir.join("rsa.pem").display()
    );
    let config = slidegate::config::Config::from_toml_str(&config).unwrap();
    let app = app_with(config.layer(MemoryStore::new()));
    let old = EncodingKey::from_secret(b"the old secret");
    let new = EncodingKey::from_rsa_pem(&fixture("rsa_private.pem")).unwrap();

    let token = with_kid(Algorithm::HS256, "2026-10", &old, &claims("alice"));
    let reply = whoami(&app, &[("authorization", &bearer(&token))]).await;
    assert_eq!(reply.json()["key"], "jwt:alice", "{}", reply.body);
    let token = with_kid(Algorithm::RS256, "2026-11", &new, &claims("bob"));
    let reply = whoami(&app, &[("authorization", &bearer(&token))]).await;
    assert_eq!(reply.json()["key"], "jwt:bob", "{}", reply.body);

    for token in [
        with_kid(Algorithm::HS256, "2026-09", &old, &claims("eve")),
        sign(Algorithm::HS256, &old, &claims("eve")),
    ] {
        let reply = whoami(&app, &[("authorization", &bearer(&token))]).await;
        assert_eq!(reply.status, StatusCode::UNAUTHORIZED);
        assert_eq!(reply.json()["reason"], "unknown_key");
    }
    // The right kid with another key's signature does not verify.
    let forged = with_kid(
        Algorithm::HS256,
        "2026-10",
        &EncodingKey::from_secret(b"a guess"),
        &claims("eve"),
    );
    let reply = whoami(&app, &[("authorization", &bearer(&forged))]).await;
    assert_eq!(reply.json()["reason"], "bad_signature");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_rotated_key_must_fit_its_algorithm() {
    let refused = |entry: &str| {
        let source =
            format!("[limiter]\nkeys = [\"jwt\"]\n[jwt]\n[[jwt.keys]]\nkid = \"k\"\n{entry}\n");
        slidegate::config::Config::from_toml_str(&source).unwrap_err()
    };
    let error = refused("algorithm = \"RS256\"\nsecret = \"s\"");
    assert_eq!(error.key(), Some("jwt.keys[0]"), "{error}");
    let error = refused("algorithm = \"XX999\"\nsecret = \"s\"");
    assert_eq!(error.key(), Some("jwt.keys[0].algorithm"), "{error}");
    let error = refused("algorithm = \"HS256\"");
    assert_eq!(error.key(), Some("jwt.keys[0]"), "{error}");
}
