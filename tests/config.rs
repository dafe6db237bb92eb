//! Configuration files: the documented format parses, and every bad file
//! stops with an error naming the key and its line.

use slidegate::config::Config;

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
    let config = Config::from_toml_str(include_str!("../examples/demo.toml")).unwrap();
    assert!(config.redis().is_none());
    assert!(config.policies().iter().any(|p| p.name() == "search"));
}

/// Asserts `source` is refused at `line` with a message naming `key`.
#[track_caller]
fn refused(source: &str, line: usize, key: &str) -> String {
    let error = Config::from_toml_str(source).expect_err("the config must be refused");
    let message = error.to_string();
    assert_eq!(error.line(), Some(line), "wrong line in: {message}");
    assert!(message.contains(key), "`{key}` not named in: {message}");
    message
}

#[test]
fn unknown_keys_are_errors() {
    refused("[limiter]\nfail = \"open\"\nfial = \"closed\"\n", 3, "fial");
    refused(&format!("{POLICY}limt = 5\n"), 6, "limt");
    refused("[jwt]\nsecret = \"x\"\n", 1, "jwt");
    refused(
        "[redis]\nurl = \"redis://x\"\nclusterr = true\n",
        3,
        "clusterr",
    );
    refused(
        "[default]\nlimit = 1\nwindow = \"1s\"\nroute = \"/x\"\n",
        4,
        "route",
    );
}

#[test]
fn bad_values_name_their_key() {
    refused(&POLICY.replace("limit = 5", "limit = \"five\""), 4, "limit");
    refused(&POLICY.replace("limit = 5", "limit = -1"), 4, "limit");
    refused(&POLICY.replace("\"60s\"", "\"soon\""), 5, "window");
    refused(
        &format!("{POLICY}algorithm = \"leaky_bucket\"\n"),
        6,
        "algorithm",
    );
    refused(&format!("{POLICY}fail = \"maybe\"\n"), 6, "fail");
    refused("[limiter]\nheaders = \"fancy\"\n", 2, "headers");
    refused(
        "[limiter]\ntrusted_proxies = [\"10.0.0.0/33\"]\n",
        2,
        "trusted_proxies",
    );
    refused("[limiter]\nkeys = [\"ip\", \"fingerprint\"]\n", 2, "keys");
    refused("[limiter]\nkeys = []\n", 2, "limiter.keys");
    refused(
        "[limiter]\napi_key_header = \"bad header\"\n",
        2,
        "limiter.api_key_header",
    );
    refused("[redis]\ntimeout_ms = 0\n", 2, "redis.timeout_ms");
    refused("[redis]\npool_size = 0\n", 2, "redis.pool_size");
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
    refused("[[policy]]\nname = \"p\"\nwindow = \"1s\"\n", 1, "limit");
    refused("[limiter\nfail = \"open\"\n", 1, "config");
}

#[test]
fn a_missing_file_names_the_file() {
    let error = Config::from_file("/nonexistent/slidegate.toml").unwrap_err();
    assert!(
        error.to_string().contains("/nonexistent/slidegate.toml"),
        "{error}"
    );
}
