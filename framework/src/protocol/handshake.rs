//! Connecting: socket buffers, the secret's challenge-response and TLS.

use std::time::Duration;

use tokio::io::AsyncRead;

use super::*;
use crate::error::{Error, Result};

/// Socket buffer size asked for on control connections (the kernel caps it
/// at `net.core.wmem_max` / `rmem_max`).
const SOCKET_BUFFER: libc::c_int = 4 << 20;

/// Enlarges a local (Unix socket) control connection's buffers: a large
/// blob then crosses in fewer, larger writes and reads, with fewer wake-ups
/// of the other end (20–30 % on a 256 MiB blob, dev VM). Not for TCP,
/// where a fixed size would turn Linux's buffer autotuning off. Best
/// effort: a refusal leaves the defaults.
pub fn size_socket_buffers(sock: &impl std::os::fd::AsRawFd) {
    for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
        // SAFETY: a valid socket descriptor and a c_int option value.
        unsafe {
            libc::setsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                (&SOCKET_BUFFER as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
    }
}

/// How long a peer may take to authenticate.
pub const HANDSHAKE_TIMEOUT: Duration = rdt_transport::rt::auth::HANDSHAKE_TIMEOUT;

/// A fresh random secret for a runtime.
pub fn new_secret() -> [u8; 32] {
    rdt_transport::rt::auth::random32()
}

/// Accepting side of the handshake (invariant 1) on a plain stream (Unix
/// socket or TCP), bounded by [`HANDSHAKE_TIMEOUT`].
pub async fn accept_plain<S: AsyncRead + tokio::io::AsyncWrite + Unpin>(
    stream: &mut S,
    secret: [u8; 32],
) -> Result<()> {
    tokio::time::timeout(
        HANDSHAKE_TIMEOUT,
        rdt_transport::rt::auth::accept_async(stream, &secret),
    )
    .await
    .map_err(|_| Error::Protocol("peer did not authenticate in time".into()))?
    .map_err(|e| match e {
        // The peer went away mid-handshake: an I/O error, not a violation.
        rdt_transport::rt::auth::AuthError::Io(e) => Error::Io(format!("handshake: {e}")),
        e => Error::Protocol(e.to_string()),
    })
}

/// Connecting side of the handshake (invariant 1) on a plain stream.
pub async fn connect_plain<S: AsyncRead + tokio::io::AsyncWrite + Unpin>(
    stream: &mut S,
    secret: &[u8],
) -> Result<()> {
    tokio::time::timeout(
        HANDSHAKE_TIMEOUT,
        rdt_transport::rt::auth::connect_async(stream, secret),
    )
    .await
    .map_err(|_| Error::Protocol("the driver did not authenticate in time".into()))?
    .map_err(|e| Error::Protocol(e.to_string()))
}

/// Accepting side over TLS: the TLS handshake, then the secret's challenge
/// inside the encrypted stream.
pub async fn accept_tls(
    stream: tokio::net::TcpStream,
    acceptor: &tokio_rustls::TlsAcceptor,
    secret: [u8; 32],
) -> Result<TlsStream> {
    tokio::time::timeout(HANDSHAKE_TIMEOUT, async {
        stream.set_nodelay(true)?;
        let mut tls = acceptor
            .accept(stream)
            .await
            .map_err(|e| Error::Protocol(format!("TLS handshake: {e}")))?;
        rdt_transport::rt::auth::accept_async(&mut tls, &secret)
            .await
            .map_err(|e| Error::Protocol(e.to_string()))?;
        Ok(TlsStream::from(tls))
    })
    .await
    .map_err(|_| Error::Protocol("peer did not authenticate in time".into()))?
}

/// Connecting side over TLS (remote workers): trusts `ca_pem`'s
/// certificates for `server_name`.
pub async fn connect_tls(
    addr: &str,
    server_name: &str,
    ca_pem: &[u8],
    secret: &[u8],
) -> Result<(TlsStream, std::net::IpAddr)> {
    use rustls_pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_pki_types::CertificateDer::pem_slice_iter(ca_pem) {
        let cert = cert.map_err(|e| Error::Protocol(format!("TLS CA file: {e}")))?;
        roots
            .add(cert)
            .map_err(|e| Error::Protocol(format!("TLS CA certificate: {e}")))?;
    }
    let config = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| Error::Protocol(e.to_string()))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let name = rustls_pki_types::ServerName::try_from(server_name.to_string())
        .map_err(|e| Error::Protocol(format!("TLS server name {server_name:?}: {e}")))?;
    tokio::time::timeout(HANDSHAKE_TIMEOUT, async {
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| Error::Io(format!("connect to the driver at {addr}: {e}")))?;
        tcp.set_nodelay(true)?;
        let ip = tcp.local_addr()?.ip();
        let mut tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
            .connect(name, tcp)
            .await
            .map_err(|e| Error::Protocol(format!("TLS handshake with {addr}: {e}")))?;
        rdt_transport::rt::auth::connect_async(&mut tls, secret)
            .await
            .map_err(|e| Error::Protocol(e.to_string()))?;
        Ok((TlsStream::from(tls), ip))
    })
    .await
    .map_err(|_| Error::Protocol(format!("the driver at {addr} did not authenticate in time")))?
}

/// A TLS acceptor from a PEM certificate chain and private key.
pub fn tls_acceptor(cert_pem: &[u8], key_pem: &[u8]) -> Result<tokio_rustls::TlsAcceptor> {
    use rustls_pki_types::pem::PemObject;
    let certs = rustls_pki_types::CertificateDer::pem_slice_iter(cert_pem)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::Protocol(format!("TLS certificate: {e}")))?;
    let key = rustls_pki_types::PrivateKeyDer::from_pem_slice(key_pem)
        .map_err(|e| Error::Protocol(format!("TLS key: {e}")))?;
    let config = rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| Error::Protocol(e.to_string()))?
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .map_err(|e| Error::Protocol(format!("TLS certificate and key: {e}")))?;
    Ok(tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config)))
}
