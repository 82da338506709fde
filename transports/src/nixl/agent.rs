//! One NIXL agent with its UCX backend: a safe face over the C API.
//!
//! The C API's agent is made with NIXL's default thread mode, which is not
//! thread-safe; every call into it goes through [`Agent::lock`], held only
//! for the call itself (calls post or query; none waits for a transfer).

use std::ffi::{c_char, c_void, CStr, CString};

use parking_lot::Mutex;

use super::api::{self, api, check, Api, NixlError};

/// The handles of the agent, only touched under the lock.
struct Raw {
    agent: api::Agent,
    backend: api::Backend,
    notifs: api::NotifMap,
    /// Finished READ requests kept to be posted again, oldest first (see
    /// [`Agent::post_read`]).
    kept: Vec<KeptRead>,
    /// Requests posted and neither finished nor released: READs that may
    /// still run ([`Agent::close_for_exit`] leaves an agent with any).
    outstanding: usize,
}

/// A finished READ request, and what it reads: posted again for the same
/// descriptors and peer, it skips NIXL's making of a request (descriptor
/// lists, metadata lookups, the backend's preparation: 2-3.5 µs of a
/// 4 KiB read's 6-10 µs post on the 2xH200 host).
struct KeptRead {
    what: ReadKey,
    req: api::XferReq,
}

/// What a kept request reads: the peer, and both descriptor lists.
#[derive(PartialEq, Eq)]
pub(crate) struct ReadKey {
    peer: String,
    local: Vec<Desc>,
    remote: Vec<Desc>,
}

/// Requests of at most this many descriptors are kept for reuse (small
/// objects, read again and again with the same few ranges)...
const KEEP_MAX_DESCS: usize = 4;
/// ... and at most this many of them per agent (a receive alternates
/// between a few destinations of the pool).
const KEEP_MAX: usize = 16;

// SAFETY: the handles are only used under `Agent::raw`'s lock, and NIXL's
// objects are not tied to the thread that made them.
unsafe impl Send for Raw {}

/// A memory type of NIXL.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub(crate) enum Mem {
    /// Host memory.
    Dram,
    /// CUDA device memory (`dev` is the CUDA ordinal).
    Vram,
}

impl Mem {
    fn code(self) -> i32 {
        match self {
            Mem::Dram => api::mem::DRAM,
            Mem::Vram => api::mem::VRAM,
        }
    }
}

/// One descriptor: `len` bytes at `addr` on device `dev` of memory `mem`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Desc {
    pub mem: Mem,
    pub addr: usize,
    pub len: usize,
    pub dev: u64,
}

/// A posted transfer request, released by [`Agent::release`] (or, once
/// it ended, kept by [`Agent::finish`] to be posted again).
pub(crate) struct Request(api::XferReq, Option<Box<ReadKey>>);
// SAFETY: a request handle is a pointer NIXL does not tie to a thread; it is
// only used through the agent's lock.
unsafe impl Send for Request {}

/// Where a request stands.
pub(crate) enum Progress {
    Done,
    Running,
    Failed(NixlError),
}

/// This process's NIXL agent.
pub(crate) struct Agent {
    api: &'static Api,
    name: String,
    /// What a peer loads to connect: fixed once the backend exists.
    connection: Vec<u8>,
    raw: Mutex<Raw>,
}

/// The longest UCX's progress thread sleeps between unconditional passes
/// over its workers (it wakes earlier on their events).
const PROGRESS_THREAD_WAKE_US: u64 = 1_000;

impl Agent {
    /// Makes the agent `name` with a UCX backend.
    pub fn new(name: &str) -> Result<Agent, NixlError> {
        let api = api()?;
        // On the 2xH200 host, agents made this way (after CUDA is
        // initialized in the process, from a thread with no context
        // current: a worker's background start) read device memory over
        // CUDA IPC at ~290 GB/s across GPUs, while the raw baseline's
        // agents read it at 0.5 GB/s (on the one-GPU hosts UCX emulates
        // such reads over TCP, for every agent). Why UCX chose differently
        // there is not established (book: NIXL chapter, "Measured"); every
        // agent is made the way that was fast.
        let _ = crate::cuda::available();
        let name = name.to_string();
        std::thread::Builder::new()
            .name("rdt-nixl-agent".into())
            .spawn(move || Agent::make(api, &name))
            .map_err(|e| NixlError(format!("starting a thread to make the agent: {e}")))?
            .join()
            .map_err(|_| NixlError("making the NIXL agent panicked".into()))?
    }

    fn make(api: &'static Api, name: &str) -> Result<Agent, NixlError> {
        let cname = c_string(name)?;
        let mut agent: api::Agent = std::ptr::null_mut();
        // The C API's default agent runs UCX's progress thread with a
        // poll timeout of 0: it spins a core in every process (measured on
        // the 2-core machine: 79 % of all CPU; a 40 MiB pass took twice as
        // long). The thread is needed (a producer's notifications, and
        // reads emulated over TCP, progress only there), so it stays, but
        // sleeps on UCX's event descriptors, waking at least every
        // millisecond (NIXL's workaround for a UCX wake-up bug). Readers
        // progress their own requests (on the receiving task, then the
        // poller) and do not wait on it.
        let config = api::AgentConfig {
            enable_prog_thread: true,
            enable_listen_thread: false,
            listen_port: 0,
            thread_sync: 0,
            num_workers: 1,
            pthr_delay_us: PROGRESS_THREAD_WAKE_US,
            lthr_delay_us: 100_000,
            capture_telemetry: false,
        };
        // SAFETY: valid C string, config and out-pointer.
        check("nixl_capi_create_configured_agent", unsafe {
            (api.create_configured_agent)(cname.as_ptr(), &config, &mut agent)
        })?;
        let ucx = c"UCX";
        let (mut mems, mut params): (api::MemList, api::Params) =
            (std::ptr::null_mut(), std::ptr::null_mut());
        let made = (|| {
            // SAFETY: live agent, valid out-pointers.
            check("nixl_capi_get_plugin_params(UCX)", unsafe {
                (api.get_plugin_params)(agent, ucx.as_ptr(), &mut mems, &mut params)
            })
            .map_err(|e| {
                NixlError(format!(
                    "{e}: NIXL's UCX plugin did not load (it is libplugin_UCX.so in the \
                     plugins folder next to {})",
                    api.path
                ))
            })?;
            let mut backend: api::Backend = std::ptr::null_mut();
            // SAFETY: live agent and params.
            check("nixl_capi_create_backend(UCX)", unsafe {
                (api.create_backend)(agent, ucx.as_ptr(), params, &mut backend)
            })?;
            let mut notifs: api::NotifMap = std::ptr::null_mut();
            // SAFETY: valid out-pointer.
            check("nixl_capi_create_notif_map", unsafe {
                (api.create_notif_map)(&mut notifs)
            })?;
            // The connection alone: partial metadata of no memory (NIXL
            // then includes every backend's connection). The full metadata
            // would also carry every registration, and change with them.
            let none = RegList::empty(api, Mem::Dram)?;
            let mut data: *mut c_void = std::ptr::null_mut();
            let mut len = 0usize;
            // SAFETY: live agent and list, valid out-pointers; the blob is
            // malloc'd and ours to free.
            check("nixl_capi_get_local_partial_md", unsafe {
                (api.get_local_partial_md)(agent, none.0, &mut data, &mut len, std::ptr::null_mut())
            })?;
            Ok((backend, notifs, take_blob(data, len)))
        })();
        // SAFETY: made above (or null, which the C API refuses harmlessly).
        unsafe {
            if !mems.is_null() {
                (api.destroy_mem_list)(mems);
            }
            if !params.is_null() {
                (api.destroy_params)(params);
            }
        }
        match made {
            Ok((backend, notifs, connection)) => Ok(Agent {
                api,
                name: name.to_string(),
                connection,
                raw: Mutex::new(Raw {
                    agent,
                    backend,
                    notifs,
                    kept: Vec::new(),
                    outstanding: 0,
                }),
            }),
            Err(e) => {
                // SAFETY: the agent made above, used by nothing else.
                unsafe { (api.destroy_agent)(agent) };
                Err(e)
            }
        }
    }

    /// The agent's name (unique per process).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The metadata a peer needs to connect to this agent (name and UCX
    /// address; no memory).
    pub fn connection_md(&self) -> &[u8] {
        &self.connection
    }

    /// Registers `desc` for remote access; returns the metadata a peer
    /// loads to read it.
    pub fn register(&self, desc: Desc) -> Result<Vec<u8>, NixlError> {
        let raw = self.raw.lock();
        let list = RegList::new(self.api, desc)?;
        // SAFETY: live agent and list; no options.
        check("nixl_capi_register_mem", unsafe {
            (self.api.register_mem)(raw.agent, list.0, std::ptr::null_mut())
        })?;
        let mut data: *mut c_void = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: as above; the blob is malloc'd and ours to free.
        let md = check("nixl_capi_get_local_partial_md", unsafe {
            (self.api.get_local_partial_md)(
                raw.agent,
                list.0,
                &mut data,
                &mut len,
                std::ptr::null_mut(),
            )
        });
        match md {
            Ok(()) => Ok(take_blob(data, len)),
            Err(e) => {
                // SAFETY: registered just above.
                unsafe { (self.api.deregister_mem)(raw.agent, list.0, std::ptr::null_mut()) };
                Err(e)
            }
        }
    }

    /// Undoes [`register`](Self::register) (before the memory is freed).
    pub fn deregister(&self, desc: Desc) -> Result<(), NixlError> {
        let mut raw = self.raw.lock();
        // A kept request may read into this memory: none outlives it.
        self.drop_kept(&mut raw, |_| true);
        let list = RegList::new(self.api, desc)?;
        // SAFETY: live agent and list.
        check("nixl_capi_deregister_mem", unsafe {
            (self.api.deregister_mem)(raw.agent, list.0, std::ptr::null_mut())
        })
    }

    /// Loads a peer's metadata (connection or memory); returns the peer
    /// agent's name.
    pub fn load_remote(&self, md: &[u8]) -> Result<String, NixlError> {
        if md.is_empty() {
            return Err(NixlError("empty agent metadata".into()));
        }
        let raw = self.raw.lock();
        let mut name: *mut c_char = std::ptr::null_mut();
        // SAFETY: live agent, valid buffer; the name is strdup'd and ours.
        check("nixl_capi_load_remote_md", unsafe {
            (self.api.load_remote_md)(raw.agent, md.as_ptr().cast(), md.len(), &mut name)
        })?;
        // SAFETY: a NUL-terminated string from strdup.
        let s = unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: strdup'd by the C API.
        unsafe { libc::free(name.cast()) };
        Ok(s)
    }

    /// Forgets everything loaded about `peer` and drops its connections.
    pub fn forget_remote(&self, peer: &str) -> Result<(), NixlError> {
        let mut raw = self.raw.lock();
        // Kept requests reading from the peer name memory of what is
        // forgotten (maybe reallocated since, with another registration).
        self.drop_kept(&mut raw, |k| k.peer == peer);
        let c = c_string(peer)?;
        // SAFETY: live agent, valid C string.
        check("nixl_capi_invalidate_remote_md", unsafe {
            (self.api.invalidate_remote_md)(raw.agent, c.as_ptr())
        })
    }

    /// Posts one READ of `remote` (on `peer`) into `local`, pairwise (same
    /// count, same lengths), with `notif` for the peer when it completes.
    /// With `reuse`, a small READ without a notification posts again a
    /// request kept from an earlier one of the same descriptors and peer
    /// (NIXL allows a finished request to be posted again), and the
    /// request it returns can be kept by [`finish`](Self::finish). Kept
    /// requests go when the local memory they name is deregistered or the
    /// peer forgotten.
    pub fn post_read(
        &self,
        local: &[Desc],
        remote: &[Desc],
        peer: &str,
        notif: &[u8],
        reuse: bool,
    ) -> Result<(Request, bool), NixlError> {
        let t0 = std::time::Instant::now();
        let mut raw = self.raw.lock();
        let t1 = std::time::Instant::now();
        super::bump(
            &super::COUNTERS.post_lock_nanos,
            (t1 - t0).as_nanos() as u64,
        );
        let keepable = reuse && notif.is_empty() && local.len() <= KEEP_MAX_DESCS;
        if keepable {
            let found = raw.kept.iter().position(|k| {
                k.what.peer == peer && k.what.local == local && k.what.remote == remote
            });
            if let Some(i) = found {
                let k = raw.kept.remove(i);
                // SAFETY: a live request that ended (kept only then).
                let s = unsafe { (self.api.post_xfer_req)(raw.agent, k.req, std::ptr::null_mut()) };
                super::bump(
                    &super::COUNTERS.post_submit_nanos,
                    t1.elapsed().as_nanos() as u64,
                );
                match s {
                    api::status::SUCCESS | api::status::IN_PROG => {
                        super::bump(&super::COUNTERS.reads_reposted, 1);
                        raw.outstanding += 1;
                        let done = s == api::status::SUCCESS;
                        return Ok((Request(k.req, Some(Box::new(k.what))), done));
                    }
                    _ => {
                        // NIXL may have deleted the request inside on this
                        // failure (the C API does not say): only its
                        // handle is freed, and a new request is made.
                        // SAFETY: the handle is ours; nothing uses it after.
                        unsafe { (self.api.destroy_xfer_req)(k.req) };
                    }
                }
            }
        }
        let l = XferList::new(self.api, local)?;
        let r = XferList::new(self.api, remote)?;
        let opts = OptArgs::new(self.api)?;
        let peer_c = c_string(peer)?;
        // SAFETY: live option args, backend and buffer.
        unsafe {
            check("nixl_capi_opt_args_add_backend", {
                (self.api.opt_args_add_backend)(opts.0, raw.backend)
            })?;
            if !notif.is_empty() {
                check(
                    "nixl_capi_opt_args_set_notif_msg",
                    (self.api.opt_args_set_notif_msg)(opts.0, notif.as_ptr().cast(), notif.len()),
                )?;
                check(
                    "nixl_capi_opt_args_set_has_notif",
                    (self.api.opt_args_set_has_notif)(opts.0, true),
                )?;
            }
        }
        let mut req: api::XferReq = std::ptr::null_mut();
        // SAFETY: live agent, lists, options; valid out-pointer.
        check("nixl_capi_create_xfer_req(READ)", unsafe {
            (self.api.create_xfer_req)(
                raw.agent,
                api::XFER_OP_READ,
                l.0,
                r.0,
                peer_c.as_ptr(),
                &mut req,
                opts.0,
            )
        })
        .map_err(|e| {
            NixlError(format!(
                "{e}: the peer's memory is not (or no longer) known to this agent"
            ))
        })?;
        let t2 = std::time::Instant::now();
        super::bump(
            &super::COUNTERS.post_create_nanos,
            (t2 - t1).as_nanos() as u64,
        );
        // SAFETY: the request made above.
        let s = unsafe { (self.api.post_xfer_req)(raw.agent, req, std::ptr::null_mut()) };
        super::bump(
            &super::COUNTERS.post_submit_nanos,
            t2.elapsed().as_nanos() as u64,
        );
        let what = keepable.then(|| {
            Box::new(ReadKey {
                peer: peer.to_string(),
                local: local.to_vec(),
                remote: remote.to_vec(),
            })
        });
        match s {
            api::status::SUCCESS | api::status::IN_PROG => {
                raw.outstanding += 1;
                Ok((Request(req, what), s == api::status::SUCCESS))
            }
            _ => {
                // The request made above; it did not start.
                self.release_handle(&raw, req);
                Err(NixlError(format!(
                    "nixl_capi_post_xfer_req(READ) failed: {} ({s})",
                    api::status::name(s)
                )))
            }
        }
    }

    /// Sends `msg` to `peer` as a NIXL notification, on its own (not
    /// attached to a transfer).
    pub fn gen_notif(&self, peer: &str, msg: &[u8]) -> Result<(), NixlError> {
        let raw = self.raw.lock();
        let peer_c = c_string(peer)?;
        // SAFETY: live agent; the name and message outlive the call (NIXL
        // copies the message).
        check("nixl_capi_gen_notif", unsafe {
            (self.api.gen_notif)(
                raw.agent,
                peer_c.as_ptr(),
                msg.as_ptr().cast(),
                msg.len(),
                std::ptr::null_mut(),
            )
        })
    }

    /// Where `req` stands.
    pub fn progress(&self, req: &Request) -> Progress {
        let raw = self.raw.lock();
        // SAFETY: live agent and request.
        match unsafe { (self.api.get_xfer_status)(raw.agent, req.0) } {
            api::status::SUCCESS => Progress::Done,
            api::status::IN_PROG => Progress::Running,
            s => Progress::Failed(NixlError(format!(
                "the READ failed: {} ({s})",
                api::status::name(s)
            ))),
        }
    }

    /// A request that ended ([`Progress::Done`]): kept to be posted again
    /// if [`post_read`](Self::post_read) made it for reuse (the oldest kept
    /// one is released past [`KEEP_MAX`]), else released. Gives it back
    /// if NIXL refuses to release it for now, to be tried again.
    pub fn finish(&self, req: Request) -> Result<(), Request> {
        let Request(handle, Some(what)) = req else {
            return self.release(req);
        };
        let mut raw = self.raw.lock();
        raw.outstanding = raw.outstanding.saturating_sub(1);
        raw.kept.push(KeptRead {
            what: *what,
            req: handle,
        });
        if raw.kept.len() > KEEP_MAX {
            // It ended: releasing it cancels nothing.
            let oldest = raw.kept.remove(0);
            self.release_handle(&raw, oldest.req);
        }
        Ok(())
    }

    /// Releases the kept requests `which` says.
    fn drop_kept(&self, raw: &mut Raw, which: impl Fn(&ReadKey) -> bool) {
        let (go, stay): (Vec<KeptRead>, Vec<KeptRead>) = std::mem::take(&mut raw.kept)
            .into_iter()
            .partition(|k| which(&k.what));
        raw.kept = stay;
        for k in go {
            self.release_handle(raw, k.req);
        }
    }

    /// Releases `req` (cancelling it if it still runs). Gives it back if
    /// NIXL refuses for now, to be tried again.
    pub fn release(&self, req: Request) -> Result<(), Request> {
        let mut raw = self.raw.lock();
        if self.release_handle(&raw, req.0) {
            raw.outstanding = raw.outstanding.saturating_sub(1);
            Ok(())
        } else {
            Err(req)
        }
    }

    /// Releases the request `req` (a live one of this agent, used by
    /// nothing else after), then frees its handle; false if NIXL refused
    /// (the handle stays valid).
    fn release_handle(&self, raw: &Raw, req: api::XferReq) -> bool {
        // SAFETY: live agent and request.
        if unsafe { (self.api.release_xfer_req)(raw.agent, req) } != api::status::SUCCESS {
            return false;
        }
        // SAFETY: released above, so its inner request is gone.
        unsafe { (self.api.destroy_xfer_req)(req) };
        true
    }

    /// The notifications that arrived since the last call, as
    /// (peer agent, message).
    pub fn take_notifications(&self) -> Result<Vec<(String, Vec<u8>)>, NixlError> {
        let raw = self.raw.lock();
        let map = raw.notifs;
        let mut out = Vec::new();
        // SAFETY: live agent and map; strings and buffers read before the
        // map is cleared.
        unsafe {
            check(
                "nixl_capi_get_notifs",
                (self.api.get_notifs)(raw.agent, map, std::ptr::null_mut()),
            )?;
            let mut agents = 0usize;
            check(
                "nixl_capi_notif_map_size",
                (self.api.notif_map_size)(map, &mut agents),
            )?;
            for i in 0..agents {
                let mut name: *const c_char = std::ptr::null();
                check(
                    "nixl_capi_notif_map_get_agent_at",
                    (self.api.notif_map_get_agent_at)(map, i, &mut name),
                )?;
                let peer = CStr::from_ptr(name).to_string_lossy().into_owned();
                let mut n = 0usize;
                check(
                    "nixl_capi_notif_map_get_notifs_size",
                    (self.api.notif_map_get_notifs_size)(map, name, &mut n),
                )?;
                for j in 0..n {
                    let (mut data, mut len): (*const c_void, usize) = (std::ptr::null(), 0);
                    check(
                        "nixl_capi_notif_map_get_notif",
                        (self.api.notif_map_get_notif)(map, name, j, &mut data, &mut len),
                    )?;
                    let msg = if len == 0 {
                        Vec::new()
                    } else {
                        std::slice::from_raw_parts(data.cast::<u8>(), len).to_vec()
                    };
                    out.push((peer.clone(), msg));
                }
            }
            (self.api.notif_map_clear)(map);
        }
        Ok(out)
    }
}

impl Agent {
    /// Destroys the agent (its kept requests, its backend, UCX's workers
    /// and progress thread) for a process that is exiting, while CUDA is
    /// still alive in it: UCX's own teardown, run by the C library after
    /// CUDA's, queried CUDA about memory it had registered and printed
    /// `cuPointerGetAttributes ... failed: unrecognized error code 4`
    /// (CUDA deinitialized) at every exit of a process that read host
    /// memory on a GPU host. The lock is never given back: anything that
    /// asks for the agent afterwards waits for the end of the process
    /// instead of using freed handles. Leaves the agent as it is (false)
    /// when its lock is not free within `wait` or a READ may still run:
    /// destroying it under a transfer is worse than the message.
    pub(crate) fn close_for_exit(&self, wait: std::time::Duration) -> bool {
        let Some(mut raw) = self.raw.try_lock_for(wait) else {
            return false;
        };
        if raw.outstanding > 0 {
            return false;
        }
        // SAFETY: the lock, kept below, keeps every other use out from now
        // on.
        unsafe { self.destroy(&mut raw) };
        std::mem::forget(raw);
        true
    }

    /// Releases the kept requests, then destroys the notification map, the
    /// backend and the agent.
    ///
    /// # Safety
    /// Nothing uses the agent's handles after this.
    unsafe fn destroy(&self, raw: &mut Raw) {
        self.drop_kept(raw, |_| true);
        // SAFETY: the agent's own handles, unused after (the caller's
        // promise).
        unsafe {
            (self.api.destroy_notif_map)(raw.notifs);
            (self.api.destroy_backend)(raw.backend);
            (self.api.destroy_agent)(raw.agent);
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let mut raw = self.raw.lock();
        // SAFETY: the agent is going: nothing uses its handles now.
        unsafe { self.destroy(&mut raw) };
    }
}

fn c_string(s: &str) -> Result<CString, NixlError> {
    CString::new(s).map_err(|_| NixlError(format!("{s:?} contains a NUL byte")))
}

/// Copies a malloc'd blob from the C API and frees it.
fn take_blob(data: *mut c_void, len: usize) -> Vec<u8> {
    if data.is_null() {
        return Vec::new();
    }
    // SAFETY: `len` bytes at `data`, malloc'd by the C API and ours to free.
    let v = unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len) }.to_vec();
    // SAFETY: see above.
    unsafe { libc::free(data) };
    v
}

/// A registration descriptor list of one entry, destroyed on drop.
struct RegList(api::RegDlist, &'static Api);

impl RegList {
    fn empty(api: &'static Api, mem: Mem) -> Result<RegList, NixlError> {
        let mut list: api::RegDlist = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        check("nixl_capi_create_reg_dlist", unsafe {
            (api.create_reg_dlist)(mem.code(), &mut list)
        })?;
        Ok(RegList(list, api))
    }

    fn new(api: &'static Api, d: Desc) -> Result<RegList, NixlError> {
        let list = RegList::empty(api, d.mem)?;
        // SAFETY: live list; no per-descriptor metadata.
        check("nixl_capi_reg_dlist_add_desc", unsafe {
            (api.reg_dlist_add_desc)(list.0, d.addr, d.len, d.dev, std::ptr::null(), 0)
        })?;
        Ok(list)
    }
}

impl Drop for RegList {
    fn drop(&mut self) {
        // SAFETY: made in `new`.
        unsafe { (self.1.destroy_reg_dlist)(self.0) };
    }
}

/// A transfer descriptor list, destroyed on drop.
struct XferList(api::XferDlist, &'static Api);

impl XferList {
    fn new(api: &'static Api, descs: &[Desc]) -> Result<XferList, NixlError> {
        let mem = descs.first().map(|d| d.mem).unwrap_or(Mem::Dram);
        let mut list: api::XferDlist = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        check("nixl_capi_create_xfer_dlist", unsafe {
            (api.create_xfer_dlist)(mem.code(), &mut list)
        })?;
        let list = XferList(list, api);
        for d in descs {
            debug_assert_eq!(d.mem, mem, "one memory type per list");
            // SAFETY: live list.
            check("nixl_capi_xfer_dlist_add_desc", unsafe {
                (api.xfer_dlist_add_desc)(list.0, d.addr, d.len, d.dev)
            })?;
        }
        Ok(list)
    }
}

impl Drop for XferList {
    fn drop(&mut self) {
        // SAFETY: made in `new`.
        unsafe { (self.1.destroy_xfer_dlist)(self.0) };
    }
}

/// Optional arguments, destroyed on drop.
struct OptArgs(api::OptArgs, &'static Api);

impl OptArgs {
    fn new(api: &'static Api) -> Result<OptArgs, NixlError> {
        let mut a: api::OptArgs = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        check("nixl_capi_create_opt_args", unsafe {
            (api.create_opt_args)(&mut a)
        })?;
        Ok(OptArgs(a, api))
    }
}

impl Drop for OptArgs {
    fn drop(&mut self) {
        // SAFETY: made in `new`.
        unsafe { (self.1.destroy_opt_args)(self.0) };
    }
}
