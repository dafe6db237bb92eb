//! Policies counted under other keys than the client's (`Policy::per`):
//! a login per address and for everyone, an API per user and per
//! organisation; all or nothing across them; a request without the key
//! skipped or refused; a bad token refused; the config file's `per`.

use std::net::SocketAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::{get, post};
use http::{Request, StatusCode};
use jsonwebtoken::{Algorithm, EncodingKey, Header as JwtHeader, encode};
use serde_json::{Value, json};
use slidegate::config::Config;
use slidegate::policy::PerMissing;
use slidegate::{Global, JwtClaim, PeerIp, Policies, Policy, RateLimitLayer, key::Key};

use crate::support::reply::send;
use crate::support::stores::StoreUnderTest;

const MINUTE: Duration = Duration::from_secs(60);
const SECRET: &str = "secret-of-the-per-key-tests";

fn login(peer: &str) -> Request<Body> {
    let mut request = Request::post("/login").body(Body::empty()).unwrap();
    request
        .extensions_mut()
        .insert(ConnectInfo(peer.parse::<SocketAddr>().unwrap()));
    request
}

/// `POST /login` answering "ok", behind `layer`.
fn login_app(layer: RateLimitLayer) -> Router {
    Router::new()
        .route("/login", post(|| async { "ok" }))
        .route_layer(layer)
}

/// The statuses of `count` logins from `peer`.
async fn logins(app: &Router, peer: &str, count: usize) -> Vec<u16> {
    let mut statuses = Vec::with_capacity(count);
    for _ in 0..count {
        statuses.push(send(app, login(peer)).await.status.as_u16());
    }
    statuses
}

fn token(claims: &Value) -> String {
    JwtClaim::install_crypto_provider();
    let key = EncodingKey::from_secret(SECRET.as_bytes());
    encode(&JwtHeader::new(Algorithm::HS256), claims, &key).unwrap()
}

fn claims(sub: &str, org: Option<&str>) -> Value {
    let exp = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 3600;
    match org {
        Some(org) => json!({ "sub": sub, "org": org, "exp": exp }),
        None => json!({ "sub": sub, "exp": exp }),
    }
}

fn api(bearer: &str) -> Request<Body> {
    Request::get("/api")
        .header("authorization", format!("Bearer {bearer}"))
        .body(Body::empty())
        .unwrap()
}

/// 3 logins a minute per address, 5 for every address together.
async fn a_login_is_limited_per_address_and_for_everyone(tested: StoreUnderTest) {
    let policies = Policies::builder()
        .with_route("POST /login", Policy::new("login", 3, MINUTE))
        .with_route(
            "POST /login",
            Policy::new("login_all", 5, MINUTE).per(Global),
        )
        .build()
        .unwrap();
    let layer = RateLimitLayer::new(tested.store.clone(), PeerIp::new(), policies);
    let app = login_app(layer);
    let statuses = logins(&app, "192.0.2.1:1000", 4).await;
    assert_eq!(statuses, [200, 200, 200, 429], "3 per address");
    // Another address has its own 3, but everyone's 5 leave it 2.
    let statuses = logins(&app, "192.0.2.2:1000", 3).await;
    assert_eq!(statuses, [200, 200, 429], "5 for everyone");
    // A request everyone's limit denied counted nowhere: a third address
    // is denied by everyone's limit, and its own count stays empty.
    let third = send(&app, login("192.0.2.3:1000")).await;
    assert_eq!(third.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(third.header("x-ratelimit-limit"), Some("5"));
    let peeked = layer_peek(&tested, "login", "ip:192.0.2.3").await;
    assert_eq!(peeked, 3, "the denied request was not counted per address");
}

on_both_stores!(a_login_is_limited_per_address_and_for_everyone);

/// A client's tier and own limit are its own: a count shared with every
/// client keeps the policy's base limit, whatever the client's.
async fn a_clients_own_limit_never_raises_a_shared_count(tested: StoreUnderTest) {
    use slidegate::limits::Overrides;
    use slidegate::policy::TierLimits;

    let everyone = Policy::new("login_all", 3, MINUTE)
        .per(Global)
        .with_tier("pro", TierLimits::new().with_limit(1000));
    let policies = Policies::builder()
        .with_route("POST /login", Policy::new("login", 100, MINUTE))
        .with_route("POST /login", everyone)
        .build()
        .unwrap();
    let big = Key::parse("ip:192.0.2.1").unwrap();
    let overrides = Overrides::new().with_limit(big, "login_all", 1000);
    let pro = |parts: &http::request::Parts| {
        let peer = parts.extensions.get::<ConnectInfo<SocketAddr>>()?.0.ip();
        let mut identity = slidegate::key::Identity::from(Key::new(peer.to_string()));
        identity.tier = Some("pro".into());
        Some(identity)
    };
    let by_address = RateLimitLayer::new(tested.store.clone(), PeerIp::new(), policies.clone())
        .with_limit_lookup(overrides);
    let by_tier = RateLimitLayer::new(tested.store.clone(), ExtractedBy(pro), policies)
        .with_namespace("tiered");
    for (name, layer) in [("an own limit", by_address), ("a tier", by_tier)] {
        let statuses = logins(&login_app(layer), "192.0.2.1:1000", 4).await;
        assert_eq!(statuses, [200, 200, 200, 429], "{name}");
    }
}

on_both_stores!(a_clients_own_limit_never_raises_a_shared_count);

/// An extractor from a closure that names a tier too.
struct ExtractedBy<F>(F);

impl<F> slidegate::KeyExtractor for ExtractedBy<F>
where
    F: Fn(&http::request::Parts) -> Option<slidegate::key::Identity> + Send + Sync + 'static,
{
    fn extract(
        &self,
        parts: &http::request::Parts,
    ) -> Result<Option<slidegate::key::Identity>, slidegate::key::KeyRejection> {
        Ok((self.0)(parts))
    }
}

/// What the store holds for `key` under a 3-a-minute `policy`: the
/// requests it has left.
async fn layer_peek(tested: &StoreUnderTest, policy: &str, key: &str) -> u32 {
    let check =
        slidegate::store::Check::new(&Policy::new(policy, 3, MINUTE), Key::parse(key).unwrap())
            .unwrap();
    tested.store.peek(&[check]).await.unwrap()[0].remaining()
}

/// An API limited per user and per organisation (its `org` claim): the
/// users of one organisation draw on one pool; a token without `org` is
/// skipped by the organisation's limit, or refused, as the policy says;
/// a bad token is refused, never counted under some other key.
async fn an_organisation_shares_one_pool_across_its_users(tested: StoreUnderTest) {
    let jwt = JwtClaim::builder()
        .with_secret(SECRET)
        .with_algorithms(["HS256"])
        .build()
        .unwrap();
    let app = |missing: PerMissing| {
        let policies = Policies::builder()
            .with_every_route(Policy::new("per_user", 3, MINUTE))
            .with_every_route(
                Policy::new("per_org", 4, MINUTE)
                    .per(jwt.per_claim("org"))
                    .with_per_missing(missing),
            )
            .build()
            .unwrap();
        let layer = RateLimitLayer::new(tested.store.clone(), jwt.clone(), policies);
        Router::new()
            .route("/api", get(|| async { "ok" }))
            .route_layer(layer)
    };
    let skipping = app(PerMissing::Skip);
    let (alice, bob, carol) = (
        token(&claims("alice", Some("acme"))),
        token(&claims("bob", Some("acme"))),
        token(&claims("carol", Some("globex"))),
    );
    let mut statuses = Vec::new();
    for bearer in [&alice, &alice, &alice, &bob, &bob, &carol] {
        statuses.push(send(&skipping, api(bearer)).await.status.as_u16());
    }
    assert_eq!(statuses, [200, 200, 200, 200, 429, 200], "acme's 4 shared");

    // No `org`: the organisation's limit does not apply under `skip`.
    let dave = token(&claims("dave", None));
    let mut statuses = Vec::new();
    for _ in 0..4 {
        statuses.push(send(&skipping, api(&dave)).await.status.as_u16());
    }
    assert_eq!(statuses, [200, 200, 200, 429], "dave's own 3 alone");
    let refusing = app(PerMissing::Refuse);
    let erin = token(&claims("erin", None));
    assert_eq!(
        send(&refusing, api(&erin)).await.status,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        layer_peek(&tested, "per_user", "jwt:erin").await,
        3,
        "nothing counted"
    );

    // A token of another signer is refused, not keyed.
    let forged = {
        let key = EncodingKey::from_secret(b"not-the-secret");
        encode(
            &JwtHeader::new(Algorithm::HS256),
            &claims("mallory", Some("globex")),
            &key,
        )
        .unwrap()
    };
    assert_eq!(
        send(&skipping, api(&forged)).await.status,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        layer_peek(&tested, "per_org", "jwt.org:globex").await,
        2,
        "carol's alone"
    );
    // An organisation's key is no subject's: a user named `globex` has a
    // count of its own, and draws on acme's pool.
    let named_globex = token(&claims("globex", Some("acme")));
    assert_eq!(
        send(&skipping, api(&named_globex)).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(layer_peek(&tested, "per_user", "jwt:globex").await, 3);
}

on_both_stores!(an_organisation_shares_one_pool_across_its_users);

/// The config file's `per` and `per_missing`, and their refusals.
#[tokio::test]
async fn the_config_file_counts_a_policy_per_another_key() {
    let config = Config::from_toml_str(
        r#"
        [[policy]]
        name = "login"
        route = "POST /login"
        limit = 3
        window = "60s"

        [[policy]]
        name = "login_all"
        route = "POST /login"
        limit = 4
        window = "60s"
        per = "global"

        [[policy]]
        name = "tenants"
        route = "POST /login"
        limit = 100
        window = "60s"
        per = "header:x-tenant"
        per_missing = "skip"
        "#,
    )
    .unwrap();
    let policies = config.policies();
    let all = policies
        .iter()
        .find(|policy| policy.name() == "login_all")
        .unwrap();
    assert_eq!(all.per_missing(), Some(PerMissing::Skip));
    let app = login_app(config.layer(slidegate::store::MemoryStore::new()));
    let mut statuses = Vec::new();
    for peer in [
        "192.0.2.1",
        "192.0.2.2",
        "192.0.2.3",
        "192.0.2.4",
        "192.0.2.5",
    ] {
        statuses.push(
            send(&app, login(&format!("{peer}:1")))
                .await
                .status
                .as_u16(),
        );
    }
    assert_eq!(statuses, [200, 200, 200, 200, 429], "4 for everyone");

    for (body, key, message) in [
        ("per = \"everyone\"", "policy[0].per", "expected \"global\""),
        ("per = \"jwt:org\"", "jwt", "needs a [jwt] section"),
        (
            "per = \"header:bad header\"",
            "policy[0].per",
            "not a valid header name",
        ),
        (
            "per_missing = \"refuse\"",
            "policy[0].per_missing",
            "only beside `per`",
        ),
        (
            "per = \"ip\"\nper_missing = \"maybe\"",
            "policy[0].per_missing",
            "skip",
        ),
    ] {
        let file = format!("[[policy]]\nname = \"p\"\nlimit = 1\nwindow = \"1s\"\n{body}\n");
        let error = Config::from_toml_str(&file).unwrap_err().to_string();
        let expected_key = if key == "jwt" { "policy[0].per" } else { key };
        assert!(error.contains(expected_key), "{body}: {error}");
        assert!(error.contains(message), "{body}: {error}");
    }
}
