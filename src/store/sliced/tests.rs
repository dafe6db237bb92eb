//! Slices over the memory store: what the table does with units taken,
//! put back, refunded and given back. (The Redis side, with several
//! instances, is in `tests/it/slices.rs`.)

use std::sync::Arc;
use std::time::Duration;

use std::sync::atomic::Ordering;

use super::*;
use crate::clock::FakeClock;
use crate::key::Key;
use crate::policy::Policy;
use crate::store::MemoryStore;

const HOUR: Duration = Duration::from_secs(3600);

fn check_of(policy: &Policy) -> Check {
    Check::new(policy, Key::new("alice")).unwrap()
}

async fn left_in_store(memory: &MemoryStore, check: &Check) -> u32 {
    let mut exact = check.clone();
    exact.slice = 0;
    memory.peek(std::slice::from_ref(&exact)).await.unwrap()[0].remaining
}

#[tokio::test(start_paused = true)]
async fn a_slice_is_taken_once_and_spent_in_process() {
    let memory = MemoryStore::new();
    let sliced = Sliced::new(Arc::new(memory.clone()));
    let check = check_of(&Policy::new("hot", 100, HOUR).with_slice(30));
    for spent in 1..=30 {
        let decisions = sliced.check(std::slice::from_ref(&check)).await.unwrap();
        assert!(decisions[0].admitted);
        assert_eq!(
            decisions[0].remaining,
            100 - spent,
            "the store's 70 and the slice's"
        );
        assert_eq!(left_in_store(&memory, &check).await, 70);
    }
    sliced.check(std::slice::from_ref(&check)).await.unwrap();
    assert_eq!(left_in_store(&memory, &check).await, 40, "a second slice");
}

#[tokio::test(start_paused = true)]
async fn dropping_the_table_gives_back_what_its_slices_hold() {
    let memory = MemoryStore::new();
    let sliced = Sliced::new(Arc::new(memory.clone()));
    let check = check_of(&Policy::new("hot", 100, HOUR).with_slice(30));
    sliced.check(std::slice::from_ref(&check)).await.unwrap();
    assert_eq!(left_in_store(&memory, &check).await, 70);
    drop(sliced);
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert_eq!(
        left_in_store(&memory, &check).await,
        99,
        "the one unit used stays counted"
    );
}

#[tokio::test(start_paused = true)]
async fn a_slice_ages_out_and_gives_back_what_it_did_not_use() {
    let memory = MemoryStore::new();
    let sliced = Sliced::new(Arc::new(memory.clone()));
    let check = check_of(&Policy::new("hot", 100, HOUR).with_slice(30));
    sliced.check(std::slice::from_ref(&check)).await.unwrap();
    sliced.check(std::slice::from_ref(&check)).await.unwrap();
    // The slice lives a tenth of the window, at most a second.
    tokio::time::sleep(Duration::from_millis(1001)).await;
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert_eq!(left_in_store(&memory, &check).await, 98);
    assert!(
        lock(&sliced.table.entries).by_scope.is_empty(),
        "the entry left the table"
    );
}

#[tokio::test(start_paused = true)]
async fn a_refund_goes_back_into_the_slice_it_came_from() {
    let memory = MemoryStore::new();
    let sliced = Sliced::new(Arc::new(memory.clone()));
    let check = check_of(&Policy::new("hot", 100, HOUR).with_slice(30));
    for _ in 0..5 {
        let decision = sliced.check(std::slice::from_ref(&check)).await.unwrap()[0];
        let at = decision.recorded_at().expect("a slice names its time");
        sliced
            .refund(std::slice::from_ref(&check), &[at])
            .await
            .unwrap();
    }
    let decision = sliced.check(std::slice::from_ref(&check)).await.unwrap()[0];
    assert_eq!(decision.remaining(), 99, "five refunded, one spent");
    // A refund naming another time (a slice given back since) is dropped.
    sliced
        .refund(std::slice::from_ref(&check), &[Duration::from_secs(1)])
        .await
        .unwrap();
    let decision = sliced.check(std::slice::from_ref(&check)).await.unwrap()[0];
    assert_eq!(decision.remaining(), 98);
    assert_eq!(left_in_store(&memory, &check).await, 70);
}

#[tokio::test(start_paused = true)]
async fn a_request_denied_by_an_unsliced_check_puts_its_units_back() {
    let memory = MemoryStore::new();
    let sliced = Sliced::new(Arc::new(memory.clone()));
    let hot = check_of(&Policy::new("hot", 100, HOUR).with_slice(10));
    let once = check_of(&Policy::new("once", 1, HOUR));
    let both = [hot.clone(), once.clone()];
    let first = sliced.check(&both).await.unwrap();
    assert!(first.iter().all(|decision| decision.admitted()));
    let second = sliced.check(&both).await.unwrap();
    assert!(second.iter().all(|decision| !decision.admitted()));
    assert!(
        second[1].retry_after().is_some(),
        "the unsliced check denied"
    );
    let alone = sliced.check(std::slice::from_ref(&hot)).await.unwrap()[0];
    assert_eq!(alone.remaining(), 98, "the denied request's unit went back");
}

#[tokio::test(start_paused = true)]
async fn near_the_limit_the_slice_is_what_is_left_then_the_request_alone() {
    // On a clock that stands still, so that two denials compare exactly.
    let memory = MemoryStore::builder()
        .with_clock(FakeClock::new(1_700_000_000_000_000))
        .build();
    let (sliced, gate, calls) = stalling_on(memory.clone(), false);
    gate.add_permits(1_000);
    let check = check_of(&Policy::new("hot", 25, HOUR).with_slice(10));
    let mut exact = check.clone();
    exact.slice = 0;
    // Another instance took 20.
    for _ in 0..20 {
        memory.check(std::slice::from_ref(&exact)).await.unwrap();
    }
    for left in (0..5).rev() {
        let decision = sliced.check(std::slice::from_ref(&check)).await.unwrap()[0];
        assert!(decision.admitted());
        assert_eq!(decision.remaining(), left);
    }
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "10 asked and denied, then the 5 left"
    );
    let denied = sliced.check(std::slice::from_ref(&check)).await.unwrap()[0];
    assert!(!denied.admitted());
    let exact_denial = memory.peek(std::slice::from_ref(&exact)).await.unwrap()[0];
    assert_eq!(
        denied.retry_after(),
        exact_denial.retry_after(),
        "the request's own denial"
    );
    assert_eq!(
        calls.load(Ordering::SeqCst),
        3,
        "the store had nothing left at its last answer: the request is asked at its cost at once"
    );
}

#[tokio::test(start_paused = true)]
async fn a_reset_drops_the_slice_in_hand() {
    let memory = MemoryStore::new();
    let sliced = Sliced::new(Arc::new(memory.clone()));
    let check = check_of(&Policy::new("hot", 100, HOUR).with_slice(30));
    sliced.check(std::slice::from_ref(&check)).await.unwrap();
    sliced.reset(std::slice::from_ref(&check)).await.unwrap();
    assert_eq!(left_in_store(&memory, &check).await, 100);
    let decision = sliced.check(std::slice::from_ref(&check)).await.unwrap()[0];
    assert_eq!(decision.remaining(), 99, "a new slice, from a fresh count");
    assert_eq!(left_in_store(&memory, &check).await, 70);
}

#[test]
fn a_slice_lives_a_tenth_of_its_window_at_most_a_second() {
    let of = |window| lifetime(&check_of(&Policy::new("p", 10, window).with_slice(2)));
    assert_eq!(of(Duration::from_secs(2)), Duration::from_millis(200));
    assert_eq!(of(HOUR), Duration::from_secs(1));
    assert_eq!(of(Duration::from_millis(5)), Duration::from_millis(1));
}

/// A memory store that counts its checks and answers each only when it is
/// let through: a store that stalls, as Redis does when its replies are
/// slow. A check that succeeds is recorded at once (the server ran it);
/// one that fails records nothing.
struct Stalling {
    memory: MemoryStore,
    gate: Arc<tokio::sync::Semaphore>,
    calls: Arc<std::sync::atomic::AtomicUsize>,
    fails: bool,
}

impl Store for Stalling {
    fn check(&self, checks: &[Check]) -> StoreFuture {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let (gate, memory, fails) = (self.gate.clone(), self.memory.clone(), self.fails);
        let checks: Vec<Check> = checks.to_vec();
        let recorded = (!fails).then(|| memory.check(&checks));
        StoreFuture::new(async move {
            let _pass = gate.acquire().await.expect("the gate stays open");
            match recorded {
                Some(recorded) => recorded.await,
                None => Err(StoreError::Timeout(Duration::from_millis(50))),
            }
        })
    }

    fn settle(&self, checks: &[Check], recorded_at: &[Duration], costs: &[u64]) -> StoreFuture<()> {
        self.memory.settle(checks, recorded_at, costs)
    }

    fn refund(&self, checks: &[Check], recorded_at: &[Duration]) -> StoreFuture<()> {
        self.memory.refund(checks, recorded_at)
    }

    fn reset(&self, checks: &[Check]) -> StoreFuture<()> {
        self.memory.reset(checks)
    }
}

fn stalling(
    fails: bool,
) -> (
    Sliced,
    Arc<tokio::sync::Semaphore>,
    Arc<std::sync::atomic::AtomicUsize>,
) {
    stalling_on(MemoryStore::new(), fails)
}

fn stalling_on(
    memory: MemoryStore,
    fails: bool,
) -> (
    Sliced,
    Arc<tokio::sync::Semaphore>,
    Arc<std::sync::atomic::AtomicUsize>,
) {
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let store = Stalling {
        memory,
        gate: gate.clone(),
        calls: calls.clone(),
        fails,
    };
    (Sliced::new(Arc::new(store)), gate, calls)
}

async fn settle_tasks() {
    for _ in 0..100 {
        tokio::task::yield_now().await;
    }
}

/// `count` requests of `check` at once, each on its task.
fn spawn_requests(
    sliced: &Arc<Sliced>,
    check: &Check,
    count: usize,
) -> Vec<tokio::task::JoinHandle<Result<Decisions, StoreError>>> {
    (0..count)
        .map(|_| {
            let (sliced, check) = (sliced.clone(), check.clone());
            tokio::spawn(async move { sliced.check(std::slice::from_ref(&check)).await })
        })
        .collect()
}

/// While the store stalls, a slice's worth of requests wait for one call
/// and the rest ask the store on their own: none waits behind call after
/// call.
#[tokio::test(start_paused = true)]
async fn past_a_slice_s_worth_of_waiting_requests_the_others_ask_the_store_at_once() {
    let (sliced, gate, calls) = stalling(false);
    let sliced = Arc::new(sliced);
    let check = check_of(&Policy::new("hot", 1_000, HOUR).with_slice(10));
    let requests = spawn_requests(&sliced, &check, 30);
    settle_tasks().await;
    assert_eq!(
        calls.load(Ordering::SeqCst),
        21,
        "one slice for 10, 20 on their own"
    );
    gate.add_permits(1_000);
    for request in requests {
        assert!(request.await.unwrap().unwrap()[0].admitted);
    }
    assert_eq!(calls.load(Ordering::SeqCst), 21, "the slice served the 10");
}

/// A slice's call that fails answers every request that waited on it:
/// none asks again, one after the other.
#[tokio::test(start_paused = true)]
async fn requests_waiting_on_a_call_that_fails_share_its_failure() {
    let (sliced, gate, calls) = stalling(true);
    let sliced = Arc::new(sliced);
    let check = check_of(&Policy::new("hot", 1_000, HOUR).with_slice(10));
    let requests = spawn_requests(&sliced, &check, 8);
    settle_tasks().await;
    gate.add_permits(1_000);
    for request in requests {
        assert!(matches!(
            request.await.unwrap(),
            Err(StoreError::Timeout(_))
        ));
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// A slice taken under one limit is not spent under another (a reload
/// that lowered the limit, a lower tier): it is given back, and the
/// request is decided under its own terms.
#[tokio::test(start_paused = true)]
async fn a_slice_is_spent_only_under_the_terms_it_was_taken_under() {
    let memory = MemoryStore::new();
    let sliced = Sliced::new(Arc::new(memory.clone()));
    let before = check_of(&Policy::new("hot", 100, HOUR).with_slice(30));
    let after = check_of(&Policy::new("hot", 10, HOUR).with_slice(5));
    sliced.check(std::slice::from_ref(&before)).await.unwrap();
    let decision = sliced.check(std::slice::from_ref(&after)).await.unwrap()[0];
    assert_eq!(
        decision.limit(),
        10,
        "decided under the new limit, not from the old slice"
    );
    settle_tasks().await;
    assert_eq!(
        left_in_store(&memory, &before).await,
        100 - 1 - 5,
        "the old slice given back but its one unit used, and a new slice of 5"
    );
}

/// A request dropped while its slice is taken (its client went away,
/// after the store recorded the slice) leaves the slice installed, with
/// its own unit back in it: all ten units serve the next requests rather
/// than staying counted in the store for a window. A request dropped
/// while it waits behind the call asks nothing.
#[tokio::test(start_paused = true)]
async fn a_request_dropped_while_its_slice_is_taken_leaves_the_slice() {
    let memory = MemoryStore::new();
    let (sliced, gate, calls) = stalling_on(memory.clone(), false);
    let sliced = Arc::new(sliced);
    let check = check_of(&Policy::new("hot", 1_000, HOUR).with_slice(10));
    let dropped = spawn_requests(&sliced, &check, 3);
    settle_tasks().await;
    assert_eq!(calls.load(Ordering::SeqCst), 1, "one call, two waiting");
    for request in dropped {
        request.abort();
        assert!(request.await.unwrap_err().is_cancelled());
    }
    gate.add_permits(1_000);
    settle_tasks().await;
    assert_eq!(left_in_store(&memory, &check).await, 990);
    for _ in 0..10 {
        let decision = sliced.check(std::slice::from_ref(&check)).await.unwrap()[0];
        assert!(decision.admitted());
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1, "served from the slice");
    assert_eq!(left_in_store(&memory, &check).await, 990);
}

/// A reset that comes while a slice's call is out drops that slice too:
/// the request that asked for it is answered, and the rest are decided
/// from the fresh count, not from units the reset may have wiped.
#[tokio::test(start_paused = true)]
async fn a_reset_during_a_slice_s_call_leaves_no_slice() {
    let memory = MemoryStore::new();
    let (sliced, gate, calls) = stalling_on(memory.clone(), false);
    let sliced = Arc::new(sliced);
    let check = check_of(&Policy::new("hot", 1_000, HOUR).with_slice(10));
    let asked = spawn_requests(&sliced, &check, 1).remove(0);
    settle_tasks().await;
    sliced.reset(std::slice::from_ref(&check)).await.unwrap();
    gate.add_permits(1_000);
    let decision = asked.await.unwrap().unwrap()[0];
    assert!(decision.admitted());
    assert_eq!(decision.recorded_at(), None, "nothing to refund");
    sliced.check(std::slice::from_ref(&check)).await.unwrap();
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "a new slice after the reset"
    );
    assert_eq!(left_in_store(&memory, &check).await, 1_000 - 10);
}

/// The layer sends the refund of units the store decided for a request
/// alone to the store, and those of a slice into the slice.
#[tokio::test(start_paused = true)]
async fn refunds_go_where_their_units_came_from() {
    let memory = MemoryStore::new();
    let (sliced, gate, _calls) = stalling_on(memory.clone(), false);
    let sliced = Arc::new(sliced);
    let check = check_of(&Policy::new("hot", 1_000, HOUR).with_slice(2));
    // Two units wait for a slice; the third is decided alone.
    let requests = spawn_requests(&sliced, &check, 3);
    let store: Arc<dyn Store> = sliced;
    settle_tasks().await;
    gate.add_permits(1_000);
    let mut recorded = crate::layer::after::recorded::Recorded::new(&store);
    for request in requests {
        let decision = request.await.unwrap().unwrap()[0];
        recorded.push_refund(&check, &decision, decision.recorded_at().unwrap());
    }
    assert_eq!(left_in_store(&memory, &check).await, 1_000 - 2 - 1);
    assert!(!recorded.give_back(|outcome| outcome.expect("refunded")));
    settle_tasks().await;
    assert_eq!(
        left_in_store(&memory, &check).await,
        1_000 - 2,
        "the unit decided alone back in the store; the slice's two in the slice"
    );
}

/// Requests that waited for a slice the store had too few units to serve
/// them all ask the store alone, at once, rather than one after the other
/// behind a call each.
#[tokio::test(start_paused = true)]
async fn waiters_a_new_slice_cannot_serve_ask_the_store_alone_together() {
    let memory = MemoryStore::new();
    let (sliced, gate, calls) = stalling_on(memory.clone(), false);
    let sliced = Arc::new(sliced);
    let check = check_of(&Policy::new("hot", 1_000, HOUR).with_slice(10));
    let mut exact = check.clone();
    exact.slice = 0;
    // Another instance took all but 4.
    for _ in 0..996 {
        memory.check(std::slice::from_ref(&exact)).await.unwrap();
    }
    let requests = spawn_requests(&sliced, &check, 10);
    settle_tasks().await;
    assert_eq!(calls.load(Ordering::SeqCst), 1, "ten wait on one call");
    // The slice's two calls (10 asked, then the 4 left) pass; the six
    // left over are all sent before any is answered.
    gate.add_permits(2);
    settle_tasks().await;
    assert_eq!(calls.load(Ordering::SeqCst), 2 + 6);
    gate.add_permits(1_000);
    let mut admitted = 0;
    for request in requests {
        let decision = request.await.unwrap().unwrap()[0];
        admitted += usize::from(decision.admitted());
        assert!(decision.admitted() || decision.retry_after().is_some());
    }
    assert_eq!(admitted, 4, "exactly what the store had left");
    assert_eq!(left_in_store(&memory, &check).await, 0);
}

/// A store that cannot take a slice back (no settlement) is asked
/// request by request once a give-back has failed: a slice it cannot
/// take back would leave its unused units counted for a window.
#[tokio::test(start_paused = true)]
async fn a_store_that_takes_no_give_back_is_asked_request_by_request() {
    struct NoSettle(MemoryStore, Arc<std::sync::atomic::AtomicUsize>);
    impl Store for NoSettle {
        fn check(&self, checks: &[Check]) -> StoreFuture {
            self.1.fetch_add(1, Ordering::SeqCst);
            self.0.check(checks)
        }
    }
    let memory = MemoryStore::new();
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let sliced = Sliced::new(Arc::new(NoSettle(memory.clone(), calls.clone())));
    let check = check_of(&Policy::new("hot", 100, HOUR).with_slice(10));
    sliced.check(std::slice::from_ref(&check)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1001)).await;
    settle_tasks().await;
    assert_eq!(left_in_store(&memory, &check).await, 90, "not given back");
    for _ in 0..5 {
        sliced.check(std::slice::from_ref(&check)).await.unwrap();
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1 + 5, "one call each");
    assert_eq!(left_in_store(&memory, &check).await, 85);
}

/// A store that names no time for its records cannot take a slice back:
/// the request that took one keeps it, and the next are asked alone.
#[tokio::test(start_paused = true)]
async fn a_store_that_names_no_times_is_asked_request_by_request() {
    struct Untimed(MemoryStore);
    impl Store for Untimed {
        fn check(&self, checks: &[Check]) -> StoreFuture {
            let memory = self.0.clone();
            let checks = checks.to_vec();
            StoreFuture::new(async move {
                let mut decisions = memory.check(&checks).await?;
                for decision in decisions.iter_mut() {
                    decision.recorded_at_us = crate::store::UNSET;
                }
                Ok(decisions)
            })
        }
    }
    let memory = MemoryStore::new();
    let sliced = Sliced::new(Arc::new(Untimed(memory.clone())));
    let check = check_of(&Policy::new("hot", 100, HOUR).with_slice(10));
    sliced.check(std::slice::from_ref(&check)).await.unwrap();
    assert_eq!(left_in_store(&memory, &check).await, 90);
    for _ in 0..5 {
        sliced.check(std::slice::from_ref(&check)).await.unwrap();
    }
    assert_eq!(left_in_store(&memory, &check).await, 85, "one unit each");
}
