//! The store an example server counts in: Redis (or a Redis Cluster, or
//! Sentinel) when `REDIS_URL` or the config's `[redis]` says where, memory
//! otherwise. Shared by the HTTP and gRPC examples.

use std::time::Duration;

use slidegate::RateLimitLayer;
use slidegate::config::Config;

/// The layer on the configured store: Redis (or a Redis Cluster) when
/// `REDIS_URL` or `[redis]` says where, memory otherwise.
pub(crate) async fn limiter(
    config: &Config,
) -> Result<(RateLimitLayer, String), Box<dyn std::error::Error>> {
    let from_env = std::env::var("REDIS_URL")
        .ok()
        .filter(|url| !url.is_empty());
    let source = if from_env.is_some() {
        "REDIS_URL"
    } else {
        "[redis]"
    };
    let settings = match (from_env, config.redis()) {
        (Some(url), settings) => settings.cloned().unwrap_or_default().with_url(url),
        (None, Some(settings)) => settings.clone(),
        (None, None) => return Ok((config.layer(config.memory_store()), "memory".into())),
    };
    let store = settings.store().map_err(|e| format!("{source}: {e}"))?;
    let kind = if settings.is_sentinel() {
        "Redis Sentinel"
    } else if settings.is_cluster() {
        "Redis Cluster"
    } else {
        "Redis"
    };
    let name = format!("{kind} ({})", settings.redacted_seeds().join(", "));
    // Connect now: the first requests do not pay for it, and a Redis that
    // cannot be reached (a certificate that does not verify, a refused
    // password) is told at once. The server starts either way.
    if let Err(error) = store.connect(CONNECT_WITHIN).await {
        tracing::error!(
            "cannot reach {name}: {error}; until it answers, each policy's fail mode applies"
        );
    }
    Ok((config.layer(settings.guard(store)), name))
}

/// How long start-up waits for Redis to answer.
const CONNECT_WITHIN: Duration = Duration::from_secs(5);
