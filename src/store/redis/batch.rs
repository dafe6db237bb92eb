//! Natural batching: a check that finds no call in flight goes to Redis
//! at once, from its own task; checks that arrive while one is in flight
//! wait, and go together as the next call when it returns.
//!
//! The store keeps a *line* (on a cluster, one per slot, since a call
//! stays in one slot). A check that finds its line idle marks it busy and
//! sends its own call: no queue, no spawned task, no channel. Checks that
//! find it busy join its queue. When the busy call ends (answered, failed,
//! timed out or dropped with its request), whatever queued meanwhile is
//! sent by a task spawned for it, as one `FCALL` of the batch function (or
//! several, for more than 32 policies in all), and that task goes on
//! sending what queues behind each call until the queue is found empty:
//! alone, a check waits for nothing; under load, batches grow with it.
//! The script decides the requests of a batch in queue order, each
//! all-or-nothing on its own, and answers each separately: one request's
//! error leaves the others' decisions standing.

use std::collections::HashMap;
use std::mem;
use std::sync::{Arc, Mutex};

use deadpool_redis::redis::Value;
use deadpool_redis::redis::cluster_routing::Slot;
use tokio::sync::oneshot;

use super::call::{BatchArguments, Call};
use super::lanes::{Lanes, Source};
use super::library::Library;
use super::reply::{batched_outcome, replies, store_error_of};
use super::run::{Failed, Routed, call_ended, sized_fcall, ticket};
use super::{Connections, Inner};
use crate::store::{CheckOutcome, StoreError};

/// What a queued check is told.
pub(super) enum Verdict {
    /// Decided in a batch.
    Decided(CheckOutcome),
    /// Not decided by the batch: the check's own task sends it alone.
    Alone(Call),
}

/// A check waiting for the call in flight on its line to end.
pub(super) struct Queued {
    pub(super) call: Call,
    pub(super) answer: oneshot::Sender<Verdict>,
}

/// Which line a check takes: `None` on a single server, the keys' slot on
/// a cluster.
type LineId = Option<Slot>;

/// One line: whether a call is in flight on it, and what waits for it.
#[derive(Default)]
struct Line {
    busy: bool,
    waiting: Vec<Queued>,
}

/// The lines of a store.
enum Lines {
    /// A single server: one line.
    One(Line),
    /// A cluster: a line per slot with a call in flight, dropped when idle.
    BySlot(HashMap<Slot, Line>),
}

/// The store's lines, under one lock held only to look or push.
pub(super) struct Queue {
    lines: Mutex<Lines>,
}

/// What a check finds on its line.
enum Turn {
    /// The line was idle: it is now this check's to send on.
    Go(Call),
    /// A call is in flight: the check waits for this answer.
    Wait(oneshot::Receiver<Verdict>),
}

impl Queue {
    /// Idle lines, for the store's `connections`.
    pub(super) fn new(connections: &Connections) -> Self {
        let lines = if connections.is_cluster() {
            Lines::BySlot(HashMap::new())
        } else {
            Lines::One(Line::default())
        };
        Self {
            lines: Mutex::new(lines),
        }
    }

    /// The line of `call`; `None` for a call that cannot share one (its
    /// keys span slots on a cluster), which goes alone.
    fn line_of(&self, call: &Call) -> Option<LineId> {
        match &*self.lock() {
            Lines::One(_) => Some(None),
            Lines::BySlot(_) => slot(call).map(Some),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Lines> {
        self.lines.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes `line` for `call` if it is idle, or queues `call` on it.
    fn enter(&self, line: LineId, call: Call) -> Turn {
        let mut lines = self.lock();
        let line = match (&mut *lines, line) {
            (Lines::One(one), _) => one,
            (Lines::BySlot(slots), Some(slot)) => slots.entry(slot).or_default(),
            (Lines::BySlot(_), None) => return Turn::Go(call),
        };
        if !line.busy {
            line.busy = true;
            return Turn::Go(call);
        }
        let (answer, receiver) = oneshot::channel();
        line.waiting.push(Queued { call, answer });
        Turn::Wait(receiver)
    }

    /// Ends the turn of the call in flight on `line`: returns what queued
    /// behind it, for the caller to send (the line stays busy), or `None`,
    /// and the line is idle.
    fn next(&self, line: LineId) -> Option<Vec<Queued>> {
        let mut lines = self.lock();
        match (&mut *lines, line) {
            (Lines::One(one), _) => take_or_idle(one),
            (Lines::BySlot(slots), Some(slot)) => {
                let next = take_or_idle(slots.get_mut(&slot)?);
                if next.is_none() {
                    slots.remove(&slot);
                }
                next
            }
            (Lines::BySlot(_), None) => None,
        }
    }
}

/// What waits on `line`, which stays busy to send it, or nothing, and the
/// line is idle.
fn take_or_idle(line: &mut Line) -> Option<Vec<Queued>> {
    // Those whose callers stopped waiting (their fail mode has answered)
    // must count nothing.
    line.waiting.retain(|queued| !queued.answer.is_closed());
    if line.waiting.is_empty() {
        line.busy = false;
        None
    } else {
        Some(mem::take(&mut line.waiting))
    }
}

/// A line's turn, held while its call is in flight: however that call
/// ends (its request dropped included), what queued behind it is sent.
struct Holding {
    inner: Arc<Inner>,
    line: LineId,
}

impl Drop for Holding {
    fn drop(&mut self) {
        let Some(queue) = &self.inner.queue else {
            return;
        };
        let Some(waiting) = queue.next(self.line) else {
            return;
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(self.inner.clone().flush(self.line, waiting));
            }
            Err(_) => {
                // Nowhere to send them: they fail, and the line is left
                // idle for the checks to come.
                fail_all(waiting, || {
                    StoreError::Internal("no Tokio runtime to send the batch on".to_owned())
                });
                while let Some(more) = queue.next(self.line) {
                    fail_all(more, || {
                        StoreError::Internal("no Tokio runtime to send the batch on".to_owned())
                    });
                }
            }
        }
    }
}

/// The flush task's hold on its line: should the task be dropped before
/// it is done (its runtime shutting down), what waits fails, and the line
/// is left idle, rather than busy for good.
struct Flushing<'a> {
    queue: &'a Queue,
    line: LineId,
    done: bool,
}

impl Drop for Flushing<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        while let Some(waiting) = self.queue.next(self.line) {
            fail_all(waiting, || {
                StoreError::Internal("the batch's task was stopped".to_owned())
            });
        }
    }
}

/// The most policies one batch call decides, over all its requests: a
/// flood of queued checks goes as several calls, split by the work they
/// ask for (each policy's is bounded, see `lua/driver.lua`), so that no
/// single script holds Redis, and every other client of it, for long.
const MAX_BATCH_POLICIES: usize = 32;

impl Inner {
    /// The decisions on `call`: sent at once when its line is idle, or
    /// else with the checks that queue behind the call in flight.
    pub(super) async fn check(
        self: Arc<Self>,
        call: Call,
        deadline: tokio::time::Instant,
    ) -> CheckOutcome {
        let Some(queue) = self.queue.as_ref().filter(|_| !self.library.refused()) else {
            return self.run(call, deadline).await;
        };
        let Some(line) = queue.line_of(&call) else {
            return self.run(call, deadline).await;
        };
        match queue.enter(line, call) {
            Turn::Go(call) => {
                let _holding = Holding {
                    inner: self.clone(),
                    line,
                };
                self.run(call, deadline).await
            }
            Turn::Wait(answer) => match tokio::time::timeout_at(deadline, answer).await {
                Ok(Ok(Verdict::Decided(outcome))) => outcome,
                Ok(Ok(Verdict::Alone(call))) => self.run(call, deadline).await,
                Ok(Err(_)) => Err(StoreError::Internal(
                    "a batched check lost its answer".to_owned(),
                )),
                Err(_) => Err(StoreError::Timeout(self.timeout)),
            },
        }
    }

    /// Sends `queued`, then what queues on `line` behind each call, until
    /// the line is found with nothing waiting and left idle.
    async fn flush(self: Arc<Self>, line: LineId, mut queued: Vec<Queued>) {
        let Some(queue) = &self.queue else { return };
        let mut flushing = Flushing {
            queue,
            line,
            done: false,
        };
        loop {
            self.clone().send(queued).await;
            match queue.next(line) {
                Some(next) => queued = next,
                None => break,
            }
        }
        flushing.done = true;
    }

    /// Sends `queued` (checks of one slot) in calls of the batch function,
    /// at most [`MAX_BATCH_POLICIES`] policies each, one after the other,
    /// so that Redis decides them in the order they were queued; a check
    /// alone goes by the single function.
    async fn send(self: Arc<Self>, mut queued: Vec<Queued>) {
        if queued.len() == 1 {
            let Queued { call, answer } = queued.pop().expect("one check");
            let deadline = tokio::time::Instant::now() + self.timeout;
            let _ = answer.send(Verdict::Decided(self.run(call, deadline).await));
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
        let replies = on_lanes!(&self.connections, lanes => self.batch_on_lane(lanes, &queued, deadline).await);
        match replies {
            Ok(replies) if replies.len() == queued.len() => {
                for (Queued { call, answer }, reply) in queued.into_iter().zip(replies) {
                    if Library::deferred(&reply) {
                        deferred.push(Queued { call, answer });
                    } else if Library::failed_in_batch(&reply) {
                        // It goes alone, for Redis to say where it failed
                        // (a batch's caught error names no line): a failed
                        // request wrote nothing but what it would write
                        // again (expired leases removed, a lost chunk's
                        // units gathered).
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
                fail_all(queued, || store_error_of(error.clone()));
            }
            Err(Failed::Timeout) => fail_all(queued, || StoreError::Timeout(self.timeout)),
        }
        deferred
    }

    /// Runs the batch function over `queued` on a lane's connection,
    /// loading the library first where it is missing; one reply per check.
    async fn batch_on_lane<S: Source>(
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

#[cfg(test)]
mod future_sizes {
    use std::time::Duration;

    use super::*;
    use crate::store::Check;
    use crate::store::redis::call::Op;
    use crate::store::redis::{RedisPool, RedisStore};

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
            (
                "flush",
                std::mem::size_of_val(&inner.clone().flush(None, Vec::new())),
            ),
        ];
        for (future, size) in sizes {
            assert!(size <= 2048, "the future of `{future}` is {size} bytes");
        }
    }
}
