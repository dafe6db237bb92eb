//! The tables of [`Store::entries`](crate::store::Store::entries): one
//! hash per table, `<prefix>:<table>`, read and written with plain hash
//! commands within the store's timeout.

use std::collections::HashMap;

use std::sync::OnceLock;

use deadpool_redis::redis::{Cmd, FromRedisValue, Script, cmd};

use super::lanes::{Lanes, Source};
use super::run::{Failed, call_ended, ticket};
use super::{Connections, RedisStore};
use crate::store::StoreFuture;

/// Removes a hash's field only while it holds the value given, by
/// `EVALSHA` (loaded with `EVAL` where Redis lacks it).
fn remove_if_holding() -> &'static Script {
    static SCRIPT: OnceLock<Script> = OnceLock::new();
    SCRIPT.get_or_init(|| Script::new(include_str!("../../../lua/remove_if_holding.lua")))
}

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
        let (field, holding) = (field.to_owned(), holding.to_owned());
        let inner = self.inner.clone();
        StoreFuture::new(async move {
            let deadline = tokio::time::Instant::now() + inner.timeout;
            let removed = on_lanes!(&inner.connections, lanes => {
                removed_if_holding(lanes, &key, &field, &holding, deadline).await
            });
            inner.note(&removed);
            removed.map_err(|failed| inner.store_error(failed))
        })
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

/// [`remove_if_holding`] run on one of `lanes` by `deadline`.
async fn removed_if_holding<S: Source>(
    lanes: &Lanes<S>,
    key: &str,
    field: &str,
    holding: &str,
    deadline: tokio::time::Instant,
) -> Result<(), Failed> {
    let mut ticket = ticket(lanes, deadline).await?;
    let mut invocation = remove_if_holding().key(key);
    invocation.arg(field).arg(holding);
    let removed = invocation.invoke_async::<()>(&mut ticket.connection);
    let reply = tokio::time::timeout_at(deadline, removed).await;
    call_ended(lanes, &ticket, reply)
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
