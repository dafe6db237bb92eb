//! The tables of [`Store::entries`](crate::store::Store::entries): one
//! hash per table, `<prefix>:<table>`, read and written with plain hash
//! commands within the store's timeout.

use std::collections::HashMap;

use deadpool_redis::redis::{Cmd, FromRedisValue, cmd};

use super::lanes::{Lanes, Source};
use super::run::{Failed, call_ended, ticket};
use super::{Connections, RedisStore};
use crate::store::StoreFuture;

/// Removes a hash's field only while it holds the value given.
const REMOVE_IF_HOLDING: &str = "if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then \
     redis.call('HDEL', KEYS[1], ARGV[1]) end return 0";

impl RedisStore {
    /// The hash that holds `table`.
    fn table_key(&self, table: &str) -> String {
        format!("{}:{table}", self.inner.prefix)
    }

    /// `HGETALL` of `table`.
    pub(super) fn hash_entries(&self, table: &str) -> StoreFuture<Vec<(String, String)>> {
        let mut command = cmd("HGETALL");
        command.arg(self.table_key(table));
        let run = self.command::<HashMap<String, String>>(command);
        StoreFuture::new(async move { Ok(run.await?.into_iter().collect()) })
    }

    /// `HSET` of `field` in `table`.
    pub(super) fn hash_set(&self, table: &str, field: &str, value: &str) -> StoreFuture<()> {
        let mut command = cmd("HSET");
        command.arg(self.table_key(table)).arg(field).arg(value);
        self.command::<()>(command)
    }

    /// `HDEL` of `field` in `table`; when `holding` is given, only while
    /// the field holds it (checked and removed in one script).
    pub(super) fn hash_remove(
        &self,
        table: &str,
        field: &str,
        holding: Option<&str>,
    ) -> StoreFuture<()> {
        let key = self.table_key(table);
        let Some(holding) = holding else {
            let mut command = cmd("HDEL");
            command.arg(key).arg(field);
            return self.command::<()>(command);
        };
        let mut command = cmd("EVAL");
        command
            .arg(REMOVE_IF_HOLDING)
            .arg(1)
            .arg(key)
            .arg(field)
            .arg(holding);
        self.command::<()>(command)
    }

    /// `command`'s reply, within the store's timeout from the first poll.
    fn command<T: FromRedisValue + Send + 'static>(&self, command: Cmd) -> StoreFuture<T> {
        let inner = self.inner.clone();
        StoreFuture::new(async move {
            let deadline = tokio::time::Instant::now() + inner.timeout;
            let reply =
                on_lanes!(&inner.connections, lanes => sent(lanes, &command, deadline).await);
            inner.note(&reply);
            reply.map_err(|failed| inner.store_error(failed))
        })
    }
}

/// `command` sent on one of `lanes` by `deadline`.
async fn sent<S: Source, T: FromRedisValue>(
    lanes: &Lanes<S>,
    command: &Cmd,
    deadline: tokio::time::Instant,
) -> Result<T, Failed> {
    let mut ticket = ticket(lanes, deadline).await?;
    let reply =
        tokio::time::timeout_at(deadline, command.query_async::<T>(&mut ticket.connection)).await;
    call_ended(lanes, &ticket, reply)
}
