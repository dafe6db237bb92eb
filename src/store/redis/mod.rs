//! The shared store: one atomic Lua script per request on a deadpool-redis
//! pool.

mod batch;
mod builder;
mod call;
mod lanes;
mod library;
mod pools;
mod reply;
mod script;

pub use builder::{PrefixError, RedisStoreBuilder};
pub use pools::{
    ClusterClientPool, ClusterManager, SentinelConnection, SentinelManager, SentinelPool,
};

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use deadpool_redis::redis::aio::{ConnectionLike, MultiplexedConnection};
use deadpool_redis::redis::cluster_async::ClusterConnection;
use deadpool_redis::redis::cluster_routing::{
    Route, RoutingInfo, SingleNodeRoutingInfo, Slot, SlotAddr,
};
use deadpool_redis::redis::{
    Cmd, ErrorKind, RedisError, RedisResult, Script, ServerErrorKind, Value, cmd,
};
use deadpool_redis::{Pool, cluster};

use self::batch::{Queue, Queued, Verdict};
use self::call::{Arguments, BatchArguments, Call, Op};
use self::lanes::{Lanes, Source};
use self::library::Library;
use self::reply::{batched_outcome, decisions, replies};
use super::{
    Check, CheckFuture, CheckOutcome, StateId, Store, StoreError, unpaired_refund,
    unpaired_settlement,
};
use crate::clock::{Clock, duration_micros};

const DEFAULT_TIMEOUT: Duration = Duration::from_millis(50);
const DEFAULT_PREFIX: &str = "slidegate";
const DEFAULT_CONNECTIONS: usize = 1;
/// The most policies one batch call decides, over all its requests: a
/// flood of queued checks goes as several calls, split by the work they
/// ask for (each policy's is bounded, see `lua/driver.lua`), so that no
/// single script holds Redis, and every other client of it, for long.
const MAX_BATCH_POLICIES: usize = 32;

/// Room for one numeric argument of a command, in bytes (`u64::MAX` has
/// 20 digits).
const ARGUMENT_BYTES: usize = 20;

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
        self.key_of(check, "")
    }

    /// The base key of `check` followed by `suffix`, built in one
    /// allocation of its length.
    pub(super) fn key_of(&self, check: &Check, suffix: &str) -> String {
        let prefix = &self.inner.prefix;
        let namespace = check.namespace.as_deref();
        let (policy, client) = (&*check.policy, check.key.as_str());
        let length = prefix.len()
            + namespace.map_or(0, |namespace| namespace.len() + 1)
            + policy.len()
            + client.len()
            + suffix.len()
            + 4;
        let mut key = String::with_capacity(length);
        key.push_str(prefix);
        key.push(':');
        if let Some(namespace) = namespace {
            key.push_str(namespace);
            key.push(':');
        }
        key.push_str(policy);
        key.push_str(":{");
        key.push_str(client);
        key.push('}');
        key.push_str(suffix);
        key
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

/// `error` as the store reports it: Redis out of memory refusing a client
/// it does not track is [`StoreError::Full`]; anything else a backend
/// failure.
fn store_error_of(error: RedisError) -> StoreError {
    if Library::out_of_memory(&error) {
        StoreError::Full(error.detail().unwrap_or_default().to_owned())
    } else if let Some(annotated) = script::annotate(&error.to_string()) {
        // The library's line that failed, named in `lua/`.
        StoreError::Backend(annotated.into())
    } else {
        StoreError::Backend(error.into())
    }
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

impl Inner {
    async fn run(&self, call: Call, deadline: tokio::time::Instant) -> CheckOutcome {
        let packed = self.packed(&call, deadline).await?;
        decisions(&call.args, &packed)
    }

    /// The script's decisions for `call`, packed.
    async fn packed(
        &self,
        call: &Call,
        deadline: tokio::time::Instant,
    ) -> Result<Vec<u8>, StoreError> {
        on_lanes!(&self.connections, lanes => self.call(lanes, call, deadline).await)
            .map_err(|failed| self.store_error(failed))
    }

    /// Runs the script on a lane's connection by `deadline`.
    async fn call<S: Source>(
        &self,
        lanes: &Lanes<S>,
        call: &Call,
        deadline: tokio::time::Instant,
    ) -> Result<Vec<u8>, Failed>
    where
        S::Shared: Routed,
    {
        let mut ticket = ticket(lanes, deadline).await?;
        let reply =
            tokio::time::timeout_at(deadline, self.decide(&mut ticket.connection, call)).await;
        call_ended(lanes, &ticket, reply)
    }

    fn store_error(&self, failed: Failed) -> StoreError {
        match failed {
            Failed::Timeout => StoreError::Timeout(self.timeout),
            Failed::Redis(error) => store_error_of(error),
        }
    }

    /// Sends every queued check. On a cluster, where a call must stay in
    /// one slot, checks are grouped by slot, and each group is sent on its
    /// own; a check whose keys span slots goes alone (and fails alone).
    async fn flush(self: Arc<Self>) {
        // Every task ready now runs first, and may queue its check.
        tokio::task::yield_now().await;
        let Some(queue) = &self.queue else { return };
        let queued = queue.take();
        if !self.connections.is_cluster() {
            return self.send(queued).await;
        }
        let mut groups: Vec<(Option<Slot>, Vec<Queued>)> = Vec::new();
        for check in queued {
            match slot(&check.call) {
                Some(slot) => match groups.iter_mut().find(|(s, _)| *s == Some(slot)) {
                    Some((_, group)) => group.push(check),
                    None => groups.push((Some(slot), vec![check])),
                },
                None => groups.push((None, vec![check])),
            }
        }
        // Checks alone in their slot go back to their own tasks; a task is
        // spawned only for a second batch and beyond.
        let mut batches = Vec::new();
        for (_, mut group) in groups {
            if group.len() == 1 {
                let Queued { call, answer } = group.pop().expect("one check");
                let _ = answer.send(Verdict::Alone(call));
            } else {
                batches.push(group);
            }
        }
        let last = batches.pop();
        for batch in batches {
            tokio::spawn(self.clone().send(batch));
        }
        if let Some(batch) = last {
            self.send(batch).await;
        }
    }

    /// Sends `queued` (checks of one slot) in calls of the batch function,
    /// at most [`MAX_BATCH_POLICIES`] policies each, one after the other,
    /// so that Redis decides them in the order they were queued; a check
    /// alone goes back to its own task.
    async fn send(self: Arc<Self>, mut queued: Vec<Queued>) {
        if queued.len() <= 1 {
            if let Some(Queued { call, answer }) = queued.pop() {
                let _ = answer.send(Verdict::Alone(call));
            }
            return;
        }
        while !queued.is_empty() {
            let rest = queued.split_off(batch_end(&queued));
            let mut deferred = self.clone().send_batch(queued).await;
            // Left undecided by a call that did its share of work: first
            // in the next call, so the queue's order holds; not those
            // whose callers have stopped waiting (their fail mode has
            // answered), which must count nothing.
            deferred.retain(|queued| !queued.answer.is_closed());
            deferred.extend(rest);
            queued = deferred;
        }
    }

    /// Sends `queued` in one call of the batch function and hands each
    /// check its answer; returns the checks the call deferred (see
    /// [`Library::deferred`]), which are to be sent again.
    async fn send_batch(self: Arc<Self>, queued: Vec<Queued>) -> Vec<Queued> {
        let mut deferred = Vec::new();
        let deadline = tokio::time::Instant::now() + self.timeout;
        let replies =
            on_lanes!(&self.connections, lanes => self.call_batch(lanes, &queued, deadline).await);
        match replies {
            Ok(replies) if replies.len() == queued.len() => {
                for (Queued { call, answer }, reply) in queued.into_iter().zip(replies) {
                    if Library::deferred(&reply) {
                        deferred.push(Queued { call, answer });
                    } else if Library::failed_in_batch(&reply) {
                        // Having written nothing, it goes alone, for Redis
                        // to say where it failed (a batch's caught error
                        // names no line).
                        let _ = answer.send(Verdict::Alone(call));
                    } else {
                        let _ = answer.send(Verdict::Decided(batched_outcome(&call, reply)));
                    }
                }
            }
            Ok(replies) => {
                let message = format!(
                    "a batch of {} checks had {} answers",
                    queued.len(),
                    replies.len()
                );
                fail_all(queued, || StoreError::Protocol(message.clone()));
            }
            Err(Failed::Redis(error)) if Library::refuses(&error) => {
                // From now on checks are not queued; these go one by one.
                self.library.refuse();
                for Queued { call, answer } in queued {
                    let _ = answer.send(Verdict::Alone(call));
                }
            }
            Err(Failed::Redis(error)) => {
                fail_all(queued, || StoreError::Backend(error.clone().into()));
            }
            Err(Failed::Timeout) => fail_all(queued, || StoreError::Timeout(self.timeout)),
        }
        deferred
    }

    /// Runs the batch function over `queued` on a lane's connection,
    /// loading the library first where it is missing; one reply per check.
    async fn call_batch<S: Source>(
        &self,
        lanes: &Lanes<S>,
        queued: &[Queued],
        deadline: tokio::time::Instant,
    ) -> Result<Vec<Value>, Failed>
    where
        S::Shared: Routed,
    {
        let mut ticket = ticket(lanes, deadline).await?;
        let time = self.time();
        let arguments = BatchArguments::new(queued.iter().map(|q| &q.call));
        let batch = |function: &str| {
            let mut fcall = sized_fcall(
                function,
                queued.iter().flat_map(|q| &q.call.keys),
                arguments.len(),
            );
            for q in queued {
                fcall.arg(&q.call.keys);
            }
            fcall.arg(&time).arg(&arguments);
            fcall
        };
        let fcall = batch(&self.library.batch_function);
        let connection = &mut ticket.connection;
        let exchange = async {
            let reply = match replies(&fcall, connection).await {
                Err(error) if Library::missing(&error) => {
                    // Boxed: rare, and its future would make every batch's larger.
                    Box::pin(self.load(connection, &queued[0].call.keys[0])).await?;
                    replies(&fcall, connection).await
                }
                reply => reply,
            };
            match reply {
                // Clients already tracked are still decided; new ones get
                // the error of their own.
                Err(error) if Library::out_of_memory(&error) => {
                    replies(&batch(&self.library.held_batch_function), connection).await
                }
                reply => reply,
            }
        };
        let reply = tokio::time::timeout_at(deadline, exchange).await;
        call_ended(lanes, &ticket, reply)
    }

    /// `FCALL`, loading the library first where it is missing; `EVALSHA`
    /// where Redis refuses functions.
    async fn decide<C: Routed>(&self, connection: &mut C, call: &Call) -> RedisResult<Vec<u8>> {
        if self.library.refused() {
            return Box::pin(self.evalsha(connection, call)).await;
        }
        let fcall = self.fcall(&self.library.function, call);
        match fcall.query_async(connection).await {
            // Boxed, as every path but the first answer: their futures
            // would make every call's larger, and it is copied at each move.
            Err(error) => Box::pin(self.after_error(connection, call, fcall, error)).await,
            reply => reply,
        }
    }

    /// `FCALL` of `function` for `call`.
    fn fcall(&self, function: &str, call: &Call) -> Cmd {
        // At most nine arguments per policy (seven, and a settlement's
        // time and cost), and the operation (`peek`, `refund`, ...).
        let mut fcall = sized_fcall(function, &call.keys, 1 + 9 * call.args.len());
        fcall.arg(&call.keys).arg(self.time()).arg(Arguments(call));
        fcall
    }

    /// What follows an `FCALL` of `call` that failed with `error`: the
    /// library loaded and the call sent again where it was missing; the
    /// function that decides tracked clients alone where Redis is out of
    /// memory; `EVALSHA` from now on where Redis refuses functions.
    async fn after_error<C: Routed>(
        &self,
        connection: &mut C,
        call: &Call,
        fcall: Cmd,
        error: RedisError,
    ) -> RedisResult<Vec<u8>> {
        let reply = if Library::missing(&error) {
            match self.load(connection, &call.keys[0]).await {
                Ok(()) => fcall.query_async(connection).await,
                Err(error) if Library::refuses(&error) => Err(error),
                Err(error) => return Err(error),
            }
        } else {
            Err(error)
        };
        match reply {
            Err(error) if Library::out_of_memory(&error) => {
                // A client already tracked is still decided.
                let held = self.fcall(&self.library.held_function, call);
                return held.query_async(connection).await;
            }
            Err(error) if Library::refuses(&error) => {}
            reply => return reply,
        }
        self.library.refuse();
        self.evalsha(connection, call).await
    }

    /// The script by `EVALSHA`, where Redis refuses functions.
    async fn evalsha<C: Routed>(&self, connection: &mut C, call: &Call) -> RedisResult<Vec<u8>> {
        let mut invocation = self.script.prepare_invoke();
        for key in &call.keys {
            invocation.key(key);
        }
        invocation.arg(self.time()).arg(Arguments(call));
        invocation.invoke_async(connection).await
    }

    /// Loads the library on the server that holds `key`; one loaded
    /// meanwhile by another caller counts as loaded.
    async fn load<C: Routed>(&self, connection: &mut C, key: &str) -> RedisResult<()> {
        let mut load = cmd("FUNCTION");
        load.arg("LOAD").arg(&self.library.source);
        match connection.route_to_key(load, key).await {
            Err(error)
                if error
                    .detail()
                    .is_some_and(|detail| detail.contains("already exists")) =>
            {
                Ok(())
            }
            result => result,
        }
    }

    /// The script's first argument: the injected time, or empty for
    /// Redis's own.
    fn time(&self) -> String {
        self.clock
            .as_ref()
            .map_or_else(String::new, |clock| clock.now_micros().to_string())
    }
}

/// `FCALL function numkeys`, its buffers sized at once for `keys`, the
/// time and at most `arguments` numeric arguments after it, which the
/// caller adds.
fn sized_fcall<'a>(
    function: &str,
    keys: impl IntoIterator<Item = &'a String>,
    arguments: usize,
) -> Cmd {
    let (count, bytes) = keys
        .into_iter()
        .fold((0, 0), |(count, bytes), key| (count + 1, bytes + key.len()));
    let mut fcall = Cmd::with_capacity(
        4 + count + arguments,
        function.len() + bytes + ARGUMENT_BYTES * (4 + arguments),
    );
    fcall.arg("FCALL").arg(function).arg(count);
    fcall
}

/// A lane's connection by `deadline`.
async fn ticket<S: Source>(
    lanes: &Lanes<S>,
    deadline: tokio::time::Instant,
) -> Result<lanes::Ticket<S::Shared>, Failed> {
    match tokio::time::timeout_at(deadline, lanes.ticket()).await {
        Ok(Ok(ticket)) => Ok(ticket),
        // Why no connection could be made: refused, a certificate that
        // does not verify, a wrong password.
        Ok(Err(deadpool_redis::PoolError::Backend(error))) => Err(Failed::Redis(error)),
        Ok(Err(error)) => Err(Failed::Redis(RedisError::from((
            ErrorKind::Io,
            "no Redis connection",
            error.to_string(),
        )))),
        Err(_) => Err(Failed::Timeout),
    }
}

/// Tells the lanes how a call on `ticket` ended: an answer (an error reply
/// included) keeps its connection; a timeout keeps it unless the lane has
/// long been silent; any other failure closes it (see
/// [`worth_keeping_after`]).
fn call_ended<S: Source, T>(
    lanes: &Lanes<S>,
    ticket: &lanes::Ticket<S::Shared>,
    reply: Result<RedisResult<T>, tokio::time::error::Elapsed>,
) -> Result<T, Failed> {
    match reply {
        Ok(Ok(value)) => {
            lanes.answered(ticket);
            Ok(value)
        }
        Ok(Err(error)) if error.is_timeout() => {
            // redis-rs's own response timeout, shorter than the store's.
            lanes.timed_out(ticket);
            Err(Failed::Timeout)
        }
        Ok(Err(error)) => {
            if worth_keeping_after(&error) {
                lanes.answered(ticket);
            } else {
                lanes.retire(ticket);
            }
            Err(Failed::Redis(error))
        }
        Err(_) => {
            lanes.timed_out(ticket);
            Err(Failed::Timeout)
        }
    }
}

/// Whether a connection that got `error` (not a timeout) may serve another
/// check. An error reply (a script error, CROSSSLOT, ...) leaves it in
/// step; anything else (I/O, a closed connection) may not. Nor is a
/// connection kept that reached a server unable to take writes now (a primary demoted to a replica, one
/// whose primary is down, one still loading): behind a failover address, a
/// new connection reaches the new primary, while a kept one would fail
/// every check until the process restarts.
fn worth_keeping_after(error: &RedisError) -> bool {
    match error.kind() {
        ErrorKind::Server(
            ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown | ServerErrorKind::BusyLoading,
        ) => false,
        ErrorKind::Server(_) => true,
        _ => false,
    }
}

/// The Redis Cluster slot of all of `call`'s keys; `None` if they span
/// several (a check mixing clients, which Redis refuses).
fn slot(call: &Call) -> Option<Slot> {
    let mut keys = call.keys.iter().map(Slot::for_key);
    let first = keys.next()?;
    keys.all(|slot| slot == first).then_some(first)
}

/// How many of `queued`'s checks the first batch call takes: as many as
/// hold at most [`MAX_BATCH_POLICIES`] policies, and at least one.
fn batch_end(queued: &[Queued]) -> usize {
    let mut policies = 0;
    queued
        .iter()
        .position(|check| {
            policies += check.call.args.len();
            policies > MAX_BATCH_POLICIES
        })
        .map_or(queued.len(), |end| end.max(1))
}

/// Answers every check of a failed batch with its own copy of the error.
fn fail_all(queued: Vec<Queued>, error: impl Fn() -> StoreError) {
    for Queued { answer, .. } in queued {
        let _ = answer.send(Verdict::Decided(Err(error())));
    }
}

/// A connection of either kind that can run a command where a key lives.
trait Routed: ConnectionLike + Send {
    /// Runs `command` on the server that holds `key` (on a cluster, that
    /// node alone).
    fn route_to_key(
        &mut self,
        command: Cmd,
        key: &str,
    ) -> impl Future<Output = RedisResult<()>> + Send;
}

impl Routed for MultiplexedConnection {
    async fn route_to_key(&mut self, command: Cmd, _key: &str) -> RedisResult<()> {
        command.query_async(self).await
    }
}

impl Routed for SentinelConnection {
    async fn route_to_key(&mut self, command: Cmd, _key: &str) -> RedisResult<()> {
        command.query_async(self).await
    }
}

impl Routed for ClusterConnection {
    async fn route_to_key(&mut self, command: Cmd, key: &str) -> RedisResult<()> {
        let primary = Route::with_key(key, SlotAddr::Master);
        let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(primary));
        self.route_command(command, routing).await.map(drop)
    }
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

impl Inner {
    /// The decisions on `call`, batched with other requests' calls when
    /// the store batches.
    async fn check(self: Arc<Self>, call: Call, deadline: tokio::time::Instant) -> CheckOutcome {
        let Some(queue) = self.queue.as_ref().filter(|_| !self.library.refused()) else {
            return self.run(call, deadline).await;
        };
        // Queued when first polled: in a runtime, in the order the
        // requests got there.
        let (answer, first) = queue.push(call);
        if first {
            tokio::spawn(self.clone().flush());
        }
        match tokio::time::timeout_at(deadline, answer).await {
            Ok(Ok(Verdict::Decided(outcome))) => outcome,
            Ok(Ok(Verdict::Alone(call))) => self.run(call, deadline).await,
            Ok(Err(_)) => Err(StoreError::Internal(
                "a batched check lost its answer".to_owned(),
            )),
            Err(_) => Err(StoreError::Timeout(self.timeout)),
        }
    }
}

#[cfg(test)]
mod future_sizes {
    use super::*;

    /// A call's future is moved by value several times on its way (into
    /// its box, into a spawned task): kept small, each move is cheap. The
    /// rare paths (opening a connection, loading the library, `EVALSHA`)
    /// are boxed for this; together they made it over 10 KB.
    #[tokio::test]
    async fn the_futures_of_a_call_stay_small() {
        let pool = deadpool_redis::Config::from_url("redis://127.0.0.1:1/")
            .create_pool(Some(deadpool_redis::Runtime::Tokio1))
            .unwrap();
        let store = RedisStore::builder(RedisPool::from(pool)).build().unwrap();
        let policy = crate::Policy::new("p", 10, Duration::from_secs(1));
        let checks = [Check::new(&policy, crate::key::Key::new("c")).unwrap()];
        let deadline = tokio::time::Instant::now();
        let call = || Call::new(&store, &checks, Op::Check);
        let inner = &store.inner;
        let sizes = [
            (
                "check",
                std::mem::size_of_val(&inner.clone().check(call(), deadline)),
            ),
            ("flush", std::mem::size_of_val(&inner.clone().flush())),
        ];
        for (future, size) in sizes {
            assert!(size <= 2048, "the future of `{future}` is {size} bytes");
        }
    }
}
