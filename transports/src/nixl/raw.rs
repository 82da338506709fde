use std::sync::Arc;

use super::agent::{self, Agent, Progress};
pub use super::api::NixlError;

/// Where memory is: the host, or a CUDA device (ordinal in this
/// process).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Memory {
    /// Host memory.
    Host,
    /// CUDA device memory, by ordinal.
    Cuda(u32),
}

/// UCX's CUDA transports work in the calling thread's context.
fn bind(m: Memory) -> Result<(), NixlError> {
    if let Memory::Cuda(o) = m {
        crate::cuda::gpu(o as usize)
            .and_then(|g| g.bind())
            .map_err(|e| NixlError(e.to_string()))?;
    }
    Ok(())
}

fn desc(m: Memory, addr: u64, len: usize) -> agent::Desc {
    match m {
        Memory::Host => agent::Desc {
            mem: agent::Mem::Dram,
            addr: addr as usize,
            len,
            dev: 0,
        },
        Memory::Cuda(o) => agent::Desc {
            mem: agent::Mem::Vram,
            addr: addr as usize,
            len,
            dev: o as u64,
        },
    }
}

/// One NIXL agent with a UCX backend.
pub struct RawAgent(Arc<Agent>);

impl RawAgent {
    /// Makes the agent `name`.
    pub fn new(name: &str) -> Result<RawAgent, NixlError> {
        Agent::new(name).map(|a| RawAgent(Arc::new(a)))
    }

    /// What a peer loads to connect.
    pub fn connection_md(&self) -> Result<Vec<u8>, NixlError> {
        Ok(self.0.connection_md().to_vec())
    }

    /// Registers `len` bytes at `addr`; returns what a peer loads to
    /// read them. Stays registered until [`deregister`](Self::deregister).
    pub fn register(&self, m: Memory, addr: u64, len: usize) -> Result<Vec<u8>, NixlError> {
        bind(m)?;
        self.0.register(desc(m, addr, len))
    }

    /// Undoes [`register`](Self::register).
    pub fn deregister(&self, m: Memory, addr: u64, len: usize) -> Result<(), NixlError> {
        self.0.deregister(desc(m, addr, len))
    }

    /// Loads a peer's metadata; returns its agent name.
    pub fn load_remote(&self, md: &[u8]) -> Result<String, NixlError> {
        self.0.load_remote(md)
    }

    /// Reads `remote` ranges of `peer` into `local` ranges (pairwise,
    /// same lengths) with one READ, and waits for it by polling.
    /// A non-empty `notif` rides on the READ (NIXL's notification
    /// attached to a transfer; rdt sends its own after the read, and
    /// `bench_nixl` times what an attached one costs).
    pub fn read(
        &self,
        local: (Memory, &[(u64, usize)]),
        remote: (Memory, &[(u64, usize)]),
        peer: &str,
        notif: &[u8],
    ) -> Result<(), NixlError> {
        bind(remote.0)?;
        bind(local.0)?;
        let l: Vec<_> = local.1.iter().map(|&(a, n)| desc(local.0, a, n)).collect();
        let r: Vec<_> = remote
            .1
            .iter()
            .map(|&(a, n)| desc(remote.0, a, n))
            .collect();
        // A new request each time, as a plain user of NIXL posts one.
        let (req, _) = self.0.post_read(&l, &r, peer, notif, false)?;
        let outcome = loop {
            match self.0.progress(&req) {
                Progress::Running => std::hint::spin_loop(),
                Progress::Done => break Ok(()),
                Progress::Failed(e) => break Err(e),
            }
        };
        if self.0.release(req).is_err() {
            return Err(NixlError("NIXL would not release a finished READ".into()));
        }
        outcome
    }
}
