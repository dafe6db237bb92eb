//! [`Policies`]: the validated set of a layer's policies, and the table
//! that selects a request's policies by route and method.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use http::Method;

use super::plan::Plan;
use super::{Policy, PolicyError, Route};

#[derive(Debug)]
struct Scoped {
    route: Option<Route>,
    policy: Arc<Policy>,
}

/// The validated set of policies of a layer: route-scoped ones, ones for
/// every route, and a default for requests no route-scoped policy matches.
///
/// Every policy whose route matches applies; a request is admitted only if
/// all of them admit it.
///
/// ```
/// use slidegate::{Policies, Policy};
/// use std::time::Duration;
///
/// let policies = Policies::builder()
///     .with_route("GET /api/search", Policy::new("search", 5, Duration::from_secs(60)))
///     .with_every_route(Policy::new("account", 1000, Duration::from_secs(3600)))
///     .with_default(Policy::new("default", 100, Duration::from_secs(60)))
///     .build()
///     .unwrap();
/// let names: Vec<_> = policies
///     .select(&http::Method::GET, "/api/search")
///     .iter()
///     .map(|p| p.name().to_owned())
///     .collect();
/// assert_eq!(names, ["search", "account"]);
/// ```
///
/// # Routes
///
/// A policy's route is a pattern as axum spells it (`GET /users/{id}`).
/// Under axum it is compared with the pattern the router matched
/// (`MatchedPath`), so it must be spelled as the router's route is;
/// outside axum a request's path is matched against the patterns as axum's
/// router would (`/users/42` falls under `/users/{id}`). Patterns axum
/// would refuse are refused when the policies are built, with a
/// [`PolicyError`] naming the pattern: an
/// unclosed `{id`, two that conflict, and axum 0.7's captures (`:id`,
/// `*rest`, which axum 0.8 no longer routes, so such a policy would never
/// apply; the error gives the spelling to use, `{id}` or `{*rest}`). The
/// layer cannot see the router's routes, so a pattern that names no route
/// (a typo) would send its requests to the default policy without a word:
/// [`Policies::routes_outside`]`(patterns)`
/// lists such routes against the patterns you serve, and the example
/// server warns of them at start-up.
///
/// A `HEAD` request on a `GET` route is counted as that `GET` (axum runs
/// the `GET` handler for it), unless a policy names `HEAD` for the route.
#[derive(Debug, Clone)]
pub struct Policies {
    scoped: Arc<[Scoped]>,
    default: Option<Arc<Policy>>,
    selections: Arc<Selections>,
}

/// The answer of [`Policies::select`] for every route pattern and method,
/// worked out once when the policies are built.
#[derive(Debug)]
struct Selections {
    by_pattern: HashMap<String, PatternSelections>,
    /// The patterns, to match a request's path against outside axum, as
    /// axum's router (matchit) would.
    paths: matchit::Router<String>,
    /// For requests whose route no policy names.
    elsewhere: Arc<Plan>,
}

#[derive(Debug)]
struct PatternSelections {
    by_method: Vec<(Method, Arc<Plan>)>,
    other_methods: Arc<Plan>,
}

impl Selections {
    fn new(scoped: &[Scoped], default: Option<&Arc<Policy>>) -> Result<Self, PolicyError> {
        let elsewhere = Arc::new(Plan::new(
            scoped
                .iter()
                .filter(|s| s.route.is_none())
                .map(|s| s.policy.clone())
                .chain(default.cloned())
                .collect(),
        ));
        let mut by_pattern = HashMap::new();
        let mut paths = matchit::Router::new();
        for route in scoped.iter().filter_map(|s| s.route.as_ref()) {
            if by_pattern.contains_key(&route.pattern) {
                continue;
            }
            paths
                .insert(route.pattern.clone(), route.pattern.clone())
                .map_err(|error| PolicyError::InvalidPattern {
                    route: route.to_string(),
                    reason: error.to_string(),
                })?;
            let mut methods: Vec<Method> = Vec::new();
            for method in scoped
                .iter()
                .filter_map(|s| s.route.as_ref())
                .filter(|r| r.pattern == route.pattern)
                .filter_map(|r| r.method.as_ref())
            {
                if !methods.contains(method) {
                    methods.push(method.clone());
                }
            }
            // axum serves `HEAD` with the `GET` handler unless a route names
            // `HEAD`: so do the policies, sharing the `GET` counts.
            if methods.contains(&Method::GET) && !methods.contains(&Method::HEAD) {
                methods.push(Method::HEAD);
            }
            // A method no route names stands for every such method.
            let other = Method::from_bytes(b"SLIDEGATE-OTHER-METHOD").expect("a valid token");
            let selections = PatternSelections {
                by_method: methods
                    .into_iter()
                    .map(|m| {
                        let selected = select_slowly(scoped, default, &m, &route.pattern);
                        (m, Arc::new(Plan::new(selected)))
                    })
                    .collect(),
                other_methods: Arc::new(Plan::new(select_slowly(
                    scoped,
                    default,
                    &other,
                    &route.pattern,
                ))),
            };
            by_pattern.insert(route.pattern.clone(), selections);
        }
        Ok(Self {
            by_pattern,
            paths,
            elsewhere,
        })
    }

    /// The selections of the pattern `route`, or of the pattern the path
    /// `route` matches.
    fn of(&self, route: &str, is_path: bool) -> Option<&PatternSelections> {
        match self.by_pattern.get(route) {
            Some(selections) => Some(selections),
            None if is_path => {
                let pattern = self.paths.at(route).ok()?.value;
                self.by_pattern.get(pattern)
            }
            None => None,
        }
    }
}

/// Every policy whose route matches, in order, and the default when no
/// route-scoped policy does. A `HEAD` request is a `GET` unless a route of
/// its pattern names `HEAD`.
fn select_slowly(
    scoped: &[Scoped],
    default: Option<&Arc<Policy>>,
    method: &Method,
    path: &str,
) -> Vec<Arc<Policy>> {
    let head_named = scoped.iter().any(|s| {
        s.route
            .as_ref()
            .is_some_and(|r| r.pattern == path && r.method.as_ref() == Some(&Method::HEAD))
    });
    let method = if *method == Method::HEAD && !head_named {
        &Method::GET
    } else {
        method
    };
    let mut selected = Vec::new();
    let mut route_matched = false;
    for scoped in scoped {
        match &scoped.route {
            Some(route) if route.matches(method, path) => {
                route_matched = true;
                selected.push(scoped.policy.clone());
            }
            Some(_) => {}
            None => selected.push(scoped.policy.clone()),
        }
    }
    if let (false, Some(default)) = (route_matched, default) {
        selected.push(default.clone());
    }
    selected
}

impl Policies {
    /// Starts an empty set of policies.
    pub fn builder() -> PoliciesBuilder {
        PoliciesBuilder::default()
    }

    /// A set holding one policy applied to every request.
    ///
    /// ```
    /// use slidegate::{Policies, Policy};
    /// use std::time::Duration;
    ///
    /// let policies = Policies::single(Policy::new("all", 10, Duration::from_secs(1))).unwrap();
    /// assert_eq!(policies.select(&http::Method::GET, "/anything").len(), 1);
    /// ```
    pub fn single(policy: Policy) -> Result<Self, PolicyError> {
        Self::builder().with_every_route(policy).build()
    }

    /// The policies that apply to a request with `method` on `route`: the
    /// pattern axum matched (`/users/{id}`, from `MatchedPath`), or, for a
    /// service outside axum, the request's path (`/users/42`), matched
    /// against the policies' patterns as axum's router would. A lookup in
    /// a table built with the policies, whatever their number.
    ///
    /// ```
    /// use slidegate::{Policies, Policy};
    /// use std::time::Duration;
    ///
    /// let policies = Policies::builder()
    ///     .with_route("GET /users/{id}", Policy::new("user", 5, Duration::from_secs(60)))
    ///     .build()
    ///     .unwrap();
    /// assert_eq!(policies.select(&http::Method::GET, "/users/{id}")[0].name(), "user");
    /// assert_eq!(policies.select(&http::Method::GET, "/users/42")[0].name(), "user");
    /// assert!(policies.select(&http::Method::GET, "/users/42/posts").is_empty());
    /// ```
    pub fn select(&self, method: &Method, route: &str) -> &[Arc<Policy>] {
        &self.plan_in(method, route, true).policies
    }

    /// The plan for `method` on the pattern `route` only (axum's
    /// `MatchedPath`), or on the path `route` when `is_path`.
    pub(crate) fn plan_in(&self, method: &Method, route: &str, is_path: bool) -> &Arc<Plan> {
        match self.selections.of(route, is_path) {
            Some(pattern) => pattern
                .by_method
                .iter()
                .find(|(m, _)| m == method)
                .map_or(&pattern.other_methods, |(_, plan)| plan),
            None => &self.selections.elsewhere,
        }
    }

    /// The route patterns of these policies that are none of `patterns`
    /// (the routes a router serves): a route a policy names but no request
    /// can reach, as a typo would make. The example server reports them
    /// at start-up.
    ///
    /// ```
    /// use slidegate::{Policies, Policy};
    /// use std::time::Duration;
    ///
    /// let policies = Policies::builder()
    ///     .with_route("GET /api/serach", Policy::new("search", 5, Duration::from_secs(60)))
    ///     .build()
    ///     .unwrap();
    /// let unknown: Vec<String> = policies
    ///     .routes_outside(["/api/search", "/api/videos"])
    ///     .map(|route| route.to_string())
    ///     .collect();
    /// assert_eq!(unknown, ["GET /api/serach"]);
    /// ```
    pub fn routes_outside<'a>(
        &'a self,
        patterns: impl IntoIterator<Item = &'a str>,
    ) -> impl Iterator<Item = impl fmt::Display + 'a> {
        let known: Vec<&str> = patterns.into_iter().collect();
        self.scoped
            .iter()
            .filter_map(|scoped| scoped.route.as_ref())
            .filter(move |route| !known.contains(&route.pattern.as_str()))
    }

    /// Every policy in the set, default last.
    pub fn iter(&self) -> impl Iterator<Item = &Policy> {
        self.shared().map(|policy| &**policy)
    }

    /// Every policy, shared.
    pub(crate) fn shared(&self) -> impl Iterator<Item = &Arc<Policy>> {
        self.scoped
            .iter()
            .map(|s| &s.policy)
            .chain(self.default.as_ref())
    }
}

/// Collects policies for [`Policies`]; validation happens in
/// [`build`](PoliciesBuilder::build).
#[derive(Debug, Default)]
#[must_use]
pub struct PoliciesBuilder {
    scoped: Vec<(Option<String>, Policy)>,
    default: Option<Policy>,
    extension_methods: Vec<Method>,
}

impl PoliciesBuilder {
    /// Applies `policy` to requests matching `route`: `"METHOD /pattern"`,
    /// or `"/pattern"` for any method, the pattern as axum spells it
    /// (`/users/{id}`).
    ///
    /// The method must be one of HTTP's standard nine (`GET`, `HEAD`,
    /// `POST`, `PUT`, `DELETE`, `CONNECT`, `OPTIONS`, `TRACE`, `PATCH`): a
    /// misspelt one (`GTE`) would name a route no client reaches, so the
    /// limit would silently never apply. A service that really routes an
    /// extension method names it with
    /// [`with_extension_method`](Self::with_extension_method). [`build`](Self::build)
    /// refuses a route that does not parse.
    ///
    /// ```
    /// use slidegate::{Policies, Policy};
    /// use std::time::Duration;
    ///
    /// let login = || Policy::new("login", 5, Duration::from_secs(60));
    /// let policies = Policies::builder().with_route("POST /api/login", login()).build().unwrap();
    /// assert_eq!(policies.select(&http::Method::POST, "/api/login").len(), 1);
    /// assert!(policies.select(&http::Method::GET, "/api/login").is_empty());
    ///
    /// let any = Policies::builder().with_route("/api/login", login()).build().unwrap();
    /// assert_eq!(any.select(&http::Method::DELETE, "/api/login").len(), 1);
    /// for refused in ["GET api", "get /api/login", "GTE /api/login"] {
    ///     // Methods are case-sensitive: `get` is a method no client sends.
    ///     assert!(Policies::builder().with_route(refused, login()).build().is_err(), "{refused}");
    /// }
    /// ```
    pub fn with_route(mut self, route: impl Into<String>, policy: Policy) -> Self {
        self.scoped.push((Some(route.into()), policy));
        self
    }

    /// Applies `policy` to every request, beside any route-scoped ones (a
    /// per-account quota, say).
    ///
    /// ```
    /// use slidegate::{Policies, Policy};
    /// use std::time::Duration;
    ///
    /// let policies = Policies::builder()
    ///     .with_every_route(Policy::new("quota", 10_000, Duration::from_secs(86_400)))
    ///     .build()
    ///     .unwrap();
    /// assert_eq!(policies.select(&http::Method::GET, "/x").len(), 1);
    /// ```
    pub fn with_every_route(mut self, policy: Policy) -> Self {
        self.scoped.push((None, policy));
        self
    }

    /// Allows routes to name `method`, an extension method the service
    /// really routes (`PURGE`, say). Routes may otherwise name only HTTP's
    /// standard methods, so that a misspelt one is refused, not silently
    /// never limited.
    ///
    /// ```
    /// use slidegate::{Policies, Policy};
    /// use std::time::Duration;
    ///
    /// let minute = || Policy::new("purge", 10, Duration::from_secs(60));
    /// assert!(Policies::builder().with_route("PURGE /cache", minute()).build().is_err());
    /// let purge = http::Method::from_bytes(b"PURGE").unwrap();
    /// let policies = Policies::builder()
    ///     .with_extension_method(purge.clone())
    ///     .with_route("PURGE /cache", minute())
    ///     .build()
    ///     .unwrap();
    /// assert_eq!(policies.select(&purge, "/cache").len(), 1);
    /// ```
    pub fn with_extension_method(mut self, method: Method) -> Self {
        self.extension_methods.push(method);
        self
    }

    /// Applies `policy` to requests that no route-scoped policy matches.
    ///
    /// ```
    /// use slidegate::{Policies, Policy};
    /// use std::time::Duration;
    ///
    /// let policies = Policies::builder()
    ///     .with_route("/a", Policy::new("a", 1, Duration::from_secs(1)))
    ///     .with_default(Policy::new("rest", 100, Duration::from_secs(60)))
    ///     .build()
    ///     .unwrap();
    /// assert_eq!(policies.select(&http::Method::GET, "/b")[0].name(), "rest");
    /// assert_eq!(policies.select(&http::Method::GET, "/a")[0].name(), "a");
    /// ```
    pub fn with_default(mut self, policy: Policy) -> Self {
        self.default = Some(policy);
        self
    }

    /// Validates every policy and route.
    pub fn build(self) -> Result<Policies, PolicyError> {
        let mut names = std::collections::HashSet::new();
        let all = self
            .scoped
            .iter()
            .map(|(_, p)| p)
            .chain(self.default.as_ref());
        for policy in all {
            policy.validate()?;
            if &*policy.name == super::CREDENTIAL_FAILURES {
                return Err(PolicyError::ReservedName {
                    name: policy.name.to_string(),
                });
            }
            if !names.insert(policy.name.clone()) {
                return Err(PolicyError::DuplicateName {
                    name: policy.name.to_string(),
                });
            }
        }
        let scoped = self
            .scoped
            .into_iter()
            .map(|(route, policy)| {
                Ok(Scoped {
                    route: route
                        .as_deref()
                        .map(|route| Route::parse_allowing(route, &self.extension_methods))
                        .transpose()?,
                    policy: Arc::new(policy),
                })
            })
            .collect::<Result<Vec<_>, PolicyError>>()?;
        let default = self.default.map(Arc::new);
        let selections = Arc::new(Selections::new(&scoped, default.as_ref())?);
        Ok(Policies {
            scoped: scoped.into(),
            default,
            selections,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::tests::minute;

    #[test]
    fn default_applies_only_when_no_route_matches() {
        let policies = Policies::builder()
            .with_route("GET /a", minute("a", 1))
            .with_route("/a", minute("a-any", 1))
            .with_default(minute("d", 1))
            .build()
            .unwrap();
        let names = |method: Method, path: &str| -> Vec<String> {
            policies
                .select(&method, path)
                .iter()
                .map(|p| p.name().to_owned())
                .collect()
        };
        assert_eq!(names(Method::GET, "/a"), ["a", "a-any"]);
        assert_eq!(names(Method::POST, "/a"), ["a-any"]);
        assert_eq!(names(Method::GET, "/b"), ["d"]);
    }

    #[test]
    fn the_selection_table_agrees_with_matching_every_route() {
        let policies = Policies::builder()
            .with_route("GET /a", minute("get-a", 1))
            .with_route("/a", minute("any-a", 1))
            .with_route("POST /a", minute("post-a", 1))
            .with_route("DELETE /b", minute("delete-b", 1))
            .with_route("GET /c", minute("get-c", 1))
            .with_route("HEAD /c", minute("head-c", 1))
            .with_every_route(minute("quota", 1))
            .with_default(minute("d", 1))
            .build()
            .unwrap();
        let names = |selected: &[Arc<Policy>]| -> Vec<String> {
            selected.iter().map(|p| p.name().to_owned()).collect()
        };
        let methods = [
            Method::GET,
            Method::HEAD,
            Method::POST,
            Method::DELETE,
            Method::PATCH,
        ];
        for method in methods {
            for path in ["/a", "/b", "/c", "/d", ""] {
                let slow =
                    select_slowly(&policies.scoped, policies.default.as_ref(), &method, path);
                assert_eq!(
                    names(policies.select(&method, path)),
                    names(&slow),
                    "{method} {path}"
                );
            }
        }
        assert_eq!(names(policies.select(&Method::PATCH, "/b")), ["quota", "d"]);
    }

    #[test]
    fn head_is_get_unless_a_route_names_head() {
        let policies = Policies::builder()
            .with_route("GET /a", minute("get-a", 1))
            .with_route("GET /c", minute("get-c", 1))
            .with_route("HEAD /c", minute("head-c", 1))
            .with_default(minute("d", 1))
            .build()
            .unwrap();
        let first =
            |method: Method, path: &str| policies.select(&method, path)[0].name().to_owned();
        assert_eq!(first(Method::HEAD, "/a"), "get-a");
        assert_eq!(first(Method::HEAD, "/c"), "head-c");
        assert_eq!(first(Method::GET, "/c"), "get-c");
        assert_eq!(first(Method::HEAD, "/elsewhere"), "d");
    }
}
