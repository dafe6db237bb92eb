//! Every answer the limiter writes itself goes through [`reject`]: the
//! rejection hook's answer, completed with the headers of the limiter's
//! own, or the limiter's own.

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::request::Parts;
use http::{HeaderMap, Method, Response};

use crate::key::KeyRejection;
use crate::layer::Shared;
use crate::response::grpc::is_grpc_content_type;
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
    Unidentified { missing_credentials: bool },
    /// A cost no window can hold: `422`.
    CostAboveLimit(&'a CostAboveLimit),
    /// The store failed and the request fails closed: `503`.
    StoreUnavailable(&'a StoreError),
}

/// The answer to `reply` for the request whose head is `parts`: the
/// layer's hook's, or for a gRPC call the gRPC status, with each header of
/// the limiter's own answer it does not set itself (`Retry-After`, the
/// rate-limit headers, `WWW-Authenticate`); otherwise the limiter's own.
pub(crate) fn reject(shared: &Shared, parts: &Parts, reply: Reply<'_>) -> Response<Bytes> {
    let custom = Custom {
        hook: shared.on_rejection.as_deref(),
        parts,
    };
    let format = HeaderFormat {
        style: shared.options.header_style,
        reset: shared.options.reset_format,
    };
    match reply {
        Reply::Limited(denial) => limited(custom, format, &denial),
        Reply::InvalidCredentials(rejection) => custom
            .or(&Rejection::InvalidCredentials(rejection), || {
                problem::invalid_credentials(rejection)
            }),
        Reply::Unidentified {
            missing_credentials,
        } => custom.or(
            &Rejection::Unidentified {
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
        Reply::CostAboveLimit(denied) => custom.or(&Rejection::CostAboveLimit(denied), || {
            problem::cost_above_limit(denied)
        }),
        Reply::StoreUnavailable(error) => custom.or(
            &Rejection::StoreUnavailable(error),
            problem::limiter_unavailable,
        ),
    }
}

/// Where an answer other than the limiter's own may come from.
#[derive(Clone, Copy)]
struct Custom<'a> {
    hook: Option<&'a Hook>,
    parts: &'a Parts,
}

impl Custom<'_> {
    /// Whether an answer might not be the limiter's own.
    fn may_answer(self) -> bool {
        self.hook.is_some() || is_grpc(self.parts)
    }

    /// The hook's answer to `rejection`, else a gRPC call's status.
    fn answer(self, rejection: &Rejection<'_>) -> Option<Response<Bytes>> {
        self.hook
            .and_then(|hook| hook(rejection, self.parts))
            .or_else(|| is_grpc(self.parts).then(|| rejection.to_grpc()))
    }

    /// [`answer`](Self::answer), completed with the headers of the
    /// limiter's own, or the limiter's own.
    fn or(
        self,
        rejection: &Rejection<'_>,
        default: impl FnOnce() -> Response<Bytes>,
    ) -> Response<Bytes> {
        let Some(mut custom) = self.answer(rejection) else {
            return default();
        };
        fill_missing(&mut custom, default().headers());
        custom
    }
}

/// Whether the request is a gRPC call: a `POST` (as every call is) of
/// `application/grpc`, or a subtype such as `application/grpc+proto`
/// (gRPC-Web is not). Other methods are told without a header lookup.
fn is_grpc(parts: &Parts) -> bool {
    if parts.method != Method::POST {
        return false;
    }
    parts
        .headers
        .get(CONTENT_TYPE)
        .is_some_and(is_grpc_content_type)
}

/// `429`: the custom answer with the limiter's `Retry-After` and
/// rate-limit headers where it sets none (its body is never rendered
/// then), or the limiter's problem body.
fn limited(custom: Custom<'_>, format: HeaderFormat, denial: &Denial<'_>) -> Response<Bytes> {
    let retry_after = retry_after_seconds(&denial.decisions[denial.denied]);
    if custom.may_answer() {
        let limited = Limited::new(
            &denial.checks[denial.denied],
            &denial.decisions[denial.denied],
            retry_after,
        );
        if let Some(mut answer) = custom.answer(&Rejection::Limited(&limited)) {
            let mut headers = HeaderMap::new();
            problem::limited_headers(denial, retry_after, format, &mut headers);
            fill_missing(&mut answer, &headers);
            return answer;
        }
    }
    problem::too_many_requests(denial, retry_after, format)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Request;

    fn with_content_type(value: &str) -> Parts {
        Request::post("/grpc.health.v1.Health/Check")
            .header(CONTENT_TYPE, value)
            .body(())
            .unwrap()
            .into_parts()
            .0
    }

    #[test]
    fn grpc_calls_are_told_by_their_content_type() {
        for grpc in [
            "application/grpc",
            "application/grpc+proto",
            "Application/GRPC;x=1",
        ] {
            assert!(is_grpc(&with_content_type(grpc)), "{grpc}");
        }
        for other in [
            "application/grpc-web",
            "application/grpcx",
            "application/json",
            "text/plain",
        ] {
            assert!(!is_grpc(&with_content_type(other)), "{other}");
        }
        assert!(!is_grpc(&Request::new(()).into_parts().0));
        let mut get = with_content_type("application/grpc");
        get.method = Method::GET;
        assert!(!is_grpc(&get), "a gRPC call is a POST");
    }
}
