//! Unit tests of `log.rs`.

use super::*;

const W: u64 = 1_000_000;

fn admit(log: &mut Log, now: u64, window: u64, cost: u32) -> u64 {
    let mut found = log.prepare(now, window, 0);
    log.record(now, cost, &mut found).expect("recorded")
}

#[test]
fn entry_leaves_exactly_one_window_later() {
    let mut log = Log::default();
    admit(&mut log, 0, W, 1);
    let window = log.prepare(W - 1, W, 0);
    assert!(!window.fits(1, 1));
    assert_eq!(
        log.decision(W - 1, 1, 1, false, &window).retry_after(),
        Some(Duration::from_micros(1))
    );
    assert!(log.prepare(W, W, 0).fits(1, 1));
    assert!(log.is_idle(W));
}

#[test]
fn a_refund_takes_back_that_request_only_and_only_once() {
    let mut log = Log::default();
    admit(&mut log, 0, W, 1);
    let at = admit(&mut log, 100, W, 2);
    // Same microsecond: recorded one later, so each is its own.
    let twin = admit(&mut log, 100, W, 2);
    assert_eq!(twin, at + 1);
    log.prepare(200, W, 0);
    log.refund(at, 2);
    log.refund(at, 2);
    assert_eq!(log.prepare(200, W, 0).count, 3);
    // Once it has left the window there is nothing to take back.
    log.prepare(W + 50, W, 0);
    log.refund(0, 1);
    assert_eq!(log.sum, 2);
}

#[test]
fn weighted_retry_after_waits_for_enough_units() {
    let mut log = Log::default();
    for at in [0, 100, 200] {
        admit(&mut log, at, W, 3);
    }
    // 9 of 10 used; a cost of 5 needs 4 freed: the first two entries.
    let window = log.prepare(300, W, 0);
    assert!(!window.fits(10, 5));
    let decision = log.decision(300, 10, 5, false, &window);
    assert_eq!(decision.remaining(), 1);
    assert_eq!(
        decision.retry_after(),
        Some(Duration::from_micros(100 + W - 300))
    );
    assert_eq!(decision.reset(), Duration::from_micros(W - 300));
}

#[test]
fn many_pages_count_and_refund_exactly() {
    let mut log = Log::default();
    let count = 80 * PAGE as u64;
    let times: Vec<u64> = (0..count).map(|i| admit(&mut log, i * 10, W, 1)).collect();
    assert!(log.tree().is_some_and(|tree| tree.top() >= 4));
    let now = count * 10;
    // Refund every third request: a third fewer count.
    for &at in times.iter().step_by(3) {
        log.prepare(now, W, 0);
        log.refund(at, 1);
    }
    let live = count - count.div_ceil(3);
    assert_eq!(log.prepare(now, W, 0).count, live);
    // A shorter window counts its share.
    let short = log.prepare(now, 1000, 0);
    let in_short: u64 = times
        .iter()
        .enumerate()
        .filter(|&(i, &t)| i % 3 != 0 && t + 1000 > now)
        .count() as u64;
    assert_eq!(short.count, in_short);
    // Pruning half of it keeps the rest.
    log.prepare(W + count * 5, W, 0);
    let kept = times
        .iter()
        .enumerate()
        .filter(|&(i, &t)| i % 3 != 0 && t + W > W + count * 5)
        .count() as u64;
    assert_eq!(log.sum, kept);
}
