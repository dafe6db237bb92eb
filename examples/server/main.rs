//! A small video API behind slidegate: the crate's example server.
//!
//! ```sh
//! cargo run --example server                          # in-memory store, built-in demo config
//! REDIS_URL=redis://127.0.0.1:6379/ cargo run --example server
//! REDIS_URL=redis+cluster://127.0.0.1:7000,127.0.0.1:7001 cargo run --example server
//! cargo run --example server -- --config my.toml --bind 127.0.0.1:8080
//! ```

mod admin;
mod complete;
mod echo;
mod store;

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::Query;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use clap::Parser;
use metrics_exporter_prometheus::{Matcher, PrometheusHandle};
use serde_json::{Value, json};
use slidegate::config::Config;
use slidegate::layer::Changes;
use slidegate::{Policies, PoliciesHandle, Policy, RateLimitLayer, key::Identity};

const DEMO_CONFIG: &str = include_str!("../demo.toml");

/// The buckets of `slidegate_store_seconds`, in seconds.
const STORE_SECONDS_BUCKETS: [f64; 10] = [
    0.000_25, 0.000_5, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
];

/// The slidegate example server.
#[derive(Debug, Parser)]
#[command(about = "A small video API rate-limited by slidegate")]
struct Args {
    /// TOML configuration file; without it the built-in demo config runs.
    #[arg(long, env = "SLIDEGATE_CONFIG")]
    config: Option<PathBuf>,
    /// Address to listen on.
    #[arg(long, env = "BIND", default_value = "127.0.0.1:3000")]
    bind: SocketAddr,
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_ansi(std::io::stdout().is_terminal())
        .init();
    match run(Args::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let config = match &args.config {
        Some(path) => Config::from_file(path)?,
        None => Config::from_toml_str(DEMO_CONFIG)?,
    };
    warn_of_unserved_routes(config.policies());
    if config.policies().iter().next().is_none() {
        tracing::warn!(
            "the config defines no policy ([[policy]] or [default]): nothing is limited"
        );
    }
    // Installed before the first request, so that every counter reports.
    // The store's answer times as a Prometheus histogram (without buckets
    // the exporter renders a summary, whose quantiles cannot be summed
    // over instances): from 250 µs to the store's timeout and past it.
    let store_seconds = Matcher::Full("slidegate_store_seconds".to_owned());
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new()
        .set_buckets_for_metric(store_seconds, &STORE_SECONDS_BUCKETS)
        .map_err(|e| format!("cannot set the store's time buckets: {e}"))?
        .install_recorder()
        .map_err(|e| format!("cannot install the metrics recorder: {e}"))?;
    let (layer, store_name) = store::limiter(&config).await?;
    // The deny list and limits set at run time, before the first request.
    if let Err(error) = layer.changes().read().await {
        tracing::error!("cannot read the deny list and limits set at run time: {error}");
    }
    tokio::spawn(reload_on_sighup(
        args.config.clone(),
        layer.policies_handle(),
        layer.changes(),
    ));
    let app = app(layer, metrics, config.admin_token());

    let listener = tokio::net::TcpListener::bind(args.bind)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", args.bind))?;
    tracing::info!(
        "slidegate example server on http://{} ({store_name} store, config: {})",
        listener.local_addr()?,
        args.config
            .as_deref()
            .map_or("built-in demo".into(), |p| p.display().to_string()),
    );
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(shutdown_signal())
    .await?;
    tracing::info!("shut down");
    Ok(())
}

/// The routes behind the limiter.
const LIMITED_ROUTES: [&str; 7] = [
    "/api/videos",
    "/api/search",
    "/api/login",
    "/api/whoami",
    "/api/slow",
    "/api/complete",
    "/ws/echo",
];

/// The server's routes; the admin routes only with an admin token.
fn app(layer: RateLimitLayer, metrics: PrometheusHandle, admin_token: Option<&str>) -> Router {
    let [
        videos_route,
        search_route,
        login_route,
        whoami_route,
        slow_route,
        complete_route,
        echo_route,
    ] = LIMITED_ROUTES;
    // `/api/whoami` shows the client the limiter resolved; a completion
    // reserves the tokens it asks for.
    let layer = layer
        .with_identity_extension(true)
        .with_request_cost(complete::reservation);
    let app = Router::new()
        .route(videos_route, get(videos))
        .route(search_route, get(search))
        .route(login_route, post(login))
        .route(whoami_route, get(whoami))
        .route(slow_route, get(slow))
        .route(complete_route, post(complete::complete))
        .route(echo_route, get(echo::echo))
        // Only matched routes are limited: an unknown path stays 404.
        .route_layer(layer.clone())
        .route("/health", get(|| async { "ok" }))
        // Prometheus text, never limited.
        .route("/metrics", get(move || async move { metrics.render() }));
    match admin_token {
        Some(token) => app.merge(admin::routes(layer, token)),
        None => app,
    }
}

const VIDEOS: [(&str, &str); 4] = [
    ("v1", "Sliding windows explained"),
    ("v2", "Redis scripting in practice"),
    ("v3", "Rate limits at the edge"),
    ("v4", "Tower middleware from scratch"),
];

async fn videos() -> Json<Value> {
    let videos: Vec<Value> = VIDEOS
        .iter()
        .map(|(id, title)| json!({ "id": id, "title": title }))
        .collect();
    Json(json!({ "videos": videos }))
}

#[derive(serde::Deserialize)]
struct SearchQuery {
    #[serde(default)]
    q: String,
}

async fn search(Query(query): Query<SearchQuery>) -> Json<Value> {
    let needle = query.q.to_lowercase();
    let results: Vec<Value> = VIDEOS
        .iter()
        .filter(|(_, title)| title.to_lowercase().contains(&needle))
        .map(|(id, title)| json!({ "id": id, "title": title }))
        .collect();
    Json(json!({ "query": query.q, "results": results }))
}

/// `200` for the JSON body `{"user": "...", "password": "demo"}` (any
/// user), `401` for anything else, malformed bodies included.
async fn login(body: Bytes) -> (StatusCode, Json<Value>) {
    let accepted = serde_json::from_slice::<Value>(&body).is_ok_and(|body| {
        body["user"].as_str().is_some_and(|user| !user.is_empty()) && body["password"] == "demo"
    });
    if accepted {
        (StatusCode::OK, Json(json!({ "status": "logged in" })))
    } else {
        (
            StatusCode::UNAUTHORIZED,
            Json(json!({ "status": "wrong user or password" })),
        )
    }
}

/// The longest `/api/slow` sleeps.
const SLOWEST: Duration = Duration::from_secs(5);

#[derive(serde::Deserialize)]
struct SlowQuery {
    /// How long to sleep, in milliseconds (default 1,000, at most 5,000).
    ms: Option<u64>,
}

/// Sleeps `ms` milliseconds, then answers `200`: a slow request, for
/// trying concurrency limits and delays. `400` for an `ms` that is not a
/// whole number.
async fn slow(Query(query): Query<SlowQuery>) -> Json<Value> {
    let asked = Duration::from_millis(query.ms.unwrap_or(1_000));
    let slept = asked.min(SLOWEST);
    tokio::time::sleep(slept).await;
    Json(json!({ "slept_ms": slept.as_millis() as u64 }))
}

async fn whoami(identity: Option<Extension<Identity>>) -> Json<Value> {
    match identity {
        Some(Extension(identity)) => Json(json!({
            "key": identity.key.as_str(),
            "tier": identity.tier.as_deref(),
        })),
        None => {
            Json(json!({ "key": null, "tier": null, "note": "no policy applies to this route" }))
        }
    }
}

/// A policy route no route of this server has is a typo to report: its
/// requests would fall to the default policy.
fn warn_of_unserved_routes(policies: &Policies) {
    for route in policies.routes_outside(LIMITED_ROUTES) {
        tracing::warn!(%route, "a policy names a route this server does not serve");
    }
}

/// On each `SIGHUP`, reads the config file again and puts its policies in
/// force, logging what changed; a file that does not load is refused with
/// the same error as at start-up, and the policies in force stay, as they
/// do when the file defines no policy at all. Counts are kept by policy
/// name. Other sections (keys, Redis) need a restart.
async fn reload_on_sighup(path: Option<PathBuf>, handle: PoliciesHandle, changes: Changes) {
    use tokio::signal::unix::{SignalKind, signal};

    let Ok(mut hangups) = signal(SignalKind::hangup()) else {
        return;
    };
    while hangups.recv().await.is_some() {
        let Some(path) = &path else {
            tracing::warn!("SIGHUP: the built-in demo config has no file to reload");
            continue;
        };
        match Config::from_file(path) {
            Ok(config) => {
                let (old, new) = (handle.current(), config.policies().clone());
                if new.iter().next().is_none() && old.iter().next().is_some() {
                    // An emptied or truncated file, most likely: lifting
                    // every limit takes a restart.
                    tracing::error!(
                        path = %path.display(),
                        "SIGHUP: the file defines no policy; the policies in force stay"
                    );
                    continue;
                }
                warn_of_unserved_routes(&new);
                match handle.replace(new.clone()) {
                    Ok(()) => {
                        log_changes(&old, &new);
                        changes.replace_deny_list(config.deny_list().clone());
                        tracing::info!(
                            path = %path.display(),
                            "SIGHUP: policies reloaded, and [deny] (other sections take a restart)"
                        );
                    }
                    Err(error) => {
                        tracing::error!(%error, "SIGHUP: policies refused; the policies in force stay");
                    }
                }
            }
            Err(error) => {
                tracing::error!(%error, "SIGHUP: config refused; the policies in force stay");
            }
        }
    }
}

/// One line per policy added, removed or changed between `old` and `new`.
fn log_changes(old: &Policies, new: &Policies) {
    let describe = |policy: &Policy| {
        format!(
            "{} per {:?}, {:?}, cost {}, counts {:?}, fail {:?}{}",
            policy.limit(),
            policy.window(),
            policy.algorithm(),
            policy.cost(),
            policy.count(),
            policy.fail_mode(),
            if policy.is_shadow() { ", shadow" } else { "" }
        )
    };
    for policy in new.iter() {
        match old.iter().find(|p| p.name() == policy.name()) {
            None => tracing::info!(policy = policy.name(), now = %describe(policy), "policy added"),
            Some(before) if before != policy => tracing::info!(
                policy = policy.name(),
                was = %describe(before),
                now = %describe(policy),
                "policy changed"
            ),
            Some(_) => {}
        }
    }
    for policy in old
        .iter()
        .filter(|p| !new.iter().any(|n| n.name() == p.name()))
    {
        tracing::info!(policy = policy.name(), "policy removed");
    }
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
    tracing::info!("shutting down");
}
