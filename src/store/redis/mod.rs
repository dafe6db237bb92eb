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
mod recoveries;
mod reply;
mod run;
mod script;
mod slots;
mod tables;

pub use builder::{PrefixError, RedisStoreBuilder};
use pools::{ClusterClientPool, ClusterManager, SentinelManager, SentinelPool};

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use deadpool_redis::redis::cluster::ClusterClient;
use deadpool_redis::redis::sentinel::SentinelClient;
use deadpool_redis::redis::{ErrorKind, Script, Value, cmd};
use deadpool_redis::{Pool, cluster};

use self::batch::Queue;
use self::call::{Call, Op};
use self::lanes::{Lanes, Source};
use self::library::Library;
use self::run::{Failed, call_ended, ticket};
use super::{Check, Store, StoreError, StoreFuture, unpaired_refund, unpaired_settlement};
use crate::clock::{Clock, duration_micros};

const DEFAULT_TIMEOUT: Duration = Duration::from_millis(50);
const DEFAULT_PREFIX: &str = "slidegate";
const DEFAULT_CONNECTIONS: usize = 1;

/// The pool a [`RedisStore`] runs on: one Redis server (or a primary
/// behind a proxy), a Redis Cluster, or the primary Redis Sentinel names.
///
/// Each kind converts into it:
///
/// | from | reaches |
/// |---|---|
/// | a `deadpool_redis::Pool` | one server |
/// | a `deadpool_redis::cluster::Pool` | a cluster, from seed URLs; each call is routed to its keys' slot, following `MOVED` and `ASK` |
/// | a redis-rs `ClusterClient` | a cluster, with every setting of its builder: response timeout, TLS certificates, credentials (deadpool-redis's own cluster pool takes seed URLs only, and keeps redis-rs's 500 ms response timeout) |
/// | a redis-rs `SentinelClient` | the primary the sentinels name, following failovers |
///
/// The store holds a few of the pool's connections for good (its
/// [lanes](RedisStoreBuilder::with_connections)); a pool made from a client
/// holds at most 16.
///
/// With Sentinel, each new connection asks the sentinels where the primary
/// is and checks (`ROLE`) that the server it reaches is one. While the
/// pool is in use, a task asks the sentinels every half second where the
/// primary is; once they name another (a failover), every connection to
/// the old one fails its next call and is replaced by one to the new
/// primary: a demoted primary may go on taking writes for seconds before
/// the sentinels reconfigure it, and counts written there would be lost.
/// Its connections have no response timeout of their own: the store's
/// [timeout](RedisStoreBuilder::with_timeout) is the one that counts.
///
/// ```no_run
/// use slidegate::deadpool_redis::redis::cluster::ClusterClientBuilder;
/// use slidegate::deadpool_redis::redis::sentinel::{SentinelClientBuilder, SentinelServerType};
/// use slidegate::deadpool_redis::redis::ConnectionAddr;
/// use slidegate::store::RedisStore;
/// use std::time::Duration;
///
/// let cluster = ClusterClientBuilder::new(["redis://10.0.0.1:7000", "redis://10.0.0.2:7000"])
///     .response_timeout(Duration::from_millis(100))
///     .build()
///     .unwrap();
/// let on_cluster = RedisStore::builder(cluster).with_timeout(Duration::from_millis(100)).build().unwrap();
///
/// let sentinels = [ConnectionAddr::Tcp("10.0.0.1".into(), 26379)];
/// let sentinel = SentinelClientBuilder::new(sentinels, "mymaster", SentinelServerType::Master)
///     .unwrap()
///     .build()
///     .unwrap();
/// let on_sentinel = RedisStore::new(sentinel);
/// ```
#[derive(Clone)]
pub struct RedisPool(Kind);

/// The kinds of [`RedisPool`].
#[derive(Clone)]
enum Kind {
    /// A pool of connections to one server.
    Standalone(Pool),
    /// deadpool-redis's pool of Redis Cluster clients.
    Cluster(cluster::Pool),
    /// A pool of Redis Cluster clients of a redis-rs `ClusterClient`.
    ClusterClient(ClusterClientPool),
    /// A pool of connections to the primary that Sentinel names.
    Sentinel(SentinelPool),
}

/// The most connections a pool made from a client holds.
const CLIENT_POOL_SIZE: usize = 16;

impl From<Pool> for RedisPool {
    fn from(pool: Pool) -> Self {
        Self(Kind::Standalone(pool))
    }
}

impl From<cluster::Pool> for RedisPool {
    fn from(pool: cluster::Pool) -> Self {
        Self(Kind::Cluster(pool))
    }
}

impl From<ClusterClient> for RedisPool {
    fn from(client: ClusterClient) -> Self {
        Self::cluster_client(client, CLIENT_POOL_SIZE)
    }
}

impl From<SentinelClient> for RedisPool {
    fn from(client: SentinelClient) -> Self {
        Self::sentinel(client, CLIENT_POOL_SIZE)
    }
}

impl RedisPool {
    /// A pool of at most `size` clients of `client`'s cluster.
    pub(crate) fn cluster_client(client: ClusterClient, size: usize) -> Self {
        let pool = ClusterClientPool::builder(ClusterManager::new(client))
            .max_size(size)
            .runtime(deadpool::Runtime::Tokio1)
            .build();
        Self(Kind::ClusterClient(
            pool.expect("a pool with a runtime builds"),
        ))
    }

    /// A pool of at most `size` connections to the primary `client`'s
    /// sentinels name.
    pub(crate) fn sentinel(client: SentinelClient, size: usize) -> Self {
        let pool = SentinelPool::builder(SentinelManager::new(client))
            .max_size(size)
            .runtime(deadpool::Runtime::Tokio1)
            .build();
        Self(Kind::Sentinel(pool.expect("a pool with a runtime builds")))
    }

    /// The pool's size and idle connections.
    pub fn status(&self) -> deadpool_redis::Status {
        match &self.0 {
            Kind::Standalone(pool) => pool.status(),
            Kind::Cluster(pool) => pool.status(),
            Kind::ClusterClient(pool) => pool.status(),
            Kind::Sentinel(pool) => pool.status(),
        }
    }
}

impl fmt::Debug for RedisPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.0 {
            Kind::Standalone(_) => "Standalone",
            Kind::Cluster(_) => "Cluster",
            Kind::ClusterClient(_) => "ClusterClient",
            Kind::Sentinel(_) => "Sentinel",
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
    /// When Redis may have lost state; see [`Store::recoveries`].
    recoveries: recoveries::Recoveries,
    prefix: String,
    timeout: Duration,
    clock: Option<Box<dyn Clock>>,
}

/// The Redis store: every check is one call of the library in `lua/`, which
/// decides every policy of the request and records it atomically, for every
/// [`Algorithm`](crate::policy::Algorithm), on Redis's own clock (`TIME`),
/// so application servers' clocks never matter. Redis 7.0 or newer is
/// needed.
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
///
/// # Pools and Redis Cluster
///
/// [`RedisStore::new`] and [`RedisStore::builder`] take any [`RedisPool`]: a
/// standalone deadpool-redis pool, a `deadpool_redis::cluster::Pool`, or a
/// redis-rs `ClusterClient` or `SentinelClient` (the configuration file
/// takes `cluster = true` and `urls`, or a
/// `redis+cluster://host:port,host:port` URL, for a cluster).
///
/// Each client has one key per policy, named after
/// [`base_key`](Self::base_key): `<prefix>:<policy>:{<client key>}`, or
/// `<prefix>:<namespace>:<policy>:{<client key>}` for a layer with a
/// namespace (the client key starts with its source's label, as in
/// `{ip:192.0.2.7}`), with a suffix for its algorithm appended: `:l` (a
/// sliding log, with `:p:0`, `:p:1`, ... for chunks of its older pages),
/// `:c` (a sliding counter), `:f` (a fixed window), `:b` (a token bucket),
/// `:n` (leases), `:q` (a calendar quota), and `:x` for a policy that
/// blocks (the repository's `docs/redis.md` has what each holds). The braces are the Redis Cluster hash tag:
/// every key of one client is in one slot, so each script call touches one
/// slot. A batch that mixes clients is refused by the cluster
/// (`CROSSSLOT`) and reported as a store error, never as an admission.
///
/// A request whose policies count under different keys
/// ([`Policy::per`](crate::Policy::per): per client and for everyone,
/// say) may span slots on a cluster. Its slots are then asked one after
/// another, in the order of its checks, each all or nothing, and what an
/// earlier slot granted is given back when a later one denies (or fails):
/// no limit is ever passed, at the price of a brief over-denial (another
/// request may be denied for units this one gives back a moment later),
/// and a round trip per slot. On one server, or where the keys share a
/// slot, it is one call as ever.
/// Every key has a TTL: a counter's runs out just past the time its counts
/// matter, a sliding log's within two spans (the longest window its
/// policy's tiers count) of its newest record (the log sets it once a
/// window rather than on every request), and a log is
/// deleted as soon as nothing in it counts.
///
/// # The script
///
/// The check runs as a Redis function (`FCALL`): the store loads its
/// library on first use on the server, or cluster node, that holds the
/// keys, and again wherever a server says it lacks it (a restart without
/// persistence, `FUNCTION FLUSH`). Its name carries the script's SHA-1, so
/// two versions of the crate never call each other's. Where Redis refuses
/// functions (an ACL without `FUNCTION` and `FCALL`, a renamed command),
/// the store runs the same script by `EVALSHA`, at about half to two
/// thirds more Redis CPU per check.
///
/// Every call does bounded work, whatever the limit, the costs clients
/// choose, the window or the time since a client's last request: no call
/// reads or rewrites a whole sliding log. Pruning, a window's count, the
/// time enough units leave (`Retry-After`), a refund and a wider record
/// each read O(log pages) fields and rewrite at most one page, and pages
/// the log has left behind are deleted a few per call. A batch call stops
/// deciding once it has done a call's worth of work in logs' pages and
/// leaves the rest for the next call (32 clients with logs of a million
/// records: calls under a millisecond, not one of 3 to 6 ms). A log whose
/// client goes quiet expires whole, a hash of 64 pages at a time (each has
/// its own TTL), so Redis frees it in its main thread a fraction of a
/// millisecond at a time whatever `lazyfree-lazy-expire` says (deleting
/// each key of a million-record log: at most 141 µs). On a log of 100,000
/// records the longest call of any path, a denial at a cost equal to a
/// limit of a million included, held Redis for under a millisecond on this
/// crate's development machine (the repository's `tests/it/bounded.rs`;
/// every path and size in its `BENCHMARKS.md`). A client at a limit of
/// 1,000 takes about 5.6 bytes per request in Redis (`MEMORY USAGE` of both
/// keys, all overhead included), with costs of all sizes about 9.5.
///
/// A clock that steps back (NTP, a failover to a skewed node) never resets
/// a count: each key remembers the latest time it counted at and places
/// new requests no earlier (a sliding log records a request one
/// microsecond after its newest, if that is later than now, so its records
/// stay in order and each has a time of its own). Peeks and denials move
/// nothing. After a step back of more than a window, a key's counts move
/// to the new time instead (a sliding log's live count gathered into one
/// record, a counter's window), so they are kept and leave within two
/// windows of it.
///
/// A policy whose tiers have windows of their own shares one log per
/// client: records leave once the longest window the log has been counted
/// under (since it was last empty) has passed over them, and each check
/// counts the records of its own window, so no tier's requests erase
/// another's.
///
/// # Connections and batches
///
/// The store takes one connection from the pool and shares it between
/// every check in flight ([`RedisStoreBuilder::with_connections`] holds
/// more): redis-rs's multiplexed connections pipeline concurrent calls,
/// and no check pays the pool's health check (a `PING` round trip per
/// checkout).
///
/// Checks are batched under load ([`RedisStoreBuilder::with_batch`]`(false)`
/// turns this off): a check that finds no call of the store in flight is
/// sent at once from its own task, with nothing added on its way; checks
/// that arrive while calls are in flight queue, and the first of them
/// spawns a flush, which lets every ready task run once and then sends
/// whatever has queued as one call of the script's batch function, with
/// no timer waiting for company and without waiting for the calls in
/// flight (they are pipelined). A call holds at most 32 policies, over
/// all its requests: a flood goes as several calls, one after the other,
/// so no one script holds Redis for long. The script decides the requests
/// in arrival order, each all-or-nothing on its own, and answers each
/// separately, so one request's error leaves the others decided. Requests
/// of one client in a batch (a busy client, a `Global` limit) read the
/// client's state once and write a sliding log's header once; a client
/// below its limit costs the script a read of its log's header, one
/// appended record and the header written back. Redis spends three
/// quarters to four fifths of the CPU per request it spends on a
/// hand-written sorted-set script, whether one client sends 70,000
/// requests a second or 10,000 clients share them, and the whole service
/// serves 1.07× and 1.15× the requests such a script's middleware does
/// (`BENCHMARKS.md`, "The hot path"). On a cluster, where one call must
/// stay in one slot, each slot batches on its own (a client's keys share a
/// slot), and a request whose keys span slots is asked slot by slot, as
/// above.
///
/// # Timeouts and failed connections
///
/// Each call has a timeout (50 ms by default,
/// [`RedisStoreBuilder::with_timeout`]), and each check in a batch keeps its
/// own: a late reply is dropped without disturbing the checks queued
/// behind it. A connection that failed below the Redis protocol (I/O), or
/// whose server answered `READONLY`, `MASTERDOWN` or `LOADING`, is closed,
/// and the next check takes a fresh one from the pool, so that after a
/// failover the store reconnects to wherever the address now leads. A
/// connection whose call timed out is kept, since it stays in step when a
/// call is abandoned (a slow Redis costs slow answers, not a storm of
/// reconnections), unless it has answered nothing for a second when a
/// check on it times out (its other end gone without closing it: a dead
/// host, a partition): that one is closed too, as it would otherwise time
/// out every check.
///
/// Pools built from the configuration give redis-rs no response timeout of
/// its own on a single server or Sentinel, and the store's on a cluster,
/// so the store's timeout is the one that counts; a pool you build
/// yourself may carry redis-rs's default of 500 ms, which ends a call
/// first if the store's is longer.
///
/// # When Redis is full
///
/// The script declares itself with a `#!lua` shebang, so that under
/// `maxmemory` Redis refuses it before it writes. Once Redis is full,
/// every request is still decided there by an `allow-oom` twin of the
/// function (by `EVALSHA`, where functions are refused, every check is
/// refused instead), from the state Redis holds: a request that any of it denies
/// (a live block, a full window under any of its policies, however
/// short-lived the request's other counts were) is denied, and one that
/// fits is admitted only when every one of its policies' state exists
/// already, and recorded: the clients Redis holds go on being admitted
/// and written past `maxmemory`.
/// Only a request that fits and would need new state (a new client, or one
/// whose counts expired) is refused by Redis; the layer then limits it in
/// the process, at its share of the limit (`limit ÷ local_share`, see
/// [`RateLimitLayer::with_local_share`](crate::RateLimitLayer::with_local_share);
/// a concurrency limit's leases too, given back there), whatever its fail
/// mode (one that fails closed still answers `503`): a full Redis never
/// fails open without a limit.
/// `slidegate_store_errors_total{kind="full"}` counts those refusals; the
/// requests the local limit then admits count as `outcome="local"`, those
/// it denies as `denied`. While Redis flaps between
/// full and not, a client may be counted in both places: at most its local
/// share and its limit in Redis, per window. So a client at its limit
/// stays at its limit however many new identities fill Redis, and a held
/// client's state grows only by its own admitted requests (and a block's
/// few bytes) and shrinks as they leave its window.
///
/// Run Redis with `maxmemory-policy noeviction`; [`connect`](Self::connect)
/// warns of any other. What eviction does to counts, and the other
/// settings Redis should run with, are in the operations guide in the
/// repository's `docs/operations.md`.
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
    /// assert_eq!(store.base_key(&check), "slidegate:search:{user:alice}");
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
        Failed::Redis(error) => StoreError::backend(error),
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
        match &pool.0 {
            Kind::Standalone(pool) => Self::Standalone(Lanes::new(pool.clone(), count)),
            Kind::Cluster(pool) => Self::Cluster(Lanes::new(pool.clone(), count)),
            Kind::ClusterClient(pool) => Self::ClusterClient(Lanes::new(pool.clone(), count)),
            Kind::Sentinel(pool) => Self::Sentinel(Lanes::new(pool.clone(), count)),
        }
    }

    /// Whether a call must keep to one slot.
    fn is_cluster(&self) -> bool {
        matches!(self, Self::Cluster(_) | Self::ClusterClient(_))
    }
}

impl Store for RedisStore {
    fn is_remote(&self) -> bool {
        true
    }

    fn recoveries(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        Some(self.inner.recoveries.watch())
    }

    fn shared_state(&self) -> Option<Arc<dyn std::any::Any + Send + Sync>> {
        Some(self.inner.clone())
    }

    fn peek(&self, checks: &[Check]) -> StoreFuture {
        if let Some(groups) = self.by_slot(checks) {
            let (store, checks) = (self.clone(), checks.to_vec());
            return StoreFuture::new(async move {
                let none = vec![(); checks.len()];
                let parts = slots::each(&checks, &none, &groups, |part, _| {
                    let peeked = store.peek(part);
                    async move { peeked.await.map(|decisions| decisions.to_vec()) }
                })
                .await?;
                Ok(slots::in_order(checks.len(), parts)?.into_iter().collect())
            });
        }
        self.ask(checks, Op::Peek, |inner, call, deadline| async move {
            inner.run(call, deadline).await
        })
    }

    fn refund(&self, checks: &[Check], recorded_at: &[Duration]) -> StoreFuture<()> {
        if let Some(unpaired) = unpaired_refund(checks, recorded_at) {
            return StoreFuture::ready(Err(unpaired));
        }
        if let Some(groups) = self.by_slot(checks) {
            let (store, checks, at) = (self.clone(), checks.to_vec(), recorded_at.to_vec());
            return StoreFuture::new(async move {
                slots::each(&checks, &at, &groups, |part, at| store.refund(part, at)).await?;
                Ok(())
            });
        }
        let recorded = recorded_at.iter().map(|&at| duration_micros(at)).collect();
        self.ask(
            checks,
            Op::Refund(recorded),
            |inner, call, deadline| async move { inner.packed(&call, deadline).await.map(drop) },
        )
    }

    fn settle(&self, checks: &[Check], recorded_at: &[Duration], costs: &[u64]) -> StoreFuture<()> {
        if let Some(unpaired) = unpaired_settlement(checks, recorded_at, costs) {
            return StoreFuture::ready(Err(unpaired));
        }
        if let Some(groups) = self.by_slot(checks) {
            let store = self.clone();
            let checks = checks.to_vec();
            let settled: Vec<(Duration, u64)> = recorded_at
                .iter()
                .copied()
                .zip(costs.iter().copied())
                .collect();
            return StoreFuture::new(async move {
                slots::each(&checks, &settled, &groups, |part, settled| {
                    let (at, costs): (Vec<Duration>, Vec<u64>) = settled.iter().copied().unzip();
                    store.settle(part, &at, &costs)
                })
                .await?;
                Ok(())
            });
        }
        let settled = recorded_at
            .iter()
            .zip(costs)
            .zip(checks)
            .map(|((&at, &cost), check)| (duration_micros(at), cost, check.id))
            .collect();
        self.ask(
            checks,
            Op::Settle(settled),
            |inner, call, deadline| async move { inner.packed(&call, deadline).await.map(drop) },
        )
    }

    fn renew(&self, checks: &[Check]) -> StoreFuture<Vec<bool>> {
        if let Some(groups) = self.by_slot(checks) {
            let (store, checks) = (self.clone(), checks.to_vec());
            return StoreFuture::new(async move {
                let none = vec![(); checks.len()];
                let parts =
                    slots::each(&checks, &none, &groups, |part, _| store.renew(part)).await?;
                slots::in_order(checks.len(), parts)
            });
        }
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

    fn reset(&self, checks: &[Check]) -> StoreFuture<()> {
        if let Some(groups) = self.by_slot(checks) {
            let (store, checks) = (self.clone(), checks.to_vec());
            return StoreFuture::new(async move {
                let none = vec![(); checks.len()];
                slots::each(&checks, &none, &groups, |part, _| store.reset(part)).await?;
                Ok(())
            });
        }
        self.ask(checks, Op::Reset, |inner, call, deadline| async move {
            inner.packed(&call, deadline).await.map(drop)
        })
    }

    fn entries(&self, table: &str) -> StoreFuture<Vec<(String, String)>> {
        self.hash_entries(table)
    }

    fn set_entry(&self, table: &str, field: &str, value: &str) -> StoreFuture<()> {
        self.hash_set(table, field, value)
    }

    fn remove_entry(&self, table: &str, field: &str, holding: Option<&str>) -> StoreFuture<()> {
        self.hash_remove(table, field, holding)
    }

    fn check(&self, checks: &[Check]) -> StoreFuture {
        if let Some(groups) = self.by_slot(checks) {
            let checks = checks.iter().cloned().collect();
            return slots::check_apart(self.clone(), checks, groups, self.inner.timeout);
        }
        self.ask(checks, Op::Check, |inner, call, deadline| async move {
            inner.check(call, deadline).await
        })
    }
}

impl RedisStore {
    /// `checks` by slot, when they span several slots of a cluster (see
    /// [`slots`]).
    fn by_slot(&self, checks: &[Check]) -> Option<slots::BySlot> {
        slots::by_slot(self.inner.connections.is_cluster(), checks)
    }

    /// `op` on `checks`, which `run` sends and reads within the store's
    /// timeout, counted from the first poll.
    fn ask<T, F>(
        &self,
        checks: &[Check],
        op: Op,
        run: impl FnOnce(Arc<Inner>, Call, tokio::time::Instant) -> F + Send + 'static,
    ) -> StoreFuture<T>
    where
        F: Future<Output = Result<T, StoreError>> + Send + 'static,
    {
        let call = Call::new(self, checks, op);
        let inner = self.inner.clone();
        StoreFuture::new(async move {
            let deadline = tokio::time::Instant::now() + inner.timeout;
            run(inner, call, deadline).await
        })
    }
}
