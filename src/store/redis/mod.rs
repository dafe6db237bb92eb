//! The shared store: one atomic Lua script per request on a deadpool-redis
//! pool.

/// `$body` with `$lanes` bound to the lanes of `$connections`, whatever
/// their kind of pool.
macro_rules! on_lanes {
    ($connections:expr, $lanes:ident => $body:expr) => {
        match $connections {
            Connections::Standalone($lanes) => $body,
            Connections::Cluster($lanes) => $body,
            Connections::ClusterClient($lanes) => $body,
            Connections::Sentinel($lanes) => $body,
        }
    };
}

mod batch;
mod builder;
mod call;
mod lanes;
mod library;
mod pools;
mod reply;
mod run;
mod script;

pub use builder::{PrefixError, RedisStoreBuilder};
pub use pools::{
    ClusterClientPool, ClusterManager, SentinelConnection, SentinelManager, SentinelPool,
};

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use deadpool_redis::redis::{ErrorKind, RedisError, Script, Value, cmd};
use deadpool_redis::{Pool, cluster};

use self::batch::Queue;
use self::call::{Call, Op};
use self::lanes::{Lanes, Source};
use self::library::Library;
use self::run::{call_ended, ticket};
use super::{Check, CheckFuture, StateId, Store, StoreError, unpaired_refund, unpaired_settlement};
use crate::clock::{Clock, duration_micros};

const DEFAULT_TIMEOUT: Duration = Duration::from_millis(50);
const DEFAULT_PREFIX: &str = "slidegate";
const DEFAULT_CONNECTIONS: usize = 1;

/// The pool a [`RedisStore`] runs on: one Redis server (or a primary
/// behind a proxy), or a Redis Cluster.
///
/// Both deadpool-redis pool types convert into it.
#[derive(Clone)]
#[non_exhaustive]
pub enum RedisPool {
    /// A pool of connections to one server.
    Standalone(Pool),
    /// A pool of Redis Cluster clients; each follows `MOVED` and `ASK`
    /// redirects and routes each script call to its keys' slot.
    Cluster(cluster::Pool),
    /// A pool of Redis Cluster clients made from a redis-rs
    /// `ClusterClient` (see [`ClusterManager`]), with every setting of its
    /// builder: response timeout, TLS certificates, credentials.
    ClusterClient(ClusterClientPool),
    /// A pool of connections to the primary that Redis Sentinel names,
    /// following failovers (see [`SentinelManager`]).
    Sentinel(SentinelPool),
}

impl From<Pool> for RedisPool {
    fn from(pool: Pool) -> Self {
        Self::Standalone(pool)
    }
}

impl From<cluster::Pool> for RedisPool {
    fn from(pool: cluster::Pool) -> Self {
        Self::Cluster(pool)
    }
}

impl From<ClusterClientPool> for RedisPool {
    fn from(pool: ClusterClientPool) -> Self {
        Self::ClusterClient(pool)
    }
}

impl From<SentinelPool> for RedisPool {
    fn from(pool: SentinelPool) -> Self {
        Self::Sentinel(pool)
    }
}

impl RedisPool {
    /// The pool's size and idle connections.
    pub fn status(&self) -> deadpool_redis::Status {
        match self {
            Self::Standalone(pool) => pool.status(),
            Self::Cluster(pool) => pool.status(),
            Self::ClusterClient(pool) => pool.status(),
            Self::Sentinel(pool) => pool.status(),
        }
    }
}

impl fmt::Debug for RedisPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self {
            Self::Standalone(_) => "Standalone",
            Self::Cluster(_) => "Cluster",
            Self::ClusterClient(_) => "ClusterClient",
            Self::Sentinel(_) => "Sentinel",
        };
        f.debug_tuple(kind).field(&self.status()).finish()
    }
}

struct Inner {
    pool: RedisPool,
    connections: Connections,
    /// Checks waiting to be sent together; see [`RedisStoreBuilder::with_batch`].
    queue: Option<Queue>,
    script: Script,
    library: Library,
    prefix: String,
    timeout: Duration,
    clock: Option<Box<dyn Clock>>,
}

/// The Redis store: every check is one call of the library in `lua/`, which
/// decides every policy of the request and records it atomically, for every
/// [`Algorithm`](crate::policy::Algorithm), on Redis's own clock (`TIME`), so application servers'
/// clocks never matter.
///
/// The script runs as a Redis function (`FCALL`), loaded on first use on
/// the server (or cluster node) that holds the keys, and again wherever a
/// server answers that it lacks it. Where Redis refuses functions (by ACL,
/// or a renamed command), the store runs the same script by `EVALSHA`.
///
/// Keys start with `<prefix>:<policy>:{<client>}` (see
/// [`RedisStore::base_key`]); the braces make every key of one client one
/// Redis Cluster slot. Every key has a TTL, within two windows of the
/// time its counts stop mattering.
///
/// The store holds a few of the pool's connections (one by default, see
/// [`RedisStoreBuilder::with_connections`]) and shares them between concurrent
/// checks: deadpool-redis's connections are multiplexed, so checks in
/// flight together are pipelined, written to Redis together and answered
/// in one read, and no check pays the pool's health check.
///
/// Each call has a timeout (50 ms by default). A connection whose call
/// timed out is kept: it stays in step when a call is abandoned, so a slow
/// Redis costs slow answers, not a storm of reconnections. A connection that
/// failed below the Redis protocol (I/O) is closed and replaced from the
/// pool, and so is one whose server answered `READONLY`, `MASTERDOWN` or
/// `LOADING`, so that after a failover the store reconnects to wherever
/// the address now leads.
///
/// ```no_run
/// use slidegate::store::RedisStore;
/// use slidegate::deadpool_redis::{Config, Runtime};
/// use std::time::Duration;
///
/// let pool = Config::from_url("redis://127.0.0.1:6379/")
///     .create_pool(Some(Runtime::Tokio1))
///     .unwrap();
/// let store = RedisStore::builder(pool)
///     .with_prefix("myapp")
///     .with_timeout(Duration::from_millis(30))
///     .build()
///     .expect("a prefix without braces");
/// ```
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.inner.prefix)
            .field("timeout", &self.inner.timeout)
            .field("pool", &self.inner.pool)
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// A store on `pool` (standalone or cluster) with the default prefix
    /// and timeout.
    pub fn new(pool: impl Into<RedisPool>) -> Self {
        Self::builder(pool)
            .build()
            .expect("the default prefix holds no braces")
    }

    /// Starts configuring a store on `pool` (standalone or cluster).
    pub fn builder(pool: impl Into<RedisPool>) -> RedisStoreBuilder {
        RedisStoreBuilder::new(pool.into())
    }

    /// The pool the store runs on.
    pub fn pool(&self) -> &RedisPool {
        &self.inner.pool
    }

    /// The key `check`'s state is named after, `<prefix>:<policy>:{<client>}`,
    /// or `<prefix>:<namespace>:<policy>:{<client>}` in a layer's
    /// namespace: a sliding log's packed string is this key with `:l`, a
    /// sliding counter's hash this key with `:c`, a fixed window's with
    /// `:f`.
    ///
    /// ```no_run
    /// # fn demo(store: slidegate::store::RedisStore) {
    /// use slidegate::{Policy, key::Key, store::Check};
    /// use std::time::Duration;
    ///
    /// let check = Check::new(&Policy::new("search", 5, Duration::from_secs(60)), Key::new("alice")).unwrap();
    /// assert_eq!(store.base_key(&check), "slidegate:search:{alice}");
    /// # }
    /// ```
    pub fn base_key(&self, check: &Check) -> String {
        call::key_of(&self.inner.prefix, check, "")
    }

    /// Opens the store's connections now rather than on the first check,
    /// and has Redis answer a `PING` on each, all within `within`: at
    /// start-up, so that the first requests do not pay for connecting (a
    /// TLS handshake to a distant Redis may take longer than the store's
    /// timeout), and so that an unreachable Redis, a refused password or a
    /// certificate that does not verify is told at once, with its reason.
    /// The store works either way: until Redis answers, each policy's fail
    /// mode applies.
    ///
    /// ```no_run
    /// # async fn demo(store: slidegate::store::RedisStore) {
    /// use std::time::Duration;
    ///
    /// if let Err(error) = store.connect(Duration::from_secs(5)).await {
    ///     tracing::error!(%error, "Redis is not reachable; the fail modes apply until it is");
    /// }
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// [`StoreError::Timeout`] if Redis did not answer within `within`,
    /// [`StoreError::Backend`] with redis-rs's reason otherwise.
    pub async fn connect(&self, within: Duration) -> Result<(), StoreError> {
        let deadline = tokio::time::Instant::now() + within;
        let inner = &self.inner;
        on_lanes!(&inner.connections, lanes => ping_all(lanes, deadline).await)
            .map_err(|failed| failed_within(failed, within))?;
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if let Some(policy) = self.eviction_policy(left).await?
            && policy != "noeviction"
        {
            tracing::warn!(
                "Redis may evict the limiter's keys (maxmemory-policy {policy}): a client whose \
                 counts are evicted starts afresh, with its whole limit again; set \
                 maxmemory-policy noeviction (every key the limiter writes has a TTL, so \
                 volatile-* policies evict them too)"
            );
        }
        Ok(())
    }

    /// Redis's `maxmemory-policy`: what it evicts when full. Only
    /// `noeviction` keeps every count: under any other a client whose keys
    /// are evicted is counted afresh (and since every key the limiter
    /// writes has a TTL, the `volatile-*` policies evict them too). `None`
    /// where Redis does not say (`CONFIG` refused, or a cluster).
    /// [`connect`](Self::connect) warns when it is not `noeviction`.
    ///
    /// # Errors
    ///
    /// As [`connect`](Self::connect).
    pub async fn eviction_policy(&self, within: Duration) -> Result<Option<String>, StoreError> {
        self.setting("maxmemory-policy", within).await
    }

    /// A setting as `CONFIG GET` answers it on one lane's server, by
    /// `within`; `None` where Redis refuses to say, or for a cluster.
    async fn setting(&self, name: &str, within: Duration) -> Result<Option<String>, StoreError> {
        let deadline = tokio::time::Instant::now() + within;
        match &self.inner.connections {
            Connections::Standalone(lanes) => config_get(lanes, name, deadline).await,
            Connections::Sentinel(lanes) => config_get(lanes, name, deadline).await,
            Connections::Cluster(_) | Connections::ClusterClient(_) => Ok(None),
        }
        .map_err(|failed| failed_within(failed, within))
    }
}

/// A failure of a call bounded by `within`, as the store reports it.
fn failed_within(failed: Failed, within: Duration) -> StoreError {
    match failed {
        Failed::Timeout => StoreError::Timeout(within),
        Failed::Redis(error) => StoreError::Backend(error.into()),
    }
}

/// The setting `name` as one lane's server says it, by `deadline`; `None`
/// if it refuses to.
async fn config_get<S: Source>(
    lanes: &Lanes<S>,
    name: &str,
    deadline: tokio::time::Instant,
) -> Result<Option<String>, Failed> {
    let mut ticket = ticket(lanes, deadline).await?;
    let mut get = cmd("CONFIG");
    get.arg("GET").arg(name);
    // Read as it comes (a list in RESP2, a map in RESP3), so that no reply
    // fails to parse and costs the lane its connection.
    let reply =
        tokio::time::timeout_at(deadline, get.query_async::<Value>(&mut ticket.connection)).await;
    let setting = match call_ended(lanes, &ticket, reply) {
        Ok(Value::Array(pair)) => pair.into_iter().nth(1),
        Ok(Value::Map(pairs)) => pairs.into_iter().next().map(|(_, value)| value),
        Ok(_) => None,
        Err(Failed::Redis(error)) if error.kind() != ErrorKind::Io => return Ok(None),
        Err(failed) => return Err(failed),
    };
    Ok(match setting {
        Some(Value::BulkString(bytes)) => String::from_utf8(bytes).ok(),
        Some(Value::SimpleString(text)) => Some(text),
        _ => None,
    })
}

/// A `PING` answered on every lane by `deadline`.
async fn ping_all<S: Source>(
    lanes: &Lanes<S>,
    deadline: tokio::time::Instant,
) -> Result<(), Failed> {
    for _ in 0..lanes.len() {
        let mut ticket = ticket(lanes, deadline).await?;
        let reply = tokio::time::timeout_at(
            deadline,
            cmd("PING").query_async::<()>(&mut ticket.connection),
        )
        .await;
        call_ended(lanes, &ticket, reply)?;
    }
    Ok(())
}

/// The lanes of a store, on its kind of pool.
enum Connections {
    Standalone(Lanes<Pool>),
    Cluster(Lanes<cluster::Pool>),
    ClusterClient(Lanes<ClusterClientPool>),
    Sentinel(Lanes<SentinelPool>),
}

impl Connections {
    /// Lanes for `count` of `pool`'s connections.
    fn new(pool: &RedisPool, count: usize) -> Self {
        match pool {
            RedisPool::Standalone(pool) => Self::Standalone(Lanes::new(pool.clone(), count)),
            RedisPool::Cluster(pool) => Self::Cluster(Lanes::new(pool.clone(), count)),
            RedisPool::ClusterClient(pool) => Self::ClusterClient(Lanes::new(pool.clone(), count)),
            RedisPool::Sentinel(pool) => Self::Sentinel(Lanes::new(pool.clone(), count)),
        }
    }

    /// Whether a call must keep to one slot.
    fn is_cluster(&self) -> bool {
        matches!(self, Self::Cluster(_) | Self::ClusterClient(_))
    }
}

/// How a call on a lane failed, in a form every check of a batch can share.
enum Failed {
    Timeout,
    Redis(RedisError),
}

impl Store for RedisStore {
    fn is_remote(&self) -> bool {
        true
    }

    fn state(&self) -> Option<StateId> {
        Some(StateId::of(&self.inner))
    }

    fn peek(&self, checks: &[Check]) -> CheckFuture {
        self.ask(checks, Op::Peek, |inner, call, deadline| async move {
            inner.run(call, deadline).await
        })
    }

    fn refund(&self, checks: &[Check], recorded_at: &[Duration]) -> CheckFuture<()> {
        if let Some(unpaired) = unpaired_refund(checks, recorded_at) {
            return CheckFuture::ready(Err(unpaired));
        }
        let recorded = recorded_at.iter().map(|&at| duration_micros(at)).collect();
        self.ask(
            checks,
            Op::Refund(recorded),
            |inner, call, deadline| async move { inner.packed(&call, deadline).await.map(drop) },
        )
    }

    fn settle(&self, checks: &[Check], recorded_at: &[Duration], costs: &[u64]) -> CheckFuture<()> {
        if let Some(unpaired) = unpaired_settlement(checks, recorded_at, costs) {
            return CheckFuture::ready(Err(unpaired));
        }
        let settled = recorded_at
            .iter()
            .zip(costs)
            .map(|(&at, &cost)| (duration_micros(at), cost))
            .collect();
        self.ask(
            checks,
            Op::Settle(settled),
            |inner, call, deadline| async move { inner.packed(&call, deadline).await.map(drop) },
        )
    }

    fn renew(&self, checks: &[Check]) -> CheckFuture<Vec<bool>> {
        let policies = checks.len();
        self.ask(checks, Op::Renew, move |inner, call, deadline| async move {
            let held = inner.packed(&call, deadline).await?;
            if held.len() != policies {
                return Err(StoreError::Protocol(format!(
                    "{} renewals answered for {policies} policies",
                    held.len()
                )));
            }
            Ok(held.into_iter().map(|byte| byte == b'1').collect())
        })
    }

    fn reset(&self, checks: &[Check]) -> CheckFuture<()> {
        self.ask(checks, Op::Reset, |inner, call, deadline| async move {
            inner.packed(&call, deadline).await.map(drop)
        })
    }

    fn check(&self, checks: &[Check]) -> CheckFuture {
        self.ask(checks, Op::Check, |inner, call, deadline| async move {
            inner.check(call, deadline).await
        })
    }
}

impl RedisStore {
    /// `op` on `checks`, which `run` sends and reads within the store's
    /// timeout, counted from the first poll.
    fn ask<T, F>(
        &self,
        checks: &[Check],
        op: Op,
        run: impl FnOnce(Arc<Inner>, Call, tokio::time::Instant) -> F + Send + 'static,
    ) -> CheckFuture<T>
    where
        F: Future<Output = Result<T, StoreError>> + Send + 'static,
    {
        let call = Call::new(self, checks, op);
        let inner = self.inner.clone();
        CheckFuture::new(async move {
            let deadline = tokio::time::Instant::now() + inner.timeout;
            run(inner, call, deadline).await
        })
    }
}
