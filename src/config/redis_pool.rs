//! The pool a [`RedisSettings`] names: one server, a Redis Cluster, or the
//! primary that Redis Sentinel names; in plain text or over TLS.
//!
//! No connection here has a response timeout longer than the store's: a
//! standalone or Sentinel connection has none of its own, and a cluster
//! client's is the store's timeout, so the configured timeout is the one
//! that counts.

use deadpool_redis::redis::cluster::ClusterClientBuilder;
use deadpool_redis::redis::sentinel::{SentinelClientBuilder, SentinelServerType};
use deadpool_redis::redis::{
    AsyncConnectionConfig, Client, ConnectionAddr, ConnectionInfo, IntoConnectionInfo,
    TlsCertificates, TlsMode,
};
use deadpool_redis::{Pool, Runtime};

use super::ConfigError;
use super::redis::{RedisSettings, RedisTls, redacted};
use crate::store::RedisPool;

impl RedisSettings {
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
    pub fn store(&self) -> Result<crate::store::RedisStore, ConfigError> {
        let pool = pool(self)?;
        let mut store = crate::store::RedisStore::builder(pool).with_timeout(self.timeout);
        if let Some(prefix) = &self.prefix {
            store = store.with_prefix(prefix.clone());
        }
        store
            .build()
            .map_err(|e| ConfigError::of("redis.prefix", e.to_string()))
    }

    /// The [`store`](Self::store), behind a [`CircuitBreaker`](crate::store::CircuitBreaker)
    /// when [`breaker`](Self::breaker) is set.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// use slidegate::store::Store;
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
    pub fn guarded_store(&self) -> Result<std::sync::Arc<dyn crate::store::Store>, ConfigError> {
        Ok(self.guard(self.store()?))
    }

    /// `store` behind a [`CircuitBreaker`](crate::store::CircuitBreaker) when
    /// [`breaker`](Self::breaker) is set.
    pub fn guard(
        &self,
        store: crate::store::RedisStore,
    ) -> std::sync::Arc<dyn crate::store::Store> {
        match self.breaker {
            Some(settings) => {
                std::sync::Arc::new(crate::store::CircuitBreaker::new(store, settings))
            }
            None => std::sync::Arc::new(store),
        }
    }
}

/// A new pool for `settings`; connections are opened on first use.
fn pool(settings: &RedisSettings) -> Result<RedisPool, ConfigError> {
    let certificates = settings.tls.as_ref().map(RedisTls::certificates);
    let any_tls = settings
        .seeds()
        .iter()
        .chain(&settings.url)
        .any(|url| url.starts_with("rediss"));
    if certificates.is_some() || any_tls {
        use_ring_unless_a_provider_is_set();
    }
    if settings.is_sentinel() {
        return sentinel(settings, certificates);
    }
    let seeds = settings.seeds();
    let Some(first) = seeds.first() else {
        return Err(ConfigError::of(
            "redis.url",
            "no Redis URL: set [redis] url (or urls) or REDIS_URL",
        ));
    };
    if let Some(plain) = certificates
        .as_ref()
        .and_then(|_| seeds.iter().find(|url| !url.starts_with("rediss")))
    {
        return Err(tls_error(format!(
            "`tls` is set, but `{}` is not a rediss:// URL",
            redacted(plain)
        )));
    }
    if settings.is_cluster() {
        cluster(settings, &seeds, certificates)
    } else {
        standalone(settings, first, certificates)
    }
}

/// redis-rs's TLS is rustls, which needs a process-wide crypto provider
/// when more than one is compiled in: ring, unless the application chose.
fn use_ring_unless_a_provider_is_set() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Another thread may have set one meanwhile: that one stays.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

fn bad_url<E: std::fmt::Display>(urls: String) -> impl FnOnce(E) -> ConfigError {
    move |e| ConfigError::of("redis.url", format!("bad Redis URL `{urls}`: {e}"))
}

fn tls_error(message: impl Into<String>) -> ConfigError {
    ConfigError::of("redis.tls", message)
}

fn sentinel_error(message: impl Into<String>) -> ConfigError {
    ConfigError::of("redis.sentinels", message)
}

fn standalone(
    settings: &RedisSettings,
    url: &str,
    certificates: Option<TlsCertificates>,
) -> Result<RedisPool, ConfigError> {
    let info: ConnectionInfo = match certificates {
        Some(certificates) => Client::build_with_tls(url, certificates)
            .map_err(|e| tls_error(e.to_string()))?
            .get_connection_info()
            .clone(),
        None => url.into_connection_info().map_err(bad_url(redacted(url)))?,
    };
    // redis-rs ends a call after its own response timeout (500 ms by
    // default): none here, so that the store's timeout decides, however
    // long it is.
    let connection = AsyncConnectionConfig::new().set_response_timeout(None);
    let manager = deadpool_redis::Manager::new_with_config(info, connection)
        .map_err(bad_url(redacted(url)))?;
    let pool = Pool::builder(manager)
        .max_size(settings.pool_size)
        .runtime(Runtime::Tokio1)
        .build()
        .map_err(bad_url(redacted(url)))?;
    Ok(pool.into())
}

fn cluster(
    settings: &RedisSettings,
    seeds: &[String],
    certificates: Option<TlsCertificates>,
) -> Result<RedisPool, ConfigError> {
    let mut client = ClusterClientBuilder::new(seeds.iter().map(String::as_str))
        .response_timeout(settings.timeout);
    if let Some(certificates) = certificates {
        client = client.certs(certificates);
    }
    let client = client
        .build()
        .map_err(bad_url(settings.redacted_seeds().join(", ")))?;
    Ok(RedisPool::cluster_client(client, settings.pool_size))
}

/// The address, TLS mode and credentials of one URL.
struct Endpoint {
    addr: ConnectionAddr,
    tls: Option<TlsMode>,
    username: Option<String>,
    password: Option<String>,
    db: i64,
}

fn endpoint(url: &str) -> Result<Endpoint, ConfigError> {
    let info = url.into_connection_info().map_err(bad_url(redacted(url)))?;
    let tls = match info.addr() {
        ConnectionAddr::TcpTls { insecure: true, .. } => Some(TlsMode::Insecure),
        ConnectionAddr::TcpTls { .. } => Some(TlsMode::Secure),
        _ => None,
    };
    let redis = info.redis_settings();
    Ok(Endpoint {
        addr: info.addr().clone(),
        tls,
        username: redis.username().map(str::to_owned),
        password: redis.password().map(str::to_owned),
        db: redis.db(),
    })
}

fn sentinel(
    settings: &RedisSettings,
    certificates: Option<TlsCertificates>,
) -> Result<RedisPool, ConfigError> {
    let master = settings
        .master
        .as_deref()
        .ok_or_else(|| sentinel_error("`sentinels` needs `master`, the primary's name"))?;
    let sentinels = settings
        .sentinels
        .iter()
        .map(|url| endpoint(url))
        .collect::<Result<Vec<_>, _>>()?;
    let first = &sentinels[0];
    if sentinels
        .iter()
        .any(|s| (s.tls, &s.username, &s.password) != (first.tls, &first.username, &first.password))
    {
        return Err(sentinel_error(
            "every sentinel URL needs the same scheme and credentials",
        ));
    }
    let data = settings.url.as_deref().map(endpoint).transpose()?;
    // Without `url`, the data nodes are reached as the sentinels are: a
    // TLS deployment never falls back to plain text.
    let data_tls = match &data {
        Some(data) => data.tls,
        None => first.tls,
    };
    if certificates.is_some() && first.tls.is_none() && data_tls.is_none() {
        return Err(tls_error(
            "`tls` is set, but neither the sentinels nor `url` use rediss://",
        ));
    }
    let addrs = sentinels.iter().map(|s| s.addr.clone());
    let mut client = SentinelClientBuilder::new(addrs, master, SentinelServerType::Master)
        .map_err(|e| sentinel_error(e.to_string()))?;
    if let Some(username) = &first.username {
        client = client.set_client_to_sentinel_username(username);
    }
    if let Some(password) = &first.password {
        client = client.set_client_to_sentinel_password(password);
    }
    if let Some(mode) = first.tls {
        client = client.set_client_to_sentinel_tls_mode(mode);
        if let Some(certificates) = &certificates {
            client = client.set_client_to_sentinel_certificates(certificates.clone());
        }
    }
    if let Some(data) = &data {
        if let Some(username) = &data.username {
            client = client.set_client_to_redis_username(username);
        }
        if let Some(password) = &data.password {
            client = client.set_client_to_redis_password(password);
        }
        client = client.set_client_to_redis_db(data.db);
    }
    if let Some(mode) = data_tls {
        client = client.set_client_to_redis_tls_mode(mode);
        if let Some(certificates) = certificates {
            client = client.set_client_to_redis_certificates(certificates);
        }
    }
    let client = client.build().map_err(|e| sentinel_error(e.to_string()))?;
    Ok(RedisPool::sentinel(client, settings.pool_size))
}
