//! The `[jwt]` section: a [`JwtClaim`] key extractor.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use toml::Spanned;

use super::{ConfigError, HumanDuration};
use crate::key::{JwtClaim, JwtError};

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
    if raw.secret.is_none() && raw.public_key_pem.is_none() {
        return Err(ConfigError::at(
            source,
            section,
            "jwt",
            "needs `secret` (HS*) or `public_key_pem` (RS*, PS*, ES*, EdDSA)",
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
        builder = builder.secret(secret.get_ref());
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
        builder = builder.public_key_pem(&bytes).map_err(|e| {
            ConfigError::at(
                source,
                offset,
                "jwt.public_key_pem",
                format!("`{}`: {e}", path.display()),
            )
        })?;
    }
    let (names, names_offset) = match &raw.algorithms {
        Some(names) => (names.get_ref().clone(), names.span().start),
        None if raw.secret.is_some() => (vec!["HS256".to_owned()], section),
        None => {
            return Err(ConfigError::at(
                source,
                section,
                "jwt.algorithms",
                "is required with `public_key_pem`, e.g. [\"RS256\"]",
            ));
        }
    };
    builder = builder
        .algorithm_names(&names)
        .map_err(|e| ConfigError::at(source, names_offset, "jwt.algorithms", e.to_string()))?;
    if let Some(claim) = raw.key_claim {
        builder = builder.key_claim(claim.into_inner());
    }
    if let Some(claim) = raw.tier_claim {
        builder = builder.tier_claim(claim);
    }
    if let Some(leeway) = raw.leeway {
        builder = builder.leeway(leeway.get_ref().0);
    }
    if let Some(issuer) = raw.issuer {
        builder = builder.issuers(issuer.into_vec());
    }
    if let Some(audience) = raw.audience {
        builder = builder.audiences(audience.into_vec());
    }
    builder.build().map_err(|e| {
        let key = match e {
            JwtError::EmptyKeyClaim => "jwt.key_claim",
            _ => "jwt.algorithms",
        };
        ConfigError::at(source, names_offset, key, e.to_string())
    })
}
