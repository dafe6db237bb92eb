//! [`JwtClaimBuilder`]: how a [`JwtClaim`] is configured: its keys, the
//! algorithms it allows, its claims and the checks on a token.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use jsonwebtoken::{Algorithm, DecodingKey, Validation};

use super::{Inner, JwtClaim, JwtError, algorithm, family_name, public_key};

/// Builds a [`JwtClaim`]; see [`JwtClaim::builder`].
#[derive(Default)]
#[must_use]
pub struct JwtClaimBuilder {
    keys: Vec<(Option<String>, DecodingKey)>,
    algorithms: Vec<Algorithm>,
    /// The first key or algorithm name refused, for `build` to report.
    refused: Option<JwtError>,
    key_claim: Option<String>,
    tier_claim: Option<String>,
    leeway: Option<Duration>,
    issuers: Vec<String>,
    audiences: Vec<String>,
}

impl fmt::Debug for JwtClaimBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JwtClaimBuilder")
            .field("algorithms", &self.algorithms)
            .finish_non_exhaustive()
    }
}

impl JwtClaimBuilder {
    /// Verifies HS256/384/512 tokens with this shared secret.
    pub fn with_secret(mut self, secret: impl AsRef<[u8]>) -> Self {
        self.keys
            .push((None, DecodingKey::from_secret(secret.as_ref())));
        self
    }

    /// Verifies HS* tokens whose header names `kid` with this secret: for
    /// rotating keys, each token verified by the key it names. A token
    /// naming a `kid` that no key has is refused (`unknown_key`) unless a
    /// key was given without one.
    ///
    /// ```
    /// use slidegate::JwtClaim;
    ///
    /// let jwt = JwtClaim::builder()
    ///     .with_secret_for_kid("2026-10", "old secret")
    ///     .with_secret_for_kid("2026-11", "new secret")
    ///     .with_algorithms(["HS256"])
    ///     .build()?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn with_secret_for_kid(mut self, kid: impl Into<String>, secret: impl AsRef<[u8]>) -> Self {
        self.keys
            .push((Some(kid.into()), DecodingKey::from_secret(secret.as_ref())));
        self
    }

    /// Verifies RS*/PS*, ES256/ES384 or EdDSA tokens with this PEM-encoded
    /// public key (its type is read from the PEM).
    ///
    /// ```no_run
    /// use slidegate::JwtClaim;
    ///
    /// // The public key your identity provider publishes, deployed with the service.
    /// let pem = std::fs::read("/etc/myapp/jwt-public.pem")?;
    /// let jwt = JwtClaim::builder()
    ///     .with_public_key_pem(&pem)
    ///     .with_algorithms(["RS256"])
    ///     .build()?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// A key that does not parse is refused at `build()`:
    ///
    /// ```
    /// use slidegate::JwtClaim;
    ///
    /// let refused = JwtClaim::builder().with_public_key_pem(b"not a key").with_algorithms(["RS256"]);
    /// assert!(refused.build().is_err());
    /// ```
    pub fn with_public_key_pem(self, pem: &[u8]) -> Self {
        self.with_key(None, public_key(pem))
    }

    /// Verifies RS*/PS*, ES* or EdDSA tokens whose header names `kid` with
    /// this PEM-encoded public key; see [`with_secret_for_kid`](Self::with_secret_for_kid).
    pub fn with_public_key_pem_for_kid(self, kid: impl Into<String>, pem: &[u8]) -> Self {
        self.with_key(Some(kid.into()), public_key(pem))
    }

    fn with_key(mut self, kid: Option<String>, key: Result<DecodingKey, JwtError>) -> Self {
        match key {
            Ok(key) => self.keys.push((kid, key)),
            Err(error) => {
                self.refused.get_or_insert(error);
            }
        }
        self
    }

    /// The algorithms a token may be signed with, by name (`"HS256"`,
    /// `"RS256"`, `"ES256"`, `"EdDSA"`, ...); every other is refused. An
    /// unknown name, `none` included, is an error of
    /// [`build`](Self::build).
    ///
    /// ```
    /// use slidegate::{JwtClaim, key::JwtError};
    ///
    /// let refused = JwtClaim::builder().with_secret(b"s").with_algorithms(["none"]).build();
    /// assert_eq!(refused.unwrap_err(), JwtError::UnknownAlgorithm("none".into()));
    /// ```
    pub fn with_algorithms<T: AsRef<str>>(mut self, names: impl IntoIterator<Item = T>) -> Self {
        self.algorithms.clear();
        for name in names {
            match algorithm(name.as_ref()) {
                Ok(algorithm) => self.algorithms.push(algorithm),
                Err(error) => {
                    self.refused.get_or_insert(error);
                }
            }
        }
        self
    }

    /// The claim that identifies the client (default `sub`).
    pub fn with_key_claim(mut self, claim: impl Into<String>) -> Self {
        self.key_claim = Some(claim.into());
        self
    }

    /// The claim that names the client's tier (default: none).
    pub fn with_tier_claim(mut self, claim: impl Into<String>) -> Self {
        self.tier_claim = Some(claim.into());
        self
    }

    /// Clock skew allowed when checking `exp` and `nbf` (default 5 s,
    /// whole seconds).
    pub fn with_leeway(mut self, leeway: Duration) -> Self {
        self.leeway = Some(leeway);
        self
    }

    /// Accepts only tokens whose `iss` is one of `issuers`; the claim
    /// becomes required.
    pub fn with_issuers<T: Into<String>>(mut self, issuers: impl IntoIterator<Item = T>) -> Self {
        self.issuers = issuers.into_iter().map(Into::into).collect();
        self
    }

    /// Accepts only tokens whose `aud` includes one of `audiences`; the
    /// claim becomes required. Without it, tokens carrying an `aud` are
    /// accepted whatever it says.
    pub fn with_audiences<T: Into<String>>(
        mut self,
        audiences: impl IntoIterator<Item = T>,
    ) -> Self {
        self.audiences = audiences.into_iter().map(Into::into).collect();
        self
    }

    /// Checks the keys and algorithms given, and that every allowed
    /// algorithm has a key to verify it.
    pub fn build(self) -> Result<JwtClaim, JwtError> {
        if let Some(refused) = self.refused {
            return Err(refused);
        }
        if self.algorithms.is_empty() {
            return Err(JwtError::NoAlgorithms);
        }
        for &algorithm in &self.algorithms {
            if !self
                .keys
                .iter()
                .any(|(_, k)| k.family() == algorithm.family())
            {
                return Err(JwtError::NoKeyFor {
                    algorithm: format!("{algorithm:?}"),
                    family: family_name(algorithm),
                });
            }
        }
        let key_claim = self.key_claim.unwrap_or_else(|| "sub".to_owned());
        if key_claim.is_empty() {
            return Err(JwtError::EmptyKeyClaim);
        }
        let leeway = self.leeway.unwrap_or(Duration::from_secs(5)).as_secs();
        let mut required = vec!["exp"];
        if !self.issuers.is_empty() {
            required.push("iss");
        }
        if !self.audiences.is_empty() {
            required.push("aud");
        }
        let validations = self
            .algorithms
            .iter()
            .map(|&algorithm| {
                let mut validation = Validation::new(algorithm);
                validation.leeway = leeway;
                validation.validate_nbf = true;
                validation.required_spec_claims.clear();
                if !self.issuers.is_empty() {
                    validation.set_issuer(&self.issuers);
                }
                if self.audiences.is_empty() {
                    validation.validate_aud = false;
                } else {
                    validation.set_audience(&self.audiences);
                }
                validation
            })
            .collect();
        JwtClaim::install_crypto_provider();
        Ok(JwtClaim {
            inner: Arc::new(Inner {
                keys: self.keys,
                algorithms: self.algorithms,
                validations,
                required,
                key_claim,
                tier_claim: self.tier_claim,
                missing_claim_unkeyed: false,
                label: "jwt".to_owned(),
            }),
        })
    }
}
