//! Mints an HS256 token that the example server's built-in demo config
//! accepts, for trying tiers with curl.
//!
//! ```sh
//! cargo run -q --example mint_token -- alice pro     # sub = alice, tier = pro
//! cargo run -q --example mint_token -- bob           # no tier: the base limits
//! cargo run -q --example mint_token -- carol free --ttl 10s
//! ```

use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::Parser;
use jsonwebtoken::{Algorithm, EncodingKey, Header, encode};

const DEMO_CONFIG: &str = include_str!("demo.toml");

/// Mint a demo JWT for the slidegate example server.
#[derive(Debug, Parser)]
struct Args {
    /// The `sub` claim: who the client is.
    subject: String,
    /// The `tier` claim (e.g. `pro`); none by default.
    tier: Option<String>,
    /// How long the token is valid.
    #[arg(long, default_value = "1h", value_parser = humantime::parse_duration)]
    ttl: Duration,
    /// The HS256 secret; defaults to the demo config's `[jwt] secret`.
    #[arg(long)]
    secret: Option<String>,
}

fn demo_secret() -> Result<String, String> {
    let config: toml::Table = toml::from_str(DEMO_CONFIG).map_err(|e| e.to_string())?;
    config
        .get("jwt")
        .and_then(|jwt| jwt.get("secret"))
        .and_then(|secret| secret.as_str())
        .map(str::to_owned)
        .ok_or_else(|| "the demo config has no [jwt] secret".to_owned())
}

fn main() -> ExitCode {
    let args = Args::parse();
    let secret = match args.secret.map_or_else(demo_secret, Ok) {
        Ok(secret) => secret,
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::FAILURE;
        }
    };
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let mut claims = serde_json::json!({
        "sub": args.subject,
        "iat": now.as_secs(),
        "exp": (now + args.ttl).as_secs(),
    });
    if let Some(tier) = args.tier {
        claims["tier"] = tier.into();
    }
    // The backend slidegate would verify with (jsonwebtoken does not
    // choose on its own when a build compiles in both).
    slidegate::JwtClaim::install_crypto_provider();
    match encode(
        &Header::new(Algorithm::HS256),
        &claims,
        &EncodingKey::from_secret(secret.as_bytes()),
    ) {
        Ok(token) => {
            println!("{token}");
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}
