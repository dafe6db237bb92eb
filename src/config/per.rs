//! A policy's `per` and `per_missing`: the key it counts under when not
//! the client's, from the sources the `[limiter]` and `[jwt]` sections
//! configure.

use http::HeaderName;
use toml::Spanned;

use super::ConfigError;
use super::JwtClaim;
use super::jwt::per_claim;
use super::raw::{PerMissingName, RawPolicy};
use crate::key::{Global, Header, KeyExtractor, PeerIp};
use crate::policy::{PerMissing, Policy};

/// The key sources a policy's `per` may name, as the file configures them.
pub(super) struct PerSources<'a> {
    /// The client address, behind the trusted proxies.
    pub(super) peer_ip: &'a PeerIp,
    /// `limiter.api_key_header` with the `[api_keys]` table.
    pub(super) api_key: &'a Header,
    /// The `[jwt]` section's verification.
    pub(super) jwt: Option<&'a JwtClaim>,
}

/// What `per` may say.
const EXPECTED: &str =
    "expected \"global\", \"ip\", \"api_key\", \"jwt:<claim>\" or \"header:<name>\"";

impl PerSources<'_> {
    /// `policy` counted per `body`'s `per`, with its `per_missing`; an
    /// error names the key of the policy `prefix`.
    pub(super) fn counted_per(
        &self,
        policy: Policy,
        body: &RawPolicy,
        prefix: &str,
        source: &str,
    ) -> Result<Policy, ConfigError> {
        let refuse = |offset: usize, key: &str, message: String| {
            ConfigError::at(source, offset, format!("{prefix}.{key}"), message)
        };
        let Some(per) = &body.per else {
            return match &body.per_missing {
                Some(missing) => Err(refuse(
                    missing.span().start,
                    "per_missing",
                    "applies only beside `per`".to_owned(),
                )),
                None => Ok(policy),
            };
        };
        let offset = per.span().start;
        let extractor = self
            .extractor(per.get_ref())
            .map_err(|message| refuse(offset, "per", message))?;
        let missing = match body.per_missing.as_ref().map(Spanned::get_ref) {
            None | Some(PerMissingName::Skip) => PerMissing::Skip,
            Some(PerMissingName::Refuse) => PerMissing::Refuse,
        };
        Ok(policy.per(extractor).with_per_missing(missing))
    }

    /// The extractor `per` names.
    fn extractor(&self, per: &str) -> Result<Box<dyn KeyExtractor>, String> {
        Ok(match per {
            "global" => Box::new(Global),
            "ip" => Box::new(self.peer_ip.clone()),
            // An unknown key is no key here: `per_missing` decides.
            "api_key" => Box::new(self.api_key.clone().with_unknown_rejected(false)),
            _ => match per.split_once(':') {
                Some(("jwt", claim)) if !claim.is_empty() => match self.jwt {
                    Some(jwt) => per_claim(jwt, claim),
                    None => return Err(format!("`{per}` needs a [jwt] section")),
                },
                Some(("header", name)) => {
                    let name = HeaderName::from_bytes(name.as_bytes())
                        .map_err(|_| format!("`{name}` is not a valid header name"))?;
                    Box::new(Header::trusted(name))
                }
                _ => return Err(format!("`{per}`: {EXPECTED}")),
            },
        })
    }
}

/// Whether a policy's `per` names a JWT claim, which needs `[jwt]`.
pub(super) fn names_a_claim(
    policies: &[Spanned<RawPolicy>],
    default: Option<&Spanned<RawPolicy>>,
) -> bool {
    policies
        .iter()
        .chain(default)
        .filter_map(|policy| policy.get_ref().per.as_ref())
        .any(|per| per.get_ref().starts_with("jwt:"))
}
