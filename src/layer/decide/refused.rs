//! Refused credentials answered: `401`, or `429` once the client's
//! address has had too many refused (see [`CredentialFailures`]), counted
//! in the store before the answer.
//!

use bytes::Bytes;
use http::Response;
use http::request::Parts;

use crate::key::KeyRejection;
use crate::layer::decide::reject::reject;
use crate::layer::remembered::credential_failures::CredentialFailures;
use crate::layer::remembered::deny_cache::{Denied, DenyCache};
use crate::layer::settings::Shared;
use crate::rejection::Rejection;
use crate::rejection::limited::Limited;
use crate::store::{Check, CheckOutcome, Decision, StoreFuture};

/// A refusal of credentials, counted against the client's address.
struct Refusal {
    blocked: DenyCache,
    check: Check,
    sent_at: u64,
}

impl Refusal {
    /// The store's decision on the refusal when it puts the address past
    /// its limit (a `429`), remembering the address as blocked while its
    /// refusals fill the window; `None` while the address is within it (a
    /// `401`). A store that cannot count does not change the answer: the
    /// credentials were refused all the same. Under `shadow`, counted and
    /// decided but never `429`.
    fn past_limit(&self, outcome: CheckOutcome, shadow: bool) -> Option<Decision> {
        let decision = outcome.ok()?.first().copied()?;
        let checks = std::slice::from_ref(&self.check);
        if shadow {
            if !decision.admitted() {
                tracing::debug!("shadow mode: refused credentials past their limit");
            }
            return None;
        }
        if decision.admitted() {
            if decision.remaining() == 0 {
                // No refusal fits until the oldest leaves the window.
                let blocked = Decision::new_denied(
                    decision.limit(),
                    0,
                    decision.reset(),
                    Some(decision.reset()),
                );
                self.blocked
                    .remember(checks, std::slice::from_ref(&blocked), self.sent_at, |_| {
                        true
                    });
            }
            return None;
        }
        self.blocked.remember(
            checks,
            std::slice::from_ref(&decision),
            self.sent_at,
            |_| true,
        );
        Some(decision)
    }
}

/// The count of this address's refused credentials under `failures`,
/// when the request presents some.
pub(crate) fn refusal_of(
    shared: &Shared,
    failures: &CredentialFailures,
    parts: &Parts,
) -> Option<Check> {
    failures.check_for(parts, &*shared.keys, shared.namespace.as_ref())
}

/// The cached denial of the address `check` counts refusals of, while it
/// is blocked; never in shadow mode.
pub(crate) fn blocked(shared: &Shared, check: &Check) -> Option<Denied> {
    let failures = shared.credential_failures.as_ref()?;
    (!shared.settings.shadow)
        .then(|| failures.blocked_now(check))
        .flatten()
}

/// Answers refused credentials `401`, after counting the refusal against
/// the client's address (`check`) when the layer counts them: `429` once
/// the address is past its limit. `Err` holds the refusal while the store
/// counts it.
pub(crate) fn refused(
    shared: &Shared,
    parts: &Parts,
    check: Option<Check>,
    rejection: KeyRejection,
) -> Result<Response<Bytes>, Box<Counting>> {
    tracing::debug!(reason = rejection.reason(), "credentials refused");
    let Some((failures, check)) = shared.credential_failures.as_ref().zip(check) else {
        let refused = Rejection::InvalidCredentials(&rejection);
        return Ok(reject(shared, parts, refused));
    };
    let blocked = failures.blocked_addresses();
    let refusal = Refusal {
        blocked: blocked.clone(),
        sent_at: blocked.now(),
        check,
    };
    match shared
        .store()
        .check(std::slice::from_ref(&refusal.check))
        .into_ready()
    {
        Ok(outcome) => Ok(refusal.answer(shared, parts, &rejection, outcome)),
        Err(count) => Err(Box::new(Counting {
            refusal,
            rejection,
            count,
        })),
    }
}

/// A refusal of credentials the store is counting.
pub(crate) struct Counting {
    refusal: Refusal,
    rejection: KeyRejection,
    count: StoreFuture,
}

impl Counting {
    /// The answer, once the store has counted the refusal.
    pub(crate) async fn answer(self, shared: &Shared, parts: &Parts) -> Response<Bytes> {
        let outcome = self.count.await;
        self.refusal.answer(shared, parts, &self.rejection, outcome)
    }
}

impl Refusal {
    /// `429` when the store's `outcome` puts the address past its limit,
    /// `401` otherwise.
    fn answer(
        &self,
        shared: &Shared,
        parts: &Parts,
        rejection: &KeyRejection,
        outcome: CheckOutcome,
    ) -> Response<Bytes> {
        let Some(decision) = self.past_limit(outcome, shared.settings.shadow) else {
            return reject(shared, parts, Rejection::InvalidCredentials(rejection));
        };
        let decisions = [decision];
        let limited = Limited::new(std::slice::from_ref(&self.check), &decisions, 0, None);
        reject(shared, parts, Rejection::Limited(&limited))
    }
}
