//! The migration stream over TCP in TLS 1.3 with both sides' certificates
//! (rustls, aws-lc's crypto, a post-quantum key exchange first): the destination takes only a source whose
//! certificate the given CA signed and that names one of the allowed
//! clients (QEMU's `tls-authz`); the source takes only a destination whose
//! certificate the same CA signed for the address it connects to (or the
//! name given). Without TLS, the stream is not authenticated: anyone who
//! reaches a plaintext listener can send it a VM of their own making.
//!
//! Certificates and keys are PEM files, as `openssl req -x509` and
//! `openssl x509 -req` write them.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::danger::HandshakeSignatureValid;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{
    ClientConfig, ClientConnection, DigitallySignedStruct, DistinguishedName, RootCertStore,
    ServerConfig, ServerConnection, SignatureScheme, StreamOwned,
};

use super::MigrationError;

/// The first byte of a TLS handshake record: what a TLS client sends first.
const TLS_HANDSHAKE: u8 = 0x16;

/// One side's certificate chain, its private key, and the CA that signs
/// the other side's certificate: PEM files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    /// This side's certificate (and any intermediates).
    pub cert: PathBuf,
    /// Its private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// The CA certificate(s) the peer's certificate must chain to.
    pub ca: PathBuf,
}

/// A source's TLS: its certificate, and whom it trusts.
#[derive(Clone)]
pub struct TlsClient {
    config: Arc<ClientConfig>,
    server_name: Option<ServerName<'static>>,
}

/// A destination's TLS: its certificate, whom it trusts, whom it allows.
#[derive(Clone)]
pub struct TlsServer {
    config: Arc<ServerConfig>,
    clients: Arc<AllowedClients>,
}

impl fmt::Debug for TlsClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsClient")
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for TlsServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsServer").finish_non_exhaustive()
    }
}

fn tls_error(what: impl fmt::Display) -> MigrationError {
    MigrationError::Tls(what.to_string())
}

/// aws-lc's provider, AES-128-GCM first: the stream is bulk data, and
/// AES-128 is the cheapest of TLS 1.3's ciphers with AES instructions.
fn provider() -> Arc<CryptoProvider> {
    let mut provider = rustls::crypto::aws_lc_rs::default_provider();
    provider
        .cipher_suites
        .sort_by_key(|s| s.suite() != rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
    Arc::new(provider)
}

/// This side's certificate chain and key, and the roots for the peer's.
type Loaded = (
    Vec<CertificateDer<'static>>,
    PrivateKeyDer<'static>,
    RootCertStore,
);

impl TlsFiles {
    fn load(&self) -> Result<Loaded, MigrationError> {
        let certs = |path: &Path| {
            let certs = CertificateDer::pem_file_iter(path)
                .and_then(|i| i.collect::<Result<Vec<_>, _>>())
                .map_err(|e| {
                    tls_error(format!(
                        "cannot read the certificates in {}: {e}",
                        path.display()
                    ))
                })?;
            match certs.is_empty() {
                true => Err(tls_error(format!(
                    "{} holds no certificate",
                    path.display()
                ))),
                false => Ok(certs),
            }
        };
        let chain = certs(&self.cert)?;
        let key = PrivateKeyDer::from_pem_file(&self.key).map_err(|e| {
            tls_error(format!(
                "cannot read the private key in {}: {e}",
                self.key.display()
            ))
        })?;
        let mut roots = RootCertStore::empty();
        for ca in certs(&self.ca)? {
            roots
                .add(ca)
                .map_err(|e| tls_error(format!("the CA in {}: {e}", self.ca.display())))?;
        }
        Ok((chain, key, roots))
    }

    /// A source's TLS from these files.
    ///
    /// # Errors
    /// [`MigrationError::Tls`]: a file cannot be read, or holds no valid
    /// certificate or key.
    pub fn client(&self) -> Result<TlsClient, MigrationError> {
        let (chain, key, roots) = self.load()?;
        let config = ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls_error)?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .map_err(tls_error)?;
        Ok(TlsClient {
            config: Arc::new(config),
            server_name: None,
        })
    }

    /// A destination's TLS from these files, taking only sources whose
    /// certificate is valid for one of `allow` (DNS names or IP
    /// addresses).
    ///
    /// # Errors
    /// As [`client`](Self::client), and an empty or unparsable `allow`.
    pub fn server(&self, allow: &[String]) -> Result<TlsServer, MigrationError> {
        let (chain, key, roots) = self.load()?;
        let names = allow
            .iter()
            .map(|n| {
                ServerName::try_from(n.clone())
                    .map_err(|e| tls_error(format!("{n:?} is no client name: {e}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        if names.is_empty() {
            return Err(tls_error("no client is allowed (give --tls-allow NAME)"));
        }
        let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
            .build()
            .map_err(tls_error)?;
        let allowed = Arc::new(AllowedClients { verifier, names });
        let clients = allowed.clone();
        let config = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls_error)?
            .with_client_cert_verifier(allowed)
            .with_single_cert(chain, key)
            .map_err(tls_error)?;
        Ok(TlsServer {
            config: Arc::new(config),
            clients,
        })
    }
}

impl TlsClient {
    /// The same, expecting the destination's certificate to be for `name`
    /// (by default: the IP address connected to).
    ///
    /// # Errors
    /// [`MigrationError::Tls`] if `name` is no DNS name or IP address.
    pub fn with_server_name(mut self, name: &str) -> Result<Self, MigrationError> {
        let name = ServerName::try_from(name.to_owned())
            .map_err(|e| tls_error(format!("{name:?} is no server name: {e}")))?;
        self.server_name = Some(name);
        Ok(self)
    }

    /// A TLS client on `sock` (connected to `peer`): the handshake runs
    /// with its first write, the stream's header, and a refusal comes back
    /// on the first read ([`super::handover`]).
    pub(crate) fn client_on(
        &self,
        sock: TcpStream,
        peer: std::net::SocketAddr,
    ) -> Result<StreamOwned<ClientConnection, TcpStream>, MigrationError> {
        let name = self
            .server_name
            .clone()
            .unwrap_or_else(|| ServerName::IpAddress(peer.ip().into()));
        let connection = ClientConnection::new(self.config.clone(), name).map_err(tls_error)?;
        Ok(StreamOwned::new(connection, sock))
    }
}

impl TlsServer {
    /// Runs the server's side of the handshake on `sock` (its timeouts
    /// bound each step): refuses, in plain text, a peer that does not
    /// speak TLS; checks the source's certificate and its name.
    pub(crate) fn handshake(
        &self,
        sock: TcpStream,
    ) -> Result<StreamOwned<ServerConnection, TcpStream>, MigrationError> {
        let mut first = [0u8];
        let mut sock = sock;
        let peeked = sock
            .peek(&mut first)
            .map_err(|e| tls_error(format!("nothing came: {e}")))?;
        match (peeked, first[0]) {
            (0, _) => return Err(tls_error("it closed before a handshake")),
            (_, TLS_HANDSHAKE) => {}
            _ => {
                let _ = super::handover::turn_away(
                    &mut sock,
                    "this destination takes TLS sources only",
                );
                return Err(tls_error(
                    "it does not speak TLS (turned away in plain text)",
                ));
            }
        }
        let mut connection = ServerConnection::new(self.config.clone()).map_err(tls_error)?;
        while connection.is_handshaking() {
            if let Err(e) = connection.complete_io(&mut sock) {
                return Err(tls_error(handshake_failure(&e, "the source")));
            }
        }
        let refused = self.clients.check(connection.peer_certificates());
        let mut stream = StreamOwned::new(connection, sock);
        match refused {
            Ok(()) => Ok(stream),
            Err(Refused { source, log }) => {
                let _ = super::handover::turn_away(&mut stream, &source);
                linger(stream);
                Err(tls_error(log))
            }
        }
    }
}

/// Closes a connection turned away after its handshake so that the
/// refusal arrives: a socket closed with the source's bytes unread (its
/// stream header) resets the connection, and the reset can overtake the
/// refusal. Reads until the source hangs up, within the socket's timeout
/// and at most [`LINGER_BYTES`]: a source that keeps sending is cut off.
fn linger(mut stream: StreamOwned<ServerConnection, TcpStream>) {
    stream.conn.send_close_notify();
    let _ = stream.flush();
    let _ = stream.sock.shutdown(std::net::Shutdown::Write);
    let mut sink = [0u8; 4096];
    let mut read = 0;
    while read < LINGER_BYTES {
        match stream.sock.read(&mut sink) {
            Ok(n) if n > 0 => read += n,
            _ => return,
        }
    }
}

/// What a refused source may still send before its connection is closed:
/// its stream header and TLS's closing records fit many times over.
const LINGER_BYTES: usize = 64 << 10;

/// What a failed handshake means, for `peer`.
pub(crate) fn handshake_failure(e: &io::Error, peer: &str) -> String {
    match e
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
    {
        Some(rustls::Error::InvalidMessage(_)) => {
            format!("{peer} does not speak TLS (a plaintext peer?)")
        }
        Some(rustls::Error::AlertReceived(alert)) => {
            format!("{peer} refused this side's certificate ({alert:?})")
        }
        Some(other) => format!("{peer}'s certificate: {other}"),
        None => format!("the TLS handshake with {peer} failed: {e}"),
    }
}

/// WebPKI's check of a client certificate, then its names against the
/// allowed ones.
#[derive(Debug)]
struct AllowedClients {
    verifier: Arc<dyn ClientCertVerifier>,
    names: Vec<ServerName<'static>>,
}

impl AllowedClients {
    /// Whether the source's certificate (checked against the CA already)
    /// is for an allowed name; if not, what the source and the log are told.
    fn check(&self, certs: Option<&[CertificateDer<'_>]>) -> Result<(), Refused> {
        let Some(leaf) = certs.and_then(<[_]>::first) else {
            return Err(Refused::same("the source sent no certificate".into()));
        };
        let cert = webpki::EndEntityCert::try_from(leaf)
            .map_err(|e| Refused::same(format!("the source's certificate: {e}")))?;
        let valid_for = |name| cert.verify_is_valid_for_subject_name(name);
        if self.names.iter().any(|n| valid_for(n).is_ok()) {
            return Ok(());
        }
        let refused = match self.names.first().map(valid_for) {
            Some(Err(webpki::Error::CertNotValidForName(context))) => context.presented,
            _ => Vec::new(),
        };
        // WebPKI quotes a DNS name inside its kind: `DnsName("a.example")`.
        let bare = |name: &String| name.split('"').nth(1).unwrap_or(name).to_owned();
        let refused: Vec<_> = refused.iter().map(bare).collect();
        let source = format!(
            "this destination does not allow a source whose certificate is for {}",
            refused.join(", ")
        );
        let allowed: Vec<_> = self.names.iter().map(|n| n.to_str().into_owned()).collect();
        Err(Refused {
            log: format!("{source} (it allows {})", allowed.join(", ")),
            source,
        })
    }
}

/// A source turned away after the handshake: what it is told, and what
/// the destination logs (with the names it allows).
struct Refused {
    source: String,
    log: String,
}

impl Refused {
    fn same(why: String) -> Self {
        Self {
            source: why.clone(),
            log: why,
        }
    }
}

impl ClientCertVerifier for AllowedClients {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.verifier.root_hint_subjects()
    }

    /// The CA's check only: the names are checked once the handshake is
    /// done ([`TlsServer::handshake`]), so that a source whose name is
    /// not allowed is told which of its names were refused, where a TLS
    /// alert could say only that its certificate was.
    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.verifier
            .verify_client_cert(end_entity, intermediates, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.verifier.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.verifier.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.verifier.supported_verify_schemes()
    }
}
