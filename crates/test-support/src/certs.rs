//! Certificates for TLS in tests and benchmarks: CAs, and what each signs,
//! written as PEM files in a fresh directory, removed once both CAs are
//! dropped.

use std::path::PathBuf;
use std::sync::Arc;

use rcgen::{BasicConstraints, Certificate, CertificateParams, IsCa, KeyPair};

/// A certificate, its key, and the CA certificate its peer must chain to:
/// PEM files.
#[derive(Clone, Debug)]
pub struct CertFiles {
    /// The certificate.
    pub cert: PathBuf,
    /// Its private key.
    pub key: PathBuf,
    /// The CA the peer's certificate must chain to.
    pub ca: PathBuf,
}

/// A CA, and what it signs.
pub struct Ca {
    cert: Certificate,
    key: KeyPair,
    dir: PathBuf,
    _scratch: Arc<Scratch>,
}

/// The directory both CAs of [`cas`] write in, removed with the last.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ca")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

impl Ca {
    fn new(scratch: &Arc<Scratch>, name: &str) -> Self {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let cert = params.self_signed(&key).unwrap();
        let ca = Self {
            cert,
            key,
            dir: scratch.0.join(name),
            _scratch: Arc::clone(scratch),
        };
        std::fs::create_dir_all(&ca.dir).unwrap();
        std::fs::write(ca.dir.join("ca.pem"), ca.cert.pem()).unwrap();
        ca
    }

    /// A certificate for `name` (a DNS name or an IP address), and its key,
    /// with this CA's certificate as the one the peer must chain to.
    pub fn files(&self, name: &str, trusting: &Ca) -> CertFiles {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec![name.to_string()])
            .unwrap()
            .signed_by(&key, &self.cert, &self.key)
            .unwrap();
        let write = |file: &str, text: String| {
            let path = self.dir.join(file);
            std::fs::write(&path, text).unwrap();
            path
        };
        CertFiles {
            cert: write(&format!("{name}.pem"), cert.pem()),
            key: write(&format!("{name}.key"), key.serialize_pem()),
            ca: trusting.dir.join("ca.pem"),
        }
    }
}

/// Two CAs in a fresh directory named after `what`: ours, and another.
/// Their files stay until both are dropped.
pub fn cas(what: &str) -> (Ca, Ca) {
    let dir = std::env::temp_dir().join(format!("rvmm-tls-{}-{what}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let scratch = Arc::new(Scratch(dir));
    (Ca::new(&scratch, "ours"), Ca::new(&scratch, "other"))
}
