//! Store calls that nobody waits for: refunds and lease releases, made
//! once a response is on its way.

use crate::store::{StoreError, StoreFuture};

/// Lets `answer` run to its end without anyone waiting for it: at once
/// for a store in process, on a task of its own otherwise; `report` is
/// given the outcome. Returns whether the call has failed already (a
/// store that answered at once, or no runtime to finish it on).
///
/// The current runtime runs it, or else `runtime`: for a call made where
/// the last owner of what it settles lets go, which may be a thread of no
/// runtime.
pub(crate) fn in_background_on(
    runtime: Option<&tokio::runtime::Handle>,
    answer: StoreFuture<()>,
    report: fn(Result<(), StoreError>),
) -> bool {
    let outcome = match answer.into_ready() {
        Ok(outcome) => outcome,
        Err(later) => match spawn_on(runtime, async move { report(later.await) }) {
            Ok(()) => return false,
            Err(no_runtime) => Err(no_runtime),
        },
    };
    let failed = outcome.is_err();
    report(outcome);
    failed
}

/// Runs `task` on the current runtime, or else `runtime`; the error to
/// report when there is neither.
pub(crate) fn spawn_on(
    runtime: Option<&tokio::runtime::Handle>,
    task: impl Future<Output = ()> + Send + 'static,
) -> Result<(), StoreError> {
    let current = tokio::runtime::Handle::try_current().ok();
    match current.as_ref().or(runtime) {
        Some(runtime) => {
            runtime.spawn(task);
            Ok(())
        }
        None => Err(StoreError::Internal(
            "no Tokio runtime to finish the call on".to_owned(),
        )),
    }
}
