//! Certificates for TLS tests, made at run time: a private CA, a server
//! certificate for 127.0.0.1 and a client certificate it signed, and a
//! second CA that signed nothing here, each as a PEM file.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair,
};

/// PEM files in a directory of their own, removed when dropped.
pub struct TestCerts {
    dir: PathBuf,
}

fn ca(name: &str) -> CertifiedIssuer<'static, KeyPair> {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap()
}

impl TestCerts {
    pub fn new() -> Self {
        let dir = std::env::temp_dir().join(format!(
            "slidegate-tls-{}-{}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let authority = ca("slidegate test CA");
        let other = ca("another CA");

        let mut server =
            CertificateParams::new(vec!["127.0.0.1".into(), "localhost".into()]).unwrap();
        server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let server_key = KeyPair::generate().unwrap();
        let server = server.signed_by(&server_key, &authority).unwrap();

        let mut client = CertificateParams::new(Vec::<String>::new()).unwrap();
        client
            .distinguished_name
            .push(DnType::CommonName, "slidegate client");
        client.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let client_key = KeyPair::generate().unwrap();
        let client = client.signed_by(&client_key, &authority).unwrap();

        let files = [
            ("ca.pem", authority.pem()),
            ("other-ca.pem", other.pem()),
            ("server.pem", server.pem()),
            ("server.key", server_key.serialize_pem()),
            ("client.pem", client.pem()),
            ("client.key", client_key.serialize_pem()),
        ];
        for (name, pem) in files {
            std::fs::write(dir.join(name), pem).unwrap();
        }
        Self { dir }
    }

    /// The directory the files are in.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// One of `ca.pem`, `other-ca.pem`, `server.pem`, `server.key`,
    /// `client.pem`, `client.key`.
    pub fn path(&self, name: &str) -> String {
        self.dir.join(name).to_str().unwrap().to_owned()
    }

    /// The contents of `name`.
    pub fn read(&self, name: &str) -> Vec<u8> {
        std::fs::read(self.dir.join(name)).unwrap()
    }
}

impl Drop for TestCerts {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
