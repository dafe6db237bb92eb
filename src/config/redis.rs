//! The `[redis]` section: where Redis is, standalone or a cluster, and how
//! to talk to it.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use toml::Spanned;

use super::ConfigError;
use super::value::HumanDuration;
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
    sentinels: Option<Spanned<Vec<String>>>,
    master: Option<Spanned<String>>,
    tls: Option<Spanned<RawTls>>,
}

/// `tls = { ca = "ca.pem", cert = "client.pem", key = "client.key" }`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTls {
    ca: Option<PathBuf>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
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
    /// Redis Sentinel nodes to ask where the primary is (`sentinels =
    /// [...]`, with [`master`](Self::master)). A sentinel URL's scheme
    /// (`rediss://` for TLS) and credentials are for the sentinels; `url`,
    /// when set, gives the data nodes' scheme, credentials and database
    /// (its host is not used: the sentinels name the primary).
    pub sentinels: Vec<String>,
    /// The name the sentinels know the primary by (`master = "mymaster"`).
    pub master: Option<String>,
    /// Certificates for `rediss://` connections (`tls = { ca, cert, key
    /// }`), when set; without them, the platform's roots verify servers.
    pub tls: Option<RedisTls>,
}

/// PEM certificates for TLS to Redis: a private CA to verify servers with,
/// and a client certificate and key for mutual TLS. Each is optional;
/// without `ca` the platform's roots verify servers.
///
/// ```no_run
/// use slidegate::config::{RedisSettings, RedisTls};
///
/// let mut settings = RedisSettings::default().with_url("rediss://cache.internal:6380");
/// settings.tls = Some(RedisTls {
///     ca: Some(std::fs::read("ca.pem").unwrap()),
///     client: None,
/// });
/// let store = settings.store().unwrap();
/// ```
#[derive(Clone, Default, PartialEq, Eq)]
pub struct RedisTls {
    /// The CA certificate(s) that servers' certificates must chain to.
    pub ca: Option<Vec<u8>>,
    /// The client certificate chain and its private key, for mutual TLS.
    pub client: Option<(Vec<u8>, Vec<u8>)>,
}

#[cfg(feature = "redis")]
impl RedisTls {
    /// These files as redis-rs takes them.
    pub(super) fn certificates(&self) -> deadpool_redis::redis::TlsCertificates {
        deadpool_redis::redis::TlsCertificates {
            client_tls: self.client.as_ref().map(|(cert, key)| {
                deadpool_redis::redis::ClientTlsConfig {
                    client_cert: cert.clone(),
                    client_key: key.clone(),
                }
            }),
            root_cert: self.ca.clone(),
        }
    }
}

/// Shows which parts are set, never a key.
impl fmt::Debug for RedisTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisTls")
            .field("ca", &self.ca.is_some())
            .field("client", &self.client.is_some())
            .finish()
    }
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
            sentinels: Vec::new(),
            master: None,
            tls: None,
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
            .field(
                "sentinels",
                &self
                    .sentinels
                    .iter()
                    .map(|url| redacted(url))
                    .collect::<Vec<_>>(),
            )
            .field("master", &self.master)
            .field("tls", &self.tls)
            .finish()
    }
}

impl RedisSettings {
    /// These settings with `url` in place of the configured URL, cluster
    /// seeds and sentinels (`REDIS_URL` does this in the example server).
    #[must_use]
    pub fn with_url(mut self, url: impl Into<String>) -> Self {
        self.url = Some(url.into());
        self.urls.clear();
        self.sentinels.clear();
        self.master = None;
        self
    }

    /// Whether these settings find the primary through Redis Sentinel.
    pub fn is_sentinel(&self) -> bool {
        !self.sentinels.is_empty()
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

    /// The URLs to connect to first: the one server, the cluster's seeds
    /// (a `redis+cluster://a:1,b:2` URL gives one seed per host), or the
    /// sentinels.
    pub fn seeds(&self) -> Vec<String> {
        if self.is_sentinel() {
            return self.sentinels.clone();
        }
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
}

/// `url` with its password and every query value (`?password=` of a
/// `redis+unix://` URL, say) written as `***`; a URL that does not parse
/// is not shown at all, since where its secret is cannot be told.
pub(super) fn redacted(url: &str) -> String {
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

/// Why `url` cannot name a Redis server, if it cannot: checked as the file
/// is read, so that the error names its line (the URL is shown with its
/// secrets hidden, or not at all when it does not parse).
fn url_problem(url: &str) -> Option<String> {
    let parsed = match url::Url::parse(url) {
        Ok(parsed) => parsed,
        Err(e) => return Some(format!("a URL that does not parse ({e})")),
    };
    if !matches!(
        parsed.scheme(),
        "redis" | "rediss" | "redis+unix" | "unix" | "valkey" | "valkeys" | "valkey+unix"
    ) {
        return Some(format!(
            "`{}` is not a Redis URL: use redis://, rediss:// (TLS) or redis+unix://",
            redacted(url)
        ));
    }
    #[cfg(feature = "redis")]
    {
        use deadpool_redis::redis::IntoConnectionInfo;
        if let Err(e) = url.into_connection_info() {
            return Some(format!("`{}`: {e}", redacted(url)));
        }
    }
    None
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

pub(super) fn redis_settings(
    raw: RawRedis,
    source: &str,
    base: &Path,
) -> Result<RedisSettings, ConfigError> {
    let mut settings = RedisSettings {
        cluster: raw.cluster.unwrap_or(false),
        ..RedisSettings::default()
    };
    if let Some(url) = raw.url {
        let at = |message: &str| ConfigError::at(source, url.span().start, "redis.url", message);
        let servers = split_cluster_url(url.get_ref());
        if servers.is_empty() {
            return Err(at("names no host"));
        }
        if let Some(problem) = servers.iter().find_map(|server| url_problem(server)) {
            return Err(at(&problem));
        }
        settings.url = Some(url.into_inner());
    }
    if let Some(urls) = raw.urls {
        let at = |message: &str| ConfigError::at(source, urls.span().start, "redis.urls", message);
        if !settings.cluster {
            return Err(at(
                "lists cluster seeds: set `cluster = true` too (or use `url` for one server)",
            ));
        }
        if let Some(problem) = urls.get_ref().iter().find_map(|url| url_problem(url)) {
            return Err(at(&problem));
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
    if let Some(sentinels) = raw.sentinels {
        let offset = sentinels.span().start;
        let at = |message: &str| ConfigError::at(source, offset, "redis.sentinels", message);
        if settings.is_cluster() {
            return Err(at("Sentinel and `cluster` do not mix"));
        }
        if sentinels.get_ref().is_empty() {
            return Err(at("lists no sentinel"));
        }
        if raw.master.is_none() {
            return Err(at(
                "needs `master` too, the name the sentinels know the primary by",
            ));
        }
        let schemes: Vec<bool> = sentinels
            .get_ref()
            .iter()
            .map(|url| url.starts_with("rediss://"))
            .collect();
        if let Some(url) = sentinels
            .get_ref()
            .iter()
            .find(|url| !url.starts_with("redis://") && !url.starts_with("rediss://"))
        {
            return Err(at(&format!(
                "`{}` is not a redis:// or rediss:// URL",
                redacted(url)
            )));
        }
        if let Some(problem) = sentinels.get_ref().iter().find_map(|url| url_problem(url)) {
            return Err(at(&problem));
        }
        if schemes.iter().any(|&tls| tls != schemes[0]) {
            return Err(at("mixes redis:// and rediss:// sentinels"));
        }
        settings.sentinels = sentinels.into_inner();
    }
    if let Some(master) = raw.master {
        if settings.sentinels.is_empty() {
            return Err(ConfigError::at(
                source,
                master.span().start,
                "redis.master",
                "names a Sentinel master: set `sentinels` too",
            ));
        }
        if master.get_ref().is_empty() {
            return Err(ConfigError::at(
                source,
                master.span().start,
                "redis.master",
                "is empty",
            ));
        }
        settings.master = Some(master.into_inner());
    }
    if let Some(tls) = raw.tls {
        settings.tls = Some(tls_files(tls, source, base)?);
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

/// Reads the `tls` table's PEM files, relative to `base`.
fn tls_files(tls: Spanned<RawTls>, source: &str, base: &Path) -> Result<RedisTls, ConfigError> {
    let offset = tls.span().start;
    let tls = tls.into_inner();
    let read = |name: &str, path: &Path| {
        let path = base.join(path);
        std::fs::read(&path).map_err(|e| {
            ConfigError::at(
                source,
                offset,
                format!("redis.tls.{name}"),
                format!("cannot read `{}`: {e}", path.display()),
            )
        })
    };
    let client = match (&tls.cert, &tls.key) {
        (Some(cert), Some(key)) => Some((read("cert", cert)?, read("key", key)?)),
        (None, None) => None,
        (Some(_), None) | (None, Some(_)) => {
            return Err(ConfigError::at(
                source,
                offset,
                "redis.tls",
                "needs `cert` and `key` together (the client certificate and its key)",
            ));
        }
    };
    let files = RedisTls {
        ca: tls.ca.as_deref().map(|ca| read("ca", ca)).transpose()?,
        client,
    };
    #[cfg(feature = "redis")]
    if let Err(e) =
        deadpool_redis::redis::Client::build_with_tls("rediss://localhost/", files.certificates())
    {
        return Err(ConfigError::at(source, offset, "redis.tls", e.to_string()));
    }
    Ok(files)
}

#[cfg(test)]
mod tests;
