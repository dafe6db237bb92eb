//! Every answer the limiter writes itself goes through [`reject`]: the
//! rejection hook's answer, completed with the headers of the limiter's
//! own, or the limiter's own.

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderMap, Response};

use crate::key::KeyRejection;
use crate::layer::Shared;
use crate::response::limited::Limited;
use crate::response::problem::{self, Denial, HeaderFormat, retry_after_seconds};
use crate::response::rejection::{CostAboveLimit, Hook, Rejection, fill_missing};
use crate::store::StoreError;

/// What the limiter answers, with what its default answer needs.
pub(crate) enum Reply<'a> {
    /// Over a limit: `429`.
    Limited(Denial<'a>),
    /// Credentials that do not verify: `401`.
    InvalidCredentials(&'a KeyRejection),
    /// No key extractor identified the client: `401` when the chain keys
    /// by credentials alone (`missing_credentials`), `500` otherwise.
    Unidentified {
        parts: &'a Parts,
        missing_credentials: bool,
    },
    /// A cost no window can hold: `422`.
    CostAboveLimit(&'a CostAboveLimit),
    /// The store failed and the request fails closed: `503`.
    StoreUnavailable(&'a StoreError),
}

/// The answer to `reply`: the layer's hook's, with each header of the
/// limiter's own answer it does not set itself (`Retry-After`, the
/// rate-limit headers, `WWW-Authenticate`), or the limiter's own.
pub(crate) fn reject(shared: &Shared, reply: Reply<'_>) -> Response<Bytes> {
    let hook = shared.on_rejection.as_deref();
    let format = HeaderFormat {
        style: shared.options.header_style,
        reset: shared.options.reset_format,
    };
    match reply {
        Reply::Limited(denial) => limited(hook, format, &denial),
        Reply::InvalidCredentials(rejection) => {
            with_hook(hook, &Rejection::InvalidCredentials(rejection), || {
                problem::invalid_credentials(rejection)
            })
        }
        Reply::Unidentified {
            parts,
            missing_credentials,
        } => with_hook(
            hook,
            &Rejection::Unidentified {
                parts,
                missing_credentials,
            },
            || {
                if missing_credentials {
                    problem::missing_credentials()
                } else {
                    problem::client_unidentified()
                }
            },
        ),
        Reply::CostAboveLimit(denied) => {
            with_hook(hook, &Rejection::CostAboveLimit(denied), || {
                problem::cost_above_limit(denied)
            })
        }
        Reply::StoreUnavailable(error) => with_hook(
            hook,
            &Rejection::StoreUnavailable(error),
            problem::limiter_unavailable,
        ),
    }
}

fn with_hook(
    hook: Option<&Hook>,
    rejection: &Rejection<'_>,
    default: impl FnOnce() -> Response<Bytes>,
) -> Response<Bytes> {
    let Some(mut custom) = hook.and_then(|hook| hook(rejection)) else {
        return default();
    };
    fill_missing(&mut custom, default().headers());
    custom
}

/// `429`: the hook's answer with the limiter's `Retry-After` and rate-limit
/// headers where it sets none (its body is never rendered then), or the
/// limiter's problem body.
fn limited(hook: Option<&Hook>, format: HeaderFormat, denial: &Denial<'_>) -> Response<Bytes> {
    let retry_after = retry_after_seconds(&denial.decisions[denial.denied]);
    if let Some(hook) = hook {
        let limited = Limited::new(
            &denial.checks[denial.denied],
            &denial.decisions[denial.denied],
            retry_after,
        );
        if let Some(mut custom) = hook(&Rejection::Limited(&limited)) {
            let mut headers = HeaderMap::new();
            problem::limited_headers(denial, retry_after, format, &mut headers);
            fill_missing(&mut custom, &headers);
            return custom;
        }
    }
    problem::too_many_requests(denial, retry_after, format)
}
