//! Store calls that nobody waits for: refunds and lease releases, made
//! once a response is on its way.

use crate::store::{CheckFuture, StoreError};

/// Lets `answer` run to its end without anyone waiting for it: at once
/// for a store in process, on a task of its own otherwise; `report` is
/// given the outcome. Returns whether the call has failed already (a
/// store that answered at once, or no runtime to finish it on).
pub(crate) fn in_background(answer: CheckFuture<()>, report: fn(Result<(), StoreError>)) -> bool {
    let outcome = match answer.into_ready() {
        Ok(outcome) => outcome,
        Err(later) => match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move { report(later.await) });
                return false;
            }
            Err(_) => Err(StoreError::Internal(
                "no Tokio runtime to finish the call on".to_owned(),
            )),
        },
    };
    let failed = outcome.is_err();
    report(outcome);
    failed
}
