//! Checks queued at the same moment, decided by one script call.
//!
//! A check joins the queue; the first to find it empty spawns a flush,
//! which first lets every task that is ready run (one yield, no timer),
//! then takes the whole queue and sends it as one `FCALL` of the batch
//! function (or several, for more than 32 policies in all). The script
//! decides the requests in queue order, each
//! all-or-nothing on its own, and answers each separately: one request's
//! error leaves the others' decisions standing. A check that finds no
//! company (alone in the queue, or alone in its slot on a cluster) is
//! handed back, and its own task sends it as usual.

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

/// What a flush tells a queued check.
pub(super) enum Verdict {
    /// Decided in a batch.
    Decided(CheckOutcome),
    /// Not batched: the check's own task sends it.
    Alone(Call),
}

/// A check waiting for its flush.
pub(super) struct Queued {
    pub(super) call: Call,
    pub(super) answer: oneshot::Sender<Verdict>,
}

/// The checks waiting for the next flush.
pub(super) struct Queue {
    waiting: Mutex<Vec<Queued>>,
    /// Whether a flush groups the checks by slot (on a cluster, where a
    /// call stays in one slot).
    by_slot: bool,
}

impl Queue {
    /// An empty queue, for the store's `connections`.
    pub(super) fn new(connections: &Connections) -> Self {
        Self {
            waiting: Mutex::default(),
            by_slot: connections.is_cluster(),
        }
    }

    /// Queues `call`; returns where its answer comes, and whether the queue
    /// was empty, in which case the caller must spawn a flush.
    pub(super) fn push(&self, call: Call) -> (oneshot::Receiver<Verdict>, bool) {
        let (answer, receiver) = oneshot::channel();
        let mut waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        waiting.push(Queued { call, answer });
        (receiver, waiting.len() == 1)
    }

    /// Everything queued so far.
    pub(super) fn take(&self) -> Vec<Queued> {
        mem::take(&mut *self.waiting.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// The most policies one batch call decides, over all its requests: a
/// flood of queued checks goes as several calls, split by the work they
/// ask for (each policy's is bounded, see `lua/driver.lua`), so that no
/// single script holds Redis, and every other client of it, for long.
const MAX_BATCH_POLICIES: usize = 32;

impl Inner {
    /// The decisions on `call`, batched with other requests' calls when
    /// the store batches.
    pub(super) async fn check(
        self: Arc<Self>,
        call: Call,
        deadline: tokio::time::Instant,
    ) -> CheckOutcome {
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

    /// Sends every queued check. On a cluster, where a call must stay in
    /// one slot, checks are grouped by slot, and each group is sent on its
    /// own; a check whose keys span slots goes alone (and fails alone).
    async fn flush(self: Arc<Self>) {
        // Every task ready now runs first, and may queue its check.
        tokio::task::yield_now().await;
        let Some(queue) = &self.queue else { return };
        let queued = queue.take();
        if !queue.by_slot {
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
            ("flush", std::mem::size_of_val(&inner.clone().flush())),
        ];
        for (future, size) in sizes {
            assert!(size <= 2048, "the future of `{future}` is {size} bytes");
        }
    }
}
