//! [`RedisStoreBuilder`]: how a [`RedisStore`] is configured.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use deadpool_redis::redis::Script;

use super::batch::Queue;
use super::library::Library;
use super::{
    Connections, DEFAULT_CONNECTIONS, DEFAULT_PREFIX, DEFAULT_TIMEOUT, Inner, RedisPool, RedisStore,
};
use crate::clock::Clock;

/// Why [`RedisStoreBuilder::build`] refused: the key prefix holds `{` or
/// `}`, which would become every key's Redis Cluster hash tag and put
/// every client in one slot.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "a RedisStore prefix must not hold braces (it would become the cluster hash tag): {prefix:?}"
)]
pub struct PrefixError {
    prefix: String,
}

/// Configures a [`RedisStore`].
#[must_use]
pub struct RedisStoreBuilder {
    pool: RedisPool,
    connections: usize,
    batch: bool,
    prefix: String,
    timeout: Duration,
    clock: Option<Box<dyn Clock>>,
}

impl fmt::Debug for RedisStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStoreBuilder")
            .field("connections", &self.connections)
            .field("prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl RedisStoreBuilder {
    pub(super) fn new(pool: RedisPool) -> Self {
        Self {
            pool,
            connections: DEFAULT_CONNECTIONS,
            batch: true,
            prefix: DEFAULT_PREFIX.to_owned(),
            timeout: DEFAULT_TIMEOUT,
            clock: None,
        }
    }

    /// Prefixes every key (default `slidegate`), so several applications can
    /// share one Redis.
    ///
    /// A prefix holding `{` or `}` is refused by [`build`](Self::build):
    /// it would become every key's Redis Cluster hash tag and put every
    /// client in one slot.
    ///
    /// ```no_run
    /// # fn demo(pool: slidegate::deadpool_redis::Pool) -> Result<(), slidegate::store::PrefixError> {
    /// let store = slidegate::store::RedisStore::builder(pool).with_prefix("shop").build()?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// How many of the pool's connections the store holds and shares
    /// between concurrent checks (default 1, at least 1, at most the
    /// pool's maximum size). One multiplexed connection pipelines every
    /// check in flight; more spread the work of reading replies over more
    /// tasks, for runtimes with many worker threads.
    ///
    /// ```no_run
    /// # fn demo(pool: slidegate::deadpool_redis::Pool) {
    /// let store = slidegate::store::RedisStore::builder(pool).with_connections(2).build().unwrap();
    /// # }
    /// ```
    pub fn with_connections(mut self, connections: usize) -> Self {
        self.connections = connections;
        self
    }

    /// Whether checks that arrive while calls are in flight are decided
    /// together by one script call (default on); a check that finds no
    /// call in flight is sent at once. On a cluster, where a
    /// call must stay in one slot, each slot batches on its own: the checks
    /// of one client (a busy one, a global limit) share a call. Each check is still decided
    /// all-or-nothing on its own, in arrival order, with its own timeout
    /// and its own error. Off, every check is its own call, pipelined with
    /// the others in flight.
    ///
    /// ```no_run
    /// # fn demo(pool: slidegate::deadpool_redis::Pool) {
    /// let store = slidegate::store::RedisStore::builder(pool).with_batch(false).build().unwrap();
    /// # }
    /// ```
    pub fn with_batch(mut self, batch: bool) -> Self {
        self.batch = batch;
        self
    }

    /// Bounds each call, from taking a connection to the reply (default
    /// 50 ms). Past it the call fails with [`StoreError::Timeout`](crate::store::StoreError::Timeout).
    ///
    /// One case waits longer: a call that finds the check library missing
    /// (a fresh or restarted Redis, a new node, `FUNCTION FLUSH`) loads it
    /// and is sent again, and it and the checks queued while a load is
    /// under way wait up to 2 s more for that, rather than fail as though
    /// Redis were down (where a policy that fails open would admit them
    /// uncounted).
    ///
    /// The pool's connections also have redis-rs's own response timeout
    /// (500 ms unless the pool was built with another); when that is the
    /// shorter, it ends the call first, with the same error. Pools made
    /// by `RedisSettings::store` (feature `config`) have none on a single
    /// server or Sentinel, and the store's own on a cluster, so the
    /// store's timeout is the one that counts; so does a pool made from a
    /// `SentinelClient`, and one made from a `ClusterClient` built with the
    /// response timeout you choose (see [`RedisPool`]).
    ///
    /// ```no_run
    /// # fn demo(pool: slidegate::deadpool_redis::Pool) {
    /// use std::time::Duration;
    ///
    /// let store = slidegate::store::RedisStore::builder(pool).with_timeout(Duration::from_millis(20)).build().unwrap();
    /// # }
    /// ```
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// **For tests only** (feature `test-util`): passes `clock`'s time to
    /// the script instead of letting it read Redis's `TIME`, so window
    /// edges can be tested deterministically. Production stores must not
    /// set this: it would make application servers' clocks part of the
    /// limit. Because Redis still expires keys on its own clock, keys
    /// written at a given time live a minute longer than their windows
    /// need.
    ///
    /// ```no_run
    /// # fn demo(pool: slidegate::deadpool_redis::Pool) {
    /// let clock = slidegate::clock::FakeClock::new(1_000_000);
    /// let store = slidegate::store::RedisStore::builder(pool).with_clock(clock.clone()).build().unwrap();
    /// # }
    /// ```
    #[cfg(feature = "test-util")]
    pub fn with_clock(mut self, clock: impl Clock) -> Self {
        self.clock = Some(Box::new(clock));
        self
    }

    /// Builds the store; the script is hashed once here.
    ///
    /// # Errors
    ///
    /// If the [prefix](Self::with_prefix) holds `{` or `}`.
    pub fn build(self) -> Result<RedisStore, PrefixError> {
        if self.prefix.contains(['{', '}']) {
            return Err(PrefixError {
                prefix: self.prefix,
            });
        }
        let script = Script::new(super::script::source());
        let count = self.connections.min(self.pool.status().max_size);
        let connections = Connections::new(&self.pool, count);
        let queue = self.batch.then(|| Queue::new(&connections));
        Ok(RedisStore {
            inner: Arc::new(Inner {
                pool: self.pool,
                connections,
                queue,
                library: Library::new(&script),
                recoveries: super::recoveries::Recoveries::new(),
                script,
                prefix: self.prefix,
                timeout: self.timeout,
                clock: self.clock,
            }),
        })
    }
}

#[cfg(test)]
mod tests {
    use deadpool_redis::{Config, Runtime};

    use super::*;

    #[test]
    fn a_prefix_with_braces_is_refused_at_build() {
        let pool = || {
            Config::from_url("redis://127.0.0.1:1/")
                .create_pool(Some(Runtime::Tokio1))
                .unwrap()
        };
        let error = RedisStore::builder(pool())
            .with_prefix("shop{1}")
            .with_timeout(Duration::from_millis(5))
            .build()
            .unwrap_err();
        assert!(error.to_string().contains("shop{1}"), "{error}");
        assert!(
            RedisStore::builder(pool())
                .with_prefix("shop")
                .build()
                .is_ok()
        );
    }
}
