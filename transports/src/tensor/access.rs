//! Host bytes: reads and writes under the storage's lock (invariant 3),
//! snapshots of shared memory, and copy on write (invariant 4).

use super::*;

impl Tensor {
    /// Calls `f` with this tensor's bytes in the storage's external
    /// memory, or `None` if the storage is not external, under the
    /// storage's read lock. A transport uses it to recognize memory it made
    /// itself ([`ExternalBytes::memory`] and [`ExternalMemory::as_any`]).
    pub fn with_external<R>(&self, f: impl FnOnce(Option<ExternalBytes<'_>>) -> R) -> R {
        match &*self.storage.mem.read() {
            Memory::External(e) => f(Some(ExternalBytes {
                mem: e.as_ref(),
                offset: self.offset,
                len: self.nbytes(),
            })),
            Memory::Owned(_) | Memory::Shared(_) | Memory::Cuda(_) => f(None),
        }
    }

    /// Moves a host storage into `mem`: under the storage's write lock, the
    /// current bytes are copied into `mem`, which then becomes the storage's
    /// memory. Every clone of this tensor, and every view of its storage,
    /// shares the storage, so all of them live in `mem` afterwards (a
    /// transport uses this to put a producer's tensors into memory that
    /// consumers map). `mem` has the whole storage's length
    /// ([`storage_nbytes`](Self::storage_nbytes)), and this tensor's bytes
    /// are at its [`byte_offset`](Self::byte_offset) in it.
    ///
    /// Returns `Ok(true)` if the storage moved, and `Ok(false)`, leaving it
    /// as it is, if it already is external memory: whoever made that memory
    /// may have published it, and dropping it would pull it from under them.
    /// Errors if the tensor is not on the host or `mem` has the wrong size.
    pub fn migrate_storage(&self, mem: Box<dyn ExternalMemory>) -> Result<bool, TensorError> {
        self.require_host()?;
        if mem.len() != self.storage.len() {
            return Err(TensorError::Mismatch(format!(
                "moving a storage of {} bytes into memory of {} bytes",
                self.storage.len(),
                mem.len()
            )));
        }
        let mut guard = self.storage.mem.write();
        let src: &[u8] = match &*guard {
            Memory::Owned(v) => v,
            Memory::Shared(b) => b,
            Memory::External(_) | Memory::Cuda(_) => return Ok(false),
        };
        // An empty memory may have a dangling (even null) pointer: nothing to
        // copy, and no slice may be made of it.
        if !src.is_empty() {
            // SAFETY: `mem` is valid for `mem.len()` bytes while it lives (the
            // `ExternalMemory` contract), and the size check above makes `src`
            // and `mem` the same length; `src` is private memory
            // of this storage, so the two do not overlap. A raw copy forms no
            // reference over `mem`, which may be shared with other processes.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), mem.as_ptr(), src.len()) };
        }
        *guard = Memory::External(mem);
        Ok(true)
    }

    /// Calls `f` with the host bytes.
    ///
    /// Private memory is read in place, under the storage's read lock (no
    /// copy). Memory shared with other processes is read as a snapshot:
    /// copied out with raw-pointer copies into a private buffer, which is
    /// what `f` sees; it may be torn if another process writes meanwhile
    /// (see the type's "Shared memory" section).
    pub fn with_bytes<R>(&self, f: impl FnOnce(&[u8]) -> R) -> Result<R, TensorError> {
        self.require_host()?;
        let range = self.range();
        let mem = self.storage.mem.read();
        match &*mem {
            Memory::Owned(v) => Ok(f(&v[range])),
            Memory::Shared(b) => Ok(f(&b[range])),
            Memory::External(e) if !e.shared_with_other_processes() => {
                // SAFETY: the memory is valid for `len` bytes while it lives,
                // and it lives while `mem` (the read guard) is held; it is not
                // shared with other processes (the `ExternalMemory` contract),
                // and the read guard excludes writers in this process.
                Ok(f(unsafe { external_slice(e.as_ref(), range) }))
            }
            Memory::External(e) => {
                let snapshot = copy_out(e.as_ref(), range);
                drop(mem);
                Ok(f(&snapshot))
            }
            Memory::Cuda(_) => unreachable!("require_host rejects CUDA storage"),
        }
    }

    /// Calls `f` with the host bytes to change them, under the storage's
    /// write lock (copying shared wire bytes first, invariant 4). Every
    /// clone sees the write.
    ///
    /// Private memory is written in place. Memory shared with other
    /// processes is copied out with raw-pointer copies, `f` changes the
    /// private copy, and all of it is copied back the same way (see the
    /// type's "Shared memory" section).
    pub fn with_bytes_mut<R>(&self, f: impl FnOnce(&mut [u8]) -> R) -> Result<R, TensorError> {
        self.require_host()?;
        let range = self.range();
        let mut mem = self.storage.mem.write();
        if let Memory::External(e) = &*mem {
            if e.shared_with_other_processes() {
                let mut staged = copy_out(e.as_ref(), range.clone());
                let r = f(&mut staged);
                copy_in(e.as_ref(), range.start, &staged);
                return Ok(r);
            }
        }
        // SAFETY: the memory is private (just checked), and the write guard
        // excludes every other access through this storage.
        Ok(f(&mut unsafe { private_slice_mut(&mut mem) }[range]))
    }

    /// Calls `f` with the host bytes in place, with no copy, whatever the
    /// memory: the zero-copy form of [`with_bytes`](Self::with_bytes).
    ///
    /// # Safety
    /// If the storage is memory shared with other processes
    /// ([`ExternalMemory::shared_with_other_processes`]), the caller
    /// guarantees that for as long as `f` runs no other process (nor
    /// another storage over the same memory in this process) writes any of
    /// the tensor's bytes: `f` gets a `&[u8]` over them, and a concurrent
    /// write under a shared reference is undefined behavior. For private
    /// memory this is always true, and the call is as safe as
    /// [`with_bytes`](Self::with_bytes).
    pub unsafe fn with_bytes_unchecked<R>(
        &self,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, TensorError> {
        self.require_host()?;
        let range = self.range();
        let mem = self.storage.mem.read();
        let bytes: &[u8] = match &*mem {
            Memory::Owned(v) => &v[range],
            Memory::Shared(b) => &b[range],
            // SAFETY: valid while `mem` is held; no concurrent writer by the
            // caller's guarantee.
            Memory::External(e) => unsafe { external_slice(e.as_ref(), range) },
            Memory::Cuda(_) => unreachable!("require_host rejects CUDA storage"),
        };
        Ok(f(bytes))
    }

    /// Calls `f` with the host bytes in place to change them, with no copy,
    /// whatever the memory: the zero-copy form of
    /// [`with_bytes_mut`](Self::with_bytes_mut).
    ///
    /// # Safety
    /// If the storage is memory shared with other processes
    /// ([`ExternalMemory::shared_with_other_processes`]), the caller
    /// guarantees that for as long as `f` runs no other process (nor
    /// another storage over the same memory in this process) reads or
    /// writes any of the tensor's bytes: `f` gets a `&mut [u8]` over them,
    /// which must be the only access. For private memory this is always
    /// true, and the call is as safe as
    /// [`with_bytes_mut`](Self::with_bytes_mut).
    pub unsafe fn with_bytes_mut_unchecked<R>(
        &self,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, TensorError> {
        self.require_host()?;
        let range = self.range();
        let mut mem = self.storage.mem.write();
        if let Memory::External(e) = &*mem {
            // SAFETY: valid while the write guard is held, which excludes
            // every access through this storage; no other access by the
            // caller's guarantee.
            return Ok(f(unsafe { external_slice_mut(e.as_ref(), range) }));
        }
        // SAFETY: not external, so private.
        Ok(f(&mut unsafe { private_slice_mut(&mut mem) }[range]))
    }

    /// A private copy of the host bytes: one copy whatever the memory (a
    /// raw-pointer copy for memory shared with other processes).
    pub(crate) fn copy_bytes(&self) -> Result<Vec<u8>, TensorError> {
        self.require_host()?;
        if let Memory::External(e) = &*self.storage.mem.read() {
            if e.shared_with_other_processes() {
                return Ok(copy_out(e.as_ref(), self.range()));
            }
        }
        self.with_bytes(<[u8]>::to_vec)
    }

    /// The bytes as an immutable [`Bytes`] (a snapshot: later writes to
    /// the tensor do not change it). No copy for private host memory:
    /// wire bytes are shared as they are, and owned bytes become wire
    /// bytes in place, so the storage turns copy-on-write (invariant 4:
    /// the next write through any clone copies them once, or not at all if
    /// nothing else holds the `Bytes` by then). Memory shared with other
    /// processes is copied.
    pub fn to_bytes(&self) -> Result<Bytes, TensorError> {
        self.require_host()?;
        let range = self.range();
        if let Memory::Shared(b) = &*self.storage.mem.read() {
            return Ok(b.slice(range));
        }
        {
            let mut mem = self.storage.mem.write();
            match &mut *mem {
                // Raced with another `to_bytes`.
                Memory::Shared(b) => return Ok(b.slice(range)),
                Memory::Owned(v) => {
                    let b = Bytes::from(std::mem::take(v));
                    *mem = Memory::Shared(b.clone());
                    return Ok(b.slice(range));
                }
                Memory::External(_) | Memory::Cuda(_) => {}
            }
        }
        self.copy_bytes().map(Bytes::from)
    }

    fn require_host(&self) -> Result<(), TensorError> {
        if !self.storage.device.is_cpu() {
            return Err(TensorError::NotHost(self.storage.device));
        }
        debug_assert!(self.offset + self.nbytes() <= self.storage.len());
        Ok(())
    }

    pub(super) fn require_dtype<T: Element>(&self) -> Result<(), TensorError> {
        if T::DTYPE != self.dtype {
            return Err(TensorError::DType {
                expected: T::DTYPE,
                actual: self.dtype,
            });
        }
        Ok(())
    }

    /// Copies the elements out.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>, TensorError> {
        self.require_dtype::<T>()?;
        self.with_bytes(|b| bytemuck::pod_collect_to_vec::<u8, T>(b))
    }
}

impl Tensor {
    /// Copies `src`'s host bytes (as many as this tensor's) into this
    /// tensor's with one copy: read where they are, under `src`'s read
    /// lock, and written under this storage's write lock. Memory shared
    /// with other processes is read or written with raw-pointer copies (no
    /// reference to it is formed), as everywhere here. A copy within one
    /// storage stages the bytes first (its lock cannot be taken twice).
    pub(crate) fn copy_host_from(&self, src: &Tensor) -> Result<(), TensorError> {
        self.require_host()?;
        src.require_host()?;
        let len = self.nbytes();
        if src.nbytes() != len {
            return Err(TensorError::Mismatch(format!(
                "copying {} bytes into {len}",
                src.nbytes()
            )));
        }
        if Arc::ptr_eq(&self.storage, &src.storage) {
            let bytes = src.copy_bytes()?;
            return self.with_bytes_mut(|b| b.copy_from_slice(&bytes));
        }
        // Two storages, locked in one order (by address): two copies in
        // opposite directions at once cannot deadlock.
        let src_first = Arc::as_ptr(&src.storage) < Arc::as_ptr(&self.storage);
        let (from_mem, mut to_mem) = if src_first {
            let f = src.storage.mem.read();
            (f, self.storage.mem.write())
        } else {
            let t = self.storage.mem.write();
            (src.storage.mem.read(), t)
        };
        let (from_range, to_range) = (src.range(), self.range());
        let from: *const u8 = match &*from_mem {
            Memory::Owned(v) => v[from_range].as_ptr(),
            Memory::Shared(b) => b[from_range].as_ptr(),
            Memory::External(e) => {
                assert!(
                    from_range.end <= e.len(),
                    "a tensor lies within its storage"
                );
                // SAFETY: within the `e.len()` bytes valid while `e` lives
                // (the `ExternalMemory` contract; asserted).
                unsafe { e.as_ptr().cast_const().add(from_range.start) }
            }
            Memory::Cuda(_) => unreachable!("require_host rejects CUDA storage"),
        };
        let to: *mut u8 = match &mut *to_mem {
            Memory::External(e) => {
                assert!(to_range.end <= e.len(), "a tensor lies within its storage");
                // SAFETY: as for the source.
                unsafe { e.as_ptr().add(to_range.start) }
            }
            // SAFETY: not external memory (matched above): the slice is
            // this storage's own private bytes, under its write lock.
            other => (unsafe { private_slice_mut(other) })[to_range].as_mut_ptr(),
        };
        if len > 0 {
            // SAFETY: both ranges are `len` bytes valid while the guards
            // live (checked above). They may overlap only if two storages
            // share external memory, so the copy is `copy` (a memmove),
            // which allows that; no reference is formed over memory another
            // process may share.
            unsafe { std::ptr::copy(from, to, len) };
        }
        drop(to_mem);
        drop(from_mem);
        Ok(())
    }
}

/// The bytes of a host memory as a mutable slice, turning shared wire bytes
/// into owned ones first (invariant 4).
///
/// # Safety
/// If `mem` is external memory, nothing else may read or write it while the
/// slice lives (for memory that is not shared with other processes, holding
/// the storage's write lock, as `mem` suggests, guarantees that).
unsafe fn private_slice_mut(mem: &mut Memory) -> &mut [u8] {
    if let Memory::Shared(b) = mem {
        // Copy on write, unless these are the only holders of the bytes.
        *mem = Memory::Owned(match std::mem::take(b).try_into_mut() {
            Ok(unique) => Vec::from(unique),
            Err(shared) => shared.to_vec(),
        });
    }
    match mem {
        Memory::Owned(v) => v,
        Memory::Shared(_) => unreachable!("converted above"),
        // SAFETY: by the caller's guarantee.
        Memory::External(e) => unsafe { external_slice_mut(&**e, 0..e.len()) },
        Memory::Cuda(_) => unreachable!("host memory only"),
    }
}
