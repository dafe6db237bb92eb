//! Taking a new slice from the store: one request calls, on a task of
//! its own, and the requests queued behind it share what it brings.

use std::sync::Arc;
use std::time::Instant;

use super::entry::{Answer, Entry, Taken, Waiting};
use super::give_back::{Slice, age, spawn_give_back};
use super::table::Table;
use super::{lifetime, lock};
use crate::store::UNSET;
use crate::store::{Check, Decision, Store, StoreError};

impl Table {
    /// [`refill`](Self::refill) on a task of its own: a request dropped
    /// while its slice is taken leaves the slice installed (the units the
    /// store recorded for it are spent or given back, not stranded there
    /// for a window), and the queue behind it is answered as if it were
    /// not. A dropped request's units go back into the slice, and one
    /// dropped before its turn asks nothing.
    pub(super) async fn refill_apart(
        self: Arc<Self>,
        waiting: Waiting,
        check: Check,
    ) -> Result<Answer, StoreError> {
        let (answer, answered) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let refilled = self.refill(&waiting, &check, &answer).await;
            if let Err(Ok(Answer::Took(taken, _))) = answer.send(refilled) {
                taken.put_back();
            }
        });
        answered.await.unwrap_or_else(|_| {
            Err(StoreError::Internal(
                "a slice's call ended without an answer".to_owned(),
            ))
        })
    }

    /// Units for `check` from its entry: from the slice in hand, or from a
    /// new one taken from the store by this request (the others wait for
    /// it). The slice asked for is the policy's, or what the store had
    /// left at its last answer if that is less; when the store has fewer
    /// left, what it has left; when it has fewer than the request costs,
    /// the request alone, so that a denial is the store's own.
    pub(super) async fn refill(
        self: &Arc<Self>,
        waiting: &Waiting,
        check: &Check,
        answer: &tokio::sync::oneshot::Sender<Result<Answer, StoreError>>,
    ) -> Result<Answer, StoreError> {
        let entry = &waiting.entry;
        let _taking = entry.taking.lock().await;
        if answer.is_closed() {
            // The request is gone: nothing to take for it.
            return Ok(Answer::Alone);
        }
        if let Some((taken, decision)) = entry.take(check, Instant::now()) {
            return Ok(Answer::Took(taken, decision));
        }
        if let Some(answer) = entry.answered_since(waiting, check) {
            return answer;
        }
        let (old, left_in_store, generation) = {
            let mut state = lock(&entry.state);
            (
                state.slice.take(),
                state.left_in_store(lifetime(check)),
                state.generation,
            )
        };
        if let Some(back) = old.and_then(|old| old.give_back(&*self.store)) {
            spawn_give_back(Arc::downgrade(self), back);
        }
        let mut asked = check.clone();
        let mut size = left_in_store
            .map_or(check.slice, |left| left.min(check.slice))
            .max(check.cost);
        let mut first = true;
        // Each attempt asks for fewer units, down to the request's cost:
        // at most three calls, one when the store's last answer holds.
        loop {
            asked.cost = size;
            let since = Instant::now();
            let answer = self.store.check(std::slice::from_ref(&asked)).await;
            let decision = match answer.and_then(|decisions| {
                decisions
                    .first()
                    .copied()
                    .ok_or_else(|| StoreError::Protocol("no decision for a slice".to_owned()))
            }) {
                Ok(decision) => decision,
                Err(error) => {
                    entry.remember(check.cost, Err(error.clone()));
                    self.forget(&asked.scope(), entry);
                    return Err(error);
                }
            };
            if decision.admitted() {
                entry.remember(size, Ok(decision));
                return Ok(self.install(entry, asked, check.cost, decision, (since, generation)));
            }
            let fewer = if first && decision.remaining() >= check.cost {
                decision.remaining().min(size)
            } else {
                check.cost
            };
            if fewer >= size {
                entry.remember(size, Ok(decision));
                self.forget(&asked.scope(), entry);
                return Ok(Answer::Denied(decision));
            }
            size = fewer;
            first = false;
        }
    }

    /// Keeps the slice `taken` (its cost the slice's size), asked for at
    /// `since` when the entry was at `generation`, as the entry's, less the
    /// `cost` of the request that took it, and schedules its give-back.
    pub(super) fn install(
        self: &Arc<Self>,
        entry: &Arc<Entry>,
        taken: Check,
        cost: u32,
        decision: Decision,
        (since, asked_at): (Instant, u64),
    ) -> Answer {
        // Units no slice holds: nothing to put back.
        let alone = || Taken {
            entry: entry.clone(),
            generation: u64::MAX,
            cost: 0,
        };
        let Some(recorded_at) = decision.recorded_at() else {
            // A store that names no time takes no give-back: the slice is
            // this request's alone, and the next are asked at their cost.
            self.go_exact();
            return Answer::Took(alone(), decision);
        };
        let slice = Slice {
            // The request that took it spends its cost at once, under the
            // same lock that makes the slice seen: no other can empty it
            // first.
            left: taken.cost - cost,
            // Its give-back names it by an id of its own.
            check: taken.with_settlement_id(),
            recorded_at,
            since,
            limit: decision.limit(),
            remaining: decision.remaining(),
            reset: decision.reset(),
        };
        let lifetime = lifetime(&slice.check);
        let mine = slice.decision(since);
        let generation = {
            let mut state = lock(&entry.state);
            if state.generation != asked_at {
                // A reset came during the call: the store may have counted
                // the slice before it (gone with the reset) or after.
                // Neither spent nor given back (a give-back could take
                // units from the fresh count), nor refunded (its record
                // is the whole slice's): the slice is this request's alone.
                let mut decision = decision;
                decision.recorded_at_us = UNSET;
                return Answer::Took(alone(), decision);
            }
            state.generation += 1;
            state.slice = Some(slice);
            state.generation
        };
        let table = Arc::downgrade(self);
        let aged = entry.clone();
        tokio::spawn(async move {
            tokio::time::sleep(lifetime).await;
            age(&table, &aged, generation);
        });
        let (taken, decision) = (
            Taken {
                entry: entry.clone(),
                generation,
                cost,
            },
            mine,
        );
        Answer::Took(taken, decision)
    }
}
