//! The `[redis]` section: where Redis is, standalone or a cluster, and how
//! to talk to it.

use std::fmt;
use std::time::Duration;

use serde::Deserialize;
use toml::Spanned;

use super::ConfigError;
use super::raw::HumanDuration;
use crate::store::BreakerSettings;

const DEFAULT_REDIS_TIMEOUT_MS: u64 = 50;
const DEFAULT_POOL_SIZE: usize = 16;
const DEFAULT_BREAKER_FAILURES: u32 = 5;
const DEFAULT_BREAKER_COOLDOWN: Duration = Duration::from_secs(2);
const CLUSTER_SCHEMES: [(&str, &str); 2] = [
    ("redis+cluster://", "redis://"),
    ("rediss+cluster://", "rediss://"),
];

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRedis {
    url: Option<Spanned<String>>,
    cluster: Option<bool>,
    urls: Option<Spanned<Vec<String>>>,
    timeout_ms: Option<Spanned<u64>>,
    pool_size: Option<Spanned<usize>>,
    prefix: Option<Spanned<String>>,
    breaker: Option<Spanned<RawBreaker>>,
}

/// `[redis.breaker]`, or `breaker = { failures = 5, cooldown = "2s" }`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBreaker {
    failures: Option<u32>,
    cooldown: Option<HumanDuration>,
}

/// Where Redis is, and how to talk to it.
///
/// ```
/// use slidegate::config::RedisSettings;
///
/// let settings = RedisSettings::default().with_url("redis+cluster://10.0.0.1:7000,10.0.0.2:7000");
/// assert!(settings.is_cluster());
/// assert_eq!(settings.seeds(), ["redis://10.0.0.1:7000", "redis://10.0.0.2:7000"]);
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct RedisSettings {
    /// `redis://` URL, or `redis+cluster://host:port,host:port` for a Redis
    /// Cluster; `REDIS_URL` overrides it in the example server.
    pub url: Option<String>,
    /// Whether Redis is a cluster (`cluster = true`).
    pub cluster: bool,
    /// Cluster seed nodes (`urls = [...]`, with `cluster = true`).
    pub urls: Vec<String>,
    /// Per-call timeout.
    pub timeout: Duration,
    /// Connections in the pool (cluster clients, for a cluster).
    pub pool_size: usize,
    /// Key prefix, when set.
    pub prefix: Option<String>,
    /// The circuit breaker in front of the store (`[redis.breaker]`), when
    /// set; see [`RedisSettings::guarded_store`].
    pub breaker: Option<BreakerSettings>,
}

impl Default for RedisSettings {
    fn default() -> Self {
        Self {
            url: None,
            cluster: false,
            urls: Vec::new(),
            timeout: Duration::from_millis(DEFAULT_REDIS_TIMEOUT_MS),
            pool_size: DEFAULT_POOL_SIZE,
            prefix: None,
            breaker: None,
        }
    }
}

/// URLs are shown as [`RedisSettings::redacted_seeds`] shows them: a
/// settings value can go into a log.
///
/// ```
/// use slidegate::config::RedisSettings;
///
/// let settings = RedisSettings::default().with_url("redis://:hunter2@cache:6379/");
/// assert!(!format!("{settings:?}").contains("hunter2"));
/// ```
impl fmt::Debug for RedisSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisSettings")
            .field("url", &self.url.as_deref().map(redacted))
            .field("cluster", &self.cluster)
            .field(
                "urls",
                &self
                    .urls
                    .iter()
                    .map(|url| redacted(url))
                    .collect::<Vec<_>>(),
            )
            .field("timeout", &self.timeout)
            .field("pool_size", &self.pool_size)
            .field("prefix", &self.prefix)
            .field("breaker", &self.breaker)
            .finish()
    }
}

impl RedisSettings {
    /// These settings with `url` in place of the configured URL and seeds
    /// (`REDIS_URL` does this in the example server).
    #[must_use]
    pub fn with_url(mut self, url: impl Into<String>) -> Self {
        self.url = Some(url.into());
        self.urls.clear();
        self
    }

    /// Whether these settings name a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        self.cluster
            || self.url.as_deref().is_some_and(|url| {
                CLUSTER_SCHEMES
                    .iter()
                    .any(|(scheme, _)| url.starts_with(scheme))
            })
    }

    /// The URLs to connect to: the one server, or the cluster's seeds (a
    /// `redis+cluster://a:1,b:2` URL gives one seed per host).
    pub fn seeds(&self) -> Vec<String> {
        let mut seeds = self.urls.clone();
        if let Some(url) = &self.url {
            seeds.extend(split_cluster_url(url));
        }
        seeds
    }

    /// The seeds for logs and errors, each with its password, if any,
    /// written as `***`.
    ///
    /// ```
    /// use slidegate::config::RedisSettings;
    ///
    /// let settings = RedisSettings::default().with_url("redis://:hunter2@cache:6379/0");
    /// assert_eq!(settings.redacted_seeds(), ["redis://:***@cache:6379/0"]);
    /// ```
    pub fn redacted_seeds(&self) -> Vec<String> {
        self.seeds().iter().map(|seed| redacted(seed)).collect()
    }

    /// A store on a new pool for these settings.
    ///
    /// ```
    /// use slidegate::config::RedisSettings;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// // Pools connect lazily: building one needs no server.
    /// let store = RedisSettings::default().with_url("redis://127.0.0.1:6379/").store().unwrap();
    /// assert!(RedisSettings::default().store().is_err(), "no URL");
    /// # }
    /// ```
    #[cfg(feature = "redis")]
    pub fn store(&self) -> Result<crate::RedisStore, RedisSettingsError> {
        use deadpool_redis::redis::AsyncConnectionConfig;
        use deadpool_redis::{PoolConfig, Runtime};

        let seeds = self.seeds();
        if seeds.is_empty() {
            return Err(RedisSettingsError::NoUrl);
        }
        let pool: crate::RedisPool = if self.is_cluster() {
            let mut config = deadpool_redis::cluster::Config::from_urls(seeds.clone());
            config.pool = Some(PoolConfig::new(self.pool_size));
            config
                .create_pool(Some(Runtime::Tokio1))
                .map_err(|e| RedisSettingsError::BadUrl {
                    urls: self.redacted_seeds().join(", "),
                    source: Box::new(e),
                })?
                .into()
        } else {
            // redis-rs ends a call after its own response timeout (500 ms
            // by default): none here, so that the store's timeout decides,
            // however long it is.
            let connection = AsyncConnectionConfig::new().set_response_timeout(None);
            let bad_url =
                |e: Box<dyn std::error::Error + Send + Sync>| RedisSettingsError::BadUrl {
                    urls: redacted(&seeds[0]),
                    source: e,
                };
            let manager = deadpool_redis::Manager::new_with_config(seeds[0].as_str(), connection)
                .map_err(|e| bad_url(Box::new(e)))?;
            deadpool_redis::Pool::builder(manager)
                .max_size(self.pool_size)
                .runtime(Runtime::Tokio1)
                .build()
                .map_err(|e| bad_url(Box::new(e)))?
                .into()
        };
        let mut store = crate::RedisStore::builder(pool).timeout(self.timeout);
        if let Some(prefix) = &self.prefix {
            store = store.prefix(prefix.clone())?;
        }
        Ok(store.build())
    }

    /// The [`store`](Self::store), behind a [`CircuitBreaker`](crate::CircuitBreaker)
    /// when [`breaker`](Self::breaker) is set.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// use slidegate::Store;
    /// use slidegate::config::Config;
    ///
    /// let config = Config::from_toml_str(
    ///     "[redis]\nurl = \"redis://127.0.0.1:6379/\"\nbreaker = { failures = 5, cooldown = \"2s\" }\n",
    /// )
    /// .unwrap();
    /// let store = config.redis().unwrap().guarded_store().unwrap();
    /// assert!(store.is_remote());
    /// # }
    /// ```
    #[cfg(feature = "redis")]
    pub fn guarded_store(&self) -> Result<std::sync::Arc<dyn crate::Store>, RedisSettingsError> {
        let store = self.store()?;
        Ok(match self.breaker {
            Some(settings) => std::sync::Arc::new(crate::CircuitBreaker::new(store, settings)),
            None => std::sync::Arc::new(store),
        })
    }
}

/// Why [`RedisSettings::store`] could not build a store.
#[cfg(feature = "redis")]
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RedisSettingsError {
    /// Neither a URL nor cluster seeds are set.
    #[error("no Redis URL: set [redis] url (or urls) or REDIS_URL")]
    NoUrl,
    /// A URL that redis-rs refuses; shown with its password as `***`.
    #[error("bad Redis URL `{urls}`: {source}")]
    BadUrl {
        /// The URL or URLs, redacted.
        urls: String,
        /// What redis-rs or the pool said.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The key prefix holds braces.
    #[error(transparent)]
    Prefix(#[from] crate::PrefixError),
}

/// `url` with its password and every query value (`?password=` of a
/// `redis+unix://` URL, say) written as `***`; a URL that does not parse
/// is not shown at all, since where its secret is cannot be told.
fn redacted(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut parsed) => {
            if parsed.password().is_some() {
                // Only URLs that cannot have a password refuse one.
                let _ = parsed.set_password(Some("***"));
            }
            if parsed.query().is_some() {
                let names: Vec<String> = parsed
                    .query_pairs()
                    .map(|(name, _)| name.into_owned())
                    .collect();
                parsed
                    .query_pairs_mut()
                    .clear()
                    .extend_pairs(names.iter().map(|name| (name, "***")));
            }
            parsed.to_string()
        }
        Err(_) => "(a URL that does not parse)".to_owned(),
    }
}

/// `redis+cluster://[auth@]a:1,b:2[/rest]` as `redis://[auth@]a:1[/rest]`,
/// `redis://[auth@]b:2[/rest]`; any other URL as it is.
fn split_cluster_url(url: &str) -> Vec<String> {
    let Some((rest, scheme)) = CLUSTER_SCHEMES
        .iter()
        .find_map(|(cluster, plain)| url.strip_prefix(cluster).map(|rest| (rest, *plain)))
    else {
        return vec![url.to_owned()];
    };
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let (auth, hosts) = match authority.rsplit_once('@') {
        Some((auth, hosts)) => (format!("{auth}@"), hosts),
        None => (String::new(), authority),
    };
    hosts
        .split(',')
        .filter(|host| !host.is_empty())
        .map(|host| format!("{scheme}{auth}{host}{path}"))
        .collect()
}

pub(super) fn redis_settings(raw: RawRedis, source: &str) -> Result<RedisSettings, ConfigError> {
    let mut settings = RedisSettings {
        cluster: raw.cluster.unwrap_or(false),
        ..RedisSettings::default()
    };
    if let Some(url) = raw.url {
        if split_cluster_url(url.get_ref()).is_empty() {
            return Err(ConfigError::at(
                source,
                url.span().start,
                "redis.url",
                "names no host",
            ));
        }
        settings.url = Some(url.into_inner());
    }
    if let Some(urls) = raw.urls {
        if !settings.cluster {
            return Err(ConfigError::at(
                source,
                urls.span().start,
                "redis.urls",
                "lists cluster seeds: set `cluster = true` too (or use `url` for one server)",
            ));
        }
        settings.urls = urls.into_inner();
    }
    if let Some(prefix) = raw.prefix {
        if prefix.get_ref().contains(['{', '}']) {
            return Err(ConfigError::at(
                source,
                prefix.span().start,
                "redis.prefix",
                "must not hold `{` or `}` (it would become every key's cluster hash tag)",
            ));
        }
        settings.prefix = Some(prefix.into_inner());
    }
    if let Some(timeout) = raw.timeout_ms {
        if *timeout.get_ref() == 0 {
            return Err(ConfigError::at(
                source,
                timeout.span().start,
                "redis.timeout_ms",
                "must be at least 1",
            ));
        }
        settings.timeout = Duration::from_millis(*timeout.get_ref());
    }
    if let Some(size) = raw.pool_size {
        if *size.get_ref() == 0 {
            return Err(ConfigError::at(
                source,
                size.span().start,
                "redis.pool_size",
                "must be at least 1",
            ));
        }
        settings.pool_size = *size.get_ref();
    }
    if let Some(breaker) = raw.breaker {
        let offset = breaker.span().start;
        let breaker = breaker.into_inner();
        let failures = breaker.failures.unwrap_or(DEFAULT_BREAKER_FAILURES);
        if failures == 0 {
            return Err(ConfigError::at(
                source,
                offset,
                "redis.breaker.failures",
                "must be at least 1",
            ));
        }
        let cooldown = breaker
            .cooldown
            .map_or(DEFAULT_BREAKER_COOLDOWN, |cooldown| cooldown.0);
        settings.breaker = Some(BreakerSettings::new(failures, cooldown));
    }
    Ok(settings)
}

#[cfg(test)]
mod tests {
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

    #[cfg(feature = "redis")]
    #[test]
    fn a_bad_url_error_hides_its_password() {
        let bad = RedisSettings::default().with_url("rediss+unknown://:hunter2@cache:6379/");
        let error = bad
            .store()
            .expect_err("an unknown scheme is refused")
            .to_string();
        assert!(error.starts_with("bad Redis URL"), "{error}");
        assert!(!error.contains("hunter2"), "{error}");
    }
}
