//! deadpool managers for the setups deadpool-redis's own managers cannot
//! express: a Redis Cluster client with every setting of redis-rs's
//! `ClusterClientBuilder` (its response timeout, TLS certificates), and
//! connections to the primary that Redis Sentinel names.

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};

use deadpool::managed::{self, Metrics, RecycleError, RecycleResult};
use deadpool_redis::redis::aio::{ConnectionLike, MultiplexedConnection};
use deadpool_redis::redis::cluster::ClusterClient;
use deadpool_redis::redis::cluster_async::ClusterConnection;
use deadpool_redis::redis::sentinel::SentinelClient;
use deadpool_redis::redis::{AsyncConnectionConfig, RedisError, Value, cmd};

/// A pool of Redis Cluster clients made by a [`ClusterManager`].
pub type ClusterClientPool = managed::Pool<ClusterManager>;

/// A pool of connections to the primary that Sentinel names, made by a
/// [`SentinelManager`].
pub type SentinelPool = managed::Pool<SentinelManager>;

/// Makes Redis Cluster clients from a redis-rs [`ClusterClient`], so that
/// every setting of its builder counts: the response timeout, TLS
/// certificates, credentials, retries. (deadpool-redis's own cluster
/// manager takes seed URLs only, and keeps redis-rs's 500 ms response
/// timeout.)
///
/// ```no_run
/// use slidegate::deadpool_redis::redis::cluster::ClusterClientBuilder;
/// use slidegate::{ClusterClientPool, ClusterManager, RedisStore};
/// use std::time::Duration;
///
/// let client = ClusterClientBuilder::new(["redis://10.0.0.1:7000", "redis://10.0.0.2:7000"])
///     .response_timeout(Duration::from_millis(100))
///     .build()
///     .unwrap();
/// let pool = ClusterClientPool::builder(ClusterManager::new(client)).max_size(4).build().unwrap();
/// let store = RedisStore::builder(pool).timeout(Duration::from_millis(100)).build();
/// ```
pub struct ClusterManager {
    client: ClusterClient,
    pings: AtomicUsize,
}

impl ClusterManager {
    /// A manager making clients of `client`'s cluster, with its settings.
    pub fn new(client: ClusterClient) -> Self {
        Self {
            client,
            pings: AtomicUsize::new(0),
        }
    }
}

impl fmt::Debug for ClusterManager {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterManager").finish_non_exhaustive()
    }
}

impl managed::Manager for ClusterManager {
    type Type = ClusterConnection;
    type Error = RedisError;

    async fn create(&self) -> Result<ClusterConnection, RedisError> {
        self.client.get_async_connection().await
    }

    async fn recycle(
        &self,
        connection: &mut ClusterConnection,
        _: &Metrics,
    ) -> RecycleResult<RedisError> {
        ping(connection, &self.pings).await
    }
}

/// Makes connections to the primary that Redis Sentinel names for one
/// master: each new connection asks the sentinels where the primary is
/// now, and checks (`ROLE`) that the server it reaches is a primary. So
/// after a failover, a connection that the store closes (its server went
/// away, or answered `READONLY` once demoted) is replaced by one to the
/// new primary.
///
/// Connections have no response timeout of their own: the store's timeout
/// is the one that counts (see
/// [`RedisStoreBuilder::timeout`](crate::RedisStoreBuilder::timeout)).
///
/// ```no_run
/// use slidegate::deadpool_redis::redis::sentinel::{SentinelClientBuilder, SentinelServerType};
/// use slidegate::deadpool_redis::redis::ConnectionAddr;
/// use slidegate::{RedisStore, SentinelManager, SentinelPool};
///
/// let sentinels = [ConnectionAddr::Tcp("10.0.0.1".into(), 26379)];
/// let client = SentinelClientBuilder::new(sentinels, "mymaster", SentinelServerType::Master)
///     .unwrap()
///     .build()
///     .unwrap();
/// let pool = SentinelPool::builder(SentinelManager::new(client)).max_size(4).build().unwrap();
/// let store = RedisStore::new(pool);
/// ```
pub struct SentinelManager {
    client: tokio::sync::Mutex<SentinelClient>,
    connection: AsyncConnectionConfig,
}

impl SentinelManager {
    /// A manager of connections to the primary that `client`'s sentinels
    /// name.
    pub fn new(client: SentinelClient) -> Self {
        Self {
            client: tokio::sync::Mutex::new(client),
            connection: AsyncConnectionConfig::new().set_response_timeout(None),
        }
    }
}

impl fmt::Debug for SentinelManager {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SentinelManager").finish_non_exhaustive()
    }
}

impl managed::Manager for SentinelManager {
    type Type = MultiplexedConnection;
    type Error = RedisError;

    async fn create(&self) -> Result<MultiplexedConnection, RedisError> {
        self.client
            .lock()
            .await
            .get_async_connection_with_config(&self.connection)
            .await
    }

    /// A pooled connection is handed out again only if its server is
    /// still the primary: one demoted by a failover is left.
    async fn recycle(
        &self,
        connection: &mut MultiplexedConnection,
        _: &Metrics,
    ) -> RecycleResult<RedisError> {
        let role: Vec<Value> = cmd("ROLE").query_async(connection).await?;
        match role.first() {
            Some(Value::BulkString(role)) if role == b"master" => Ok(()),
            _ => Err(RecycleError::message("the server is no longer the primary")),
        }
    }
}

/// A pooled client is handed out again only if it still answers a `PING`
/// with the number it was sent.
async fn ping(
    connection: &mut impl ConnectionLike,
    pings: &AtomicUsize,
) -> RecycleResult<RedisError> {
    let sent = pings.fetch_add(1, Ordering::Relaxed).to_string();
    let echoed: String = cmd("PING").arg(&sent).query_async(connection).await?;
    if echoed == sent {
        Ok(())
    } else {
        Err(RecycleError::message(
            "a PING came back with another number",
        ))
    }
}
