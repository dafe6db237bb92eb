//! Batches: a check that finds no call of its line in flight goes to
//! Redis at once, from its own task; checks that arrive while calls are
//! in flight queue, and go together.
//!
//! The store keeps a *line* (on a cluster, one per slot, since a call
//! stays in one slot). A check that finds its line idle sends its own
//! call: no queue, no spawned task, no channel, nothing added to a lone
//! request's wait. One that finds a call in flight joins the line's
//! queue, and the first to find the queue empty spawns its flush, which
//! lets every task that is ready run (one yield, no timer), then sends
//! the whole queue as one `FCALL` of the batch function (or several, for
//! more than 32 policies in all). Calls are pipelined on the store's
//! connections: a flush does not wait for the calls in flight, so Redis
//! is kept busy under load while each call carries what queued since the
//! last. The script decides the requests of a batch in queue order, each
//! all-or-nothing on its own, and answers each separately: one request's
//! error leaves the others' decisions standing.

use std::collections::HashMap;
use std::mem;
use std::sync::{Arc, Mutex, MutexGuard};

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

/// A check waiting for its flush.
pub(super) struct Queued {
    pub(super) call: Call,
    pub(super) answer: oneshot::Sender<Verdict>,
}

/// Which line a check takes: `None` on a single server, the keys' slot on
/// a cluster.
type LineId = Option<Slot>;

/// One line: its calls in flight, and the checks waiting for a flush.
#[derive(Default)]
struct Line {
    in_flight: usize,
    waiting: Vec<Queued>,
}

impl Line {
    fn is_idle(&self) -> bool {
        self.in_flight == 0 && self.waiting.is_empty()
    }
}

/// The lines of a store.
enum Lines {
    /// A single server: one line.
    One(Line),
    /// A cluster: a line per slot in use, dropped when idle.
    BySlot(HashMap<Slot, Line>),
}

impl Lines {
    /// `id`'s line, made if need be; `None` for a check that cannot share
    /// one (its keys span slots on a cluster).
    fn get(&mut self, id: LineId) -> Option<&mut Line> {
        match (self, id) {
            (Self::One(one), _) => Some(one),
            (Self::BySlot(slots), Some(slot)) => Some(slots.entry(slot).or_default()),
            (Self::BySlot(_), None) => None,
        }
    }

    /// Forgets `id`'s line if it is idle (on a cluster).
    fn tidy(&mut self, id: LineId) {
        if let (Self::BySlot(slots), Some(slot)) = (self, id)
            && slots.get(&slot).is_some_and(Line::is_idle)
        {
            slots.remove(&slot);
        }
    }
}

/// The store's lines, under one lock held only to look, count or push.
pub(super) struct Queue {
    lines: Mutex<Lines>,
    by_slot: bool,
}

/// What a check finds on its line.
enum Turn {
    /// The line was idle: the check goes at once.
    Go(Call),
    /// Calls are in flight: the check waits for this answer, and spawns
    /// the flush if it is the first to wait.
    Wait(oneshot::Receiver<Verdict>, bool),
}

impl Queue {
    /// Idle lines, for the store's `connections`.
    pub(super) fn new(connections: &Connections) -> Self {
        let by_slot = connections.is_cluster();
        let lines = if by_slot {
            Lines::BySlot(HashMap::new())
        } else {
            Lines::One(Line::default())
        };
        Self {
            lines: Mutex::new(lines),
            by_slot,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Lines> {
        self.lines.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The line of `call`; `None` for a call that cannot share one (its
    /// keys span slots on a cluster), which goes alone.
    fn line_of(&self, call: &Call) -> Option<LineId> {
        if self.by_slot {
            slot(call).map(Some)
        } else {
            Some(None)
        }
    }

    /// Sends `call` at once on an idle line (counted in flight), or
    /// queues it.
    fn enter(&self, id: LineId, call: Call) -> Turn {
        let mut lines = self.lock();
        let Some(line) = lines.get(id) else {
            return Turn::Go(call);
        };
        if line.is_idle() {
            line.in_flight += 1;
            return Turn::Go(call);
        }
        let (answer, receiver) = oneshot::channel();
        line.waiting.push(Queued { call, answer });
        Turn::Wait(receiver, line.waiting.len() == 1)
    }

    /// Everything queued on `id`'s line, counted in flight as one call.
    fn take(&self, id: LineId) -> Vec<Queued> {
        let mut lines = self.lock();
        let Some(line) = lines.get(id) else {
            return Vec::new();
        };
        let queued = mem::take(&mut line.waiting);
        if queued.is_empty() {
            lines.tidy(id);
        } else {
            line.in_flight += 1;
        }
        queued
    }

    /// Notes that a call on `id`'s line has ended.
    fn ended(&self, id: LineId) {
        let mut lines = self.lock();
        if let Some(line) = lines.get(id) {
            line.in_flight = line.in_flight.saturating_sub(1);
        }
        lines.tidy(id);
    }
}

/// A call in flight on a line, counted until it ends however it ends
/// (its request dropped included).
struct InFlight<'a> {
    queue: &'a Queue,
    line: LineId,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.queue.ended(self.line);
    }
}

/// A flush not yet started: should its task be dropped first (its
/// runtime shutting down), what waits for it fails rather than waiting
/// for a flush that no check would spawn again.
struct Flushing<'a> {
    queue: &'a Queue,
    line: LineId,
    taken: bool,
}

impl Drop for Flushing<'_> {
    fn drop(&mut self) {
        if !self.taken {
            let stranded = self.queue.take(self.line);
            let had = !stranded.is_empty();
            fail_all(stranded, || {
                StoreError::Internal("the batch's task was stopped".to_owned())
            });
            if had {
                self.queue.ended(self.line);
            }
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
    /// else with the checks that queue beside it.
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
                let _in_flight = InFlight { queue, line };
                self.run(call, deadline).await
            }
            Turn::Wait(answer, first) => {
                if first {
                    tokio::spawn(self.clone().flush(line));
                }
                let (mut answer, mut deadline) = (answer, deadline);
                let answer = match tokio::time::timeout_at(deadline, &mut answer).await {
                    // The call it waits for is loading the library.
                    Err(_) if self.library.is_loading() => {
                        deadline = Library::load_deadline(deadline);
                        tokio::time::timeout_at(deadline, answer).await
                    }
                    answer => answer,
                };
                match answer {
                    Ok(Ok(Verdict::Decided(outcome))) => outcome,
                    Ok(Ok(Verdict::Alone(call))) => self.run(call, deadline).await,
                    Ok(Err(_)) => Err(StoreError::Internal(
                        "a batched check lost its answer".to_owned(),
                    )),
                    Err(_) => Err(StoreError::Timeout(self.timeout)),
                }
            }
        }
    }

    /// Sends what has queued on `line`, once every task that is ready has
    /// run (and may have queued its check).
    async fn flush(self: Arc<Self>, line: LineId) {
        let Some(queue) = &self.queue else { return };
        let mut flushing = Flushing {
            queue,
            line,
            taken: false,
        };
        tokio::task::yield_now().await;
        let mut queued = queue.take(line);
        flushing.taken = true;
        if queued.is_empty() {
            return;
        }
        let _in_flight = InFlight { queue, line };
        // Those whose callers stopped waiting (their fail mode has
        // answered) must count nothing.
        queued.retain(|queued| !queued.answer.is_closed());
        self.clone().send(queued).await;
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
        self.note(&replies);
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
        let mut reply = tokio::time::timeout_at(deadline, replies(&fcall, connection)).await;
        let mut deadline = deadline;
        if matches!(&reply, Ok(Err(error)) if Library::missing(error)) {
            deadline = Library::load_deadline(deadline);
            self.recoveries.lost();
            // Boxed: rare, and its future would make every batch's larger.
            let loaded = Box::pin(async {
                // Under way until the answer (see `Library::is_loading`).
                let _loading = self.library.loading();
                self.load(connection, &queued[0].call.keys[0]).await?;
                replies(&fcall, connection).await
            });
            reply = tokio::time::timeout_at(deadline, loaded).await;
        }
        if matches!(&reply, Ok(Err(error)) if Library::out_of_memory(error)) {
            // Clients already tracked are still decided; new ones get the
            // error of their own.
            let held = batch(&self.library.held_batch_function);
            reply = tokio::time::timeout_at(deadline, replies(&held, connection)).await;
        }
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
            ("flush", std::mem::size_of_val(&inner.clone().flush(None))),
        ];
        for (future, size) in sizes {
            assert!(size <= 2048, "the future of `{future}` is {size} bytes");
        }
    }
}
