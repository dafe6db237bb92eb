//! Unit tests of `peer_ip.rs`.

use super::*;

fn key(extractor: &PeerIp, peer: &str, headers: &[(&str, &[u8])]) -> Option<String> {
    let mut request = http::Request::new(());
    for (name, value) in headers {
        request.headers_mut().append(
            http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
            http::HeaderValue::from_bytes(value).unwrap(),
        );
    }
    request
        .extensions_mut()
        .insert(peer.parse::<SocketAddr>().unwrap());
    let (parts, _) = request.into_parts();
    extractor
        .extract(&parts)
        .unwrap()
        .map(|identity| identity.key.as_str().to_owned())
}

fn behind_proxy() -> PeerIp {
    PeerIp::new().with_trusted_proxies(["10.0.0.0/8".parse().unwrap()])
}

fn behind_cloudflare() -> PeerIp {
    behind_proxy().with_client_ip_header(HeaderName::from_static("cf-connecting-ip"))
}

#[cfg(feature = "tonic")]
#[test]
fn the_peer_of_a_tonic_server_is_read_as_it_records_it() {
    use tonic::transport::server::TcpConnectInfo;

    let mut request = http::Request::new(());
    request.extensions_mut().insert(TcpConnectInfo {
        local_addr: Some(SocketAddr::from(([127, 0, 0, 1], 50051))),
        remote_addr: Some(SocketAddr::from(([203, 0, 113, 9], 40000))),
    });
    let (parts, _) = request.into_parts();
    let identity = PeerIp::new().extract(&parts).unwrap().unwrap();
    assert_eq!(identity.key.as_str(), "ip:203.0.113.9");

    // No remote address recorded: no client, never the local address.
    let mut request = http::Request::new(());
    request.extensions_mut().insert(TcpConnectInfo {
        local_addr: Some(SocketAddr::from(([127, 0, 0, 1], 50051))),
        remote_addr: None,
    });
    let (parts, _) = request.into_parts();
    assert!(PeerIp::new().extract(&parts).unwrap().is_none());
}

#[test]
fn a_single_value_client_header_is_read_from_trusted_proxies_only() {
    let cf: &[(&str, &[u8])] = &[("cf-connecting-ip", b"203.0.113.9")];
    assert_eq!(
        key(&behind_cloudflare(), "10.0.0.1:1", cf).unwrap(),
        "ip:203.0.113.9"
    );
    // From anyone else it is whatever the client wrote.
    assert_eq!(
        key(&behind_cloudflare(), "198.51.100.7:1", cf).unwrap(),
        "ip:198.51.100.7"
    );
    // The forwarding chain is not read in its place.
    let xff: &[(&str, &[u8])] = &[("x-forwarded-for", b"203.0.113.9")];
    assert_eq!(
        key(&behind_cloudflare(), "10.0.0.1:1", xff).unwrap(),
        "ip:10.0.0.1"
    );
    // IPv6 clients are grouped as ever; mapped IPv4 is IPv4.
    let v6: &[(&str, &[u8])] = &[("cf-connecting-ip", b"2001:db8::1")];
    assert_eq!(
        key(&behind_cloudflare(), "10.0.0.1:1", v6).unwrap(),
        "ip:2001:db8::/64"
    );
    let mapped: &[(&str, &[u8])] = &[("cf-connecting-ip", b" ::ffff:203.0.113.9 ")];
    assert_eq!(
        key(&behind_cloudflare(), "10.0.0.1:1", mapped).unwrap(),
        "ip:203.0.113.9"
    );
}

#[test]
fn a_client_header_that_is_not_one_address_names_no_client() {
    let proxy = "ip:10.0.0.1";
    for headers in [
        &[("cf-connecting-ip", &b"203.0.113.9, 198.51.100.1"[..])][..],
        &[
            ("cf-connecting-ip", b"203.0.113.9"),
            ("cf-connecting-ip", b"198.51.100.1"),
        ],
        &[("cf-connecting-ip", b"unknown")],
        &[("cf-connecting-ip", b"\xff\xfe")],
        &[("cf-connecting-ip", b"")],
        &[],
    ] {
        assert_eq!(
            key(&behind_cloudflare(), "10.0.0.1:1", headers).unwrap(),
            proxy,
            "{headers:?}"
        );
    }
    let with_port: &[(&str, &[u8])] = &[("cf-connecting-ip", b"[2001:db8::1]:443")];
    assert_eq!(
        key(&behind_cloudflare(), "10.0.0.1:1", with_port).unwrap(),
        "ip:2001:db8::/64"
    );
}

#[test]
fn untrusted_peer_cannot_spoof_forwarded_for() {
    let xff: &[(&str, &[u8])] = &[("x-forwarded-for", b"1.1.1.1")];
    assert_eq!(
        key(&PeerIp::new(), "203.0.113.5:1", xff).unwrap(),
        "ip:203.0.113.5"
    );
    assert_eq!(
        key(&behind_proxy(), "203.0.113.5:1", xff).unwrap(),
        "ip:203.0.113.5"
    );
}

#[test]
fn right_most_untrusted_hop_wins() {
    let headers: &[(&str, &[u8])] = &[
        ("x-forwarded-for", b"9.9.9.9, 198.51.100.1"),
        ("x-forwarded-for", b"10.1.1.1"),
    ];
    assert_eq!(
        key(&behind_proxy(), "10.0.0.1:1", headers).unwrap(),
        "ip:198.51.100.1"
    );
}

#[test]
fn garbage_hop_stops_at_last_trusted_address() {
    let headers: &[(&str, &[u8])] = &[("x-forwarded-for", b"1.2.3.4, not-an-ip, 10.9.9.9")];
    assert_eq!(
        key(&behind_proxy(), "10.0.0.1:1", headers).unwrap(),
        "ip:10.9.9.9"
    );
    let binary: &[(&str, &[u8])] = &[("x-forwarded-for", b"\xff\xfe")];
    assert_eq!(
        key(&behind_proxy(), "10.0.0.1:1", binary).unwrap(),
        "ip:10.0.0.1"
    );
}

#[test]
fn one_non_ascii_element_does_not_hide_the_client_appended_after_it() {
    // nginx appends the real client to the line the client sent.
    let appended: &[(&str, &[u8])] = &[("x-forwarded-for", b"\x80, 203.0.113.9")];
    assert_eq!(
        key(&behind_proxy(), "10.0.0.1:1", appended).unwrap(),
        "ip:203.0.113.9"
    );
    let forwarded: &[(&str, &[u8])] = &[("forwarded", b"for=\xff\xfe, for=203.0.113.9")];
    assert_eq!(
        key(
            &behind_proxy().with_forwarded_header(ForwardedHeader::Forwarded),
            "10.0.0.1:1",
            forwarded
        )
        .unwrap(),
        "ip:203.0.113.9"
    );
}

#[test]
fn the_walk_stops_after_the_hop_cap() {
    let mut line = b"203.0.113.9".to_vec();
    for _ in 0..MAX_HOPS {
        line.extend_from_slice(b", 10.1.1.1");
    }
    let headers: &[(&str, &[u8])] = &[("x-forwarded-for", &line)];
    assert_eq!(
        key(&behind_proxy(), "10.0.0.1:1", headers).unwrap(),
        "ip:10.1.1.1",
        "past the cap the last trusted hop seen is the key"
    );
}

/// One element a forwarding line may hold.
#[derive(Debug, Clone)]
enum Element {
    Trusted(Ipv4Addr),
    Untrusted(IpAddr),
    Garbage(Vec<u8>),
}

fn element() -> impl proptest::strategy::Strategy<Value = Element> {
    use proptest::prelude::*;
    let garbage_byte = prop_oneof![0x21u8..=0x2b, 0x2du8..=0x7e, 0x80u8..=0xff];
    prop_oneof![
        any::<[u8; 3]>().prop_map(|[a, b, c]| Element::Trusted(Ipv4Addr::new(10, a, b, c))),
        any::<u8>().prop_map(|d| Element::Untrusted(Ipv4Addr::new(203, 0, 113, d).into())),
        any::<u16>().prop_map(|d| {
            Element::Untrusted(Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, d).into())
        }),
        proptest::collection::vec(garbage_byte, 1..8)
            .prop_filter("not an address", |bytes| {
                parse_element(bytes, ForwardedHeader::XForwardedFor).is_none()
            })
            .prop_map(Element::Garbage),
    ]
}

fn bytes_of(element: &Element) -> Vec<u8> {
    match element {
        Element::Trusted(ip) => ip.to_string().into_bytes(),
        Element::Untrusted(ip) => ip.to_string().into_bytes(),
        Element::Garbage(bytes) => bytes.clone(),
    }
}

proptest::proptest! {
    /// Arbitrary bytes never panic the parser, and the client is the
    /// peer or an address the lines hold.
    #[test]
    fn any_forwarding_bytes_are_survived(
        lines in proptest::collection::vec(proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64), 0..4)
    ) {
        let mut request = http::Request::new(());
        for line in &lines {
            if let Ok(value) = http::HeaderValue::from_bytes(line) {
                request.headers_mut().append("x-forwarded-for", value);
            }
        }
        let (parts, _) = request.into_parts();
        let peer: IpAddr = Ipv4Addr::new(10, 0, 0, 1).into();
        let client = behind_proxy().client_ip(peer, &parts);
        let written: Vec<IpAddr> = lines
            .iter()
            .flat_map(|line| line.split(|&b| b == b','))
            .filter_map(|element| parse_element(element, ForwardedHeader::XForwardedFor))
            .map(canonical)
            .collect();
        proptest::prop_assert!(client == peer || written.contains(&client));
    }

    /// Walking from the right, the first element that is not a trusted
    /// proxy is the client when it is an address; when it is garbage,
    /// the last trusted address seen is, and nothing to its left counts.
    #[test]
    fn the_first_untrusted_hop_from_the_right_is_the_client(
        elements in proptest::collection::vec(element(), 0..20),
        breaks in proptest::collection::vec(proptest::prelude::any::<bool>(), 20),
    ) {
        let peer: IpAddr = Ipv4Addr::new(10, 0, 0, 1).into();
        let mut expected = peer;
        for element in elements.iter().rev() {
            match element {
                Element::Trusted(ip) => expected = IpAddr::V4(*ip),
                Element::Untrusted(ip) => {
                    expected = *ip;
                    break;
                }
                Element::Garbage(_) => break,
            }
        }
        // The elements, over one or more header lines.
        let mut request = http::Request::new(());
        let mut line: Vec<u8> = Vec::new();
        for (index, element) in elements.iter().enumerate() {
            if !line.is_empty() {
                line.extend_from_slice(b", ");
            }
            line.extend_from_slice(&bytes_of(element));
            if breaks[index] || index + 1 == elements.len() {
                let value = http::HeaderValue::from_bytes(&line).unwrap();
                request.headers_mut().append("x-forwarded-for", value);
                line.clear();
            }
        }
        let (parts, _) = request.into_parts();
        proptest::prop_assert_eq!(behind_proxy().client_ip(peer, &parts), expected);
    }
}

#[test]
fn no_header_from_trusted_proxy_keys_the_proxy() {
    assert_eq!(
        key(&behind_proxy(), "10.0.0.1:1", &[]).unwrap(),
        "ip:10.0.0.1"
    );
}

#[test]
fn rfc7239_forwarded_is_read_only_when_configured() {
    let headers: &[(&str, &[u8])] = &[(
        "forwarded",
        b"for=192.0.2.1, for=\"[2001:db8:cafe::17]:4711\";proto=https",
    )];
    let forwarded = behind_proxy().with_forwarded_header(ForwardedHeader::Forwarded);
    assert_eq!(
        key(&forwarded, "10.0.0.1:1", headers).unwrap(),
        "ip:2001:db8:cafe::/64"
    );
    assert_eq!(
        key(&behind_proxy(), "10.0.0.1:1", headers).unwrap(),
        "ip:10.0.0.1"
    );
}

#[test]
fn ipv6_is_grouped_and_mapped_ipv4_is_ipv4() {
    let a = key(&PeerIp::new(), "[2001:db8:1:2:aaaa::1]:1", &[]).unwrap();
    let b = key(&PeerIp::new(), "[2001:db8:1:2:bbbb::2]:1", &[]).unwrap();
    assert_eq!(a, "ip:2001:db8:1:2::/64");
    assert_eq!(a, b);
    let exact = PeerIp::new().with_ipv6_prefix(128);
    assert_eq!(
        key(&exact, "[2001:db8::1]:1", &[]).unwrap(),
        "ip:2001:db8::1"
    );
    assert_eq!(
        key(&PeerIp::new(), "[::ffff:192.0.2.7]:1", &[]).unwrap(),
        "ip:192.0.2.7"
    );
    let v4_group = PeerIp::new().with_ipv4_prefix(24);
    assert_eq!(
        key(&v4_group, "192.0.2.7:1", &[]).unwrap(),
        "ip:192.0.2.0/24"
    );
}

#[test]
fn no_peer_address_yields_nothing() {
    let (parts, _) = http::Request::new(()).into_parts();
    assert_eq!(PeerIp::new().extract(&parts), Ok(None));
}
