//! The admin routes: `GET` and `DELETE /admin/limits/{policy}/{key}` (one
//! client's standing under one policy, and forgetting it), `PUT` and
//! `DELETE /admin/deny/{key}` (denying a client on every instance, for a
//! while or until lifted), and `PUT` and `DELETE
//! /admin/overrides/{policy}/{key}` (a client's own limit under a policy,
//! on every instance). Present only when the config sets `[admin] token`;
//! every call must carry `Authorization: Bearer <token>`. Never limited:
//! an operator locked out by the limiter could not unlock a client.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, Query, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, put};
use axum::{Json, Router};
use serde_json::json;
use sha2::{Digest, Sha256};
use slidegate::RateLimitLayer;
use slidegate::key::Key;
use slidegate::layer::LimitError;
use subtle::ConstantTimeEq;

/// A token's SHA-256 digest: tokens are compared as digests, which have
/// one length whatever the tokens', so the comparison (in constant time)
/// tells nothing of the token's length either.
type TokenDigest = [u8; 32];

fn digest(token: &str) -> TokenDigest {
    Sha256::digest(token.as_bytes()).into()
}

/// What the admin routes work with.
#[derive(Clone)]
struct Admin {
    layer: RateLimitLayer,
    token: Arc<TokenDigest>,
}

/// The admin routes on `layer`'s store and policies, behind `token`.
pub(crate) fn routes(layer: RateLimitLayer, token: &str) -> Router {
    let admin = Admin {
        layer,
        token: Arc::new(digest(token)),
    };
    Router::new()
        .route("/admin/limits/{policy}/{key}", get(inspect).delete(reset))
        .route("/admin/deny/{key}", put(deny).delete(lift_denial))
        .route(
            "/admin/overrides/{policy}/{key}",
            put(set_limit).delete(clear_limit),
        )
        // Before anything of the request is read.
        .route_layer(middleware::from_fn_with_state(admin.clone(), require_token))
        .with_state(admin)
}

#[derive(serde::Deserialize)]
struct TierQuery {
    /// The tier whose limits apply to the client (its base limits without).
    tier: Option<String>,
}

/// `200` with the client's `limit`, `remaining` units and `reset_seconds`
/// (until capacity next grows), recording nothing.
async fn inspect(
    State(admin): State<Admin>,
    Path((policy, key)): Path<(String, String)>,
    Query(query): Query<TierQuery>,
) -> Response {
    let Some(key) = Key::parse(&key) else {
        return not_a_key();
    };
    match admin.layer.peek(&policy, &key, query.tier.as_deref()).await {
        Ok(decision) => Json(json!({
            "policy": policy,
            "key": key.as_str(),
            "tier": query.tier,
            "limit": decision.limit(),
            "remaining": decision.remaining(),
            "reset_seconds": decision.reset().as_secs_f64().ceil() as u64,
        }))
        .into_response(),
        Err(error) => failure(&error),
    }
}

/// `204` once the client's count (and block) under the policy is gone.
async fn reset(
    State(admin): State<Admin>,
    Path((policy, key)): Path<(String, String)>,
) -> Response {
    let Some(key) = Key::parse(&key) else {
        return not_a_key();
    };
    match admin.layer.reset(&policy, &key).await {
        Ok(()) => {
            tracing::info!(policy, key = key.as_str(), "admin: count reset");
            StatusCode::NO_CONTENT.into_response()
        }
        Err(error) => failure(&error),
    }
}

/// `PUT /admin/deny/{key}`'s optional body.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Denial {
    /// How long the denial lasts; without it, until it is lifted.
    seconds: Option<u64>,
}

/// `PUT /admin/overrides/{policy}/{key}`'s body.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Limit {
    limit: u32,
}

/// The JSON `body`, or what is wrong with it; an empty body is `empty`'s.
fn json_body<T: serde::de::DeserializeOwned>(body: &Bytes, empty: Option<T>) -> Result<T, String> {
    if body.iter().all(u8::is_ascii_whitespace)
        && let Some(empty) = empty
    {
        return Ok(empty);
    }
    serde_json::from_slice(body)
        .map_err(|error| format!("the body is not the JSON this route takes: {error}"))
}

/// `400` saying what is wrong with the request.
fn bad_request(error: &str) -> Response {
    (StatusCode::BAD_REQUEST, Json(json!({ "error": error }))).into_response()
}

/// `204` once the client is denied on every instance (this one at once,
/// the others within a second): for `seconds` when the body gives them,
/// until `DELETE` otherwise.
async fn deny(State(admin): State<Admin>, Path(key): Path<String>, body: Bytes) -> Response {
    let Some(key) = Key::parse(&key) else {
        return not_a_key();
    };
    let denial = match json_body(&body, Some(Denial { seconds: None })) {
        Ok(denial) => denial,
        Err(error) => return bad_request(&error),
    };
    if denial.seconds == Some(0) {
        return bad_request("`seconds` must be at least 1 (leave it out to deny until lifted)");
    }
    let lasting = denial.seconds.map(Duration::from_secs);
    match admin.layer.changes().deny(&key, lasting).await {
        Ok(()) => {
            tracing::info!(
                key = key.as_str(),
                seconds = denial.seconds,
                "admin: client denied"
            );
            StatusCode::NO_CONTENT.into_response()
        }
        Err(error) => failure(&LimitError::Store(error)),
    }
}

/// `204` once the client's denial is lifted (whether or not it had one).
async fn lift_denial(State(admin): State<Admin>, Path(key): Path<String>) -> Response {
    let Some(key) = Key::parse(&key) else {
        return not_a_key();
    };
    match admin.layer.changes().remove_denial(&key).await {
        Ok(()) => {
            tracing::info!(key = key.as_str(), "admin: denial lifted");
            StatusCode::NO_CONTENT.into_response()
        }
        Err(error) => failure(&LimitError::Store(error)),
    }
}

/// `204` once the client has its own limit under the policy on every
/// instance; its count is kept, so a limit below it denies at once.
async fn set_limit(
    State(admin): State<Admin>,
    Path((policy, key)): Path<(String, String)>,
    body: Bytes,
) -> Response {
    let Some(key) = Key::parse(&key) else {
        return not_a_key();
    };
    let limit = match json_body::<Limit>(&body, None) {
        Ok(limit) => limit.limit,
        Err(error) => return bad_request(&error),
    };
    match admin.layer.changes().set_limit(&policy, &key, limit).await {
        Ok(()) => {
            tracing::info!(policy, key = key.as_str(), limit, "admin: limit set");
            StatusCode::NO_CONTENT.into_response()
        }
        Err(error) => failure(&error),
    }
}

/// `204` once the client's own limit under the policy is gone.
async fn clear_limit(
    State(admin): State<Admin>,
    Path((policy, key)): Path<(String, String)>,
) -> Response {
    let Some(key) = Key::parse(&key) else {
        return not_a_key();
    };
    match admin.layer.changes().clear_limit(&policy, &key).await {
        Ok(()) => {
            tracing::info!(policy, key = key.as_str(), "admin: limit cleared");
            StatusCode::NO_CONTENT.into_response()
        }
        Err(error) => failure(&error),
    }
}

/// Passes requests with `Authorization: Bearer <token>` of the configured
/// token on (their digests compared in constant time); answers `401` with
/// a challenge otherwise.
async fn require_token(State(admin): State<Admin>, request: Request, next: Next) -> Response {
    let given = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim());
    let valid = given.is_some_and(|token| bool::from(digest(token).ct_eq(&*admin.token)));
    if valid {
        return next.run(request).await;
    }
    (
        StatusCode::UNAUTHORIZED,
        [(header::WWW_AUTHENTICATE, "Bearer realm=\"slidegate-admin\"")],
        Json(json!({ "error": "the admin routes need Authorization: Bearer <[admin] token>" })),
    )
        .into_response()
}

/// `400` for a path segment that is no client key.
fn not_a_key() -> Response {
    (
        StatusCode::BAD_REQUEST,
        Json(json!({
            "error": "not a client key: write it in label form, as /api/whoami shows it \
                      (ip:203.0.113.9, jwt:alice), percent-encoded in the path",
        })),
    )
        .into_response()
}

/// `404` for a policy the server does not have, `422` for a limit it
/// cannot count, `503` when the store cannot answer.
fn failure(error: &LimitError) -> Response {
    let status = match error {
        LimitError::UnknownPolicy(_) => StatusCode::NOT_FOUND,
        LimitError::InvalidLimit(_) => StatusCode::UNPROCESSABLE_ENTITY,
        _ => {
            tracing::warn!(%error, "admin: the store did not answer");
            StatusCode::SERVICE_UNAVAILABLE
        }
    };
    (status, Json(json!({ "error": error.to_string() }))).into_response()
}
