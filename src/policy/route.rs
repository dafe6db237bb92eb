//! [`Route`]: which requests a policy applies to.

use std::fmt;

use http::Method;

use super::PolicyError;

/// Which requests a policy applies to: an HTTP method (or any) and a route
/// pattern as axum spells it (`/users/{id}`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Route {
    pub(super) method: Option<Method>,
    pub(super) pattern: String,
}

impl Route {
    /// Parses `"METHOD /pattern"` or `"/pattern"` (any method), accepting
    /// the extension `methods` beside the standard nine; see
    /// [`PoliciesBuilder::with_route`](crate::policy::PoliciesBuilder::with_route).
    pub(crate) fn parse_allowing(route: &str, methods: &[Method]) -> Result<Self, PolicyError> {
        let invalid = || PolicyError::InvalidRoute {
            route: route.to_owned(),
        };
        let route_text = route.trim();
        let (method, pattern) = match route_text.split_once(char::is_whitespace) {
            Some((method, pattern)) => {
                // Methods are case-sensitive: `get` is a method of its
                // own that no client sends for GET, so it would never match.
                if method.bytes().any(|b| b.is_ascii_lowercase()) {
                    let upper = method.to_ascii_uppercase();
                    return Err(PolicyError::InvalidPattern {
                        route: route_text.to_owned(),
                        reason: format!(
                            "methods are case-sensitive and `{method}` is not `{upper}`: write `{upper}`"
                        ),
                    });
                }
                let method = Method::from_bytes(method.as_bytes()).map_err(|_| invalid())?;
                if !is_standard(&method) && !methods.contains(&method) {
                    return Err(PolicyError::UnknownMethod {
                        route: route_text.to_owned(),
                        method: method.to_string(),
                    });
                }
                (Some(method), pattern.trim())
            }
            None => (None, route_text),
        };
        if !pattern.starts_with('/') || pattern.contains(char::is_whitespace) {
            return Err(invalid());
        }
        if let Some(reason) = old_capture(pattern) {
            return Err(PolicyError::InvalidPattern {
                route: route_text.to_owned(),
                reason,
            });
        }
        Ok(Self {
            method,
            pattern: pattern.to_owned(),
        })
    }

    /// Whether a request with `method` on the route pattern `path` matches.
    /// (Through [`Policies`](crate::Policies), a `GET` route also governs `HEAD`, as axum
    /// routes it.)
    pub(crate) fn matches(&self, method: &Method, path: &str) -> bool {
        self.method.as_ref().is_none_or(|m| m == method) && self.pattern == path
    }
}

/// Whether `method` is one of the nine HTTP defines (RFC 9110 and RFC 5789).
pub(crate) fn is_standard(method: &Method) -> bool {
    [
        Method::GET,
        Method::HEAD,
        Method::POST,
        Method::PUT,
        Method::DELETE,
        Method::CONNECT,
        Method::OPTIONS,
        Method::TRACE,
        Method::PATCH,
    ]
    .contains(method)
}

/// Why `pattern` would never match under axum 0.8: a segment in axum
/// 0.7's capture syntax (`:id`, `*rest`), which axum 0.8 refuses to route
/// and so never names in `MatchedPath`.
fn old_capture(pattern: &str) -> Option<String> {
    let segment = pattern
        .split('/')
        .find(|segment| segment.starts_with([':', '*']))?;
    let (sigil, name) = segment.split_at(1);
    let spelling = if sigil == ":" {
        format!("{{{name}}}")
    } else {
        format!("{{*{name}}}")
    };
    Some(format!(
        "`{segment}` is axum 0.7's capture syntax, which axum 0.8 refuses; write `{spelling}`"
    ))
}

impl fmt::Display for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.method {
            Some(method) => write!(f, "{method} {}", self.pattern),
            None => f.write_str(&self.pattern),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axum_07_captures_are_refused_with_the_right_spelling() {
        for (route, reason) in [
            (
                "GET /api/videos/:id",
                "`:id` is axum 0.7's capture syntax, which axum 0.8 refuses; write `{id}`",
            ),
            (
                "/files/*path",
                "`*path` is axum 0.7's capture syntax, which axum 0.8 refuses; write `{*path}`",
            ),
        ] {
            let error = Route::parse_allowing(route, &[]).unwrap_err();
            assert_eq!(
                error,
                PolicyError::InvalidPattern {
                    route: route.to_owned(),
                    reason: reason.to_owned(),
                }
            );
            assert!(error.to_string().contains(reason), "{error}");
        }
        // A colon inside a segment is a literal, in axum as here.
        assert!(Route::parse_allowing("GET /v1/items:batch", &[]).is_ok());
    }

    #[test]
    fn a_method_http_does_not_define_is_refused_unless_allowed() {
        for route in ["GTE /api/videos", "PURGE /cache", "GETT /x"] {
            let error = Route::parse_allowing(route, &[]).unwrap_err();
            assert!(
                matches!(error, PolicyError::UnknownMethod { .. }),
                "{error}"
            );
            assert_eq!(error.field(), "route");
        }
        let message = Route::parse_allowing("GTE /api/videos", &[])
            .unwrap_err()
            .to_string();
        assert!(message.contains("`GTE`"), "{message}");
        let purge = Method::from_bytes(b"PURGE").unwrap();
        let route = Route::parse_allowing("PURGE /cache", std::slice::from_ref(&purge)).unwrap();
        assert!(route.matches(&purge, "/cache"));
        assert!(Route::parse_allowing("GTE /cache", &[purge]).is_err());
        for method in [
            "GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH",
        ] {
            assert!(
                Route::parse_allowing(&format!("{method} /x"), &[]).is_ok(),
                "{method}"
            );
        }
    }

    #[test]
    fn route_display_round_trips() {
        for text in ["GET /api/search", "/api/videos", "POST /users/{id}"] {
            assert_eq!(Route::parse_allowing(text, &[]).unwrap().to_string(), text);
        }
    }
}
