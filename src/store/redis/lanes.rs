//! A few of the pool's connections, held by the store and shared by every
//! check, so that concurrent checks are pipelined on them.
//!
//! deadpool-redis hands out multiplexed connections: many calls can be in
//! flight on one, and their commands go out together in one write and come
//! back in one read. A check that took a connection from the pool for
//! itself would use none of that, and would pay the pool's health check (a
//! `PING` round trip) on every checkout. So the store takes a few
//! connections from the pool once, keeps them as *lanes*, and gives each
//! check a clone of one lane's connection (a handle on the same socket).
//! A lane whose connection turns out unusable is handed back to be closed,
//! and the next check on it takes a fresh connection from the pool. So is
//! one that has answered nothing for [`SILENT_FOR`] when a call on it times
//! out: a connection whose other end vanished without closing it (a host
//! gone, a network partition, a failover behind one address) would
//! otherwise time out every check, and fail every request open, for as
//! long as the process runs.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use deadpool_redis::redis::aio::{ConnectionLike, MultiplexedConnection};
use deadpool_redis::redis::cluster_async::ClusterConnection;
use deadpool_redis::redis::{RedisResult, cmd};
use deadpool_redis::{Connection, Pool, PoolError, cluster};

/// How long a lane may go without an answer before a timeout on it closes
/// its connection. Long enough that a busy or briefly stalled Redis keeps
/// its connections (a frozen one is reconnected at most about once this
/// often per lane), short enough that a dead connection is left within a
/// couple of seconds.
pub(super) const SILENT_FOR: Duration = Duration::from_secs(1);

/// The name every connection of the store takes (`CLIENT SETNAME`).
pub(super) const CLIENT_NAME: &str = "slidegate";

/// Where lanes come from: a deadpool-redis pool of either kind.
pub(super) trait Source: Send + Sync + 'static {
    /// A connection checked out of the pool.
    type Held: Send;
    /// A handle on a held connection, for one call.
    type Shared: ConnectionLike + Send;

    /// Checks a connection out of the pool.
    fn get(&self) -> impl Future<Output = Result<Self::Held, PoolError>> + Send;

    /// A handle on `held`'s connection.
    fn share(held: &Self::Held) -> Self::Shared;

    /// Takes `held` out of the pool for good, so that it closes once its
    /// last handle is dropped instead of being handed out again.
    fn discard(held: Self::Held);
}

impl Source for Pool {
    type Held = Connection;
    type Shared = MultiplexedConnection;

    fn get(&self) -> impl Future<Output = Result<Connection, PoolError>> + Send {
        Pool::get(self)
    }

    fn share(held: &Connection) -> MultiplexedConnection {
        MultiplexedConnection::clone(held)
    }

    fn discard(held: Connection) {
        drop(Connection::take(held));
    }
}

impl Source for cluster::Pool {
    type Held = cluster::Connection;
    type Shared = ClusterConnection;

    fn get(&self) -> impl Future<Output = Result<cluster::Connection, PoolError>> + Send {
        cluster::Pool::get(self)
    }

    fn share(held: &cluster::Connection) -> ClusterConnection {
        ClusterConnection::clone(held)
    }

    fn discard(held: cluster::Connection) {
        drop(cluster::Connection::take(held));
    }
}

/// Names a new connection [`CLIENT_NAME`] (`CLIENT SETNAME`), so that
/// operators can tell the limiter's connections in `CLIENT LIST`; on a
/// cluster, on every node the client knows. A server that refuses (an
/// ACL without `CLIENT`) still serves the store.
async fn name(connection: &mut impl ConnectionLike) {
    let named: RedisResult<()> = cmd("CLIENT")
        .arg("SETNAME")
        .arg(CLIENT_NAME)
        .query_async(connection)
        .await;
    if let Err(error) = named {
        tracing::debug!(%error, "a Redis connection could not be named");
    }
}

impl<M> Source for deadpool::managed::Pool<M>
where
    M: deadpool::managed::Manager<Error = deadpool_redis::redis::RedisError> + 'static,
    M::Type: ConnectionLike + Clone + Send + Sync,
{
    type Held = deadpool::managed::Object<M>;
    type Shared = M::Type;

    fn get(&self) -> impl Future<Output = Result<Self::Held, PoolError>> + Send {
        deadpool::managed::Pool::get(self)
    }

    fn share(held: &Self::Held) -> M::Type {
        M::Type::clone(held)
    }

    fn discard(held: Self::Held) {
        drop(deadpool::managed::Object::take(held));
    }
}

/// The lanes of one store, taken in turn.
pub(super) struct Lanes<S: Source> {
    source: S,
    lanes: Box<[Lane<S::Held>]>,
    next: AtomicUsize,
    /// What the lanes' answer times are measured from.
    started: Instant,
    /// Numbers every connection a lane takes, so that a call can retire
    /// the connection it used and not one that replaced it meanwhile.
    taken: AtomicU64,
}

/// A lane: its connection, once it has one, and a lock taken to give it
/// one, so that calls arriving together at an empty lane take one
/// connection from the pool, not one each.
struct Lane<H> {
    connected: Mutex<Option<Connected<H>>>,
    filling: tokio::sync::Mutex<()>,
    /// When the lane last had an answer (or its connection), in µs from
    /// [`Lanes::started`].
    answered: AtomicU64,
}

struct Connected<H> {
    serial: u64,
    held: H,
}

/// A handle on one lane's connection, for one call.
pub(super) struct Ticket<C> {
    lane: usize,
    serial: u64,
    /// The connection to call on.
    pub(super) connection: C,
}

impl<S: Source> Lanes<S> {
    /// `count` lanes (at least one) on connections from `source`.
    pub(super) fn new(source: S, count: usize) -> Self {
        Self {
            source,
            lanes: (0..count.max(1))
                .map(|_| Lane {
                    connected: Mutex::new(None),
                    filling: tokio::sync::Mutex::new(()),
                    answered: AtomicU64::new(0),
                })
                .collect(),
            next: AtomicUsize::new(0),
            started: Instant::now(),
            taken: AtomicU64::new(0),
        }
    }

    /// How many lanes there are.
    pub(super) fn len(&self) -> usize {
        self.lanes.len()
    }

    /// A handle on the next lane's connection, taking one from the pool
    /// when the lane has none.
    pub(super) async fn ticket(&self) -> Result<Ticket<S::Shared>, PoolError> {
        let lane = self.next.fetch_add(1, Ordering::Relaxed) % self.lanes.len();
        if let Some(ticket) = self.share(lane) {
            return Ok(ticket);
        }
        // Boxed: a lane is filled rarely, and opening a connection is a
        // large future, whose size every call's future would carry (and
        // copy at each move) otherwise.
        Box::pin(self.fill(lane)).await
    }

    /// A ticket on `lane`, with a connection taken from the pool for it
    /// unless another caller filled it meanwhile.
    async fn fill(&self, lane: usize) -> Result<Ticket<S::Shared>, PoolError> {
        let _filling = self.lanes[lane].filling.lock().await;
        // Filled by the call that held the lock before this one?
        if let Some(ticket) = self.share(lane) {
            return Ok(ticket);
        }
        let held = self.source.get().await?;
        let mut connection = S::share(&held);
        name(&mut connection).await;
        self.lanes[lane]
            .answered
            .store(self.micros(), Ordering::Relaxed);
        let serial = self.taken.fetch_add(1, Ordering::Relaxed);
        *self.lanes[lane]
            .connected
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(Connected { serial, held });
        Ok(Ticket {
            lane,
            serial,
            connection,
        })
    }

    fn share(&self, lane: usize) -> Option<Ticket<S::Shared>> {
        let connected = self.lanes[lane]
            .connected
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        connected.as_ref().map(|filled| Ticket {
            lane,
            serial: filled.serial,
            connection: S::share(&filled.held),
        })
    }

    fn micros(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    /// Notes that a call on `ticket`'s lane was answered.
    pub(super) fn answered(&self, ticket: &Ticket<S::Shared>) {
        self.lanes[ticket.lane]
            .answered
            .store(self.micros(), Ordering::Relaxed);
    }

    /// Notes that a call on `ticket`'s lane timed out: its connection is
    /// closed if the lane has answered nothing for [`SILENT_FOR`].
    pub(super) fn timed_out(&self, ticket: &Ticket<S::Shared>) {
        let answered = self.lanes[ticket.lane].answered.load(Ordering::Relaxed);
        let silent = Duration::from_micros(self.micros().saturating_sub(answered));
        if silent >= SILENT_FOR && self.retire(ticket) {
            tracing::warn!(
                silent_ms = silent.as_millis() as u64,
                "a Redis connection has answered nothing for {silent:?}; it is closed and replaced"
            );
        }
    }

    /// Closes the connection `ticket` was issued on, unless the lane has
    /// already moved on to another; the lane's next call takes a fresh one.
    /// Returns whether it closed it.
    pub(super) fn retire(&self, ticket: &Ticket<S::Shared>) -> bool {
        let mut connected = self.lanes[ticket.lane]
            .connected
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if connected
            .as_ref()
            .is_some_and(|filled| filled.serial == ticket.serial)
            && let Some(retired) = connected.take()
        {
            S::discard(retired.held);
            return true;
        }
        false
    }
}
