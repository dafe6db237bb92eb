//! A gRPC service behind slidegate: the standard health service
//! (`grpc.health.v1.Health`, answering `SERVING`), five `Check` calls a
//! minute per client IP. Over the limit a call ends with
//! `RESOURCE_EXHAUSTED`, and its metadata says when to retry
//! (`retry-after` in seconds, `grpc-retry-pushback-ms`).
//!
//! ```sh
//! cargo run --example grpc                          # 127.0.0.1:50051, in memory
//! REDIS_URL=redis://127.0.0.1:6379/ cargo run --example grpc
//! cargo run --example grpc -- --config my.toml --bind 127.0.0.1:50052
//! ```
//!
//! A policy's route is the gRPC method's path: `POST
//! /grpc.health.v1.Health/Check` (every gRPC call is a `POST`).

#[path = "server/store.rs"]
mod store;

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use slidegate::config::Config;
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;
use tower::filter::FilterLayer;

/// The built-in configuration: five `Check` calls a minute per client IP.
const BUILT_IN: &str = r#"
[limiter]
keys = ["ip"]

[[policy]]
name = "health-check"
route = "POST /grpc.health.v1.Health/Check"
limit = 5
window = "60s"
"#;

/// The slidegate gRPC example.
#[derive(Debug, Parser)]
#[command(about = "The gRPC health service rate-limited by slidegate")]
struct Args {
    /// TOML configuration file (the example server's format); without
    /// it, five `Check` calls a minute per client IP.
    #[arg(long, env = "SLIDEGATE_CONFIG")]
    config: Option<PathBuf>,
    /// Address to listen on.
    #[arg(long, env = "BIND", default_value = "127.0.0.1:50051")]
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
        None => Config::from_toml_str(BUILT_IN)?,
    };
    warn_of_what_is_not_limited(&config);
    // The layer answers gRPC calls with gRPC statuses by itself
    // (RESOURCE_EXHAUSTED over a limit): no hook needed.
    let (layer, store_name) = store::limiter(&config).await?;
    let (_reporter, health) = tonic_health::server::health_reporter();

    let listener = tokio::net::TcpListener::bind(args.bind)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", args.bind))?;
    tracing::info!(
        "slidegate gRPC example on {} ({store_name} store, config: {})",
        listener.local_addr()?,
        args.config
            .as_deref()
            .map_or("built-in".into(), |p| p.display().to_string()),
    );
    // With slidegate's `tonic` feature, `PeerIp` reads the peer address
    // tonic records: the layer goes on as it is. tonic serves a call
    // whatever its HTTP method, so other methods are refused first: a
    // policy for `POST /pkg.Service/Method` cannot be gone round.
    Server::builder()
        .layer(FilterLayer::new(only_post))
        .layer(layer)
        .add_service(health)
        .serve_with_incoming_shutdown(TcpIncoming::from(listener), async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}

/// Lets only `POST` requests through, as every gRPC call is one.
fn only_post(
    request: http::Request<tonic::body::Body>,
) -> Result<http::Request<tonic::body::Body>, tonic::Status> {
    if request.method() == http::Method::POST {
        Ok(request)
    } else {
        Err(tonic::Status::unimplemented(
            "a gRPC call is a POST request",
        ))
    }
}

/// Warns of what the config leaves unlimited: everything when it defines
/// no policy, and the calls of a route no gRPC call can match (every call
/// is a `POST`).
fn warn_of_what_is_not_limited(config: &Config) {
    let policies = config.policies();
    if policies.iter().next().is_none() {
        tracing::warn!(
            "the config defines no policy ([[policy]] or [default]): nothing is limited"
        );
    }
    for route in policies.routes_outside([]).map(|route| route.to_string()) {
        // A route reads "METHOD /pattern", or "/pattern" for any method.
        if !route.starts_with('/') && !route.starts_with("POST ") {
            tracing::warn!(%route, "every gRPC call is a POST: this route never matches one");
        }
    }
}
