//! Mutual challenge-response authentication with a shared secret, for every
//! connection rdt makes (control plane and worker-to-worker data links).
//!
//! Protocol (all on a blocking stream, before any other byte):
//! 1. acceptor → connector: 32-byte random nonce `ns`;
//! 2. connector → acceptor: its nonce `nc` and `HMAC(secret, "rdt-client" ‖ ns ‖ nc)`;
//! 3. acceptor checks it and answers `HMAC(secret, "rdt-server" ‖ nc ‖ ns)`;
//! 4. connector checks that.
//!
//! The secret never crosses the wire; fresh nonces on both sides defeat
//! replay. Both ends bound every read by a timeout, so a silent peer cannot
//! hold a thread.

use std::io::{Read, Write};
use std::time::Duration;

use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;
const NONCE: usize = 32;
const TAG: usize = 32;

/// How long a peer may take to authenticate.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Authentication failed.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// The peer does not know the secret.
    #[error("peer failed authentication (it does not know this runtime's secret)")]
    BadPeer,
    /// I/O failed or timed out during the handshake.
    #[error("handshake I/O: {0}")]
    Io(#[from] std::io::Error),
}

/// Fresh random bytes (nonces, secrets).
pub fn random32() -> [u8; 32] {
    let mut s = [0u8; 32];
    getrandom::getrandom(&mut s).expect("the OS random source works");
    s
}

fn mac(secret: &[u8], label: &[u8], a: &[u8], b: &[u8]) -> HmacSha256 {
    let mut m = HmacSha256::new_from_slice(secret).expect("HMAC takes keys of any length");
    m.update(label);
    m.update(a);
    m.update(b);
    m
}

/// Accepting side.
pub fn accept<S: Read + Write>(s: &mut S, secret: &[u8]) -> Result<(), AuthError> {
    let ns = random32();
    s.write_all(&ns)?;
    s.flush()?;
    let mut buf = [0u8; NONCE + TAG];
    s.read_exact(&mut buf)?;
    let (nc, t) = buf.split_at(NONCE);
    mac(secret, b"rdt-client", &ns, nc)
        .verify_slice(t)
        .map_err(|_| AuthError::BadPeer)?;
    s.write_all(&mac(secret, b"rdt-server", nc, &ns).finalize().into_bytes())?;
    s.flush()?;
    Ok(())
}

/// Connecting side.
pub fn connect<S: Read + Write>(s: &mut S, secret: &[u8]) -> Result<(), AuthError> {
    let mut ns = [0u8; NONCE];
    s.read_exact(&mut ns)?;
    let nc = random32();
    let mut out = [0u8; NONCE + TAG];
    out[..NONCE].copy_from_slice(&nc);
    out[NONCE..].copy_from_slice(&mac(secret, b"rdt-client", &ns, &nc).finalize().into_bytes());
    s.write_all(&out)?;
    s.flush()?;
    let mut t = [0u8; TAG];
    s.read_exact(&mut t)?;
    mac(secret, b"rdt-server", &nc, &ns)
        .verify_slice(&t)
        .map_err(|_| AuthError::BadPeer)?;
    Ok(())
}

/// [`accept`] on an async stream (used inside TLS, where the handshake must
/// run on the encrypted stream).
pub async fn accept_async<S>(s: &mut S, secret: &[u8]) -> Result<(), AuthError>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let ns = random32();
    s.write_all(&ns).await?;
    s.flush().await?;
    let mut buf = [0u8; NONCE + TAG];
    s.read_exact(&mut buf).await?;
    let (nc, t) = buf.split_at(NONCE);
    mac(secret, b"rdt-client", &ns, nc)
        .verify_slice(t)
        .map_err(|_| AuthError::BadPeer)?;
    s.write_all(&mac(secret, b"rdt-server", nc, &ns).finalize().into_bytes())
        .await?;
    s.flush().await?;
    Ok(())
}

/// [`connect`] on an async stream.
pub async fn connect_async<S>(s: &mut S, secret: &[u8]) -> Result<(), AuthError>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut ns = [0u8; NONCE];
    s.read_exact(&mut ns).await?;
    let nc = random32();
    let mut out = [0u8; NONCE + TAG];
    out[..NONCE].copy_from_slice(&nc);
    out[NONCE..].copy_from_slice(&mac(secret, b"rdt-client", &ns, &nc).finalize().into_bytes());
    s.write_all(&out).await?;
    s.flush().await?;
    let mut t = [0u8; TAG];
    s.read_exact(&mut t).await?;
    mac(secret, b"rdt-server", &nc, &ns)
        .verify_slice(&t)
        .map_err(|_| AuthError::BadPeer)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    fn pair(a: &'static [u8], b: &'static [u8]) -> (Result<(), AuthError>, Result<(), AuthError>) {
        let (mut x, mut y) = UnixStream::pair().unwrap();
        x.set_read_timeout(Some(HANDSHAKE_TIMEOUT)).unwrap();
        y.set_read_timeout(Some(HANDSHAKE_TIMEOUT)).unwrap();
        let h = std::thread::spawn(move || accept(&mut x, a));
        let r = connect(&mut y, b);
        drop(y);
        (h.join().unwrap(), r)
    }

    #[test]
    fn same_secret_passes_other_secret_fails() {
        let (a, c) = pair(b"k", b"k");
        assert!(a.is_ok() && c.is_ok());
        let (a, c) = pair(b"k", b"other");
        assert!(matches!(a, Err(AuthError::BadPeer)));
        assert!(c.is_err());
    }
}
