//! Every answer the limiter writes itself goes through [`reject`]: the
//! rejection hook's answer (or a gRPC status), completed with the headers
//! of the limiter's own, or the limiter's own.

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::request::Parts;
use http::{HeaderMap, Method, Response};

use crate::layer::Shared;
use crate::response::grpc::is_grpc_content_type;
use crate::response::headers::HeaderFormat;
use crate::response::problem;
use crate::response::rejection::{Rejection, fill_missing};

/// The answer to `rejection` for the request whose head is `parts`: the
/// layer's hook's, or for a gRPC call the gRPC status, with each header of
/// the limiter's own answer it does not set itself (`Retry-After`, the
/// rate-limit headers, `WWW-Authenticate`); otherwise the limiter's own.
pub(crate) fn reject(shared: &Shared, parts: &Parts, rejection: Rejection<'_>) -> Response<Bytes> {
    let format = shared.settings.header_format;
    let custom = shared
        .on_rejection
        .as_deref()
        .and_then(|hook| hook(&rejection, parts))
        .or_else(|| is_grpc(parts).then(|| rejection.to_grpc()));
    let Some(mut custom) = custom else {
        return own_answer(&rejection, format);
    };
    if let Rejection::Limited(limited) = rejection {
        // The headers alone: the body is never rendered.
        let mut headers = HeaderMap::new();
        problem::limited_headers(limited, format, &mut headers);
        fill_missing(&mut custom, &headers);
    } else {
        fill_missing(&mut custom, own_answer(&rejection, format).headers());
    }
    custom
}

/// The limiter's own answer to `rejection`.
fn own_answer(rejection: &Rejection<'_>, format: HeaderFormat) -> Response<Bytes> {
    match *rejection {
        Rejection::Limited(limited) => problem::too_many_requests(limited, format),
        Rejection::InvalidCredentials(refused) => problem::invalid_credentials(refused),
        Rejection::Unidentified {
            missing_credentials: true,
        } => problem::missing_credentials(),
        Rejection::Unidentified { .. } => problem::client_unidentified(),
        Rejection::CostAboveLimit(denied) => problem::cost_above_limit(denied),
        Rejection::StoreUnavailable(_) => problem::limiter_unavailable(),
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
