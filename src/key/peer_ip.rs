//! Keys by the client's IP address, with forwarding headers honoured only
//! from trusted proxies.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};

use http::HeaderName;
use http::request::Parts;
use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use super::{Identity, Key, KeyExtractor, KeyRejection};
use crate::log_lines::MISSING_PEER_ADDRESS;

/// Forwarding hops beyond this many are not examined.
const MAX_HOPS: usize = 64;

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static FORWARDED: HeaderName = http::header::FORWARDED;

/// Whether a forwarding header from a peer that is not a trusted proxy has
/// been reported: once per process, for the most common misconfiguration
/// (a proxy left out of the trusted ranges, so that every client behind it
/// shares its address).
static UNTRUSTED_FORWARDING_REPORTED: AtomicBool = AtomicBool::new(false);

/// Which forwarding header the trusted proxies write.
///
/// Only the header your proxies set may be read: a header they pass through
/// untouched is whatever the client wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ForwardedHeader {
    /// `X-Forwarded-For: client, proxy1, proxy2`.
    #[default]
    XForwardedFor,
    /// RFC 7239 `Forwarded: for=client, for=proxy1`.
    Forwarded,
}

/// Keys a request by the client's IP address.
///
/// The address is the TCP peer, from axum's `ConnectInfo<SocketAddr>` (serve
/// with `into_make_service_with_connect_info::<SocketAddr>()`), tonic's
/// `TcpConnectInfo` (feature `tonic`), or a plain `SocketAddr` request
/// extension. Only when that peer is in a trusted proxy
/// range is the forwarding header read, and then the right-most address that
/// is not a trusted proxy is the client: hops to its left were written by
/// the client and prove nothing. IPv6 clients are grouped by prefix (/64 by
/// default, the usual size of one subscriber's network).
///
/// ```
/// use slidegate::{KeyExtractor, PeerIp};
/// use std::net::SocketAddr;
///
/// let peer_ip = PeerIp::new().with_trusted_proxies(["10.0.0.0/8".parse().unwrap()]);
/// let mut request = http::Request::builder()
///     .header("x-forwarded-for", "6.6.6.6, 203.0.113.9, 10.0.0.7")
///     .body(())
///     .unwrap();
/// request.extensions_mut().insert("10.0.0.2:5000".parse::<SocketAddr>().unwrap());
/// let (parts, _) = request.into_parts();
/// assert_eq!(peer_ip.extract(&parts).unwrap().unwrap().key.as_str(), "ip:203.0.113.9");
/// ```
#[derive(Debug, Clone)]
pub struct PeerIp {
    trusted: Vec<IpNet>,
    header: ForwardedHeader,
    /// A single-value client header read from trusted proxies in place of
    /// the forwarding chain.
    client_header: Option<HeaderName>,
    ipv4_prefix: u8,
    ipv6_prefix: u8,
}

impl Default for PeerIp {
    fn default() -> Self {
        Self::new()
    }
}

impl PeerIp {
    /// The TCP peer's address, no proxies trusted, IPv6 grouped by /64.
    pub fn new() -> Self {
        Self {
            trusted: Vec::new(),
            header: ForwardedHeader::default(),
            client_header: None,
            ipv4_prefix: 32,
            ipv6_prefix: 64,
        }
    }

    /// Trusts these proxy ranges to write the forwarding header.
    ///
    /// ```
    /// use slidegate::PeerIp;
    ///
    /// let peer_ip = PeerIp::new().with_trusted_proxies(["10.0.0.0/8".parse().unwrap(), "fd00::/8".parse().unwrap()]);
    /// ```
    #[must_use]
    pub fn with_trusted_proxies(mut self, ranges: impl IntoIterator<Item = IpNet>) -> Self {
        self.trusted.extend(ranges);
        self
    }

    /// Reads this forwarding header from trusted proxies (default
    /// `X-Forwarded-For`).
    ///
    /// ```
    /// use slidegate::{PeerIp, key::ForwardedHeader};
    ///
    /// let peer_ip = PeerIp::new().with_forwarded_header(ForwardedHeader::Forwarded);
    /// ```
    #[must_use]
    pub fn with_forwarded_header(mut self, header: ForwardedHeader) -> Self {
        self.header = header;
        self
    }

    /// Reads the client's address from this single-value header when the
    /// peer is a trusted proxy, in place of the forwarding chain: the
    /// header a CDN or proxy sets to the address it saw
    /// (`CF-Connecting-IP`, `True-Client-IP`, `Fly-Client-IP`,
    /// `X-Real-IP`). The header must hold exactly one address on exactly
    /// one line; anything else (a list, two lines, text that is no
    /// address) names no client, and the request is keyed by the proxy's
    /// address. From a peer that is not trusted, the header is ignored.
    ///
    /// ```
    /// use http::HeaderName;
    /// use slidegate::{KeyExtractor, PeerIp};
    /// use std::net::SocketAddr;
    ///
    /// let behind_cloudflare = PeerIp::new()
    ///     .with_trusted_proxies(["173.245.48.0/20".parse().unwrap()])
    ///     .with_client_ip_header(HeaderName::from_static("cf-connecting-ip"));
    /// let mut request = http::Request::get("/").header("cf-connecting-ip", "203.0.113.9").body(()).unwrap();
    /// request.extensions_mut().insert("173.245.48.7:443".parse::<SocketAddr>().unwrap());
    /// let (parts, ()) = request.into_parts();
    /// let identity = behind_cloudflare.extract(&parts).unwrap().unwrap();
    /// assert_eq!(identity.key.as_str(), "ip:203.0.113.9");
    /// ```
    #[must_use]
    pub fn with_client_ip_header(mut self, name: HeaderName) -> Self {
        self.client_header = Some(name);
        self
    }

    /// Groups IPv6 clients by this prefix length (default 64, at most 128).
    ///
    /// ```
    /// use slidegate::PeerIp;
    ///
    /// let peer_ip = PeerIp::new().with_ipv6_prefix(56);
    /// ```
    #[must_use]
    pub fn with_ipv6_prefix(mut self, bits: u8) -> Self {
        self.ipv6_prefix = bits.min(128);
        self
    }

    /// Groups IPv4 clients by this prefix length (default 32, at most 32).
    ///
    /// ```
    /// use slidegate::PeerIp;
    ///
    /// let peer_ip = PeerIp::new().with_ipv4_prefix(24);
    /// ```
    #[must_use]
    pub fn with_ipv4_prefix(mut self, bits: u8) -> Self {
        self.ipv4_prefix = bits.min(32);
        self
    }

    fn is_trusted(&self, ip: IpAddr) -> bool {
        self.trusted.iter().any(|net| net.contains(&ip))
    }

    /// The header this extractor reads from trusted proxies.
    fn client_header_name(&self) -> &HeaderName {
        match (&self.client_header, self.header) {
            (Some(name), _) => name,
            (None, ForwardedHeader::XForwardedFor) => &X_FORWARDED_FOR,
            (None, ForwardedHeader::Forwarded) => &FORWARDED,
        }
    }

    /// Warns, once per process, of a request that carries the client
    /// header from a peer that is not trusted: the header is ignored, as it
    /// must be, but when the peer is a proxy left out of the trusted ranges
    /// every client behind it shares one limit.
    fn report_untrusted_forwarding(&self, peer: IpAddr, parts: &Parts) {
        if UNTRUSTED_FORWARDING_REPORTED.load(Ordering::Relaxed) {
            return;
        }
        let header = self.client_header_name();
        if parts.headers.contains_key(header)
            && !UNTRUSTED_FORWARDING_REPORTED.swap(true, Ordering::Relaxed)
        {
            tracing::warn!(
                %peer,
                header = header.as_str(),
                "a request carries a client address header from a peer that is not a trusted \
                 proxy: the header is ignored and the request keyed by the peer's address; if \
                 the peer is your proxy, add it to the trusted proxies, or every client behind \
                 it shares one limit (reported once)"
            );
        }
    }

    /// The client address: the peer, or when the peer is trusted, the
    /// right-most untrusted forwarding hop. Hops are read lazily from the
    /// right, at most [`MAX_HOPS`] of them. An unreadable hop stops the walk
    /// at the last trusted address seen: what lies to its left was written
    /// by the client, so garbage never lets a client pick its key.
    fn client_ip(&self, peer: IpAddr, parts: &Parts) -> IpAddr {
        let mut client = peer;
        if !self.is_trusted(peer) {
            self.report_untrusted_forwarding(peer, parts);
            return client;
        }
        if let Some(name) = &self.client_header {
            return single_client(parts, name).map_or(peer, canonical);
        }
        for hop in hops_from_the_right(parts, self.header).take(MAX_HOPS) {
            let Some(ip) = hop else { break };
            client = canonical(ip);
            if !self.is_trusted(client) {
                break;
            }
        }
        client
    }

    /// The client's address as this extractor resolves it (the peer, or
    /// behind trusted proxies the right-most untrusted hop), before any
    /// grouping. `None` without a peer address, and when the address
    /// resolved is a trusted proxy's: its forwarding chain did not name the
    /// client (no header, an unreadable or `unknown` hop), so nothing is
    /// known of who sent the request. For decisions of your own about a
    /// client, such as exempting an internal network with
    /// [`RateLimitLayer::with_exemption`](crate::RateLimitLayer::with_exemption): a trusted
    /// proxy's address is never a client's, so it is never exempt. (The
    /// rate-limit key of such a request is the proxy's: all the requests
    /// it cannot name share one count.)
    ///
    /// ```
    /// use axum::extract::ConnectInfo;
    /// use slidegate::PeerIp;
    /// use std::net::SocketAddr;
    ///
    /// let proxies = PeerIp::new().with_trusted_proxies(["10.0.0.0/8".parse().unwrap()]);
    /// let mut request = http::Request::get("/").header("x-forwarded-for", "203.0.113.9").body(()).unwrap();
    /// request.extensions_mut().insert(ConnectInfo(SocketAddr::from(([10, 0, 0, 1], 5000))));
    /// let (parts, ()) = request.into_parts();
    /// assert_eq!(proxies.client(&parts), Some("203.0.113.9".parse().unwrap()));
    ///
    /// // The proxy could not name its client.
    /// let mut request = http::Request::get("/").header("forwarded", "for=unknown").body(()).unwrap();
    /// request.extensions_mut().insert(ConnectInfo(SocketAddr::from(([10, 0, 0, 1], 5000))));
    /// let (parts, ()) = request.into_parts();
    /// let proxies = proxies.with_forwarded_header(slidegate::key::ForwardedHeader::Forwarded);
    /// assert_eq!(proxies.client(&parts), None);
    /// ```
    pub fn client(&self, parts: &Parts) -> Option<IpAddr> {
        let peer = peer_addr(parts)?;
        let client = self.client_ip(canonical(peer.ip()), parts);
        (!self.is_trusted(client)).then_some(client)
    }

    /// The key a client at `ip` is counted under.
    pub(crate) fn key_of(&self, ip: IpAddr) -> Key {
        self.group(canonical(ip))
    }

    /// The key of `ip`'s group: the address, or its network when grouped.
    fn group(&self, ip: IpAddr) -> Key {
        match ip {
            IpAddr::V4(v4) if self.ipv4_prefix < 32 => match Ipv4Net::new(v4, self.ipv4_prefix) {
                Ok(net) => Key::formatted("ip", net.trunc()),
                Err(_) => Key::formatted("ip", v4),
            },
            IpAddr::V6(v6) if self.ipv6_prefix < 128 => match Ipv6Net::new(v6, self.ipv6_prefix) {
                Ok(net) => Key::formatted("ip", net.trunc()),
                Err(_) => Key::formatted("ip", v6),
            },
            IpAddr::V4(v4) => ipv4_key(v4),
            other => Key::formatted("ip", other),
        }
    }
}

impl KeyExtractor for PeerIp {
    fn extract(&self, parts: &Parts) -> Result<Option<Identity>, KeyRejection> {
        let Some(peer) = peer_addr(parts) else {
            if let Some(held_back) = MISSING_PEER_ADDRESS.admit() {
                tracing::error!(
                    held_back,
                    "PeerIp found no peer address: serve with \
                     into_make_service_with_connect_info::<SocketAddr>() \
                     (tonic: turn on slidegate's `tonic` feature)"
                );
            }
            return Ok(None);
        };
        let client = self.client_ip(canonical(peer.ip()), parts);
        Ok(Some(self.group(client).into()))
    }
}

/// `ip:a.b.c.d`, written by hand: the standard `Display` of an address
/// costs more than the rest of building the key.
fn ipv4_key(ip: Ipv4Addr) -> Key {
    let mut text = [0u8; 18];
    text[..3].copy_from_slice(b"ip:");
    let mut len = 3;
    for (i, octet) in ip.octets().into_iter().enumerate() {
        if i > 0 {
            text[len] = b'.';
            len += 1;
        }
        if octet >= 100 {
            text[len] = b'0' + octet / 100;
            len += 1;
        }
        if octet >= 10 {
            text[len] = b'0' + octet / 10 % 10;
            len += 1;
        }
        text[len] = b'0' + octet % 10;
        len += 1;
    }
    Key::from_ascii(&text[..len])
}

fn peer_addr(parts: &Parts) -> Option<SocketAddr> {
    #[cfg(feature = "axum")]
    if let Some(info) = parts
        .extensions
        .get::<axum::extract::ConnectInfo<SocketAddr>>()
    {
        return Some(info.0);
    }
    #[cfg(feature = "tonic")]
    if let Some(peer) = parts
        .extensions
        .get::<tonic::transport::server::TcpConnectInfo>()
        .and_then(tonic::transport::server::TcpConnectInfo::remote_addr)
    {
        return Some(peer);
    }
    parts.extensions.get::<SocketAddr>().copied()
}

/// IPv4-mapped IPv6 addresses (`::ffff:1.2.3.4`) are IPv4 clients.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    }
}

/// The address in the single-value header `name`: one line holding one
/// address (with a port, or bracketed, at most), else `None`.
fn single_client(parts: &Parts, name: &HeaderName) -> Option<IpAddr> {
    let mut lines = parts.headers.get_all(name).iter();
    let line = lines.next()?;
    if lines.next().is_some() {
        // One written by the client, one by the proxy: which is which?
        return None;
    }
    parse_hop(std::str::from_utf8(line.as_bytes()).ok()?.trim())
}

/// The hops of the forwarding header, right to left, across repeated header
/// lines: the raw bytes are split on `,` and each element parsed on its own,
/// so one unreadable element (`None`) never hides the others.
fn hops_from_the_right(
    parts: &Parts,
    header: ForwardedHeader,
) -> impl Iterator<Item = Option<IpAddr>> + '_ {
    let name = match header {
        ForwardedHeader::XForwardedFor => "x-forwarded-for",
        ForwardedHeader::Forwarded => "forwarded",
    };
    parts
        .headers
        .get_all(name)
        .iter()
        .rev()
        .flat_map(|value| value.as_bytes().rsplit(|&byte| byte == b','))
        .map(move |element| parse_element(element, header))
}

/// One element of a forwarding header: an address, or `None` when it is not
/// one (or not even text).
fn parse_element(element: &[u8], header: ForwardedHeader) -> Option<IpAddr> {
    let text = std::str::from_utf8(element.trim_ascii()).ok()?;
    match header {
        ForwardedHeader::XForwardedFor => parse_hop(text),
        ForwardedHeader::Forwarded => forwarded_for(text).and_then(parse_hop),
    }
}

/// The `for=` parameter of one RFC 7239 element, unquoted.
fn forwarded_for(element: &str) -> Option<&str> {
    element.split(';').find_map(|pair| {
        let (name, value) = pair.trim().split_once('=')?;
        name.trim()
            .eq_ignore_ascii_case("for")
            .then(|| value.trim().trim_matches('"'))
    })
}

/// An address, possibly with a port, possibly bracketed (`[v6]:port`).
fn parse_hop(text: &str) -> Option<IpAddr> {
    if let Ok(ip) = text.parse::<IpAddr>() {
        return Some(ip);
    }
    if let Ok(socket) = text.parse::<SocketAddr>() {
        return Some(socket.ip());
    }
    let bracketed = text.strip_prefix('[')?.strip_suffix(']')?;
    bracketed.parse::<Ipv6Addr>().ok().map(IpAddr::V6)
}

#[cfg(test)]
mod tests;
