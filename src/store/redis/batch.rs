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
use std::sync::Mutex;

use tokio::sync::oneshot;

use super::call::Call;
use crate::store::CheckOutcome;

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
#[derive(Default)]
pub(super) struct Queue {
    waiting: Mutex<Vec<Queued>>,
}

impl Queue {
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
