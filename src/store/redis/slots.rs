//! A request whose checks live in several slots of a Redis Cluster (its
//! policies count under different keys, see
//! [`Policy::per`](crate::Policy::per)): one call cannot span slots, so
//! the slots are asked one after another, in the order of the request's
//! checks, and what earlier slots granted is given back when a later one
//! denies.
//!
//! No limit is ever passed: each slot's call is all or nothing on its
//! own, and a grant is in its count before the next slot is asked. The
//! slots are asked on a task of their own: the request waits at most the
//! store's timeout, as for one call, and a request dropped or given up on
//! meanwhile (answered by its fail mode) has every grant given back once
//! the task ends. A request the slots would hold for different delays is
//! given back and refused with the longest wait (each slot records a held
//! request at the time it would pass there). The price is a brief
//! over-denial: between a grant and its give-back, another request of that
//! count may be denied for units this one then returns; and a give-back
//! that fails (Redis gone between two slots) leaves its units to leave
//! with their window, as a refund that fails does. The other operations (peek, refund, settle, renew, reset)
//! stand per check, so each slot's part is sent on its own, one after
//! another.

use std::time::Duration;

use deadpool_redis::redis::cluster_routing::Slot;
use smallvec::SmallVec;

use super::RedisStore;
use crate::store::{Check, Checks, Decision, Decisions, Store, StoreError, StoreFuture};

/// The indices of a request's checks, by slot, in the order each slot
/// first appears among the checks.
pub(super) type BySlot = SmallVec<[SmallVec<[usize; 2]>; 2]>;

/// `checks` by slot, when their keys span several slots of a cluster.
pub(super) fn by_slot(cluster: bool, checks: &[Check]) -> Option<BySlot> {
    if !cluster || checks.len() < 2 {
        return None;
    }
    // A key's braces are its hash tag, which is the client key itself.
    let slots: SmallVec<[Slot; 4]> = checks
        .iter()
        .map(|check| Slot::for_key(check.key.as_str()))
        .collect();
    if slots.iter().all(|slot| *slot == slots[0]) {
        return None;
    }
    let mut groups: SmallVec<[(Slot, SmallVec<[usize; 2]>); 2]> = SmallVec::new();
    for (index, slot) in slots.into_iter().enumerate() {
        match groups.iter_mut().find(|(seen, _)| *seen == slot) {
            Some((_, group)) => group.push(index),
            None => groups.push((slot, SmallVec::from_slice(&[index]))),
        }
    }
    Some(groups.into_iter().map(|(_, group)| group).collect())
}

/// The checks of `group`, each unsliced: a request whose checks span
/// slots takes no slice, so what a slot grants is the request's alone,
/// and is given back as such.
fn part(checks: &[Check], group: &[usize]) -> Checks {
    group
        .iter()
        .map(|&index| {
            let mut check = checks[index].clone();
            check.slice = 0;
            check
        })
        .collect()
}

/// Decides `checks` slot by slot (see [`check`]) on a task of its own, so
/// that what earlier slots grant is given back whatever becomes of the
/// request: dropped between two slots, or given up on once `timeout` (one
/// call's) has passed, the request takes no answer, and every grant is
/// given back then.
pub(super) fn check_apart(
    store: RedisStore,
    checks: Checks,
    groups: BySlot,
    timeout: Duration,
) -> StoreFuture {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        let none = StoreError::Internal("no Tokio runtime to ask the slots on".to_owned());
        return StoreFuture::ready(Err(none));
    };
    let (answer, answered) = tokio::sync::oneshot::channel();
    runtime.spawn(async move {
        let decided = check(&store, &checks, &groups).await;
        // Nobody takes the answer: an admission is given back (a denial
        // gave back its grants already).
        if let Err(Ok(decisions)) = answer.send(decided)
            && decisions.iter().all(Decision::admitted)
        {
            let decided: SmallVec<[Option<Decision>; 4]> =
                decisions.iter().map(|decision| Some(*decision)).collect();
            let granted: SmallVec<[usize; 4]> = (0..checks.len()).collect();
            give_back(&store, &checks, &decided, &granted).await;
        }
    });
    StoreFuture::new(async move {
        match tokio::time::timeout(timeout, answered).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => Err(StoreError::Internal(
                "the check across slots ended without an answer".to_owned(),
            )),
            Err(_) => Err(StoreError::Timeout(timeout)),
        }
    })
}

/// Decides `checks` slot by slot (see the module): their decisions, in
/// the checks' order. On a denial, the slots not yet asked are peeked, so
/// that every check has its decision, and nothing they hold is taken.
async fn check(
    store: &RedisStore,
    checks: &[Check],
    groups: &BySlot,
) -> Result<Decisions, StoreError> {
    let mut decided: SmallVec<[Option<Decision>; 4]> = SmallVec::from_elem(None, checks.len());
    let mut granted: SmallVec<[usize; 4]> = SmallVec::new();
    for (asked, group) in groups.iter().enumerate() {
        let decisions = match store.check(&part(checks, group)).await {
            Ok(decisions) if decisions.len() == group.len() => decisions,
            Ok(decisions) => {
                give_back(store, checks, &decided, &granted).await;
                return Err(StoreError::Protocol(format!(
                    "{} decisions for {} checks",
                    decisions.len(),
                    group.len()
                )));
            }
            Err(error) => {
                give_back(store, checks, &decided, &granted).await;
                return Err(error);
            }
        };
        let admitted = decisions.iter().all(Decision::admitted);
        for (&index, decision) in group.iter().zip(decisions.iter()) {
            decided[index] = Some(*decision);
        }
        if admitted {
            granted.extend_from_slice(group);
            continue;
        }
        give_back(store, checks, &decided, &granted).await;
        for group in &groups[asked + 1..] {
            let peeked = store.peek(&part(checks, group)).await;
            for (position, &index) in group.iter().enumerate() {
                let check = &checks[index];
                decided[index] = Some(match &peeked {
                    Ok(peeked) if peeked.len() == group.len() => peeked[position],
                    // Unknown, and not what denied the request: shown as
                    // its whole limit, counted nowhere.
                    _ => Decision::new_admitted(check.burst, check.burst, Duration::ZERO),
                });
            }
        }
        break;
    }
    if granted.len() == checks.len() {
        held_alike(store, checks, &mut decided, &granted).await;
    }
    let mut answer = Decisions::new();
    for decision in decided {
        answer.push(decision.ok_or_else(|| StoreError::Protocol("a check left undecided".into()))?);
    }
    Ok(answer)
}

/// A request every slot admitted, some holding it for a delay
/// ([`Policy::with_delay`](crate::Policy::with_delay)) longer than
/// others': each slot recorded it at the time it would pass there, while
/// the request would pass at the latest, so a slot that recorded it
/// sooner would let the next request in early. Such a request is given
/// back everywhere, and refused with the longest wait as its retry time:
/// a brief over-denial, never more than a limit.
async fn held_alike(
    store: &RedisStore,
    checks: &[Check],
    decided: &mut [Option<Decision>],
    granted: &[usize],
) {
    let delay =
        |decision: &Option<Decision>| decision.and_then(|d| d.delayed_for()).unwrap_or_default();
    let longest = decided.iter().map(delay).max().unwrap_or_default();
    if longest.is_zero() || decided.iter().all(|decision| delay(decision) == longest) {
        return;
    }
    give_back(store, checks, decided, granted).await;
    for decision in decided.iter_mut().flatten() {
        if decision.delayed_for() == Some(longest) {
            *decision = Decision::new_denied(
                decision.limit(),
                decision.remaining(),
                decision.reset(),
                Some(longest),
            );
        }
    }
}

/// Gives back what the checks at `granted` were granted (their decisions
/// in `decided`): a failure is logged, as the layer's refunds are, and
/// the units then leave with their window.
async fn give_back(
    store: &RedisStore,
    checks: &[Check],
    decided: &[Option<Decision>],
    granted: &[usize],
) {
    if granted.is_empty() {
        return;
    }
    let given: Checks = part(checks, granted);
    let at: SmallVec<[Duration; 4]> = granted
        .iter()
        .map(|&index| {
            decided[index]
                .and_then(|decision| decision.recorded_at())
                .unwrap_or_default()
        })
        .collect();
    if let Err(error) = store.refund(&given, &at).await {
        tracing::warn!(%error, "units granted in one slot of a request another slot denied were not given back");
    }
}

/// Runs `op` on each slot's part of `checks` (and of `values`, one per
/// check), one part after another: per part, the indices of its checks
/// and its answer. Every part is sent, whatever became of the others; the
/// first error is the answer then.
pub(super) async fn each<V: Clone, T, F>(
    checks: &[Check],
    values: &[V],
    groups: &BySlot,
    op: impl Fn(&[Check], &[V]) -> F,
) -> Result<Vec<(SmallVec<[usize; 2]>, T)>, StoreError>
where
    F: Future<Output = Result<T, StoreError>>,
{
    let mut answers = Vec::with_capacity(groups.len());
    let mut failed = None;
    for group in groups {
        let part: Checks = group.iter().map(|&index| checks[index].clone()).collect();
        let values: Vec<V> = group.iter().map(|&index| values[index].clone()).collect();
        match op(&part, &values).await {
            Ok(answer) => answers.push((group.clone(), answer)),
            Err(error) => {
                failed.get_or_insert(error);
            }
        }
    }
    match failed {
        Some(error) => Err(error),
        None => Ok(answers),
    }
}

/// The parts' answers of [`each`], one per check, back in the checks'
/// order (`count` of them).
pub(super) fn in_order<T: Copy>(
    count: usize,
    parts: Vec<(SmallVec<[usize; 2]>, impl AsRef<[T]>)>,
) -> Result<Vec<T>, StoreError> {
    let mut answers: Vec<Option<T>> = vec![None; count];
    for (group, answer) in &parts {
        let answer = answer.as_ref();
        if answer.len() != group.len() {
            return Err(StoreError::Protocol(format!(
                "{} answers for {} checks",
                answer.len(),
                group.len()
            )));
        }
        for (&index, value) in group.iter().zip(answer) {
            answers[index] = Some(*value);
        }
    }
    answers
        .into_iter()
        .map(|answer| answer.ok_or_else(|| StoreError::Protocol("a check left unanswered".into())))
        .collect()
}
