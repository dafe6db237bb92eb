//! One call of the library on one connection: sent within the store's
//! timeout on a lane, the library loaded where it is missing, the
//! functions for clients already held where Redis is out of memory, and
//! `EVALSHA` where Redis refuses functions.

use std::future::Future;

use tokio::time::error::Elapsed;
use tokio::time::timeout_at;

use deadpool_redis::redis::aio::{ConnectionLike, MultiplexedConnection};
use deadpool_redis::redis::cluster_async::ClusterConnection;
use deadpool_redis::redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use deadpool_redis::redis::{Cmd, ErrorKind, RedisError, RedisResult, ServerErrorKind, cmd};

use super::call::{Arguments, Call};
use super::lanes::{self, Lanes, Source};
use super::library::Library;
use super::pools::SentinelConnection;
use super::reply::{decisions, store_error_of};
use super::{Connections, Inner};
use crate::store::{CheckOutcome, StoreError};

/// Room for one numeric argument of a command, in bytes (`u64::MAX` has
/// 20 digits).
const ARGUMENT_BYTES: usize = 20;

/// How a call on a lane failed, in a form every check of a batch can share.
pub(super) enum Failed {
    Timeout,
    Redis(RedisError),
}

impl Inner {
    pub(super) async fn run(&self, call: Call, deadline: tokio::time::Instant) -> CheckOutcome {
        let packed = self.packed(&call, deadline).await?;
        decisions(&call.args, &packed)
    }

    /// The script's decisions for `call`, packed.
    pub(super) async fn packed(
        &self,
        call: &Call,
        deadline: tokio::time::Instant,
    ) -> Result<Vec<u8>, StoreError> {
        let packed =
            on_lanes!(&self.connections, lanes => self.on_lane(lanes, call, deadline).await);
        self.note(&packed);
        packed.map_err(|failed| self.store_error(failed))
    }

    /// Notes how a call ended, for [`Recoveries`](super::recoveries::Recoveries):
    /// failed where Redis was not reached, did not answer in time or
    /// cannot take calls now (a replica, a primary whose own primary is
    /// down, one still loading); answered otherwise, an error reply (out
    /// of memory, a key of another type) included.
    pub(super) fn note<T>(&self, ended: &Result<T, Failed>) {
        let unreachable = |error: &RedisError| {
            error.is_io_error()
                || error.is_connection_dropped()
                || error.is_connection_refusal()
                || matches!(
                    error.kind(),
                    ErrorKind::Server(
                        ServerErrorKind::ReadOnly
                            | ServerErrorKind::MasterDown
                            | ServerErrorKind::BusyLoading
                    )
                )
        };
        match ended {
            Err(Failed::Timeout) => self.recoveries.failed(),
            Err(Failed::Redis(error)) if unreachable(error) => self.recoveries.failed(),
            _ => self.recoveries.answered(),
        }
    }

    /// Runs the script on a lane's connection by `deadline`.
    async fn on_lane<S: Source>(
        &self,
        lanes: &Lanes<S>,
        call: &Call,
        deadline: tokio::time::Instant,
    ) -> Result<Vec<u8>, Failed>
    where
        S::Shared: Routed,
    {
        let mut ticket = ticket(lanes, deadline).await?;
        let reply = self
            .script_call(&mut ticket.connection, call, deadline)
            .await;
        call_ended(lanes, &ticket, reply)
    }

    pub(super) fn store_error(&self, failed: Failed) -> StoreError {
        match failed {
            Failed::Timeout => StoreError::Timeout(self.timeout),
            Failed::Redis(error) => store_error_of(error),
        }
    }

    /// `FCALL` by `deadline`, loading the library first where it is
    /// missing (by [`Library::load_deadline`] then); `EVALSHA` where Redis
    /// refuses functions.
    async fn script_call<C: Routed>(
        &self,
        connection: &mut C,
        call: &Call,
        deadline: tokio::time::Instant,
    ) -> Result<RedisResult<Vec<u8>>, Elapsed> {
        if self.library.refused() {
            return timeout_at(deadline, Box::pin(self.evalsha(connection, call))).await;
        }
        let fcall = self.fcall(&self.library.function, call);
        match timeout_at(deadline, fcall.query_async(connection)).await? {
            Err(error) => {
                // A load, and the call sent again, count as one under way
                // until the answer (see `Library::is_loading`).
                let loading = Library::missing(&error).then(|| {
                    self.recoveries.lost();
                    self.library.loading()
                });
                let deadline = match loading {
                    Some(_) => Library::load_deadline(deadline),
                    None => deadline,
                };
                // Boxed, as every path but the first answer: their futures
                // would make every call's larger, and it is copied at each move.
                let rest = Box::pin(self.after_error(connection, call, fcall, error));
                timeout_at(deadline, rest).await
            }
            reply => Ok(reply),
        }
    }

    /// `FCALL` of `function` for `call`.
    fn fcall(&self, function: &str, call: &Call) -> Cmd {
        // At most eleven arguments per policy (eight, and a settlement's
        // time, cost and id), and the operation (`peek`, `refund`, ...).
        let mut fcall = sized_fcall(function, &call.keys, 1 + 11 * call.args.len());
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
    pub(super) async fn load<C: Routed>(&self, connection: &mut C, key: &str) -> RedisResult<()> {
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
    pub(super) fn time(&self) -> String {
        self.clock
            .as_ref()
            .map_or_else(String::new, |clock| clock.now_micros().to_string())
    }
}

/// `FCALL function numkeys`, its buffers sized at once for `keys`, the
/// time and at most `arguments` numeric arguments after it, which the
/// caller adds.
pub(super) fn sized_fcall<'a>(
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
pub(super) async fn ticket<S: Source>(
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
pub(super) fn call_ended<S: Source, T>(
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

/// A connection of either kind that can run a command where a key lives.
pub(super) trait Routed: ConnectionLike + Send {
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
