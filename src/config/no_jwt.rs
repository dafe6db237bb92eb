//! The `[jwt]` section in a build without the `jwt` feature: taken as any
//! table, and refused with a message that names the feature.

use std::path::Path;

use toml::Spanned;

use super::ConfigError;
use crate::key::KeyExtractor;

/// Whatever the section holds: it is refused before it is read.
pub(super) type RawJwt = toml::Table;

/// A JWT extractor, which a build without the `jwt` feature never has.
#[derive(Debug, Clone)]
pub(super) enum JwtClaim {}

/// The extractor of the key chain: there is none to give.
pub(super) fn boxed(jwt: &JwtClaim) -> Box<dyn KeyExtractor> {
    match *jwt {}
}

pub(super) fn per_claim(jwt: &JwtClaim, _claim: &str) -> Box<dyn KeyExtractor> {
    match *jwt {}
}

/// Refuses the `[jwt]` section: verifying tokens needs the `jwt` feature.
pub(super) fn jwt_claim(
    raw: Spanned<RawJwt>,
    source: &str,
    _base: &Path,
) -> Result<JwtClaim, ConfigError> {
    Err(ConfigError::at(
        source,
        raw.span().start,
        "jwt",
        "needs slidegate's `jwt` feature (features = [\"config\", \"jwt\"])",
    ))
}
