//! Configuration files: the documented format parses, and every bad file
//! stops with an error naming the key and its line.

use slidegate::config::Config;
use tower::ServiceExt;

const POLICY: &str =
    "[[policy]]\nname = \"search\"\nroute = \"GET /api/search\"\nlimit = 5\nwindow = \"60s\"\n";

#[test]
fn the_documented_format_parses() {
    let config = Config::from_toml_str(
        r#"
[redis]
url = "redis://127.0.0.1:6379/"
timeout_ms = 50
pool_size = 16

[limiter]
keys = ["api_key", "ip"]
api_key_header = "x-api-key"
trusted_proxies = ["10.0.0.0/8", "192.168.1.1"]
headers = "x-ratelimit"
fail = "open"

[[policy]]
name = "search"
route = "GET /api/search"
limit = 5
window = "60s"
algorithm = "sliding_log"
cost = 1
fail = "closed"

[[policy]]
name = "quota"
limit = 1000
window = "1h"

[default]
limit = 100
window = "60s"
"#,
    )
    .unwrap();
    let redis = config.redis().unwrap();
    assert_eq!(redis.url.as_deref(), Some("redis://127.0.0.1:6379/"));
    assert_eq!(redis.timeout.as_millis(), 50);
    assert_eq!(redis.pool_size, 16);
    let names: Vec<_> = config
        .policies()
        .iter()
        .map(|p| p.name().to_owned())
        .collect();
    assert_eq!(names, ["search", "quota", "default"]);
    let selected = config.policies().select(&http::Method::GET, "/api/search");
    assert_eq!(selected.len(), 2, "search plus the every-route quota");
}

#[test]
fn the_example_servers_demo_config_parses() {
    let config = Config::from_toml_str(include_str!("../../examples/demo.toml")).unwrap();
    assert!(config.redis().is_none());
    assert!(config.policies().iter().any(|p| p.name() == "search"));
}

/// Asserts `source` is refused at `line` with a message naming `key`.
#[track_caller]
fn refused(source: &str, line: usize, key: &str) -> String {
    let error = Config::from_toml_str(source).expect_err("the config must be refused");
    let message = error.to_string();
    assert_eq!(error.line(), Some(line), "wrong line in: {message}");
    assert_eq!(error.key(), Some(key), "wrong key in: {message}");
    assert!(message.contains(key), "`{key}` not named in: {message}");
    message
}

#[test]
fn unknown_keys_are_errors() {
    refused(
        "[limiter]\nfail = \"open\"\nfial = \"closed\"\n",
        3,
        "limiter.fial",
    );
    refused(&format!("{POLICY}limt = 5\n"), 6, "policy[0].limt");
    refused(
        "[limiter]\nkeys = [\"jwt\"]\n[jwt]\nsecret = \"x\"\nleway = \"5s\"\n",
        5,
        "jwt.leway",
    );
    refused(
        &format!("{POLICY}tiers = {{ pro = {{ limt = 50 }} }}\n"),
        6,
        "policy[0].tiers.pro.limt",
    );
    refused(
        "[redis]\nurl = \"redis://x\"\nclusterr = true\n",
        3,
        "redis.clusterr",
    );
    refused(
        "[default]\nlimit = 1\nwindow = \"1s\"\nroute = \"/x\"\n",
        4,
        "default.route",
    );
}

#[test]
fn a_route_with_a_method_http_does_not_define_is_refused() {
    let policy = |route: &str| {
        format!("[[policy]]\nname = \"videos\"\nroute = \"{route}\"\nlimit = 5\nwindow = \"60s\"\n")
    };
    let message = refused(&policy("GTE /api/videos"), 3, "policy[0].route");
    assert!(
        message.contains("`GTE` is not a standard HTTP method"),
        "{message}"
    );
    refused(&policy("PURGE /cache"), 3, "policy[0].route");
    // Named as an extension method, it is routed and limited.
    let allowed = format!(
        "[limiter]\nextension_methods = [\"PURGE\"]\n{}",
        policy("PURGE /cache")
    );
    let config = Config::from_toml_str(&allowed).unwrap();
    let purge = http::Method::from_bytes(b"PURGE").unwrap();
    assert_eq!(config.policies().select(&purge, "/cache").len(), 1);
    // The list itself is checked.
    refused(
        "[limiter]\nextension_methods = [\"purge\"]\n",
        2,
        "limiter.extension_methods",
    );
    refused(
        "[limiter]\nextension_methods = [\"PUR GE\"]\n",
        2,
        "limiter.extension_methods",
    );
}

#[test]
fn bad_values_name_their_key() {
    refused(
        &POLICY.replace("limit = 5", "limit = \"five\""),
        4,
        "policy[0].limit",
    );
    refused(
        &POLICY.replace("limit = 5", "limit = -1"),
        4,
        "policy[0].limit",
    );
    refused(
        &POLICY.replace("\"60s\"", "\"soon\""),
        5,
        "policy[0].window",
    );
    refused(
        &POLICY.replace("\"60s\"", "\"400days\""),
        5,
        "policy[0].window",
    );
    refused(
        &format!("{POLICY}algorithm = \"leaky_bucket\"\n"),
        6,
        "policy[0].algorithm",
    );
    refused(&format!("{POLICY}fail = \"maybe\"\n"), 6, "policy[0].fail");
    refused("[limiter]\nheaders = \"fancy\"\n", 2, "limiter.headers");
    refused(
        "[limiter]\ntrusted_proxies = [\"10.0.0.0/33\"]\n",
        2,
        "limiter.trusted_proxies[0]",
    );
    refused(
        "[limiter]\nkeys = [\"ip\", \"fingerprint\"]\n",
        2,
        "limiter.keys[1]",
    );
    refused("[limiter]\nkeys = []\n", 2, "limiter.keys");
    refused(
        "[limiter]\napi_key_header = \"bad header\"\n",
        2,
        "limiter.api_key_header",
    );
    refused("[redis]\ntimeout_ms = 0\n", 2, "redis.timeout_ms");
    refused("[redis]\npool_size = 0\n", 2, "redis.pool_size");
    refused("[memory]\nmax_keys = 0\n", 2, "memory.max_keys");
    refused("[memory]\nmax_keys = -5\n", 2, "memory.max_keys");
    refused("[memory]\nmax_key = 5\n", 2, "memory.max_key");
    refused(
        "[limiter]\nunknown_api_key = \"ignore\"\n",
        2,
        "limiter.unknown_api_key",
    );
}

#[tokio::test]
async fn memory_max_keys_bounds_the_memory_store() {
    use slidegate::{
        Policy,
        key::Key,
        store::{Check, Store},
    };
    let config = Config::from_toml_str("[memory]\nmax_keys = 100\n").unwrap();
    let store = config.memory_store();
    let policy = Policy::new("p", 5, std::time::Duration::from_secs(60));
    for client in 0..1000 {
        let checks = [Check::new(&policy, Key::new(format!("c{client}"))).unwrap()];
        assert!(store.check(&checks).await.unwrap()[0].admitted());
    }
    assert!(store.len() <= 100, "{} tracked", store.len());
}

#[test]
fn invalid_policies_name_their_key() {
    let message = refused(&format!("{POLICY}cost = 6\n"), 6, "policy[0].cost");
    assert!(message.contains("above the limit"), "{message}");
    refused(
        &POLICY.replace("limit = 5", "limit = 0"),
        4,
        "policy[0].limit",
    );
    refused(&POLICY.replace("\"60s\"", "\"0s\""), 5, "policy[0].window");
    refused(
        &POLICY.replace("GET /api/search", "GET api/search"),
        3,
        "policy[0].route",
    );
    let message = refused(
        &POLICY.replace("GET /api/search", "GET /api/videos/:id"),
        3,
        "policy[0].route",
    );
    assert!(message.contains("write `{id}`"), "{message}");
    // A method in another case is a method no client sends: refused,
    // naming the spelling to use.
    for spelling in ["get", "Get"] {
        let message = refused(
            &POLICY.replace("GET /api/search", &format!("{spelling} /api/search")),
            3,
            "policy[0].route",
        );
        assert!(message.contains("write `GET`"), "{message}");
    }
    refused(
        &POLICY.replace("name = \"search\"", "name = \"{search}\""),
        2,
        "policy[0].name",
    );
    refused(&format!("{POLICY}{POLICY}"), 7, "policy[1].name");
    refused(
        "[default]\nlimit = 5\nwindow = \"1m\"\ncost = 9\n",
        4,
        "default.cost",
    );
}

#[test]
fn missing_keys_and_broken_syntax_point_at_the_line() {
    refused(
        "[[policy]]\nname = \"p\"\nwindow = \"1s\"\n",
        1,
        "policy[0].limit",
    );
    refused("[limiter\nfail = \"open\"\n", 1, "limiter");
}

#[test]
fn a_missing_file_names_the_file() {
    let error = Config::from_file("/nonexistent/slidegate.toml").unwrap_err();
    assert!(
        error.to_string().contains("/nonexistent/slidegate.toml"),
        "{error}"
    );
}

/// The DESIGN's example configuration, word for word in its identity parts.
const IDENTITY: &str = r#"
[limiter]
keys = ["jwt", "api_key", "ip"]      # ordered fallback chain
api_key_header = "x-api-key"
headers = "ietf"

[jwt]
secret = "change-me"                 # HS* secret
algorithms = ["HS256"]
key_claim = "sub"
tier_claim = "tier"

[api_keys]                           # api key -> tier
"demo-pro-key" = "pro"

[[policy]]
name = "search"
route = "GET /api/search"            # "METHOD /pattern" or "/pattern" (any method)
limit = 5
window = "60s"
cost = 1
fail = "closed"
tiers = { pro = { limit = 50 } }     # per-tier overrides

[default]
limit = 100
window = "60s"
tiers = { pro = { limit = 1000, window = "1m", cost = 2 } }
"#;

#[test]
fn jwt_api_keys_and_tiers_parse() {
    let config = Config::from_toml_str(IDENTITY).unwrap();
    let search = config.policies().iter().next().unwrap();
    assert_eq!(search.limits_for(Some("pro")).limit, 50);
    assert_eq!(search.limits_for(None).limit, 5);
    let default = config.policies().iter().nth(1).unwrap();
    let pro = default.limits_for(Some("pro"));
    assert_eq!((pro.limit, pro.cost, pro.window.as_secs()), (1000, 2, 60));
    // The [api_keys] table never shows a raw key.
    assert!(!format!("{config:?}").contains("demo-pro-key"));
}

#[test]
fn bad_identity_settings_name_key_and_line() {
    let with = |from: &str, to: &str| {
        assert!(IDENTITY.contains(from), "{from}");
        IDENTITY.replacen(from, to, 1)
    };
    let message = refused(
        &with("[\"HS256\"]", "[\"HS256\", \"none\"]"),
        9,
        "jwt.algorithms",
    );
    assert!(message.contains("none"), "{message}");
    let message = refused(&with("[\"HS256\"]", "[\"RS256\"]"), 9, "jwt.algorithms");
    assert!(message.contains("RSA"), "{message}");
    refused(
        &with("secret = \"change-me\"", "secret = \"\""),
        8,
        "jwt.secret",
    );
    refused(
        &with(
            "secret = \"change-me\"",
            "public_key_pem = \"/nonexistent/key.pem\"",
        ),
        8,
        "jwt.public_key_pem",
    );
    refused(
        &with("secret = \"change-me\"        ", "tier_claim_x = 1\n"),
        8,
        "jwt.tier_claim_x",
    );
    refused(&with("secret = \"change-me\"", "issuer = \"me\""), 7, "jwt");
    refused(
        &with("[\"jwt\", \"api_key\", \"ip\"]", "[\"api_key\", \"ip\"]"),
        7,
        "jwt",
    );
    refused(
        &with("[\"jwt\", \"api_key\", \"ip\"]", "[\"jwt\", \"ip\"]"),
        13,
        "api_keys",
    );
    refused("[limiter]\nkeys = [\"jwt\", \"ip\"]\n", 2, "limiter.keys");
    let message = refused(
        &with(
            "{ pro = { limit = 50 } }",
            "{ pro = { limit = 50, cost = 60 } }",
        ),
        23,
        "policy[0].tiers.pro.cost",
    );
    assert!(message.contains("tier `pro`"), "{message}");
    refused(
        &with("{ pro = { limit = 50 } }", "{ pro = { limit = 0 } }"),
        23,
        "policy[0].tiers.pro.limit",
    );
    refused(
        &with("window = \"1m\"", "window = \"0s\""),
        28,
        "default.tiers.pro.window",
    );
}

#[test]
fn a_bad_api_key_entry_does_not_echo_the_key() {
    let source = IDENTITY.replace("\"demo-pro-key\" = \"pro\"", "\"sk-live-secret\" = 5");
    let message = refused(&source, 14, "api_keys");
    assert!(!message.contains("sk-live-secret"), "{message}");
    let source = IDENTITY.replace("\"demo-pro-key\" = \"pro\"", "\"sk-live-secret\" = \"\"");
    let message = refused(&source, 14, "api_keys");
    assert!(!message.contains("sk-live-secret"), "{message}");
    // Values of the wrong type, which serde would quote.
    let message = refused("api_keys = \"sk-live-secret\"\n", 1, "api_keys");
    assert!(!message.contains("sk-live-secret"), "{message}");
    let message = refused(
        "[limiter]\nexempt_api_keys = \"sk-live-secret\"\n",
        2,
        "limiter.exempt_api_keys",
    );
    assert!(!message.contains("sk-live-secret"), "{message}");
    assert!(message.contains("expected a sequence"), "{message}");
    // Other secrets, given as a number where a string is wanted.
    for (source, line, key) in [
        ("[admin]\ntoken = 987654321\n", 2, "admin.token"),
        ("[jwt]\nsecret = 987654321\n", 2, "jwt.secret"),
    ] {
        let message = refused(source, line, key);
        assert!(!message.contains("987654321"), "{message}");
    }
}

#[test]
fn public_key_paths_are_relative_to_the_config_file() {
    let dir = std::env::temp_dir().join(format!("slidegate-jwt-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("keys")).unwrap();
    std::fs::copy(
        concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/rsa_public.pem"),
        dir.join("keys/rsa_public.pem"),
    )
    .unwrap();
    let path = dir.join("rs.toml");
    std::fs::write(
        &path,
        "[limiter]\nkeys = [\"jwt\"]\n[jwt]\npublic_key_pem = \"keys/rsa_public.pem\"\nalgorithms = [\"RS256\"]\n",
    )
    .unwrap();
    let loaded = Config::from_file(&path);
    std::fs::write(
        &path,
        "[limiter]\nkeys = [\"jwt\"]\n[jwt]\npublic_key_pem = \"keys/rsa_public.pem\"\n",
    )
    .unwrap();
    let without_algorithms = Config::from_file(&path);
    std::fs::remove_dir_all(&dir).unwrap();
    loaded.unwrap();
    let message = without_algorithms.unwrap_err().to_string();
    assert!(message.contains("jwt.algorithms"), "{message}");
}

#[test]
fn every_algorithm_can_be_chosen() {
    for (name, algorithm) in [
        ("sliding_log", slidegate::policy::Algorithm::SlidingLog),
        (
            "sliding_counter",
            slidegate::policy::Algorithm::SlidingCounter,
        ),
        ("fixed_window", slidegate::policy::Algorithm::FixedWindow),
        ("token_bucket", slidegate::policy::Algorithm::TokenBucket),
    ] {
        let config = Config::from_toml_str(&format!("{POLICY}algorithm = \"{name}\"\n")).unwrap();
        let policy = config.policies().iter().next().unwrap();
        assert_eq!(policy.algorithm(), algorithm);
    }
    let message = refused(
        &format!("{POLICY}algorithm = \"sliding_counter\"\n")
            .replace("limit = 5", "limit = 4000000000")
            .replace("\"60s\"", "\"30d\""),
        5,
        "policy[0].window",
    );
    assert!(message.contains("2^51"), "{message}");
}

#[test]
fn a_token_bucket_takes_a_burst_and_a_policy_a_block() {
    let config = Config::from_toml_str(&format!(
        "{POLICY}algorithm = \"token_bucket\"\nburst = 20\nblock = \"10m\"\n\
         tiers = {{ pro = {{ limit = 50, burst = 100 }} }}\n"
    ))
    .unwrap();
    let policy = config.policies().iter().next().unwrap();
    assert_eq!(policy.limits_for(None).burst, 20);
    assert_eq!(policy.limits_for(Some("pro")).burst, 100);
    assert_eq!(policy.block(), Some(std::time::Duration::from_secs(600)));
    // A burst belongs to a bucket; a cost may not exceed it.
    let message = refused(&format!("{POLICY}burst = 20\n"), 6, "policy[0].burst");
    assert!(message.contains("token_bucket"), "{message}");
    let message = refused(
        &format!("{POLICY}algorithm = \"token_bucket\"\nburst = 2\ncost = 3\n"),
        8,
        "policy[0].cost",
    );
    assert!(message.contains("above the limit 2"), "{message}");
    refused(&format!("{POLICY}block = \"0s\"\n"), 6, "policy[0].block");
    let message = refused(
        &format!("{POLICY}algorithm = \"token_bucket\"\nburst = 4000000000\n")
            .replace("\"60s\"", "\"1d\""),
        7,
        "policy[0].burst",
    );
    assert!(message.contains("2^52"), "{message}");
}

#[test]
fn redis_cluster_settings() {
    let config = Config::from_toml_str(
        "[redis]\ncluster = true\nurls = [\"redis://127.0.0.1:7000\", \"redis://127.0.0.1:7001\"]\n",
    )
    .unwrap();
    let redis = config.redis().unwrap();
    assert!(redis.is_cluster());
    assert_eq!(redis.seeds().len(), 2);
    let config = Config::from_toml_str("[redis]\nurl = \"redis+cluster://a:1,b:2\"\n").unwrap();
    assert_eq!(
        config.redis().unwrap().seeds(),
        ["redis://a:1", "redis://b:2"]
    );
    refused("[redis]\nurls = [\"redis://a:1\"]\n", 2, "redis.urls");
    refused("[redis]\nprefix = \"{app}\"\n", 2, "redis.prefix");
    refused("[redis]\nurl = \"redis+cluster://\"\n", 2, "redis.url");
}

#[test]
fn a_url_redis_would_refuse_is_refused_at_its_line() {
    let message = refused(
        "[redis]\ntimeout_ms = 50\nurl = \"http://cache\"\n",
        3,
        "redis.url",
    );
    assert!(message.contains("redis://"), "{message}");
    let message = refused(
        "[redis]\nurl = \"redis://:hunter2@cache:port/\"\n",
        2,
        "redis.url",
    );
    assert!(!message.contains("hunter2"), "{message}");
    refused("[redis]\nurl = \"redis://cache/db\"\n", 2, "redis.url");
    refused(
        "[redis]\nurl = \"redis+cluster://a:1,b:x\"\n",
        2,
        "redis.url",
    );
    refused(
        "[redis]\ncluster = true\nurls = [\"redis://a:1\", \"a:2\"]\n",
        3,
        "redis.urls",
    );
    refused(
        "[redis]\nmaster = \"m\"\nsentinels = [\"redis://s:1\", \"redis://s:two\"]\n",
        3,
        "redis.sentinels",
    );
}

#[test]
fn a_file_that_is_not_utf8_names_the_line() {
    let dir = std::env::temp_dir().join(format!("slidegate-utf8-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("latin1.toml");
    std::fs::write(
        &path,
        b"[limiter]\nkeys = [\"ip\"]\napi_key_header = \"x-\xe9\"\n",
    )
    .unwrap();
    let error = Config::from_file(&path).unwrap_err();
    std::fs::remove_dir_all(&dir).unwrap();
    let message = error.to_string();
    assert_eq!(error.line(), Some(3), "{message}");
    assert_eq!(error.key(), Some("api_key_header"), "{message}");
    assert!(
        message.contains("latin1.toml") && message.contains("UTF-8"),
        "{message}"
    );
}

/// `limiter.deny_cache` switches the cache: on a Redis store (where it is
/// on unless the file says otherwise), a client denied once is answered
/// from the cache, and with `false` every request asks Redis.
#[tokio::test]
async fn the_deny_cache_can_be_switched() {
    use crate::deny_cache::script_calls;
    use crate::support::RedisServer;
    use crate::support::reply::send;
    use axum::{Router, body::Body, routing::get};
    use slidegate::store::RedisStore;

    for (setting, calls) in [
        ("", 2),
        ("deny_cache = true\n", 2),
        ("deny_cache = false\n", 3),
    ] {
        let config = Config::from_toml_str(&format!(
            "[limiter]\nkeys = [\"global\"]\n{setting}\n[[policy]]\nname = \"p\"\nlimit = 1\nwindow = \"60s\"\n"
        ))
        .unwrap_or_else(|e| panic!("{e}"));
        let redis = RedisServer::start();
        let app = Router::new()
            .route("/", get(|| async { "ok" }))
            .route_layer(config.layer(RedisStore::new(redis.pool(2))));
        for status in [200, 429, 429] {
            let request = http::Request::get("/").body(Body::empty()).unwrap();
            assert_eq!(send(&app, request).await.status, status, "{setting:?}");
        }
        assert_eq!(script_calls(&redis), calls, "{setting:?}");
    }
    refused(
        "[limiter]\ndeny_cache = \"sometimes\"\n",
        2,
        "limiter.deny_cache",
    );
}

/// The configuration reference, `docs/configuration.md`, is a file that
/// parses.
#[test]
fn the_configuration_reference_parses() {
    let section = include_str!("../../docs/configuration.md");
    let start = section.find("```toml\n").unwrap() + "```toml\n".len();
    let block = &section[start..];
    let block = &block[..block.find("```").unwrap()];
    let config = Config::from_toml_str(block).unwrap_or_else(|e| panic!("{e}"));
    assert!(config.policies().iter().any(|p| p.name() == "search"));
}

/// The sample configuration of the crate's design, word for word (every
/// key the example server documents), parses, in both of the breaker's
/// spellings.
#[test]
fn the_full_sample_configuration_parses() {
    let sample = r#"
[redis]                 # optional; REDIS_URL overrides url; absent and no REDIS_URL => memory
url = "redis://127.0.0.1:6379/"      # rediss:// for TLS; redis://user:pass@host/ for ACL users
# cluster = true; urls = ["redis://127.0.0.1:7000", "redis://127.0.0.1:7001"]   # Redis Cluster seeds
# sentinels = ["redis://127.0.0.1:26379", "redis://127.0.0.1:26380"]; master = "mymaster"
# tls = { ca = "ca.pem", cert = "client.pem", key = "client.key" }   # all optional (PEM)
timeout_ms = 50
pool_size = 16

[limiter]
keys = ["jwt", "api_key", "ip"]      # ordered fallback chain
api_key_header = "x-api-key"
unknown_api_key = "next"             # next | reject (401)
trusted_proxies = ["10.0.0.0/8"]     # default: none
# client_ip_header = "cf-connecting-ip"  # a single-value header set by a trusted proxy
headers = "x-ratelimit"              # x-ratelimit | ietf | both | none
fail = "open"                        # default fail mode: open | closed | local
local_share = 1                      # fail = "local": the limit is divided by this (instances)
credential_failures = { limit = 10, window = "60s" }   # per client IP; false turns it off
shadow = false                       # true: decide and count, never answer 429
exempt = ["10.1.0.0/16"]             # client IPs never limited
exempt_api_keys = ["internal-key"]

[memory]
max_keys = 1000000                   # bound on tracked clients; a flood never fails open

[redis.breaker]                      # or: breaker = { failures = 5, cooldown = "2s" } under [redis]
failures = 5
cooldown = "2s"

[jwt]
secret = "change-me"                 # HS* secret; or public_key_pem = "path" for RS*/ES*
algorithms = ["HS256"]
key_claim = "sub"
tier_claim = "tier"
# [[jwt.keys]]  kid = "2026-11"; algorithm = "RS256"; public_key_pem = "path"   # rotation by kid

[api_keys]                           # api key -> tier
"demo-pro-key" = "pro"

[[policy]]
name = "search"
route = "GET /api/search"            # "METHOD /pattern" or "/pattern" (any method)
limit = 5
window = "60s"                       # humantime durations
algorithm = "sliding_log"            # sliding_log | sliding_counter | fixed_window | token_bucket
# burst = 10                         # token_bucket: bucket size (default: limit)
# delay = "500ms"                    # hold a request that fits within this, instead of 429
# block = "10m"                      # once denied, stay denied this long
cost = 1
fail = "closed"                      # open | closed | local
count = "all"                        # all | failures (status >= 400) | successes
shadow = false
tiers = { pro = { limit = 50 } }     # per-tier overrides

[[policy]]
name = "exports"
route = "GET /api/slow"
concurrency = 2                      # at most 2 in flight per client (instead of limit/window)
lease = "30s"                        # a crashed instance's leases expire after this

[default]                            # optional policy for routes not listed
limit = 100
window = "60s"

[overrides]                          # per-client limits: "<key label>" = { <policy> = limit }
"jwt:alice" = { search = 50 }

[admin]
token = "change-me"                  # enables /admin/limits/...; absent => no admin routes
"#;
    let config = Config::from_toml_str(sample).unwrap_or_else(|e| panic!("{e}"));
    let breaker = config.redis().unwrap().breaker.unwrap();
    assert_eq!(
        (breaker.failures(), breaker.cooldown()),
        (5, std::time::Duration::from_secs(2))
    );
    let exports = config
        .policies()
        .iter()
        .find(|p| p.name() == "exports")
        .unwrap();
    assert_eq!(
        exports.algorithm(),
        slidegate::policy::Algorithm::Concurrency
    );
    assert_eq!(
        (exports.limit(), exports.window()),
        (2, std::time::Duration::from_secs(30))
    );
    let search = config
        .policies()
        .iter()
        .find(|p| p.name() == "search")
        .unwrap();
    assert_eq!(
        search.fail_mode(),
        Some(slidegate::policy::FailMode::Closed)
    );
    assert_eq!(search.count(), slidegate::policy::Count::All);
    let alice = slidegate::key::Key::parse("jwt:alice").unwrap();
    assert_eq!(config.overrides().get(&alice, "search"), Some(50));
    assert_eq!(config.admin_token(), Some("change-me"));

    let section = sample.find("[redis.breaker]").unwrap();
    let section_end = section + sample[section..].find("\n\n").unwrap();
    let inline = format!("{}{}", &sample[..section], &sample[section_end..]).replace(
        "pool_size = 16\n",
        "pool_size = 16\nbreaker = { failures = 3 }\n",
    );
    let config = Config::from_toml_str(&inline).unwrap_or_else(|e| panic!("{e}"));
    let breaker = config.redis().unwrap().breaker.unwrap();
    assert_eq!(
        (breaker.failures(), breaker.cooldown()),
        (3, std::time::Duration::from_secs(2))
    );
}

#[test]
fn bad_operating_keys_are_refused_by_name() {
    for (text, key) in [
        ("[limiter]\nlocal_share = 0\n", "limiter.local_share"),
        ("[limiter]\nfail = \"nearby\"\n", "limiter.fail"),
        (
            "[redis]\nurl = \"redis://h/\"\nbreaker = { failures = 0 }\n",
            "redis.breaker.failures",
        ),
        (
            "[redis]\nurl = \"redis://h/\"\n[redis.breaker]\ncooldown = \"soon\"\n",
            "redis.breaker.cooldown",
        ),
        (
            "[[policy]]\nname = \"a\"\nlimit = 1\nwindow = \"1s\"\ncount = \"some\"\n",
            "policy[0].count",
        ),
        (
            "[[policy]]\nname = \"a\"\nlimit = 1\nwindow = \"1s\"\nshadow = \"yes\"\n",
            "policy[0].shadow",
        ),
        ("[limiter]\nnamespace = \"a:b\"\n", "limiter.namespace"),
        ("[limiter]\nnamespace = \"\"\n", "limiter.namespace"),
    ] {
        let error = Config::from_toml_str(text).unwrap_err().to_string();
        assert!(error.contains(key), "{key}: {error}");
    }
}

#[test]
fn concurrency_delays_overrides_and_admin_parse() {
    use slidegate::key::Key;
    use slidegate::policy::Algorithm;
    use std::time::Duration;

    let config = Config::from_toml_str(
        r#"
[limiter]
keys = ["jwt", "api_key", "ip"]
max_delayed = 500

[jwt]
secret = "change-me"

[[policy]]
name = "exports"
route = "GET /api/slow"
concurrency = 2
lease = "2m"
tiers = { pro = { limit = 8 } }

[[policy]]
name = "videos"
route = "GET /api/videos"
limit = 20
window = "10s"
algorithm = "token_bucket"
delay = "750ms"

[default]
concurrency = 100

[overrides]
"jwt:alice" = { videos = 50, exports = 4 }
"ip:203.0.113.9" = { default = 1 }
"ip:2001:db8::/64" = { videos = 5 }
"key:#00112233445566778899aabbccddeeff" = { videos = 7 }

[admin]
token = "s3cret-token"
"#,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let policy = |name: &str| {
        config
            .policies()
            .iter()
            .find(|p| p.name() == name)
            .unwrap()
            .clone()
    };
    let exports = policy("exports");
    assert_eq!(exports.algorithm(), Algorithm::Concurrency);
    assert_eq!(
        (exports.limit(), exports.window()),
        (2, Duration::from_secs(120))
    );
    assert_eq!(exports.limits_for(Some("pro")).limit, 8);
    assert_eq!(policy("videos").delay(), Some(Duration::from_millis(750)));
    let default = policy("default");
    assert_eq!(
        (default.algorithm(), default.window()),
        (Algorithm::Concurrency, Duration::from_secs(30)),
        "a concurrency policy's lease is 30 s unless set"
    );
    let overrides = config.overrides();
    assert_eq!(overrides.len(), 5);
    let key = |label: &str| Key::parse(label).unwrap();
    assert_eq!(overrides.get(&key("jwt:alice"), "exports"), Some(4));
    assert_eq!(overrides.get(&key("ip:203.0.113.9"), "default"), Some(1));
    assert_eq!(overrides.get(&key("ip:2001:db8::/64"), "videos"), Some(5));
    assert_eq!(overrides.get(&key("jwt:alice"), "default"), None);
    assert_eq!(config.admin_token(), Some("s3cret-token"));
    // Without [admin] there is no token, so no admin routes.
    assert_eq!(Config::from_toml_str(POLICY).unwrap().admin_token(), None);
}

#[test]
fn bad_concurrency_and_delay_settings_name_key_and_line() {
    let concurrency = "[[policy]]\nname = \"slow\"\nconcurrency = 2\n";
    // Either a rate or a concurrency limit, never both, never neither.
    let message = refused(
        &format!("{concurrency}limit = 5\n"),
        4,
        "policy[0].concurrency",
    );
    assert!(message.contains("one or the other"), "{message}");
    refused(
        &format!("{concurrency}window = \"1s\"\n"),
        4,
        "policy[0].concurrency",
    );
    let message = refused("[[policy]]\nname = \"p\"\n", 1, "policy[0].limit");
    assert!(message.contains("concurrency"), "{message}");
    refused("x = 1\n[default]\nlimit = 3\n", 1, "x");
    refused("[default]\nlimit = 3\n", 1, "default.window");
    // A concurrency limit has no algorithm, burst, delay or block; a rate
    // has no lease.
    refused(
        &format!("{concurrency}algorithm = \"sliding_log\"\n"),
        3,
        "policy[0].algorithm",
    );
    refused(&format!("{concurrency}burst = 3\n"), 4, "policy[0].burst");
    refused(
        &format!("{concurrency}delay = \"1s\"\n"),
        3,
        "policy[0].concurrency",
    );
    refused(
        &format!("{concurrency}block = \"1m\"\n"),
        3,
        "policy[0].concurrency",
    );
    refused(&format!("{POLICY}lease = \"1m\"\n"), 6, "policy[0].lease");
    refused(
        &format!("{concurrency}lease = \"0s\"\n"),
        4,
        "policy[0].lease",
    );
    refused(
        "[[policy]]\nname = \"slow\"\nconcurrency = 0\n",
        3,
        "policy[0].concurrency",
    );
    let message = refused(
        "[[policy]]\nname = \"slow\"\nconcurrency = 5000\n",
        3,
        "policy[0].concurrency",
    );
    assert!(message.contains("4096"), "{message}");
    let message = refused(&format!("{POLICY}delay = \"2m\"\n"), 6, "policy[0].delay");
    assert!(message.contains("60s"), "{message}");
    refused(&format!("{POLICY}delay = \"soon\"\n"), 6, "policy[0].delay");
    refused("[limiter]\nmax_delayed = -1\n", 2, "limiter.max_delayed");
}

#[test]
fn bad_overrides_and_admin_settings_name_key_and_line() {
    let file = |overrides: &str| {
        format!("[limiter]\nkeys = [\"api_key\", \"ip\"]\n{POLICY}[overrides]\n{overrides}\n")
    };
    // Line 9 is the override's.
    let message = refused(
        &file("\"ip:203.0.113.9\" = { serch = 5 }"),
        9,
        "overrides.\"ip:203.0.113.9\".serch",
    );
    assert!(message.contains("no policy"), "{message}");
    refused(
        &file("\"ip:203.0.113.9\" = { search = 0 }"),
        9,
        "overrides.\"ip:203.0.113.9\".search",
    );
    // A limit the policy cannot count exactly on both stores: a token
    // bucket of 2 h whose burst × window passes 2^52 µs.
    let bucket = "[[policy]]\nname = \"b\"\nroute = \"GET /api/b\"\nlimit = 10\nwindow = \"2h\"\n\
                  algorithm = \"token_bucket\"\n";
    let message = refused(
        &format!(
            "[limiter]\nkeys = [\"ip\"]\n{bucket}[overrides]\n\"ip:203.0.113.9\" = {{ b = 2562047789 }}\n"
        ),
        10,
        "overrides.\"ip:203.0.113.9\".b",
    );
    assert!(message.contains("2^52"), "{message}");
    refused(
        &file("\"ip:203.0.113.9\" = { search = \"many\" }"),
        9,
        "overrides.ip:203.0.113.9.search",
    );
    // A client no key source of the file can ever name.
    let message = refused(&file("\"jwt:alice\" = { search = 5 }"), 9, "overrides");
    assert!(message.contains("limiter.keys"), "{message}");
    let message = refused(&file("\"alice\" = { search = 5 }"), 9, "overrides");
    assert!(message.contains("jwt:<claim>"), "{message}");
    refused(&file("\"ip:a b\" = { search = 5 }"), 9, "overrides");
    refused(&file("\"ip:{x}\" = { search = 5 }"), 9, "overrides");
    let long = format!("\"key:{}\" = {{ search = 5 }}", "a".repeat(300));
    refused(&file(&long), 9, "overrides");
    let message = refused(&file("\"ip:example.com\" = { search = 5 }"), 9, "overrides");
    assert!(message.contains("not an IP address"), "{message}");
    // IPv6 clients are counted by their /64: an address alone never matches.
    let message = refused(&file("\"ip:2001:db8::1\" = { search = 5 }"), 9, "overrides");
    assert!(message.contains("`ip:2001:db8::/64`"), "{message}");
    // [admin] takes a token, and only a token.
    refused("[admin]\ntoken = \"\"\n", 2, "admin.token");
    refused("[admin]\ntoken = \"two words\"\n", 2, "admin.token");
    refused("[admin]\n", 1, "admin.token");
    refused("[admin]\ntoken = \"t\"\nuser = \"root\"\n", 3, "admin.user");
}

/// The layer a file describes gives the clients of `[overrides]` their own
/// limits, and holds no more requests than `limiter.max_delayed`.
#[tokio::test]
async fn the_layer_applies_overrides_and_max_delayed() {
    use crate::support::reply::send;
    use axum::extract::ConnectInfo;
    use axum::{Router, body::Body, routing::get};
    use std::net::SocketAddr;

    let config = Config::from_toml_str(
        r#"
[limiter]
max_delayed = 0                      # no request is ever held

[[policy]]
name = "search"
limit = 2
window = "60s"
delay = "60s"

[overrides]
"ip:203.0.113.9" = { search = 3 }
"#,
    )
    .unwrap();
    let app = Router::new()
        .route("/search", get(|| async { "results" }))
        .route_layer(config.layer(config.memory_store()));
    let request = |client: &str| {
        let mut request = http::Request::get("/search").body(Body::empty()).unwrap();
        let peer: SocketAddr = format!("{client}:40000").parse().unwrap();
        request.extensions_mut().insert(ConnectInfo(peer));
        request
    };
    let statuses = |client: &'static str| {
        let app = app.clone();
        async move {
            let mut statuses = Vec::new();
            for _ in 0..4 {
                // Answered at once: a held request would take a minute.
                let reply = tokio::time::timeout(
                    std::time::Duration::from_secs(10),
                    send(&app, request(client)),
                )
                .await
                .expect("answered without being held");
                statuses.push(reply.status.as_u16());
            }
            statuses
        }
    };
    assert_eq!(statuses("203.0.113.9").await, [200, 200, 200, 429]);
    assert_eq!(statuses("203.0.113.10").await, [200, 200, 429, 429]);
}

/// `client_ip_header` keys clients by the header a trusted proxy sets, and
/// only with trusted proxies to set it.
#[tokio::test]
async fn a_client_ip_header_is_read_from_the_trusted_proxies() {
    use crate::support::reply::send;
    use axum::extract::ConnectInfo;
    use axum::{Router, body::Body, routing::get};
    use std::net::SocketAddr;

    let config = Config::from_toml_str(
        r#"
[limiter]
trusted_proxies = ["10.0.0.0/8"]
client_ip_header = "CF-Connecting-IP"

[[policy]]
name = "search"
limit = 1
window = "60s"
"#,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let app = Router::new()
        .route("/search", get(|| async { "results" }))
        .route_layer(config.layer(config.memory_store()));
    let request = |peer: &str, client: &str| {
        let mut request = http::Request::get("/search")
            .header("cf-connecting-ip", client)
            .body(Body::empty())
            .unwrap();
        let peer: SocketAddr = format!("{peer}:443").parse().unwrap();
        request.extensions_mut().insert(ConnectInfo(peer));
        request
    };
    // Two clients behind the proxy, counted apart.
    assert_eq!(
        send(&app, request("10.0.0.1", "203.0.113.9")).await.status,
        200
    );
    assert_eq!(
        send(&app, request("10.0.0.1", "203.0.113.10")).await.status,
        200
    );
    assert_eq!(
        send(&app, request("10.0.0.2", "203.0.113.9")).await.status,
        429
    );
    // A client writing the header itself is counted by its own address.
    assert_eq!(
        send(&app, request("198.51.100.7", "203.0.113.11"))
            .await
            .status,
        200
    );
    assert_eq!(
        send(&app, request("198.51.100.7", "203.0.113.12"))
            .await
            .status,
        429
    );

    refused(
        "[limiter]\nclient_ip_header = \"cf-connecting-ip\"\n",
        2,
        "limiter.client_ip_header",
    );
    refused(
        "[limiter]\ntrusted_proxies = [\"10.0.0.0/8\"]\nclient_ip_header = \"bad header\"\n",
        3,
        "limiter.client_ip_header",
    );
}

/// `limiter.namespace` puts the layer's counts apart from another layer's
/// on the same store, even under one policy name and another limit.
#[tokio::test]
async fn a_namespace_from_the_file_keeps_two_layers_apart() {
    use slidegate::store::MemoryStore;

    let file = |namespace: &str, limit: u32| {
        Config::from_toml_str(&format!(
            "[limiter]\nkeys = [\"global\"]\nnamespace = \"{namespace}\"\n\n\
             [[policy]]\nname = \"api\"\nroute = \"GET /\"\nlimit = {limit}\nwindow = \"60s\"\n"
        ))
        .unwrap()
    };
    let store = MemoryStore::new();
    let routes = || axum::Router::new().route("/", axum::routing::get(|| async { "ok" }));
    let shop = routes().route_layer(file("shop", 1).layer(store.clone()));
    let blog = routes().route_layer(file("blog", 3).layer(store));
    let statuses = |app: axum::Router| async move {
        let mut statuses = Vec::new();
        for _ in 0..2 {
            let request = http::Request::get("/")
                .body(axum::body::Body::empty())
                .unwrap();
            statuses.push(
                app.clone()
                    .oneshot(request)
                    .await
                    .unwrap()
                    .status()
                    .as_u16(),
            );
        }
        statuses
    };
    assert_eq!(statuses(shop).await, [200, 429]);
    assert_eq!(statuses(blog).await, [200, 200]);
}

const QUOTA: &str = "[[policy]]\nname = \"monthly\"\nlimit = 10000\ncalendar = \"month\"\n";

#[test]
fn calendar_quotas_parse() {
    use slidegate::policy::{Algorithm, Calendar, Period};
    use std::time::Duration;

    let config = Config::from_toml_str(&format!("{QUOTA}utc_offset = \"-05:30\"\n")).unwrap();
    let policy = config.policies().iter().next().unwrap();
    let expected =
        Calendar::new(Period::Month).with_west_of_utc(Duration::from_secs(5 * 3600 + 1800));
    assert_eq!(policy.algorithm(), Algorithm::Calendar(expected));
    assert_eq!(policy.limit(), 10_000);
    for (offset, seconds) in [("+14:00", 50_400), ("Z", 0), ("+00:00", 0)] {
        let config = Config::from_toml_str(&format!("{QUOTA}utc_offset = \"{offset}\"\n")).unwrap();
        let policy = config.policies().iter().next().unwrap();
        let Algorithm::Calendar(calendar) = policy.algorithm() else {
            panic!("a calendar quota");
        };
        assert_eq!(calendar.utc_offset_seconds(), seconds, "{offset}");
    }
}

#[test]
fn bad_calendar_quotas_name_their_key() {
    refused(
        &QUOTA.replace("month", "fortnight"),
        4,
        "policy[0].calendar",
    );
    refused(&format!("{QUOTA}window = \"30d\"\n"), 5, "policy[0].window");
    refused(
        &format!("{QUOTA}algorithm = \"fixed_window\"\n"),
        4,
        "policy[0].algorithm",
    );
    refused(
        &format!("{QUOTA}concurrency = 2\n"),
        5,
        "policy[0].concurrency",
    );
    refused(&QUOTA.replace("limit = 10000\n", ""), 3, "policy[0].limit");
    for offset in ["+24:00", "+2:00", "02:00", "+02:60", "+02", "", "-00:0x"] {
        let message = refused(
            &format!("{QUOTA}utc_offset = \"{offset}\"\n"),
            5,
            "policy[0].utc_offset",
        );
        assert!(message.contains("+HH:MM"), "{message}");
    }
    refused(
        &format!("{POLICY}utc_offset = \"+02:00\"\n"),
        6,
        "policy[0].utc_offset",
    );
    refused(&format!("{QUOTA}delay = \"1s\"\n"), 4, "policy[0].calendar");
    refused(
        &format!("{QUOTA}tiers = {{ pro = {{ window = \"1d\" }} }}\n"),
        5,
        "policy[0].tiers.pro.calendar",
    );
}

#[test]
fn settled_policies_parse() {
    let config =
        Config::from_toml_str(&format!("{POLICY}usage_header = \"x-usage-tokens\"\n")).unwrap();
    let policy = config.policies().iter().next().unwrap();
    assert!(policy.is_settled_after_response());
    assert_eq!(
        policy.usage_header().map(|name| name.as_str()),
        Some("x-usage-tokens")
    );
    let config = Config::from_toml_str(&format!("{POLICY}settled = true\n")).unwrap();
    let policy = config.policies().iter().next().unwrap();
    assert!(policy.is_settled_after_response());
    assert_eq!(policy.usage_header(), None);
    assert_eq!(policy.max_unsettled(), Some(8), "the default");
    let config =
        Config::from_toml_str(&format!("{POLICY}settled = true\nmax_unsettled = 3\n")).unwrap();
    let policy = config.policies().iter().next().unwrap();
    assert_eq!(policy.max_unsettled(), Some(3));
    let config = Config::from_toml_str(&format!("{POLICY}settled = false\n")).unwrap();
    assert!(
        !config
            .policies()
            .iter()
            .next()
            .unwrap()
            .is_settled_after_response()
    );
}

#[test]
fn bad_settled_policies_name_their_key() {
    refused(
        &format!("{POLICY}usage_header = \"x usage\"\n"),
        6,
        "policy[0].usage_header",
    );
    refused(
        &format!("{POLICY}settled = false\nusage_header = \"x-usage\"\n"),
        6,
        "policy[0].settled",
    );
    refused(
        &format!("{POLICY}settled = true\ncount = \"failures\"\n"),
        6,
        "policy[0].settled",
    );
    refused(
        "[[policy]]\nname = \"slow\"\nconcurrency = 2\nusage_header = \"x-usage\"\n",
        4,
        "policy[0].settled",
    );
    refused(
        &format!("{POLICY}max_unsettled = 3\n"),
        6,
        "policy[0].max_unsettled",
    );
    refused(
        &format!("{POLICY}settled = true\nmax_unsettled = 0\n"),
        7,
        "policy[0].max_unsettled",
    );
}

/// The keys the loader takes in a table, as it lists them when it refuses
/// an unknown one in `probe`.
fn keys_taken(probe: &str) -> std::collections::BTreeSet<String> {
    let message = Config::from_toml_str(probe).unwrap_err().to_string();
    let (_, expected) = message
        .split_once("expected ")
        .unwrap_or_else(|| panic!("no list of keys in: {message}"));
    expected
        .split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

/// Every table of the configuration reference (`docs/configuration.md`)
/// lists exactly the keys the loader takes there, and every key of the
/// inline tables is named in its row: a key added to the loader and not
/// documented, or documented and not taken, fails here.
#[test]
fn the_reference_lists_every_key_the_loader_takes() {
    let reference = include_str!("../../docs/configuration.md");
    let section = |heading: &str| {
        let start = reference
            .find(&format!("## {heading}\n"))
            .unwrap_or_else(|| panic!("no section {heading}"));
        let body = &reference[start + heading.len() + 4..];
        &body[..body.find("\n## ").unwrap_or(body.len())]
    };
    let tables = [
        ("`[redis]`", "[redis]\nnot_a_key = 1\n"),
        ("`[limiter]`", "[limiter]\nnot_a_key = 1\n"),
        ("`[memory]`", "[memory]\nnot_a_key = 1\n"),
        ("`[jwt]`", "[jwt]\nnot_a_key = 1\n"),
        ("`[[jwt.keys]]`", "[[jwt.keys]]\nnot_a_key = 1\n"),
        (
            "`[[policy]]` and `[default]`",
            "[[policy]]\nname = \"p\"\nnot_a_key = 1\n",
        ),
        ("`[deny]`", "[deny]\nnot_a_key = 1\n"),
        ("`[admin]`", "[admin]\nnot_a_key = 1\n"),
    ];
    for (heading, probe) in tables {
        let documented: std::collections::BTreeSet<String> = section(heading)
            .lines()
            .filter_map(|line| line.strip_prefix("| `"))
            .filter_map(|row| row.split_once('`'))
            .map(|(key, _)| key.to_owned())
            .collect();
        assert_eq!(keys_taken(probe), documented, "{heading}");
    }
    assert_eq!(
        keys_taken("[[policy]]\nname = \"p\"\nnot_a_key = 1\n").len(),
        24
    );
    let inline = [
        ("`[redis]`", "tls", "[redis]\ntls = { not_a_key = 1 }\n"),
        ("`[redis]`", "breaker", "[redis.breaker]\nnot_a_key = 1\n"),
        (
            "`[limiter]`",
            "credential_failures",
            "[limiter]\ncredential_failures = { not_a_key = 1 }\n",
        ),
        (
            "`[[policy]]` and `[default]`",
            "tiers",
            "[[policy]]\nname = \"p\"\nlimit = 1\nwindow = \"1s\"\ntiers = { t = { not_a_key = 1 } }\n",
        ),
        (
            "`[[policy]]` and `[default]`",
            "messages",
            "[[policy]]\nname = \"p\"\nlimit = 1\nwindow = \"1s\"\nmessages = { not_a_key = 1 }\n",
        ),
    ];
    for (heading, key, probe) in inline {
        let row = section(heading)
            .lines()
            .find(|line| line.starts_with(&format!("| `{key}` |")))
            .unwrap_or_else(|| panic!("no row {key} in {heading}"));
        for taken in keys_taken(probe) {
            assert!(
                row.contains(&format!("`{taken}`")),
                "{key}.{taken} in: {row}"
            );
        }
    }
}

/// `[default]` is the policy of routes no `[[policy]]` names: it takes a
/// policy's settings, but neither a name nor a route.
#[test]
fn the_default_policy_takes_no_name() {
    let message = refused(
        "[default]\nname = \"d\"\nlimit = 1\nwindow = \"1s\"\n",
        2,
        "default.name",
    );
    assert!(message.contains("takes no `name`"), "{message}");
    refused(
        "[[policy]]\nlimit = 1\nwindow = \"1s\"\n",
        1,
        "policy[0].name",
    );
}

#[test]
fn a_slice_loads_and_a_bad_one_names_its_key() {
    let config = Config::from_toml_str(&format!("{POLICY}slice = 2\n")).unwrap();
    assert_eq!(config.policies().iter().next().unwrap().slice(), Some(2));
    let message = refused(&format!("{POLICY}slice = 1\n"), 6, "policy[0].slice");
    assert!(message.contains("from 2 to the limit (5)"), "{message}");
    refused(&format!("{POLICY}slice = 6\n"), 6, "policy[0].slice");
    for (other, line) in [
        ("delay = \"1s\"", "delay"),
        ("block = \"1m\"", "block"),
        ("settled = true", "settled"),
    ] {
        let message = refused(
            &format!("{POLICY}{other}\nslice = 2\n"),
            7,
            "policy[0].slice",
        );
        assert!(
            message.contains(&format!("does not combine with {line}")),
            "{message}"
        );
    }
    let message = refused(
        "[[policy]]\nname = \"slow\"\nconcurrency = 2\nslice = 2\n",
        4,
        "policy[0].slice",
    );
    assert!(message.contains("with concurrency"), "{message}");
    let message = refused(
        "[[policy]]\nname = \"month\"\nlimit = 100\ncalendar = \"month\"\nslice = 10\n",
        5,
        "policy[0].slice",
    );
    assert!(message.contains("with calendar"), "{message}");
}
