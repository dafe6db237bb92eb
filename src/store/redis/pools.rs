//! deadpool managers for the setups deadpool-redis's own managers cannot
//! express: a Redis Cluster client with every setting of redis-rs's
//! `ClusterClientBuilder` (its response timeout, TLS certificates), and
//! connections to the primary that Redis Sentinel names.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use deadpool::managed::{self, Metrics, RecycleError, RecycleResult};
use deadpool_redis::redis::aio::{ConnectionLike, MultiplexedConnection};
use deadpool_redis::redis::cluster::ClusterClient;
use deadpool_redis::redis::cluster_async::ClusterConnection;
use deadpool_redis::redis::sentinel::SentinelClient;
use deadpool_redis::redis::{
    AsyncConnectionConfig, Client, Cmd, ErrorKind, Pipeline, RedisError, RedisFuture, Value, cmd,
};

/// A pool of Redis Cluster clients made by a [`ClusterManager`].
pub(super) type ClusterClientPool = managed::Pool<ClusterManager>;

/// A pool of connections to the primary that Sentinel names, made by a
/// [`SentinelManager`].
pub(super) type SentinelPool = managed::Pool<SentinelManager>;

/// Makes Redis Cluster clients from a redis-rs [`ClusterClient`], so that
/// every setting of its builder counts: the response timeout, TLS
/// certificates, credentials, retries. (deadpool-redis's own cluster
/// manager takes seed URLs only, and keeps redis-rs's 500 ms response
/// timeout.)
pub(super) struct ClusterManager {
    client: ClusterClient,
    pings: AtomicUsize,
}

impl ClusterManager {
    /// A manager making clients of `client`'s cluster, with its settings.
    pub(super) fn new(client: ClusterClient) -> Self {
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
/// master (see [`RedisPool`](super::RedisPool)'s `From<SentinelClient>` for
/// how it follows a failover): each new connection asks the sentinels where
/// the primary is now, and checks (`ROLE`) that the server it reaches is a
/// primary.
pub(super) struct SentinelManager {
    shared: Arc<Sentinels>,
    connection: AsyncConnectionConfig,
    watching: AtomicBool,
}

/// How often a [`SentinelManager`] asks the sentinels where the primary is.
const WATCH_EVERY: Duration = Duration::from_millis(500);

/// What a manager and its watching task share.
struct Sentinels {
    client: tokio::sync::Mutex<SentinelClient>,
    /// The primary's address as last seen, and how many times it moved.
    primary: Mutex<(Option<String>, u64)>,
    /// The move count, for connections to compare theirs with.
    moves: AtomicU64,
}

impl Sentinels {
    /// A client of the primary the sentinels name now, after checking that
    /// it is one, and the move count that goes with it: the two are read
    /// and noted under one lock, so a connection to an old primary never
    /// carries a newer count, and answers are noted in the order they came.
    async fn primary(&self) -> Result<(Client, u64), RedisError> {
        let mut client = self.client.lock().await;
        let primary = client.async_get_client().await?;
        let address = primary.get_connection_info().addr().to_string();
        let mut seen = self.primary.lock().unwrap_or_else(|e| e.into_inner());
        if seen.0.as_ref() != Some(&address) {
            if let Some(old) = &seen.0 {
                tracing::warn!(from = %old, to = %address, "the Redis primary moved (Sentinel failover)");
                seen.1 += 1;
                self.moves.store(seen.1, Ordering::Release);
            }
            seen.0 = Some(address);
        }
        let moves = seen.1;
        drop(seen);
        drop(client);
        Ok((primary, moves))
    }
}

impl SentinelManager {
    /// A manager of connections to the primary that `client`'s sentinels
    /// name.
    pub(super) fn new(client: SentinelClient) -> Self {
        Self {
            shared: Arc::new(Sentinels {
                client: tokio::sync::Mutex::new(client),
                primary: Mutex::new((None, 0)),
                moves: AtomicU64::new(0),
            }),
            connection: AsyncConnectionConfig::new().set_response_timeout(None),
            watching: AtomicBool::new(false),
        }
    }

    /// Starts the task that watches where the primary is, once; it ends
    /// when the manager is dropped.
    fn watch(&self) {
        if self.watching.swap(true, Ordering::AcqRel) {
            return;
        }
        let shared = Arc::downgrade(&self.shared);
        tokio::spawn(async move {
            let mut every = tokio::time::interval(WATCH_EVERY);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                let Some(shared) = shared.upgrade() else {
                    return;
                };
                if let Err(error) = shared.primary().await {
                    tracing::debug!(%error, "the sentinels could not name a primary");
                }
            }
        });
    }
}

impl fmt::Debug for SentinelManager {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SentinelManager").finish_non_exhaustive()
    }
}

/// A connection to the primary a [`SentinelManager`] found. Once the
/// primary has moved, every call on it fails at once (an I/O error, so the
/// store closes it and connects to the new primary).
#[derive(Clone)]
pub(super) struct SentinelConnection {
    connection: MultiplexedConnection,
    /// The manager's move count when this connection was made.
    made_at: u64,
    shared: Arc<Sentinels>,
}

impl SentinelConnection {
    fn moved(&self) -> bool {
        self.shared.moves.load(Ordering::Acquire) != self.made_at
    }
}

fn primary_moved() -> RedisError {
    RedisError::from((
        ErrorKind::Io,
        "the Redis primary moved (Sentinel failover); reconnecting",
    ))
}

impl ConnectionLike for SentinelConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        if self.moved() {
            return Box::pin(async { Err(primary_moved()) });
        }
        self.connection.req_packed_command(cmd)
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        if self.moved() {
            return Box::pin(async { Err(primary_moved()) });
        }
        self.connection.req_packed_commands(pipeline, offset, count)
    }

    fn get_db(&self) -> i64 {
        self.connection.get_db()
    }
}

impl managed::Manager for SentinelManager {
    type Type = SentinelConnection;
    type Error = RedisError;

    async fn create(&self) -> Result<SentinelConnection, RedisError> {
        self.watch();
        let (client, made_at) = self.shared.primary().await?;
        let connection = client
            .get_multiplexed_async_connection_with_config(&self.connection)
            .await?;
        Ok(SentinelConnection {
            connection,
            made_at,
            shared: self.shared.clone(),
        })
    }

    /// A pooled connection is handed out again only if its server is
    /// still the primary: one demoted by a failover is left.
    async fn recycle(
        &self,
        connection: &mut SentinelConnection,
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
