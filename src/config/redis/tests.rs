//! Unit tests of `redis.rs`.

use super::*;

#[test]
fn cluster_urls_split_into_seeds() {
    assert_eq!(
        split_cluster_url("rediss+cluster://u:p@a:1,b:2/0"),
        ["rediss://u:p@a:1/0", "rediss://u:p@b:2/0"]
    );
    assert_eq!(split_cluster_url("redis://a:1/"), ["redis://a:1/"]);
    assert!(split_cluster_url("redis+cluster://").is_empty());
}

#[test]
fn passwords_never_reach_logs_or_errors() {
    let cluster = RedisSettings::default().with_url("redis+cluster://app:hunter2@a:1,b:2/");
    assert_eq!(
        cluster.redacted_seeds(),
        ["redis://app:***@a:1/", "redis://app:***@b:2/"]
    );
    assert_eq!(
        redacted("redis://127.0.0.1:6379/"),
        "redis://127.0.0.1:6379/"
    );
    assert_eq!(
        redacted("redis://:hunter2@[::1]:x/"),
        "(a URL that does not parse)"
    );
    assert_eq!(
        redacted("redis+unix:///run/redis.sock?db=2&pass=hunter2"),
        "redis+unix:///run/redis.sock?db=***&pass=***"
    );
    let config = crate::config::Config::from_toml_str(
        "[redis]\nurl = \"redis://app:hunter2@cache:6379/?password=hunter3\"\n",
    )
    .unwrap();
    let debug = format!("{config:?}");
    assert!(
        !debug.contains("hunter2") && !debug.contains("hunter3"),
        "{debug}"
    );
}

#[test]
fn a_url_of_the_wrong_type_is_quoted_without_its_password() {
    for redis in [
        "sentinels = \"redis://:hunter2@h:26379\"\nmaster = \"m\"",
        "url = [\"redis://app:hunter2@h/\"]",
    ] {
        let error = crate::config::Config::from_toml_str(&format!("[redis]\n{redis}\n"))
            .expect_err("the wrong type")
            .to_string();
        assert!(!error.contains("hunter2"), "{error}");
    }
}

#[test]
fn sentinel_settings_that_cannot_work_are_refused() {
    for (redis, key) in [
        ("sentinels = [\"redis://h:26379\"]", "redis.sentinels"),
        ("master = \"m\"", "redis.master"),
        ("sentinels = []\nmaster = \"m\"", "redis.sentinels"),
        (
            "sentinels = [\"redis://a:1\", \"rediss://b:2\"]\nmaster = \"m\"",
            "redis.sentinels",
        ),
        (
            "cluster = true\nsentinels = [\"redis://a:1\"]\nmaster = \"m\"",
            "redis.sentinels",
        ),
    ] {
        let error = crate::config::Config::from_toml_str(&format!("[redis]\n{redis}\n"))
            .expect_err(redis)
            .to_string();
        assert!(error.contains(key), "{redis}: {error}");
    }
}

#[cfg(feature = "redis")]
#[test]
fn a_bad_url_error_hides_its_password() {
    let bad = RedisSettings::default().with_url("rediss+unknown://:hunter2@cache:6379/");
    let error = bad
        .store()
        .expect_err("an unknown scheme is refused")
        .to_string();
    assert!(error.contains("key `redis.url`: bad Redis URL"), "{error}");
    assert!(!error.contains("hunter2"), "{error}");
}
