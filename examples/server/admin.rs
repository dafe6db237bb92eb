//! `GET` and `DELETE /admin/limits/{policy}/{key}`: one client's standing
//! under one policy, and forgetting it. Present only when the config sets
//! `[admin] token`; every call must carry `Authorization: Bearer <token>`.
//! Never limited: an operator locked out by the limiter could not unlock
//! a client.

use std::sync::Arc;

use axum::extract::{Path, Query, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
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

/// `404` for a policy the server does not have, `503` when the store
/// cannot answer.
fn failure(error: &LimitError) -> Response {
    let status = match error {
        LimitError::UnknownPolicy(_) => StatusCode::NOT_FOUND,
        _ => {
            tracing::warn!(%error, "admin: the store did not answer");
            StatusCode::SERVICE_UNAVAILABLE
        }
    };
    (status, Json(json!({ "error": error.to_string() }))).into_response()
}
