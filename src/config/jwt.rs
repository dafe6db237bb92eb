//! The `[jwt]` section: a [`JwtClaim`] key extractor.

use std::path::{Path, PathBuf};
use std::str::FromStr;

use jsonwebtoken::{Algorithm, AlgorithmFamily};
use serde::Deserialize;
use toml::Spanned;

use super::ConfigError;
use super::value::HumanDuration;
use crate::key::jwt::{algorithm, public_key};
use crate::key::{JwtClaim, JwtClaimBuilder, JwtError};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawJwt {
    secret: Option<Spanned<String>>,
    public_key_pem: Option<Spanned<PathBuf>>,
    algorithms: Option<Spanned<Vec<String>>>,
    key_claim: Option<Spanned<String>>,
    tier_claim: Option<String>,
    leeway: Option<Spanned<HumanDuration>>,
    issuer: Option<OneOrMany>,
    audience: Option<OneOrMany>,
    keys: Option<Vec<Spanned<RawJwtKey>>>,
}

/// One key of `[[jwt.keys]]`: a token naming `kid` is verified with it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawJwtKey {
    kid: String,
    algorithm: Spanned<String>,
    secret: Option<String>,
    public_key_pem: Option<Spanned<PathBuf>>,
}

/// A string, or a list of them.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    fn into_vec(self) -> Vec<String> {
        match self {
            Self::One(one) => vec![one],
            Self::Many(many) => many,
        }
    }
}

pub(super) fn jwt_claim(
    raw: Spanned<RawJwt>,
    source: &str,
    base: &Path,
) -> Result<JwtClaim, ConfigError> {
    let section = raw.span().start;
    let raw = raw.into_inner();
    let mut builder = JwtClaim::builder();
    let keyed = raw.keys.unwrap_or_default();
    if raw.secret.is_none() && raw.public_key_pem.is_none() && keyed.is_empty() {
        return Err(ConfigError::at(
            source,
            section,
            "jwt",
            "needs `secret` (HS*), `public_key_pem` (RS*, PS*, ES*, EdDSA) or [[jwt.keys]]",
        ));
    }
    if let Some(secret) = &raw.secret {
        if secret.get_ref().is_empty() {
            return Err(ConfigError::at(
                source,
                secret.span().start,
                "jwt.secret",
                "must not be empty",
            ));
        }
        builder = builder.with_secret(secret.get_ref());
    }
    if let Some(pem) = &raw.public_key_pem {
        let offset = pem.span().start;
        let path = base.join(pem.get_ref());
        let bytes = std::fs::read(&path).map_err(|e| {
            ConfigError::at(
                source,
                offset,
                "jwt.public_key_pem",
                format!("cannot read `{}`: {e}", path.display()),
            )
        })?;
        public_key(&bytes).map_err(|e| {
            ConfigError::at(
                source,
                offset,
                "jwt.public_key_pem",
                format!("`{}`: {e}", path.display()),
            )
        })?;
        builder = builder.with_public_key_pem(&bytes);
    }
    let mut keyed_algorithms = Vec::new();
    for (index, key) in keyed.into_iter().enumerate() {
        let (builder_with_key, algorithm) = keyed_key(builder, key, index, source, base)?;
        builder = builder_with_key;
        if !keyed_algorithms.contains(&algorithm) {
            keyed_algorithms.push(algorithm);
        }
    }
    let (mut names, names_offset) = match &raw.algorithms {
        Some(names) => (names.get_ref().clone(), names.span().start),
        None if raw.secret.is_some() => (vec!["HS256".to_owned()], section),
        None if raw.public_key_pem.is_none() => (Vec::new(), section),
        None => {
            return Err(ConfigError::at(
                source,
                section,
                "jwt.algorithms",
                "is required with `public_key_pem`, e.g. [\"RS256\"]",
            ));
        }
    };
    // Each `[[jwt.keys]]` entry allows its own algorithm.
    for algorithm in keyed_algorithms {
        if !names.contains(&algorithm) {
            names.push(algorithm);
        }
    }
    for name in &names {
        algorithm(name)
            .map_err(|e| ConfigError::at(source, names_offset, "jwt.algorithms", e.to_string()))?;
    }
    builder = builder.with_algorithms(&names);
    if let Some(claim) = raw.key_claim {
        builder = builder.with_key_claim(claim.into_inner());
    }
    if let Some(claim) = raw.tier_claim {
        builder = builder.with_tier_claim(claim);
    }
    if let Some(leeway) = raw.leeway {
        builder = builder.with_leeway(leeway.get_ref().0);
    }
    if let Some(issuer) = raw.issuer {
        builder = builder.with_issuers(issuer.into_vec());
    }
    if let Some(audience) = raw.audience {
        builder = builder.with_audiences(audience.into_vec());
    }
    builder.build().map_err(|e| {
        let key = match e {
            JwtError::EmptyKeyClaim => "jwt.key_claim",
            _ => "jwt.algorithms",
        };
        ConfigError::at(source, names_offset, key, e.to_string())
    })
}

/// Adds the `[[jwt.keys]]` entry at `index` to `builder`, and returns its
/// algorithm's name.
fn keyed_key(
    builder: JwtClaimBuilder,
    key: Spanned<RawJwtKey>,
    index: usize,
    source: &str,
    base: &Path,
) -> Result<(JwtClaimBuilder, String), ConfigError> {
    let offset = key.span().start;
    let path = format!("jwt.keys[{index}]");
    let key = key.into_inner();
    let algorithm = key.algorithm.get_ref().clone();
    let parsed = Algorithm::from_str(&algorithm).map_err(|_| {
        ConfigError::at(
            source,
            key.algorithm.span().start,
            format!("{path}.algorithm"),
            format!("unknown JWT algorithm `{algorithm}`"),
        )
    })?;
    let wants_secret = parsed.family() == AlgorithmFamily::Hmac;
    if wants_secret != key.secret.is_some() {
        let needs = if wants_secret {
            "`secret`"
        } else {
            "`public_key_pem`"
        };
        return Err(ConfigError::at(
            source,
            offset,
            path,
            format!("{algorithm} needs {needs}"),
        ));
    }
    let builder = match (key.secret, key.public_key_pem) {
        (Some(secret), None) if !secret.is_empty() => builder.with_secret_for_kid(key.kid, secret),
        (None, Some(pem)) => {
            let file = base.join(pem.get_ref());
            let bytes = std::fs::read(&file).map_err(|e| {
                ConfigError::at(
                    source,
                    pem.span().start,
                    format!("{path}.public_key_pem"),
                    format!("cannot read `{}`: {e}", file.display()),
                )
            })?;
            public_key(&bytes).map_err(|e| {
                ConfigError::at(
                    source,
                    pem.span().start,
                    format!("{path}.public_key_pem"),
                    format!("`{}`: {e}", file.display()),
                )
            })?;
            builder.with_public_key_pem_for_kid(key.kid, &bytes)
        }
        _ => {
            return Err(ConfigError::at(
                source,
                offset,
                path,
                "needs one of `secret` (not empty) or `public_key_pem`",
            ));
        }
    };
    Ok((builder, algorithm))
}

/// The extractor of the key chain.
pub(super) fn boxed(jwt: &JwtClaim) -> Box<dyn crate::key::KeyExtractor> {
    Box::new(jwt.clone())
}

/// `jwt`'s verification, keyed by the claim `claim`, for a policy's
/// `per = "jwt:<claim>"`.
pub(super) fn per_claim(jwt: &JwtClaim, claim: &str) -> Box<dyn crate::key::KeyExtractor> {
    Box::new(jwt.per_claim(claim))
}
