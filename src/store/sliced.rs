//! Slices of a client's limit, taken from a remote store ahead and spent
//! in this process (see [`Policy::with_slice`](crate::Policy::with_slice)):
//! [`Sliced`] wraps the layer's store when it is remote, and answers a
//! sliced check from the units in hand while they last and live.
//!
//! Each (namespace, policy, client) has a [`Slot`]: the slice in hand,
//! under a lock held for no more than arithmetic, and a second lock that
//! the one request taking a new slice holds across its store call, so
//! that the others wait for its units rather than each calling. The call
//! runs on a task of its own: a request dropped meanwhile (its client
//! gone) leaves the slice it asked for installed, to be spent or given
//! back, never stranded in the store. A request that waited and found a
//! short slice (what the store had left) spent already asks the store
//! alone, exact, rather than wait for call after call. A slice ages out
//! after its lifetime, when a task spawned with it gives back what it
//! did not use; one found aged by a request is given back then.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::{Duration, Instant};

use smallvec::SmallVec;

use super::{Check, CheckFuture, Decision, Decisions, Scope, Store, StoreError};
use crate::store::Checks;
use crate::store::UNSET;

/// The longest a slice lives, whatever its window.
const MAX_LIFETIME: Duration = Duration::from_secs(1);

/// Clients with a slot at once, past which a new client's checks go to
/// the store one by one, exact: a flood of clients cannot grow the table
/// without bound (slots leave it as their slices age out).
const MAX_SLOTS: usize = 1_000_000;

/// How long a slice of `check` lives: a tenth of its window, at most
/// [`MAX_LIFETIME`].
pub(crate) fn lifetime(check: &Check) -> Duration {
    (check.window() / 10).clamp(Duration::from_millis(1), MAX_LIFETIME)
}

/// A remote store, with the slices this process holds of it.
pub(crate) struct Sliced {
    table: Arc<Table>,
}

impl Sliced {
    pub(crate) fn new(store: Arc<dyn Store>) -> Self {
        Self {
            table: Arc::new(Table {
                store,
                slots: Mutex::default(),
                exact: AtomicBool::new(false),
            }),
        }
    }
}

struct Table {
    store: Arc<dyn Store>,
    slots: Mutex<Slots>,
    /// Set when the store cannot take a slice back (it names no time for
    /// its records, or takes no settlement): from then on every check is
    /// the store's alone, since a slice it cannot take back would leave
    /// its unused units counted for a whole window.
    exact: AtomicBool,
}

/// The clients' slots. A slot leaves when its slice ages out, or when a
/// request that found it empty is done with it and no other holds it;
/// one left behind by a race is swept when the table doubles.
#[derive(Default)]
struct Slots {
    by_scope: HashMap<Scope, Arc<Slot>, foldhash::fast::RandomState>,
    sweep_at: usize,
}

/// The size at which the table is first swept.
const FIRST_SWEEP: usize = 1024;

impl Slots {
    /// Whether `slot` may leave: empty, and held by none but the table
    /// and the caller.
    fn is_idle(slot: &Arc<Slot>, held: usize) -> bool {
        Arc::strong_count(slot) <= held && slot.is_empty()
    }
}

/// One client's slice under one policy.
#[derive(Default)]
struct Slot {
    state: Mutex<State>,
    /// Held by the request that takes a new slice, across its store call.
    taking: tokio::sync::Mutex<()>,
    /// The units of the requests waiting for a slice. Past a slice's
    /// worth, a request goes to the store on its own instead: a queue
    /// one slice cannot serve would wait for call after call.
    queued: AtomicU32,
}

#[derive(Default)]
struct State {
    /// Counts the slices taken, so that what was taken from one is never
    /// put back into another.
    generation: u64,
    slice: Option<Slice>,
    /// The store's last answer to a slice's call: a request that was
    /// waiting meanwhile takes a denial or a failure as its own, and
    /// after a slice it did not get a share of, asks the store alone.
    last: Option<Last>,
}

/// The answer to a slice's store call: a slice, a denial or a failure.
struct Last {
    /// When it came.
    at: Instant,
    /// The cost it was asked at.
    cost: u32,
    answer: Result<Decision, StoreError>,
}

impl State {
    /// What the store had left at its last answer, if that was a decision
    /// within the last `lifetime` (a slice's): older, the window has moved.
    fn left_in_store(&self, lifetime: Duration) -> Option<u32> {
        let last = self
            .last
            .as_ref()
            .filter(|last| last.at.elapsed() < lifetime)?;
        last.answer
            .as_ref()
            .ok()
            .map(|decision| decision.remaining())
    }
}

/// `error` again, for another request that waited on the same call.
fn again(error: &StoreError) -> StoreError {
    match error {
        StoreError::Timeout(after) => StoreError::Timeout(*after),
        StoreError::Backend(source) => StoreError::Backend(source.to_string().into()),
        StoreError::Protocol(text) => StoreError::Protocol(text.clone()),
        StoreError::Internal(text) => StoreError::Internal(text.clone()),
        StoreError::CircuitOpen => StoreError::CircuitOpen,
        StoreError::Unsupported(what) => StoreError::Unsupported(what),
        StoreError::Full(text) => StoreError::Full(text.clone()),
    }
}

/// A request queued for a slice: its units leave the queue when it is
/// answered, or dropped.
struct Waiting {
    slot: Arc<Slot>,
    cost: u32,
    since: Instant,
}

impl Waiting {
    /// Queues `check`'s request on `slot`, unless the queue holds a
    /// slice's worth already.
    fn join(slot: Arc<Slot>, check: &Check) -> Option<Self> {
        let ahead = slot.queued.fetch_add(check.cost, Ordering::Relaxed);
        if ahead > 0 && ahead.saturating_add(check.cost) > check.slice {
            slot.queued.fetch_sub(check.cost, Ordering::Relaxed);
            return None;
        }
        Some(Self {
            slot,
            cost: check.cost,
            since: Instant::now(),
        })
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.slot.queued.fetch_sub(self.cost, Ordering::Relaxed);
    }
}

/// Units taken from the store ahead.
struct Slice {
    /// The check that took them: its cost is the slice's size.
    check: Check,
    /// When the store recorded them (what a give-back names).
    recorded_at: Duration,
    left: u32,
    /// When the slice was asked for: it lives from then.
    since: Instant,
    /// What the store answered then.
    limit: u32,
    remaining: u32,
    reset: Duration,
}

impl Slice {
    /// Whether a request of `check` may spend it: taken under the same
    /// terms. A reload, a tier or a client's own limit that changed them
    /// takes a new slice, so that none is spent under a larger limit or
    /// slice than the request's.
    fn serves(&self, check: &Check) -> bool {
        self.check.counts_as(check)
    }

    fn is_live(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.since) < lifetime(&self.check)
    }

    /// The decision of a request that took units from it: the store's
    /// answer at the take, with what is left of the slice.
    fn decision(&self, now: Instant) -> Decision {
        let elapsed = now.saturating_duration_since(self.since);
        let mut decision = Decision::new_admitted(
            self.limit,
            self.remaining.saturating_add(self.left),
            self.reset.saturating_sub(elapsed),
        )
        .with_recorded_at(self.recorded_at);
        decision.sliced = true;
        decision
    }

    /// Gives back to `store` the units not used: the record of the whole
    /// slice replaced by what was used. Nothing when every unit was.
    fn give_back(self, store: &dyn Store) -> Option<CheckFuture<()>> {
        (self.left > 0).then(|| {
            let used = u64::from(self.check.cost - self.left);
            store.settle(
                std::slice::from_ref(&self.check),
                &[self.recorded_at],
                &[used],
            )
        })
    }
}

/// Runs a give-back to its end, on its own. A store that takes no
/// settlement makes `table` exact from then on.
fn spawn_give_back(table: Weak<Table>, back: CheckFuture<()>) {
    tokio::spawn(async move {
        match back.await {
            Ok(()) => {}
            Err(StoreError::Unsupported(_)) => {
                if let Some(table) = table.upgrade() {
                    table.go_exact();
                }
            }
            Err(error) => {
                tracing::debug!(%error, "slidegate: a slice's unused units were not given back");
            }
        }
    });
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Units a request took from a slot: put back if the request is not
/// admitted after all.
struct Taken {
    slot: Arc<Slot>,
    generation: u64,
    cost: u32,
}

impl Taken {
    fn put_back(self) {
        let mut state = lock(&self.slot.state);
        if state.generation == self.generation
            && let Some(slice) = &mut state.slice
        {
            slice.left = (slice.left + self.cost).min(slice.check.cost);
        }
    }
}

impl Slot {
    /// Units for `check`'s request from the live slice, if it has them
    /// and was taken under the request's terms.
    fn take(self: &Arc<Self>, check: &Check, now: Instant) -> Option<(Taken, Decision)> {
        let cost = check.cost;
        let mut state = lock(&self.state);
        let generation = state.generation;
        let slice = state.slice.as_mut()?;
        if slice.left < cost || !slice.is_live(now) || !slice.serves(check) {
            return None;
        }
        slice.left -= cost;
        let decision = slice.decision(now);
        let taken = Taken {
            slot: self.clone(),
            generation,
            cost,
        };
        Some((taken, decision))
    }

    fn is_empty(&self) -> bool {
        lock(&self.state).slice.is_none()
    }

    /// What a slice's call, answered since `waiting` queued, says to
    /// its request of `check`: a failure or a denial at no more than its
    /// cost are its own; after a denial of more than it costs, or a slice
    /// smaller than the policy's (the store had no more) that others
    /// spent, it asks the store alone. After a whole slice others spent,
    /// nothing: it takes the next.
    fn answered_since(
        &self,
        waiting: &Waiting,
        check: &Check,
    ) -> Option<Result<Answer, StoreError>> {
        let state = lock(&self.state);
        let last = state
            .last
            .as_ref()
            .filter(|last| last.at >= waiting.since)?;
        match &last.answer {
            Err(error) => Some(Err(again(error))),
            Ok(decision) if !decision.admitted() && last.cost <= waiting.cost => {
                Some(Ok(Answer::Denied(*decision)))
            }
            Ok(decision) if decision.admitted() && last.cost >= check.slice => None,
            Ok(_) => Some(Ok(Answer::Alone)),
        }
    }

    /// Remembers the answer to a slice's call.
    fn remember(&self, cost: u32, answer: Result<Decision, StoreError>) {
        lock(&self.state).last = Some(Last {
            at: Instant::now(),
            cost,
            answer,
        });
    }
}

/// What a request's sliced check came to.
enum Answer {
    /// Units taken, from a slice in hand or a new one.
    Took(Taken, Decision),
    /// The store has fewer units left than the request costs: its
    /// decision for the request alone.
    Denied(Decision),
    /// The request waited, and the slice that came was spent by others:
    /// it asks the store alone.
    Alone,
}

impl Table {
    /// The slot of `check`'s client, made if need be; `None` when the
    /// table is full and the client has none.
    fn slot(&self, check: &Check) -> Option<Arc<Slot>> {
        let mut slots = lock(&self.slots);
        let scope = check.scope();
        if let Some(slot) = slots.by_scope.get(&scope) {
            return Some(slot.clone());
        }
        if slots.by_scope.len() >= slots.sweep_at.max(FIRST_SWEEP) {
            slots.by_scope.retain(|_, slot| !Slots::is_idle(slot, 1));
            slots.sweep_at = 2 * slots.by_scope.len();
        }
        if slots.by_scope.len() >= MAX_SLOTS {
            return None;
        }
        Some(slots.by_scope.entry(scope).or_default().clone())
    }

    /// Drops `slot`, which the caller holds, from the table when it holds
    /// no slice and no other request holds it.
    fn forget(&self, scope: &Scope, slot: &Arc<Slot>) {
        let mut slots = lock(&self.slots);
        let kept = slots
            .by_scope
            .get(scope)
            .is_some_and(|kept| Arc::ptr_eq(kept, slot));
        if kept && Slots::is_idle(slot, 2) {
            slots.by_scope.remove(scope);
        }
    }

    /// Makes every check from now on the store's alone.
    fn go_exact(&self) {
        if !self.exact.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "slidegate: the store cannot take back a slice's unused units; \
                 policies with a slice are decided by the store request by request"
            );
        }
    }

    /// [`refill`](Self::refill) on a task of its own: a request dropped
    /// while its slice is taken leaves the slice installed (the units the
    /// store recorded for it are spent or given back, not stranded there
    /// for a window), and the queue behind it is answered as if it were
    /// not. A dropped request's units go back into the slice, and one
    /// dropped before its turn asks nothing.
    async fn refill_apart(
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

    /// Units for `check` from its slot: from the slice in hand, or from a
    /// new one taken from the store by this request (the others wait for
    /// it). The slice asked for is the policy's, or what the store had
    /// left at its last answer if that is less; when the store has fewer
    /// left, what it has left; when it has fewer than the request costs,
    /// the request alone, so that a denial is the store's own.
    async fn refill(
        self: &Arc<Self>,
        waiting: &Waiting,
        check: &Check,
        answer: &tokio::sync::oneshot::Sender<Result<Answer, StoreError>>,
    ) -> Result<Answer, StoreError> {
        let slot = &waiting.slot;
        let _taking = slot.taking.lock().await;
        if answer.is_closed() {
            // The request is gone: nothing to take for it.
            return Ok(Answer::Alone);
        }
        if let Some((taken, decision)) = slot.take(check, Instant::now()) {
            return Ok(Answer::Took(taken, decision));
        }
        if let Some(answer) = slot.answered_since(waiting, check) {
            return answer;
        }
        let (old, left_in_store, generation) = {
            let mut state = lock(&slot.state);
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
                    slot.remember(check.cost, Err(again(&error)));
                    self.forget(&asked.scope(), slot);
                    return Err(error);
                }
            };
            if decision.admitted() {
                slot.remember(size, Ok(decision));
                return Ok(self.install(slot, asked, check.cost, decision, (since, generation)));
            }
            let fewer = if first && decision.remaining() >= check.cost {
                decision.remaining().min(size)
            } else {
                check.cost
            };
            if fewer >= size {
                slot.remember(size, Ok(decision));
                self.forget(&asked.scope(), slot);
                return Ok(Answer::Denied(decision));
            }
            size = fewer;
            first = false;
        }
    }

    /// Keeps the slice `taken` (its cost the slice's size), asked for at
    /// `since` when the slot was at `generation`, as the slot's, less the
    /// `cost` of the request that took it, and schedules its give-back.
    fn install(
        self: &Arc<Self>,
        slot: &Arc<Slot>,
        taken: Check,
        cost: u32,
        decision: Decision,
        (since, asked_at): (Instant, u64),
    ) -> Answer {
        // Units no slice holds: nothing to put back.
        let alone = || Taken {
            slot: slot.clone(),
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
            let mut state = lock(&slot.state);
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
        let aged = slot.clone();
        tokio::spawn(async move {
            tokio::time::sleep(lifetime).await;
            age(&table, &aged, generation);
        });
        let (taken, decision) = (
            Taken {
                slot: slot.clone(),
                generation,
                cost,
            },
            mine,
        );
        Answer::Took(taken, decision)
    }
}

/// How far a request's check has come: decided by the store (unsliced,
/// its client found no room in the table, or a slice's worth of requests
/// wait for a slice already), units taken, or waiting for a slice.
enum Part {
    Store,
    Took(Taken, Decision),
    Short(Waiting),
}

type Parts = SmallVec<[Part; 2]>;

impl Store for Sliced {
    fn check(&self, checks: &[Check]) -> CheckFuture {
        if checks.iter().all(|check| check.slice == 0) || self.table.exact.load(Ordering::Relaxed) {
            return self.table.store.check(checks);
        }
        let now = Instant::now();
        let mut short = false;
        let parts: Parts = checks
            .iter()
            .map(|check| {
                let slot = (check.slice > 0).then(|| self.table.slot(check)).flatten();
                let Some(slot) = slot else {
                    return Part::Store;
                };
                if let Some((taken, decision)) = slot.take(check, now) {
                    return Part::Took(taken, decision);
                }
                match Waiting::join(slot, check) {
                    Some(waiting) => {
                        short = true;
                        Part::Short(waiting)
                    }
                    None => Part::Store,
                }
            })
            .collect();
        if !short {
            return finish(&self.table, checks, parts);
        }
        let table = self.table.clone();
        let checks: Checks = checks.iter().cloned().collect();
        CheckFuture::new(async move {
            let mut parts = parts;
            for (index, check) in checks.iter().enumerate() {
                if !matches!(parts[index], Part::Short(_)) {
                    continue;
                }
                // A check asked alone goes to the store with the rest.
                let Part::Short(waiting) = std::mem::replace(&mut parts[index], Part::Store) else {
                    continue;
                };
                match table.clone().refill_apart(waiting, check.clone()).await {
                    Ok(Answer::Took(taken, decision)) => parts[index] = Part::Took(taken, decision),
                    Ok(Answer::Alone) => {}
                    Ok(Answer::Denied(decision)) => {
                        return Ok(denied(parts, &checks, index, decision));
                    }
                    Err(error) => {
                        put_back(parts);
                        return Err(error);
                    }
                }
            }
            finish(&table, &checks, parts).await
        })
    }

    fn peek(&self, checks: &[Check]) -> CheckFuture {
        self.table.store.peek(checks)
    }

    /// A sliced check's units go back into the slice they came from,
    /// while it lives; after, the request stays counted.
    fn refund(&self, checks: &[Check], recorded_at: &[Duration]) -> CheckFuture<()> {
        if checks.iter().all(|check| check.slice == 0) {
            return self.table.store.refund(checks, recorded_at);
        }
        if let Some(error) = super::unpaired_refund(checks, recorded_at) {
            return CheckFuture::ready(Err(error));
        }
        let mut rest = Checks::new();
        let mut times = SmallVec::<[Duration; 2]>::new();
        for (check, &at) in checks.iter().zip(recorded_at) {
            if check.slice == 0 {
                rest.push(check.clone());
                times.push(at);
            } else {
                self.table.refund_into_slice(check, at);
            }
        }
        if rest.is_empty() {
            return CheckFuture::ready(Ok(()));
        }
        self.table.store.refund(&rest, &times)
    }

    fn settle(&self, checks: &[Check], recorded_at: &[Duration], costs: &[u64]) -> CheckFuture<()> {
        self.table.store.settle(checks, recorded_at, costs)
    }

    fn renew(&self, checks: &[Check]) -> CheckFuture<Vec<bool>> {
        self.table.store.renew(checks)
    }

    /// Drops the slices in hand of the checks' clients (the store forgets
    /// their units) before the store resets them.
    fn reset(&self, checks: &[Check]) -> CheckFuture<()> {
        for check in checks.iter().filter(|check| check.slice > 0) {
            let slot = lock(&self.table.slots)
                .by_scope
                .get(&check.scope())
                .cloned();
            if let Some(slot) = slot {
                let mut state = lock(&slot.state);
                state.generation += 1;
                state.slice = None;
                state.last = None;
            }
        }
        self.table.store.reset(checks)
    }

    fn is_remote(&self) -> bool {
        self.table.store.is_remote()
    }

    fn shared_state(&self) -> Option<Arc<dyn std::any::Any + Send + Sync>> {
        self.table.store.shared_state()
    }

    fn recoveries(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        self.table.store.recoveries()
    }
}

impl Table {
    fn refund_into_slice(&self, check: &Check, at: Duration) {
        let slot = lock(&self.slots).by_scope.get(&check.scope()).cloned();
        let Some(slot) = slot else {
            return;
        };
        let mut state = lock(&slot.state);
        if let Some(slice) = state.slice.as_mut().filter(|slice| slice.recorded_at == at) {
            slice.left = (slice.left + check.cost).min(slice.check.cost);
        }
    }
}

/// Every sliced check of the request has its units: the others go to the
/// store, and the request stands or falls with its answer.
fn finish(table: &Table, checks: &[Check], parts: Parts) -> CheckFuture {
    let local: Option<Decisions> = parts
        .iter()
        .map(|part| match part {
            Part::Took(_, decision) => Some(*decision),
            _ => None,
        })
        .collect();
    if let Some(decisions) = local {
        return CheckFuture::ready(Ok(decisions));
    }
    let rest: Checks = checks
        .iter()
        .zip(&parts)
        .filter(|(_, part)| matches!(part, Part::Store))
        .map(|(check, _)| check.clone())
        .collect();
    match table.store.check(&rest).into_ready() {
        Ok(answer) => CheckFuture::ready(merged(parts, answer)),
        Err(later) => CheckFuture::new(async move { merged(parts, later.await) }),
    }
}

/// The store's decisions of the unsliced checks, in their places among
/// the slices' own; a denial puts the slices' units back.
fn merged(parts: Parts, answer: Result<Decisions, StoreError>) -> Result<Decisions, StoreError> {
    let decided = match answer {
        Ok(decided) => decided,
        Err(error) => {
            put_back(parts);
            return Err(error);
        }
    };
    let admitted = decided.iter().all(|decision| decision.admitted());
    let mut decided = decided.iter();
    let mut decisions = Decisions::new();
    for part in parts {
        let decision = match part {
            Part::Took(taken, mut decision) => {
                if !admitted {
                    taken.put_back();
                    decision.admitted = false;
                    decision.recorded_at_us = UNSET;
                }
                decision
            }
            _ => *decided
                .next()
                .ok_or_else(|| StoreError::Protocol("fewer decisions than checks".to_owned()))?,
        };
        decisions.push(decision);
    }
    Ok(decisions)
}

/// The decisions of a request whose check at `index` the store denied
/// (`decision`): the units its other checks took go back, and checks the
/// store was not asked about say nothing is known to be spent.
fn denied(parts: Parts, checks: &[Check], index: usize, decision: Decision) -> Decisions {
    parts
        .into_iter()
        .zip(checks)
        .enumerate()
        .map(|(at, (part, check))| match part {
            _ if at == index => decision,
            Part::Took(taken, mut decision) => {
                taken.put_back();
                decision.admitted = false;
                decision.recorded_at_us = UNSET;
                decision
            }
            Part::Store | Part::Short(_) => {
                Decision::new_denied(check.limit(), check.limit(), Duration::ZERO, None)
            }
        })
        .collect()
}

/// Puts back the units the parts took.
fn put_back(parts: Parts) {
    for part in parts {
        if let Part::Took(taken, _) = part {
            taken.put_back();
        }
    }
}

/// Gives back the slice of `generation` in `slot` when it has aged out,
/// and drops the slot from the table when nothing else took its place.
fn age(table: &Weak<Table>, slot: &Arc<Slot>, generation: u64) {
    let Some(table) = table.upgrade() else {
        return;
    };
    let slice = {
        let mut state = lock(&slot.state);
        if state.generation != generation {
            return;
        }
        state.slice.take()
    };
    let Some(slice) = slice else {
        return;
    };
    let scope = slice.check.scope();
    if let Some(back) = slice.give_back(&*table.store) {
        spawn_give_back(Arc::downgrade(&table), back);
    }
    table.forget(&scope, slot);
}

impl Drop for Table {
    fn drop(&mut self) {
        if tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        let slots = self.slots.get_mut().unwrap_or_else(PoisonError::into_inner);
        for slot in std::mem::take(&mut slots.by_scope).into_values() {
            let slice = lock(&slot.state).slice.take();
            if let Some(back) = slice.and_then(|slice| slice.give_back(&*self.store)) {
                // The table is going: nothing to make exact.
                spawn_give_back(Weak::new(), back);
            }
        }
    }
}

#[cfg(test)]
mod tests;
