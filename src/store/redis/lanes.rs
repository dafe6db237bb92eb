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
//! and the next check on it takes a fresh connection from the pool.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use deadpool_redis::redis::aio::{ConnectionLike, MultiplexedConnection};
use deadpool_redis::redis::cluster_async::ClusterConnection;
use deadpool_redis::{Connection, Pool, PoolError, cluster};

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

/// The lanes of one store, taken in turn.
pub(super) struct Lanes<S: Source> {
    source: S,
    lanes: Box<[Slot<S::Held>]>,
    next: AtomicUsize,
    /// Numbers every connection a lane takes, so that a call can retire
    /// the connection it used and not one that replaced it meanwhile.
    taken: AtomicU64,
}

/// A lane: its connection, once it has one, and a lock taken to give it
/// one, so that calls arriving together at an empty lane take one
/// connection from the pool, not one each.
struct Slot<H> {
    lane: Mutex<Option<Lane<H>>>,
    filling: tokio::sync::Mutex<()>,
}

struct Lane<H> {
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
                .map(|_| Slot {
                    lane: Mutex::new(None),
                    filling: tokio::sync::Mutex::new(()),
                })
                .collect(),
            next: AtomicUsize::new(0),
            taken: AtomicU64::new(0),
        }
    }

    /// A handle on the next lane's connection, taking one from the pool
    /// when the lane has none.
    pub(super) async fn ticket(&self) -> Result<Ticket<S::Shared>, PoolError> {
        let lane = self.next.fetch_add(1, Ordering::Relaxed) % self.lanes.len();
        if let Some(ticket) = self.share(lane) {
            return Ok(ticket);
        }
        let _filling = self.lanes[lane].filling.lock().await;
        // Filled by the call that held the lock before this one?
        if let Some(ticket) = self.share(lane) {
            return Ok(ticket);
        }
        let held = self.source.get().await?;
        let serial = self.taken.fetch_add(1, Ordering::Relaxed);
        let connection = S::share(&held);
        *self.lanes[lane]
            .lane
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(Lane { serial, held });
        Ok(Ticket {
            lane,
            serial,
            connection,
        })
    }

    fn share(&self, lane: usize) -> Option<Ticket<S::Shared>> {
        let slot = self.lanes[lane]
            .lane
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        slot.as_ref().map(|filled| Ticket {
            lane,
            serial: filled.serial,
            connection: S::share(&filled.held),
        })
    }

    /// Closes the connection `ticket` was issued on, unless the lane has
    /// already moved on to another; the lane's next call takes a fresh one.
    pub(super) fn retire(&self, ticket: &Ticket<S::Shared>) {
        let mut slot = self.lanes[ticket.lane]
            .lane
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if slot
            .as_ref()
            .is_some_and(|filled| filled.serial == ticket.serial)
            && let Some(retired) = slot.take()
        {
            S::discard(retired.held);
        }
    }
}
