use super::*;
use http::request::Parts;

#[test]
fn unsafe_material_is_hashed() {
    let long = "a".repeat(MAX_RAW_LEN + 1);
    for material in [
        &b"{slot}"[..],
        b"has space",
        b"#abc",
        b"\xff\xfe",
        b"",
        long.as_bytes(),
    ] {
        let key = Key::new(material);
        assert!(key.as_str().starts_with("user:#"), "{material:?} -> {key}");
        assert_eq!(key.as_str().len(), "user:".len() + 33);
    }
    assert_eq!(
        Key::new("a".repeat(MAX_RAW_LEN)).as_str().len(),
        "user:".len() + MAX_RAW_LEN
    );
}

#[test]
fn hashing_is_stable_and_distinguishes_inputs() {
    assert_eq!(Key::hashed("a"), Key::hashed("a"));
    assert_ne!(Key::hashed("a"), Key::hashed("b"));
    // SHA-256("abc") starts ba7816bf8f01cfea414140de5dae2223.
    assert_eq!(
        Key::hashed("abc").as_str(),
        "user:#ba7816bf8f01cfea414140de5dae2223"
    );
}

#[test]
fn user_keys_never_name_a_built_in_source() {
    for forged in [
        "ip:192.0.2.7",
        "jwt:alice",
        "key:abc",
        "global",
        "header:x:y",
    ] {
        let key = Key::new(forged);
        assert_eq!(key.as_str(), format!("user:{forged}"));
    }
}

#[test]
fn or_falls_through_in_order() {
    let none = |_: &Parts| None::<Key>;
    let first = |_: &Parts| Some(Key::new("first"));
    let (parts, _) = http::Request::new(()).into_parts();
    assert_eq!(
        none.or(first)
            .extract(&parts)
            .unwrap()
            .unwrap()
            .key
            .as_str(),
        "user:first"
    );
    assert_eq!(
        first
            .or(Global)
            .extract(&parts)
            .unwrap()
            .unwrap()
            .key
            .as_str(),
        "user:first"
    );
    assert_eq!(none.or(none).extract(&parts), Ok(None));
}

#[tokio::test]
async fn a_copy_of_an_identity_awaiting_its_lookup_never_confirms() {
    let exists = |_: &[u8]| async { ApiKeyStatus::Known(None) };
    let header = Header::new(http::HeaderName::from_static("x-api-key")).with_lookup(exists);
    let (parts, _) = http::Request::builder()
        .header("x-api-key", "db-key")
        .body(())
        .unwrap()
        .into_parts();
    let identity = header.extract(&parts).unwrap().unwrap();
    let copy = identity.clone();
    let timeout = std::time::Duration::from_secs(5);
    assert_eq!(confirmed(copy, timeout).await, Ok(None));
    let original = confirmed(identity, timeout).await.unwrap().unwrap();
    assert!(original.key.as_str().starts_with("key:#"));
    assert!(original.unconfirmed.is_none());
}

#[test]
fn a_rejection_stops_the_chain() {
    struct Refuses;
    impl KeyExtractor for Refuses {
        fn extract(&self, _: &Parts) -> Extracted {
            Err(KeyRejection::new("expired", "old"))
        }
    }
    let (parts, _) = http::Request::new(()).into_parts();
    let rejection = Refuses.or(Global).extract(&parts).unwrap_err();
    assert_eq!(rejection.reason(), "expired");
}
