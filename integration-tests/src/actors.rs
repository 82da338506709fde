//! Test actors.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

use rdt::prelude::*;
use serde::{Deserialize, Serialize};

/// A nested value: tensors inside a struct, a map, a vec and an option,
/// next to plain CPU data.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Batch {
    /// Plain data.
    pub step: u64,
    /// Named tensors.
    pub weights: HashMap<String, Tensor>,
    /// More tensors.
    pub extra: Vec<Tensor>,
    /// Maybe a tensor.
    pub mask: Option<Tensor>,
    /// Plain data.
    pub label: String,
}

/// `n` tensors of `numel` f32 by name, `layer{i}.weight` equal to
/// `first + i`: weights kept by name.
pub fn named_weights(n: usize, numel: usize, first: f32) -> HashMap<String, Tensor> {
    (0..n)
        .map(|i| {
            (
                format!("layer{i}.weight"),
                Tensor::full(first + i as f32, &[numel]),
            )
        })
        .collect()
}

/// Each named tensor's sum, sorted by name.
pub fn named_sums(named: &HashMap<String, Tensor>) -> rdt::Result<Vec<(String, f64)>> {
    let mut sums = named
        .iter()
        .map(|(k, t)| Ok((k.clone(), t.sum()?)))
        .collect::<rdt::Result<Vec<_>>>()?;
    sums.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(sums)
}

/// A struct-valued set of weights: tensors named by field and index.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NamedModel {
    /// The embedding.
    pub embed: Tensor,
    /// The layers, in order.
    pub layers: Vec<NamedLayer>,
    /// The step that made them.
    pub step: u64,
}

/// One layer of [`NamedModel`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NamedLayer {
    /// Weight.
    pub w: Tensor,
    /// Bias.
    pub b: Tensor,
}

/// A [`NamedModel`] of `layers` layers, every tensor `numel` f32: `embed`
/// equal to `first`, layer `i`'s `w` to `first + 1 + 2i` and `b` to
/// `first + 2 + 2i`.
pub fn named_model(layers: usize, numel: usize, first: f32) -> NamedModel {
    NamedModel {
        embed: Tensor::full(first, &[numel]),
        layers: (0..layers)
            .map(|i| NamedLayer {
                w: Tensor::full(first + 1.0 + 2.0 * i as f32, &[numel]),
                b: Tensor::full(first + 2.0 + 2.0 * i as f32, &[numel]),
            })
            .collect(),
        step: 1,
    }
}

/// Configures a fail point in this process (fail-rs syntax, e.g.
/// `return(why)`; `off` removes it).
pub fn configure_failpoint(name: String, actions: &str) -> rdt::Result<()> {
    if actions == "off" {
        rdt::__private::fail::remove(name);
        return Ok(());
    }
    rdt::__private::fail::cfg(name, actions).map_err(rdt::Error::Protocol)
}

/// A typed application error.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Oops {
    /// Needs this many bytes.
    OutOfMemory {
        /// Bytes.
        needed: u64,
    },
    /// Busy, with a reason.
    Busy(String),
}

impl std::fmt::Display for Oops {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Oops::OutOfMemory { needed } => write!(f, "out of memory: needs {needed} bytes"),
            Oops::Busy(why) => write!(f, "busy: {why}"),
        }
    }
}

/// An error that is `Display` only.
#[derive(Debug)]
pub struct PlainError;

impl std::fmt::Display for PlainError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("plain failure")
    }
}

/// Produces tensors.
#[rdt::actor]
pub struct Producer {
    kept: Vec<Tensor>,
}

#[rdt::actor]
impl Producer {
    fn new() -> Self {
        Producer { kept: Vec::new() }
    }

    /// A tensor of `n` f32 equal to `v`.
    async fn make(&mut self, v: f32, n: usize) -> Tensor {
        Tensor::full(v, &[n])
    }

    /// Like `make`, over tcp (the attribute, not a per-call override).
    #[rdt::method(tensor_transport = "tcp")]
    async fn make_tcp(&mut self, v: f32, n: usize) -> Tensor {
        Tensor::full(v, &[n])
    }

    /// Like `make`, over shm.
    #[rdt::method(tensor_transport = "shm")]
    async fn make_shm(&mut self, v: f32, n: usize) -> Tensor {
        Tensor::full(v, &[n])
    }

    /// A tensor it keeps a clone of (to check storage identity later).
    async fn make_kept(&mut self, v: f32, n: usize) -> Tensor {
        let t = Tensor::full(v, &[n]);
        self.kept.push(t.clone());
        t
    }

    /// `n` one-element tensors; keeps a clone of the last (the last one a
    /// drop of the value reaches), at index [`kept_refs`]'s `i`.
    async fn many_keep_last(&mut self, n: usize) -> (usize, Vec<Tensor>) {
        let ts: Vec<Tensor> = (0..n).map(|i| Tensor::full(i as f32, &[1])).collect();
        self.kept.push(ts[n - 1].clone());
        (self.kept.len() - 1, ts)
    }

    /// How many tensors share the storage of the kept tensor `i` (the
    /// kept clone included).
    async fn kept_refs(&mut self, i: usize) -> usize {
        self.kept[i].storage_refs()
    }

    /// Does `t` share storage with the tensor kept at `i`?
    async fn is_kept(&mut self, t: Tensor, i: usize) -> bool {
        self.kept
            .get(i)
            .map(|k| k.shares_storage(&t))
            .unwrap_or(false)
    }

    /// A nested value.
    async fn batch(&mut self, step: u64) -> Batch {
        let mut weights = HashMap::new();
        weights.insert("w1".to_string(), Tensor::full(1.0f32, &[8, 8]));
        weights.insert("w2".to_string(), Tensor::arange::<i64>(16));
        Batch {
            step,
            weights,
            extra: vec![Tensor::full(2.0f64, &[3]), Tensor::full(3u8, &[5])],
            mask: Some(Tensor::full(1u8, &[4])),
            label: format!("batch-{step}"),
        }
    }

    /// A map of tensors.
    async fn weights(&mut self, n: usize) -> HashMap<String, Tensor> {
        (0..n)
            .map(|i| (format!("layer{i}"), Tensor::full(i as f32, &[1024])))
            .collect()
    }

    /// Fails.
    async fn fail(&mut self, msg: String) -> Result<Tensor, String> {
        Err(msg)
    }

    /// Panics.
    async fn boom(&mut self) -> Tensor {
        panic!("boom on purpose")
    }

    /// Exits the process abruptly.
    async fn die(&mut self) -> Tensor {
        std::process::exit(7)
    }

    /// Waits until the store frees `t`'s storage (the kept tensor `i`).
    async fn wait_freed(&mut self, i: usize, timeout_ms: u64) -> Result<bool, Error> {
        let t = self.kept[i].clone();
        match rdt::wait_tensor_freed_timeout(&t, std::time::Duration::from_millis(timeout_ms)).await
        {
            Ok(()) => Ok(true),
            Err(Error::Timeout { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Echoes.
    async fn echo(&mut self, x: u64) -> u64 {
        x
    }

    /// Blocks its thread for `ms` milliseconds (a long, non-async method).
    async fn block(&mut self, ms: u64) -> u64 {
        std::thread::sleep(std::time::Duration::from_millis(ms));
        ms
    }

    /// Objects in this worker's store.
    async fn stored(&mut self) -> usize {
        rdt::runtime().metrics().local_objects
    }

    /// Writes `v` into the kept tensor `i` (to observe sharing).
    async fn write_kept(&mut self, i: usize, v: f32) -> rdt::Result<()> {
        self.kept[i].fill_(v)?;
        Ok(())
    }

    /// First element of the kept tensor `i`.
    async fn read_kept(&mut self, i: usize) -> rdt::Result<f32> {
        Ok(self.kept[i].to_vec::<f32>()?[0])
    }

    /// A tensor of exactly `n` bytes.
    async fn make_u8(&mut self, n: usize) -> Tensor {
        Tensor::full(1u8, &[n])
    }

    /// Configures a fail point in this worker (fail-rs syntax, e.g.
    /// `return(why)`; `off` removes it).
    async fn failpoint(&mut self, name: String, actions: String) -> rdt::Result<()> {
        configure_failpoint(name, &actions)
    }

    /// Writes to a pipe whose reading end is closed: a normal Rust process
    /// gets `EPIPE` (SIGPIPE is ignored); returns the error's kind.
    async fn write_to_closed_socket(&mut self) -> String {
        use std::io::Write;
        use std::os::fd::FromRawFd;
        let mut fds = [0i32; 2];
        // SAFETY: pipe(2) fills two fresh descriptors, each owned once below.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        let (r, mut w) = unsafe {
            (
                std::fs::File::from_raw_fd(fds[0]),
                std::fs::File::from_raw_fd(fds[1]),
            )
        };
        drop(r);
        match w.write_all(b"hello") {
            Ok(()) => "written".into(),
            Err(e) => format!("{:?}", e.kind()),
        }
    }

    /// The collective groups this worker is in: (group, rank, size).
    async fn memberships(&mut self) -> Vec<(u64, u32, usize)> {
        rdt::runtime()
            .group_memberships()
            .into_iter()
            .map(|m| (m.group.0, m.rank, m.size))
            .collect()
    }

    /// Recurses until the stack overflows.
    async fn overflow(&mut self, depth: u64) -> u64 {
        #[allow(unconditional_recursion)]
        fn down(n: u64, pad: &mut [u8; 4096]) -> u64 {
            pad[(n % 4096) as usize] = n as u8;
            let mut next = [0u8; 4096];
            next[0] = pad[0];
            std::hint::black_box(&mut next);
            1 + down(std::hint::black_box(n + 1), &mut next)
        }
        let mut pad = [0u8; 4096];
        down(depth, &mut pad)
    }

    /// `n` tensors of `numel` f32, tensor `i` equal to `i`.
    async fn make_many(&mut self, n: usize, numel: usize) -> Vec<Tensor> {
        (0..n).map(|i| Tensor::full(i as f32, &[numel])).collect()
    }

    /// `n` tensors of `numel` f32, tensor `i` equal to `first + i` (a
    /// version of some weights).
    async fn make_version(&mut self, n: usize, numel: usize, first: f32) -> Vec<Tensor> {
        (0..n)
            .map(|i| Tensor::full(first + i as f32, &[numel]))
            .collect()
    }

    /// `n` tensors of `numel` f32 kept by name, as the quickstart keeps
    /// weights: `layer{i}.weight` equal to `first + i`.
    async fn make_named(&mut self, n: usize, numel: usize, first: f32) -> HashMap<String, Tensor> {
        named_weights(n, numel, first)
    }

    /// A struct-valued version of weights (see [`named_model`]).
    async fn make_model(&mut self, layers: usize, numel: usize, first: f32) -> NamedModel {
        named_model(layers, numel, first)
    }

    /// The kept tensor `i` again, in a new object (same storage).
    async fn kept_again(&mut self, i: usize) -> Tensor {
        self.kept[i].clone()
    }

    /// Views of one flat buffer of `arange(1000)` f32 (see
    /// [`flat_views`]): the flat buffer itself, and views of it, one of
    /// them overlapping another and one reading its bytes as `u8`.
    async fn views(&mut self) -> Vec<Tensor> {
        flat_views(Tensor::arange::<f32>(1000))
    }

    /// One tensor twice in one object (two clones of one storage).
    async fn twice(&mut self, v: f32, n: usize) -> (Tensor, Tensor) {
        let t = Tensor::full(v, &[n]);
        (t.clone(), t)
    }

    /// This worker's NIXL counters (`rdt::data::nixl::stats`).
    async fn nixl_stats(&mut self) -> rdt::data::nixl::NixlStats {
        rdt::data::nixl::stats()
    }

    /// Frees this worker's idle NIXL host slabs (`rdt::data::nixl::trim`);
    /// returns the bytes freed.
    async fn nixl_trim(&mut self) -> usize {
        rdt::data::nixl::trim()
    }

    /// Fails with a typed error (`Oops`), or with one that is only
    /// `Display` when `kind` is 0.
    async fn oops(&mut self, kind: u32) -> Result<Tensor, Oops> {
        Err(match kind {
            1 => Oops::OutOfMemory { needed: 1 << 30 },
            _ => Oops::Busy("try later".into()),
        })
    }

    /// Fails with an error that is `Display` but not `Serialize`.
    async fn plain_error(&mut self) -> Result<u32, PlainError> {
        Err(PlainError)
    }

    /// Keeps `n` more tensors of `numel` f32 (a model's parameters),
    /// tensor `i` equal to `first + i`; returns the index of the first.
    async fn keep_many(&mut self, n: usize, numel: usize, first: f32) -> usize {
        let at = self.kept.len();
        self.kept
            .extend((0..n).map(|i| Tensor::full(first + i as f32, &[numel])));
        at
    }

    /// Writes `first + i` into the kept tensor `at + i`, for each of the
    /// `n` (a trainer's step, in place).
    async fn step_kept(&mut self, at: usize, n: usize, first: f32) -> rdt::Result<()> {
        for (i, t) in self.kept[at..at + n].iter().enumerate() {
            t.fill_(first + i as f32)?;
        }
        Ok(())
    }

    /// The kept tensors `at..at + n`, in a new object each call (a weight
    /// sync passes the same parameters every step).
    async fn kept_range(&mut self, at: usize, n: usize) -> Vec<Tensor> {
        self.kept[at..at + n].to_vec()
    }
}

/// Consumes tensors.
#[rdt::actor]
pub struct Consumer {
    seen: u64,
    held: Vec<Tensor>,
    params: Vec<Tensor>,
    /// Parameters kept as `rdt::Targets` (`update_kept`).
    kept: Option<rdt::Targets>,
    /// What `note` was given, in call order.
    noted: Vec<u64>,
    /// Parameters kept by name (`load_named_*`).
    named: Option<HashMap<String, Tensor>>,
}

#[rdt::actor]
impl Consumer {
    fn new() -> Self {
        Consumer {
            seen: 0,
            held: Vec::new(),
            named: None,
            params: Vec::new(),
            kept: None,
            noted: Vec::new(),
        }
    }

    /// Sum of a tensor.
    async fn sum(&mut self, t: Tensor) -> rdt::Result<f64> {
        self.seen += 1;
        Ok(t.sum()?)
    }

    /// Sum of two tensors.
    async fn sum2(&mut self, a: Tensor, b: Tensor) -> rdt::Result<(f64, bool)> {
        Ok((a.sum()? + b.sum()?, a.shares_storage(&b)))
    }

    /// Sum of every tensor in a batch, and its plain data.
    async fn batch_sum(&mut self, b: Batch) -> rdt::Result<(u64, String, f64)> {
        let mut s = 0.0;
        for t in b.weights.values() {
            s += t.sum()?;
        }
        for t in &b.extra {
            s += t.sum()?;
        }
        if let Some(m) = &b.mask {
            s += m.sum()?;
        }
        Ok((b.step, b.label, s))
    }

    /// Sum of a map of tensors.
    async fn reduce(&mut self, w: HashMap<String, Tensor>) -> rdt::Result<f64> {
        let mut s = 0.0;
        for t in w.values() {
            s += t.sum()?;
        }
        Ok(s)
    }

    /// Keeps the tensor (so its storage outlives the call).
    async fn hold(&mut self, t: Tensor) -> usize {
        self.held.push(t);
        self.held.len()
    }

    /// Calls seen.
    async fn seen(&mut self) -> u64 {
        self.seen
    }

    /// Objects in this worker's store.
    async fn stored(&mut self) -> usize {
        rdt::runtime().metrics().local_objects
    }

    /// Adds 1 to every element and returns the result.
    async fn add_one(&mut self, t: Tensor) -> rdt::Result<Tensor> {
        t.add_scalar_(1.0f32)?;
        Ok(t)
    }

    /// The collective groups this worker is in: (group, rank, size).
    async fn memberships(&mut self) -> Vec<(u64, u32, usize)> {
        rdt::runtime()
            .group_memberships()
            .into_iter()
            .map(|m| (m.group.0, m.rank, m.size))
            .collect()
    }

    /// The sum of `t` and the device it is on here (where received
    /// tensors land).
    async fn sum_where(&mut self, t: Tensor) -> rdt::Result<(f64, String)> {
        Ok((t.to_cpu()?.sum()?, t.device().to_string()))
    }

    /// [`sum_where`](Self::sum_where) of the object `r`, got here with
    /// its tensors put in `place`.
    async fn sum_on(
        &mut self,
        r: ObjectRef<Tensor>,
        place: rdt::Place,
    ) -> rdt::Result<(f64, String)> {
        let t: Tensor = rdt::runtime().get_on(&r, place).await?;
        Ok((t.to_cpu()?.sum()?, t.device().to_string()))
    }

    /// Objects this worker received over `transport` (which path a value
    /// took).
    async fn received(&mut self, transport: String) -> rdt::Result<u64> {
        Ok(rdt::runtime().metrics().received_over(transport.parse()?))
    }

    /// This worker's hot window, in microseconds (`rdt::data::rt::hot`).
    async fn hot_window_us(&mut self) -> u64 {
        rdt::data::rt::hot::window().as_micros() as u64
    }

    /// Sums every tensor, checking tensor `i` holds only `i` (as
    /// `Producer::make_many` makes them); returns the total.
    async fn sum_many(&mut self, ts: Vec<Tensor>) -> Result<f64, String> {
        let mut total = 0.0;
        for (i, t) in ts.iter().enumerate() {
            let s = t.sum().map_err(|e| e.to_string())?;
            if s != i as f64 * t.numel() as f64 {
                return Err(format!(
                    "tensor {i} sums to {s}, not {}",
                    i as f64 * t.numel() as f64
                ));
            }
            total += s;
        }
        Ok(total)
    }

    /// Each tensor's dtype, shape and sum, in order.
    async fn describe_all(
        &mut self,
        ts: Vec<Tensor>,
    ) -> rdt::Result<Vec<(String, Vec<usize>, f64)>> {
        ts.iter()
            .map(|t| Ok((t.dtype().to_string(), t.shape().to_vec(), t.sum()?)))
            .collect()
    }

    /// Sums both tensors; tells whether they share storage.
    async fn sum_pair(&mut self, p: (Tensor, Tensor)) -> rdt::Result<(f64, f64)> {
        Ok((p.0.sum()?, p.1.sum()?))
    }

    /// This worker's NIXL counters (`rdt::data::nixl::stats`).
    async fn nixl_stats(&mut self) -> rdt::data::nixl::NixlStats {
        rdt::data::nixl::stats()
    }

    /// This worker's environment variable `name`.
    async fn env_var(&mut self, name: String) -> Option<String> {
        std::env::var(name).ok()
    }

    /// Receives this worker's control loop started after the frames in
    /// hand (see `rdt::metrics::WorkerMetrics`).
    async fn started_after_frames(&mut self) -> u64 {
        rdt::runtime().metrics().receives_started_after_frames
    }

    /// Sum of the tensor, `ms` milliseconds after the call started (a
    /// long method holding its argument).
    async fn sum_after(&mut self, t: Tensor, ms: u64) -> rdt::Result<f64> {
        tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
        Ok(t.sum()?)
    }

    /// Sums `t` and tells whether its bytes are page-aligned (a received
    /// large blob lands in a host pool buffer, which is; a heap buffer of
    /// that size is not), with this worker's pool counters after the call
    /// (`rdt::data::host_pool::stats`: hits, misses).
    async fn sum_pooled(&mut self, t: Tensor) -> rdt::Result<(f64, bool, u64, u64)> {
        let aligned = t.with_bytes(|b| (b.as_ptr() as usize).is_multiple_of(4096))?;
        let s = rdt::data::host_pool::stats();
        Ok((t.sum()?, aligned, s.hits, s.misses))
    }

    /// A weight update: receives the object behind `r` into this actor's
    /// parameters (`n` f32 tensors of `numel`, made at first use and
    /// kept) with `get_into`. Returns the parameters' sums after, and
    /// whether the value got back holds the parameters themselves.
    async fn update_params(
        &mut self,
        r: ObjectRef<Vec<Tensor>>,
        n: usize,
        numel: usize,
    ) -> rdt::Result<(Vec<f64>, bool)> {
        if self.params.is_empty() {
            self.params = (0..n)
                .map(|_| Tensor::zeros(DType::F32, &[numel]))
                .collect();
        }
        let targets = &self.params[..n.min(self.params.len())];
        let got = rdt::runtime().get_into(&r, targets).await?;
        let same =
            got.len() == targets.len() && got.iter().zip(targets).all(|(g, p)| g.shares_storage(p));
        let sums = self
            .params
            .iter()
            .map(Tensor::sum)
            .collect::<Result<_, _>>()?;
        Ok((sums, same))
    }

    /// `get_into` with the tensors it holds (`hold`) as the targets: their
    /// sums after.
    async fn update_held(&mut self, r: ObjectRef<Vec<Tensor>>) -> rdt::Result<Vec<f64>> {
        rdt::runtime().get_into(&r, &self.held).await?;
        Ok(self
            .held
            .iter()
            .map(Tensor::sum)
            .collect::<Result<_, _>>()?)
    }

    /// `get_into` calls received in place (see `rdt::metrics::WorkerMetrics`).
    async fn in_place(&mut self) -> u64 {
        rdt::runtime().metrics().received_in_place
    }

    /// Each tensor's sum.
    async fn sums(&mut self, ts: Vec<Tensor>) -> rdt::Result<Vec<f64>> {
        Ok(ts.iter().map(Tensor::sum).collect::<Result<_, _>>()?)
    }

    /// Values this worker received straight from their producers (see
    /// `rdt::metrics::WorkerMetrics`).
    async fn straight(&mut self) -> u64 {
        rdt::runtime().metrics().straight_deliveries
    }

    /// Forgets the parameters: the next `update_params` makes new ones.
    async fn drop_params(&mut self) -> usize {
        std::mem::take(&mut self.params).len()
    }

    /// `update_params` into parameters kept as one `rdt::Targets` (`n`
    /// f32 tensors of `numel`, made at first use): the sums after, and
    /// whether the value got back holds the parameters themselves.
    async fn update_kept(
        &mut self,
        r: ObjectRef<Vec<Tensor>>,
        n: usize,
        numel: usize,
    ) -> rdt::Result<(Vec<f64>, bool)> {
        let kept = self.kept.get_or_insert_with(|| {
            (0..n)
                .map(|_| Tensor::zeros(DType::F32, &[numel]))
                .collect()
        });
        let got = rdt::runtime().get_into(&r, &*kept).await?;
        let same = got.len() == kept.len()
            && got
                .iter()
                .zip(kept.iter())
                .all(|(g, p)| g.shares_storage(p));
        let sums = kept.iter().map(Tensor::sum).collect::<Result<_, _>>()?;
        Ok((sums, same))
    }

    /// `update_kept` with `load_into`: the object's tensors written into
    /// the kept parameters, no value decoded. Their sums after.
    async fn load_kept(
        &mut self,
        r: ObjectRef<Vec<Tensor>>,
        n: usize,
        numel: usize,
    ) -> rdt::Result<Vec<f64>> {
        let kept = self.kept.get_or_insert_with(|| {
            (0..n)
                .map(|_| Tensor::zeros(DType::F32, &[numel]))
                .collect()
        });
        rdt::runtime().load_into(&r, &*kept).await?;
        Ok(kept.iter().map(Tensor::sum).collect::<Result<_, _>>()?)
    }

    /// A rollout that keeps its parameters by name (`n` f32 tensors of
    /// `numel`, `layer{i}.weight`, made at first use and kept) loads the
    /// named weights behind `r` into them, its targets taken from its own
    /// map in the map's order. Each parameter's name and sum after, by
    /// name.
    async fn load_named_by_position(
        &mut self,
        r: ObjectRef<HashMap<String, Tensor>>,
        n: usize,
        numel: usize,
    ) -> rdt::Result<Vec<(String, f64)>> {
        let named = self
            .named
            .get_or_insert_with(|| named_weights(n, numel, 0.0));
        let targets: Vec<Tensor> = named.values().cloned().collect();
        rdt::runtime().load_into(&r, targets).await?;
        named_sums(named)
    }

    /// [`load_named_by_position`](Self::load_named_by_position) with
    /// keyed targets (`rdt::Targets::from(&map)`), by `get_into` when
    /// `get` (then checking the value got back holds the parameters
    /// themselves) or `load_into`.
    async fn load_named_by_key(
        &mut self,
        r: ObjectRef<HashMap<String, Tensor>>,
        n: usize,
        numel: usize,
        get: bool,
    ) -> rdt::Result<Vec<(String, f64)>> {
        let named = self
            .named
            .get_or_insert_with(|| named_weights(n, numel, 0.0));
        let targets = rdt::Targets::from(&*named);
        if get {
            let got = rdt::runtime().get_into(&r, &targets).await?;
            // The value got back holds the parameters themselves.
            assert!(got.iter().all(|(k, t)| t.shares_storage(&named[k])));
        } else {
            rdt::runtime().load_into(&r, &targets).await?;
        }
        named_sums(named)
    }

    /// A struct-valued update ([`NamedModel`]) into parameters this
    /// rollout keeps in its own map by path (`embed`, `layers.0.w`, …),
    /// with keyed targets. Each parameter's name and sum after.
    async fn load_model_by_key(
        &mut self,
        r: ObjectRef<NamedModel>,
        layers: usize,
        numel: usize,
    ) -> rdt::Result<Vec<(String, f64)>> {
        let mine: HashMap<String, Tensor> =
            rdt::Targets::from_value(&named_model(layers, numel, 0.0))?
                .keys()
                .into_iter()
                .flatten()
                .map(|k| (k.clone(), Tensor::zeros(DType::F32, &[numel])))
                .collect();
        rdt::runtime()
            .load_into(&r, rdt::Targets::from(&mine))
            .await?;
        named_sums(&mine)
    }

    /// Keyed targets of the given names, dtypes and lengths, zeros:
    /// `load_into` the object behind `r`. Their sums after, by name.
    async fn load_into_named(
        &mut self,
        r: ObjectRef<HashMap<String, Tensor>>,
        spec: Vec<(String, DType, usize)>,
    ) -> rdt::Result<Vec<(String, f64)>> {
        let mine: HashMap<String, Tensor> = spec
            .into_iter()
            .map(|(k, d, n)| (k, Tensor::zeros(d, &[n])))
            .collect();
        rdt::runtime()
            .load_into(&r, &rdt::Targets::from(&mine))
            .await?;
        named_sums(&mine)
    }

    /// `t` itself: a link of a chain of calls.
    async fn pass(&mut self, t: Tensor) -> Tensor {
        t
    }

    /// Configures a fail point in this worker (fail-rs syntax; `off`
    /// removes it), as `Producer::failpoint`.
    async fn failpoint(&mut self, name: String, actions: String) -> rdt::Result<()> {
        configure_failpoint(name, &actions)
    }

    /// A `get_into` of `r` into `n` zero f32 targets of `numel`, dropped by
    /// a timeout of `ms` milliseconds (its receive may be under way then).
    /// Returns whether it timed out, and the targets' total sum right
    /// after the drop and again once the object is here whole (a `get`
    /// of it, which ends after the dropped one's receive ended).
    async fn get_into_dropped(
        &mut self,
        r: ObjectRef<Vec<Tensor>>,
        n: usize,
        numel: usize,
        ms: u64,
    ) -> rdt::Result<(bool, f64, f64)> {
        let targets: rdt::Targets = (0..n)
            .map(|_| Tensor::zeros(DType::F32, &[numel]))
            .collect();
        let total =
            |ts: &rdt::Targets| -> rdt::Result<f64> { ts.iter().map(|t| Ok(t.sum()?)).sum() };
        let timed_out = tokio::time::timeout(
            std::time::Duration::from_millis(ms),
            rdt::runtime().get_into(&r, &targets),
        )
        .await
        .is_err();
        // A READ posted into them ends or is cancelled a moment later.
        tokio::time::timeout(std::time::Duration::from_secs(10), targets.idle())
            .await
            .map_err(|_| rdt::Error::Timeout {
                what: "the dropped receive's writes into the targets to end".into(),
                after_ms: 10_000,
            })?;
        let after_drop = total(&targets)?;
        let whole: Vec<Tensor> = rdt::runtime().get(&r).await?;
        drop(whole);
        Ok((timed_out, after_drop, total(&targets)?))
    }

    /// Whether [`Tensor::with_bytes`] hands out a reference into `t`'s
    /// own memory (`true`) rather than a snapshot of it, and whether that
    /// memory is external at all.
    async fn bytes_behind_a_reference(&mut self, t: Tensor) -> rdt::Result<(bool, bool)> {
        let own = t.with_external(|e| e.map(|e| e.as_ptr() as usize));
        let given = t.with_bytes(|b| b.as_ptr() as usize)?;
        Ok((own == Some(given), own.is_some()))
    }

    /// Notes `i` after those noted before; how many are noted now.
    async fn note(&mut self, i: u64) -> u64 {
        self.noted.push(i);
        self.noted.len() as u64
    }

    /// Everything noted, in the order the calls ran.
    async fn noted(&mut self) -> Vec<u64> {
        self.noted.clone()
    }

    /// Calls that reached this actor's thread through the hand-off queue
    /// (see `rdt::metrics::WorkerMetrics`).
    async fn handed_over(&mut self) -> u64 {
        rdt::runtime().metrics().calls_handed_to_listener
    }

    // New methods go last: tests call some of the others by index.

    /// Has this actor sum `r` (the object `t` came from) again, in a call
    /// submitted now and not awaited, and returns the ref to its result:
    /// that call reaches this actor only after this one ended (OW-12).
    async fn sum_again_later(
        &mut self,
        t: Tensor,
        me: ConsumerHandle,
        r: ObjectRef<Tensor>,
    ) -> ObjectRef<f64> {
        self.seen += 1;
        drop(t);
        me.sum(r).remote()
    }
}

/// An actor whose constructor can fail.
#[rdt::actor]
pub struct Picky {
    v: u32,
}

#[rdt::actor]
impl Picky {
    async fn new(v: u32) -> Result<Self, String> {
        if v == 0 {
            return Err("zero is not allowed".into());
        }
        Ok(Picky { v })
    }

    /// The value.
    async fn value(&mut self) -> u32 {
        self.v
    }
}

/// A concurrent actor (`max_concurrency = 10`, group `io` of 2): counts
/// how many of its calls run at once, and has gates that one call waits
/// on and another opens.
#[rdt::actor]
pub struct Juggler {
    running: Cell<u32>,
    peak: Cell<u32>,
    io_running: Cell<u32>,
    io_peak: Cell<u32>,
    finished: RefCell<Vec<u32>>,
    gates: RefCell<HashMap<u32, Rc<tokio::sync::Notify>>>,
}

impl Juggler {
    fn gate(&self, g: u32) -> Rc<tokio::sync::Notify> {
        self.gates.borrow_mut().entry(g).or_default().clone()
    }
}

#[rdt::actor(max_concurrency = 10, concurrency_groups(io = 2))]
impl Juggler {
    fn new() -> Self {
        Juggler {
            running: Cell::new(0),
            peak: Cell::new(0),
            io_running: Cell::new(0),
            io_peak: Cell::new(0),
            finished: RefCell::new(Vec::new()),
            gates: RefCell::new(HashMap::new()),
        }
    }

    /// Sleeps `ms` (without blocking the thread), then logs `tag` as
    /// finished.
    async fn nap(&self, ms: u64, tag: u32) -> u32 {
        self.running.set(self.running.get() + 1);
        self.peak.set(self.peak.get().max(self.running.get()));
        tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
        self.running.set(self.running.get() - 1);
        self.finished.borrow_mut().push(tag);
        tag
    }

    /// Like `nap`, in the `io` group.
    #[rdt::method(concurrency_group = "io")]
    async fn io_nap(&self, ms: u64) -> u32 {
        self.io_running.set(self.io_running.get() + 1);
        self.io_peak
            .set(self.io_peak.get().max(self.io_running.get()));
        tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
        self.io_running.set(self.io_running.get() - 1);
        self.io_peak.get()
    }

    /// Waits until `open_gate(g)` (before or after this call).
    async fn wait_gate(&self, g: u32) -> u32 {
        self.gate(g).notified().await;
        g
    }

    /// Opens gate `g` for one waiter.
    async fn open_gate(&self, g: u32) {
        self.gate(g).notify_one();
    }

    /// A tensor of `n` f32 equal to `v`, once gate `g` opens.
    async fn tensor_after_gate(&self, g: u32, v: f32, n: usize) -> Tensor {
        self.gate(g).notified().await;
        Tensor::full(v, &[n])
    }

    /// (default-group peak, io-group peak).
    async fn peaks(&self) -> (u32, u32) {
        (self.peak.get(), self.io_peak.get())
    }

    /// Tags in the order their naps finished.
    async fn finished(&self) -> Vec<u32> {
        self.finished.borrow().clone()
    }

    /// Calls `nap` on itself (through its own handle) and waits for it:
    /// a `&self` method of a concurrent actor, so the nap runs beside it.
    async fn nap_via_self(&self, me: JugglerHandle, tag: u32) -> rdt::Result<u32> {
        rdt::runtime().get(me.nap(1, tag).remote()).await
    }

    /// The same from a `&mut self` method, which runs alone: the nap could
    /// not start before it returns.
    async fn exclusive_nap_via_self(&mut self, me: JugglerHandle, tag: u32) -> rdt::Result<u32> {
        rdt::runtime().get(me.nap(1, tag).remote()).await
    }

    /// Exclusive: how many other calls ran when it started; resets the
    /// counters.
    async fn reset(&mut self) -> u32 {
        let others = self.running.get() + self.io_running.get();
        self.peak.set(0);
        self.io_peak.set(0);
        self.finished.borrow_mut().clear();
        others
    }
}

/// A serial actor that logs which calls ran, in order.
#[rdt::actor]
pub struct Recorder {
    log: Vec<u32>,
}

#[rdt::actor]
impl Recorder {
    fn new() -> Self {
        Recorder { log: Vec::new() }
    }

    /// Logs `tag`; returns the tensor's sum.
    async fn take(&mut self, t: Tensor, tag: u32) -> rdt::Result<f64> {
        self.log.push(tag);
        Ok(t.to_vec::<f32>()
            .map_err(tensor_err)?
            .iter()
            .map(|x| *x as f64)
            .sum())
    }

    /// Logs `tag`.
    async fn note(&mut self, tag: u32) -> u32 {
        self.log.push(tag);
        tag
    }

    /// The log.
    async fn log(&mut self) -> Vec<u32> {
        self.log.clone()
    }
}

// ---------------------------------------------------------------------------
// GPU actors (used by `tests/gpu.rs`, feature `gpu`; they compile everywhere
// and only touch CUDA when called).

fn tensor_err(e: rdt::TensorError) -> Error {
    Error::from(e)
}

extern "C" {
    // glibc's <execinfo.h>.
    fn backtrace(buffer: *mut *mut libc::c_void, size: libc::c_int) -> libc::c_int;
    fn backtrace_symbols_fd(buffer: *const *mut libc::c_void, size: libc::c_int, fd: libc::c_int);
}

extern "C" fn on_fatal_signal(sig: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // Only write(2) and glibc's backtrace (its unwinder was loaded at
    // install time), then die of the same signal (core dump included).
    // SAFETY: the buffers are local; `info` is the kernel's.
    unsafe {
        let head = b"\n=== rdt gpu test worker: fatal signal; backtrace (resolve +offsets with addr2line -e <unstripped binary>) ===\n";
        libc::write(2, head.as_ptr().cast(), head.len());
        let addr = format_hex((*info).si_addr() as usize);
        libc::write(2, b"fault address ".as_ptr().cast(), 14);
        libc::write(2, addr.as_ptr().cast(), addr.len());
        libc::write(2, b"\n".as_ptr().cast(), 1);
        let mut frames = [std::ptr::null_mut::<libc::c_void>(); 64];
        let n = backtrace(frames.as_mut_ptr(), frames.len() as libc::c_int);
        backtrace_symbols_fd(frames.as_ptr(), n, 2);
        libc::signal(sig, libc::SIG_DFL);
        libc::raise(sig);
    }
}

/// `0x...` without allocating.
fn format_hex(mut v: usize) -> [u8; 18] {
    let mut out = [b'0'; 18];
    out[1] = b'x';
    for i in (2..18).rev() {
        out[i] = b"0123456789abcdef"[v & 15];
        v >>= 4;
    }
    out
}

/// Makes a segfault (or bus error) in this worker print a raw backtrace to
/// stderr before the process dies of it, so that a crash inside the driver
/// on a GPU host is located even without a debugger there.
pub fn report_fatal_signals() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: installs a handler that only uses async-signal-tolerant
        // calls; the first `backtrace` call loads the unwinder now, not in
        // the handler.
        unsafe {
            let mut frames = [std::ptr::null_mut::<libc::c_void>(); 4];
            backtrace(frames.as_mut_ptr(), 4);
            for sig in [libc::SIGSEGV, libc::SIGBUS] {
                let mut sa: libc::sigaction = std::mem::zeroed();
                sa.sa_sigaction = on_fatal_signal as *const () as usize;
                sa.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
                libc::sigemptyset(&mut sa.sa_mask);
                libc::sigaction(sig, &sa, std::ptr::null_mut());
            }
        }
    });
}

/// Produces CUDA tensors on its first visible device.
#[rdt::actor]
pub struct GpuProducer {
    kept: Vec<Tensor>,
}

#[rdt::actor]
impl GpuProducer {
    fn new() -> Self {
        report_fatal_signals();
        GpuProducer { kept: Vec::new() }
    }

    /// A CUDA tensor of `n` f32 equal to `v`, ready when returned.
    async fn make(&mut self, v: f32, n: usize) -> rdt::Result<Tensor> {
        let t = Tensor::cuda_full(v, &[n], 0).map_err(tensor_err)?;
        Ok(t)
    }

    /// Like `make`, but returns while the GPU is still busy with it: the
    /// tensor is filled `reps` times (the last time with `v`), so a
    /// consumer that does not wait for the producer's event sees a wrong
    /// sum.
    async fn make_busy(&mut self, v: f32, n: usize, reps: usize) -> rdt::Result<Tensor> {
        let t = Tensor::cuda_full(-1.0f32, &[n], 0).map_err(tensor_err)?;
        for i in 0..reps {
            t.fill_(if i + 1 == reps { v } else { -(i as f32) })
                .map_err(tensor_err)?;
        }
        Ok(t)
    }

    /// Like `make_busy`, but the tensor is written on a stream of its own
    /// (as another library would: a fill of -1, then `reps - 1` more, the
    /// last with `v`), and rdt is told so with `produced_on_stream`. A
    /// transfer that did not wait for that stream sees a wrong sum.
    async fn make_on_own_stream(&mut self, v: f32, n: usize, reps: usize) -> rdt::Result<Tensor> {
        use cudarc::driver::{result, sys};
        let t = Tensor::cuda_empty(DType::F32, &[n], 0).map_err(tensor_err)?;
        let stream = t
            .with_device_buffer(|d| -> rdt::Result<sys::CUstream> {
                d.gpu()
                    .bind()
                    .map_err(|e| rdt::Error::Tensor(e.to_string()))?;
                let stream = result::stream::create(result::stream::StreamKind::NonBlocking)
                    .map_err(|e| rdt::Error::Tensor(format!("cuStreamCreate: {e:?}")))?;
                for i in 0..reps {
                    let x = if i + 1 == reps { v } else { -(i as f32) - 1.0 };
                    // SAFETY: the range is this tensor's, `n` f32 long; the
                    // stream was just made in the bound context.
                    let r =
                        unsafe { sys::cuMemsetD32Async(d.device_ptr(), x.to_bits(), n, stream) };
                    if r != sys::CUresult::CUDA_SUCCESS {
                        return Err(rdt::Error::Tensor(format!("cuMemsetD32Async: {r:?}")));
                    }
                }
                Ok(stream)
            })
            .map_err(tensor_err)??;
        // SAFETY: a live stream of the tensor's device's primary context.
        unsafe { t.produced_on_stream(stream) }.map_err(tensor_err)?;
        // Destroying a stream with work pending lets that work finish.
        // SAFETY: our stream, not used after this.
        unsafe {
            let _ = result::stream::destroy(stream);
        }
        Ok(t)
    }

    /// A CUDA tensor of `n` random f32 from `seed` (cuRAND).
    async fn make_rand(&mut self, seed: u64, n: usize) -> rdt::Result<Tensor> {
        Tensor::cuda_rand(DType::F32, &[n], 0, seed).map_err(tensor_err)
    }

    /// Like `make`, keeping a clone (to look at it after a consumer wrote).
    async fn make_kept(&mut self, v: f32, n: usize) -> rdt::Result<Tensor> {
        let t = Tensor::cuda_full(v, &[n], 0).map_err(tensor_err)?;
        self.kept.push(t.clone());
        Ok(t)
    }

    /// Fills the kept tensor `i` with `v` on rdt's stream, without waiting
    /// for the GPU (work queued right after returning it).
    async fn fill_kept(&mut self, i: usize, v: f32) -> rdt::Result<()> {
        self.kept[i].fill_(v).map_err(tensor_err)
    }

    /// First element of the kept tensor `i`, read back from the GPU.
    async fn read_kept(&mut self, i: usize) -> rdt::Result<f32> {
        let v = self.kept[i].to_cpu().map_err(tensor_err)?;
        Ok(v.to_vec::<f32>().map_err(tensor_err)?[0])
    }

    /// Drops the kept tensors.
    async fn forget(&mut self) -> usize {
        let n = self.kept.len();
        self.kept.clear();
        n
    }

    /// A nested value of CUDA tensors and plain data.
    async fn batch(&mut self, step: u64) -> rdt::Result<Batch> {
        let mut weights = HashMap::new();
        weights.insert(
            "w1".to_string(),
            Tensor::cuda_full(1.0f32, &[8, 8], 0).map_err(tensor_err)?,
        );
        weights.insert(
            "w2".to_string(),
            Tensor::arange::<i64>(16).to_device(0).map_err(tensor_err)?,
        );
        Ok(Batch {
            step,
            weights,
            extra: vec![
                Tensor::cuda_full(2.0f64, &[3], 0).map_err(tensor_err)?,
                Tensor::cuda_full(3u8, &[5], 0).map_err(tensor_err)?,
            ],
            mask: Some(Tensor::cuda_full(1u8, &[4], 0).map_err(tensor_err)?),
            label: format!("batch-{step}"),
        })
    }

    /// A CUDA tensor `[0, 1, ..., n-1]` (f32), to check element order.
    /// [`flat_views`] of `arange(1000)` f32 on the GPU.
    async fn views(&mut self) -> rdt::Result<Vec<Tensor>> {
        let flat = Tensor::arange::<f32>(1000)
            .to_device(0)
            .map_err(tensor_err)?;
        Ok(flat_views(flat))
    }

    async fn iota(&mut self, n: usize) -> rdt::Result<Tensor> {
        Tensor::arange::<f32>(n).to_device(0).map_err(tensor_err)
    }

    /// The UUID of its device.
    async fn uuid(&mut self) -> rdt::Result<String> {
        Ok(rdt::data::cuda::gpu(0)
            .map_err(|e| tensor_err(e.into()))?
            .uuid()
            .to_string())
    }

    /// Objects in its store.
    async fn stored(&mut self) -> usize {
        rdt::runtime().metrics().local_objects
    }

    /// Returns unused slabs to the driver (`alloc::trim`): (bytes freed now,
    /// bytes waiting for importers to close their mappings).
    async fn trim(&mut self) -> (usize, usize) {
        let t = rdt::data::cuda::alloc::trim();
        (t.freed_bytes, t.waiting_bytes)
    }

    /// `n` f32 equal to `v` in another library's device memory (plain
    /// `cuMemAlloc`, or pool memory where `pooled`), brought in through
    /// DLPack and returned over `cuda_ipc`.
    #[rdt::method(tensor_transport = "cuda_ipc")]
    async fn dlpack_make(&mut self, v: f32, n: usize, pooled: bool) -> rdt::Result<Tensor> {
        use crate::dlpack_cuda::{make, Alloc};
        make(v, n, if pooled { Alloc::Pooled } else { Alloc::Plain })
    }

    /// Like `dlpack_make`, kept here too (its clone in `kept`).
    #[rdt::method(tensor_transport = "cuda_ipc")]
    async fn dlpack_make_kept(&mut self, v: f32, n: usize) -> rdt::Result<Tensor> {
        let t = crate::dlpack_cuda::make(v, n, crate::dlpack_cuda::Alloc::Plain)?;
        self.kept.push(t.clone());
        Ok(t)
    }

    /// Tensors this process exported over `cuda_ipc` by a device copy.
    async fn export_copies(&mut self) -> u64 {
        rdt::data::cuda_ipc::stats().export_copies
    }

    /// Deleters of foreign memory that ran here, after a `trim` (which
    /// lets adopted allocations nobody maps any more go).
    async fn dlpack_deleters(&mut self) -> u64 {
        rdt::data::cuda::alloc::trim();
        crate::dlpack_cuda::DELETERS_RUN.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Bytes this process holds in slabs (in use, cached or retiring).
    async fn slab_bytes(&mut self) -> usize {
        rdt::data::cuda::alloc::slab_bytes().values().sum()
    }

    /// Exits the process abruptly.
    async fn die(&mut self) -> u64 {
        std::process::exit(7)
    }

    /// Answers (to tell whether it lives).
    async fn echo(&mut self, x: u64) -> u64 {
        x
    }

    /// A CPU tensor (for transports that move CUDA tensors only).
    async fn make_cpu(&mut self, n: usize) -> Tensor {
        Tensor::full(1.0f32, &[n])
    }

    /// An application error instead of a tensor.
    async fn fail(&mut self, msg: String) -> Result<Tensor, String> {
        Err(msg)
    }

    /// `n` CUDA tensors, tensor `i` of `len` f32 equal to `i`.
    async fn many(&mut self, n: usize, len: usize) -> rdt::Result<Vec<Tensor>> {
        (0..n)
            .map(|i| Tensor::cuda_full(i as f32, &[len], 0).map_err(tensor_err))
            .collect()
    }

    /// `n` CUDA tensors, tensor `i` of `len` f32 equal to `first + i` (a
    /// version of some weights).
    async fn version(&mut self, n: usize, len: usize, first: f32) -> rdt::Result<Vec<Tensor>> {
        (0..n)
            .map(|i| Tensor::cuda_full(first + i as f32, &[len], 0).map_err(tensor_err))
            .collect()
    }

    /// One CUDA tensor of `n` f32 equal to `v` and one CPU tensor of `n`
    /// f32 equal to `2v`, in one object.
    async fn mixed(&mut self, v: f32, n: usize) -> rdt::Result<(Tensor, Tensor)> {
        Ok((
            Tensor::cuda_full(v, &[n], 0).map_err(tensor_err)?,
            Tensor::full(2.0 * v, &[n]),
        ))
    }
    /// Blocks this actor's thread for `ms` milliseconds: a call queued
    /// behind it is still running when its consumer's call comes.
    async fn block(&mut self, ms: u64) -> u64 {
        std::thread::sleep(std::time::Duration::from_millis(ms));
        ms
    }
}

/// What [`GpuConsumer::fill_own_copy`] saw: (sum of the copy as taken,
/// after the fill, sum of the received tensor, shared storage, copy's
/// device UUID, the worker's device UUID).
pub type CopyReport = (f64, f64, f64, bool, String, String);

/// Consumes CUDA tensors.
#[rdt::actor]
pub struct GpuConsumer {
    held: Vec<Tensor>,
    params: Vec<Tensor>,
}

#[rdt::actor]
impl GpuConsumer {
    fn new() -> Self {
        report_fatal_signals();
        GpuConsumer {
            held: Vec::new(),
            params: Vec::new(),
        }
    }

    /// Sum of `t` (read back from the GPU) and whether it is a CUDA tensor.
    async fn sum(&mut self, t: Tensor) -> rdt::Result<(f64, bool)> {
        Ok((t.sum().map_err(tensor_err)?, t.is_cuda()))
    }

    /// Sums of both and whether they share storage.
    async fn sum2(&mut self, a: Tensor, b: Tensor) -> rdt::Result<(f64, bool)> {
        let s = a.sum().map_err(tensor_err)? + b.sum().map_err(tensor_err)?;
        Ok((s, a.shares_storage(&b)))
    }

    /// Sum of every tensor of a nested value, with its plain data.
    async fn batch_sum(&mut self, b: Batch) -> rdt::Result<(u64, String, f64, bool)> {
        let mut s = 0.0;
        let mut all_cuda = true;
        let ts = b
            .weights
            .values()
            .chain(b.extra.iter())
            .chain(b.mask.iter());
        for t in ts {
            s += t.sum().map_err(tensor_err)?;
            all_cuda &= t.is_cuda();
        }
        Ok((b.step, b.label, s, all_cuda))
    }

    /// Fills `t` with `v` in place and waits for the GPU.
    async fn fill(&mut self, t: Tensor, v: f32) -> rdt::Result<()> {
        t.fill_(v).map_err(tensor_err)?;
        t.cuda_ready().await.map_err(tensor_err)?;
        Ok(())
    }

    /// cuda_ipc's copy mode: takes its own copy of `t` (`deep_copy`), reads
    /// it, fills the copy with `v` and returns (sum of the copy as taken,
    /// sum of the copy after the fill, sum of `t`, whether copy and `t`
    /// share storage, the copy's device UUID, this worker's device UUID).
    async fn fill_own_copy(&mut self, t: Tensor, v: f32) -> rdt::Result<CopyReport> {
        let own = t.deep_copy().map_err(tensor_err)?;
        let taken = own.sum().map_err(tensor_err)?;
        own.fill_(v).map_err(tensor_err)?;
        own.cuda_ready().await.map_err(tensor_err)?;
        let uuid = match own.device() {
            Device::Cuda { uuid, .. } => uuid.to_string(),
            Device::Cpu => "cpu".into(),
        };
        let mine = rdt::data::cuda::gpu(0)
            .map(|g| g.uuid().to_string())
            .map_err(|e| tensor_err(e.into()))?;
        Ok((
            taken,
            own.sum().map_err(tensor_err)?,
            t.sum().map_err(tensor_err)?,
            own.shares_storage(&t),
            uuid,
            mine,
        ))
    }

    /// Waits until `t` is usable on the GPU; returns its byte size (the
    /// benchmark's "consumer can read the tensor").
    async fn touch(&mut self, t: Tensor) -> rdt::Result<usize> {
        t.cuda_ready().await.map_err(tensor_err)?;
        Ok(t.nbytes())
    }

    /// Sum of `t` read with a kernel launched as the method starts, and
    /// whether the tensor's bytes were still on their way then (its
    /// transfer's done event not passed): a stream-ordered receive lets
    /// the method start early, and the kernel waits on the GPU.
    async fn early_sum(&mut self, t: Tensor) -> rdt::Result<(bool, f64)> {
        let early = !t.ready_event_passed().map_err(tensor_err)?;
        Ok((early, t.sum().map_err(tensor_err)?))
    }

    /// Panics while `t`'s bytes may still be on their way; says whether
    /// they were, in the panic's message.
    async fn early_panic(&mut self, t: Tensor) -> rdt::Result<f64> {
        let early = !t.ready_event_passed().map_err(tensor_err)?;
        panic!("panicked with the bytes still on their way: {early}");
    }

    /// Exits while `t`'s bytes are still on their way (a receiver that dies
    /// mid-transfer); returns `false` (and lives) if they already landed.
    async fn die_mid_transfer(&mut self, t: Tensor) -> rdt::Result<bool> {
        if !t.ready_event_passed().map_err(tensor_err)? {
            std::process::exit(9);
        }
        Ok(false)
    }

    /// Keeps this process's GPU stream busy for a while (`reps` fills of
    /// `bytes` bytes) and returns at once.
    async fn busy(&mut self, bytes: usize, reps: usize) -> rdt::Result<()> {
        let t = Tensor::cuda_empty(DType::U8, &[bytes], 0).map_err(tensor_err)?;
        for i in 0..reps {
            t.fill_(i as u8).map_err(tensor_err)?;
        }
        self.held.push(t);
        Ok(())
    }

    /// A weight update behind work on the old weights: long fills keep
    /// rdt's stream busy, a copy of the parameters (made by
    /// `update_params`, `n` × `len` f32 in one buffer) is queued behind
    /// them, then `get_into` receives the object behind `r` into the
    /// parameters. Returns the copy's sum (the values the queued work
    /// saw) and the parameters' sum after.
    async fn copy_then_update(
        &mut self,
        r: ObjectRef<Vec<Tensor>>,
        n: usize,
        len: usize,
    ) -> rdt::Result<(f64, f64)> {
        let g = rdt::data::cuda::gpu(0).map_err(|e| tensor_err(e.into()))?;
        let busy = Tensor::cuda_empty(DType::U8, &[1 << 30], 0).map_err(tensor_err)?;
        for i in 0..500 {
            busy.fill_(i as u8).map_err(tensor_err)?;
        }
        self.held.push(busy);
        let copy = Tensor::cuda_empty(DType::F32, &[n * len], 0).map_err(tensor_err)?;
        let src = self.params[0]
            .with_device_buffer(|d| d.device_ptr())
            .map_err(tensor_err)?;
        let dst = copy
            .with_device_buffer(|d| d.device_ptr())
            .map_err(tensor_err)?;
        g.copy_dtod(dst, src, n * len * 4)
            .map_err(|e| tensor_err(e.into()))?;
        rdt::runtime().get_into(&r, &self.params).await?;
        let before = copy.sum().map_err(tensor_err)?;
        let mut after = 0.0;
        for p in &self.params {
            after += p.sum().map_err(tensor_err)?;
        }
        Ok((before, after))
    }

    /// This process's nccl receive counters.
    async fn nccl_stats(&mut self) -> rdt::data::nccl::NcclStats {
        rdt::data::nccl::stats()
    }

    /// Waits until rdt's stream on this process's GPU has done everything
    /// enqueued so far: memory freed before is then clean (a transfer's
    /// stream may write it without waiting for rdt's).
    async fn gpu_settled(&mut self) -> rdt::Result<()> {
        let g = rdt::data::cuda::gpu(0).map_err(|e| tensor_err(e.into()))?;
        let done = g.completion().map_err(|e| tensor_err(e.into()))?;
        done.wait().await.map_err(|e| tensor_err(e.into()))
    }

    /// Whether `t`'s bytes landed while rdt's stream was still busy with
    /// work enqueued before its receive (`busy`), and its sum: a receive
    /// into clean memory does not wait for unrelated compute.
    async fn landed_while_busy(&mut self, t: Tensor) -> rdt::Result<(bool, f64)> {
        let g = rdt::data::cuda::gpu(0).map_err(|e| tensor_err(e.into()))?;
        let busy = loop {
            if t.ready_event_passed().map_err(tensor_err)? {
                break !g.stream_idle().map_err(|e| tensor_err(e.into()))?;
            }
            if g.stream_idle().map_err(|e| tensor_err(e.into()))? {
                // The stream went idle first; the bytes land after.
                t.cuda_ready().await.map_err(tensor_err)?;
                break false;
            }
            tokio::task::yield_now().await;
        };
        Ok((busy, t.sum().map_err(tensor_err)?))
    }

    /// A weight update on the GPU: receives the object behind `r` into
    /// `n` views of `len` f32 of one flat CUDA buffer of this actor's (its
    /// parameters, made at first use and kept), with `get_into`. Returns
    /// the parameters' sums after, whether the value got back holds the
    /// parameters themselves, and whether they are still views of the one
    /// buffer.
    async fn update_params(
        &mut self,
        r: ObjectRef<Vec<Tensor>>,
        n: usize,
        len: usize,
    ) -> rdt::Result<(Vec<f64>, bool, bool)> {
        if self.params.is_empty() {
            let flat = Tensor::cuda_zeros(DType::F32, &[n * len], 0).map_err(tensor_err)?;
            self.params = (0..n)
                .map(|i| flat.view(i * len * 4, DType::F32, &[len]))
                .collect::<Result<_, _>>()
                .map_err(tensor_err)?;
        }
        let got = rdt::runtime().get_into(&r, &self.params).await?;
        let same = got.len() == self.params.len()
            && got
                .iter()
                .zip(&self.params)
                .all(|(g, p)| g.shares_storage(p));
        let one_buffer = self
            .params
            .iter()
            .all(|p| p.shares_storage(&self.params[0]));
        let sums = self
            .params
            .iter()
            .map(|p| p.sum().map_err(tensor_err))
            .collect::<rdt::Result<_>>()?;
        Ok((sums, same, one_buffer))
    }

    /// Sums of every tensor of `ts`, in order.
    async fn sums(&mut self, ts: Vec<Tensor>) -> rdt::Result<Vec<f64>> {
        ts.iter().map(|t| t.sum().map_err(tensor_err)).collect()
    }

    /// Objects received over `transport` (see `rdt::metrics::WorkerMetrics`).
    async fn received(&mut self, transport: String) -> rdt::Result<u64> {
        Ok(rdt::runtime().metrics().received_over(transport.parse()?))
    }

    /// Objects in its store.
    async fn stored(&mut self) -> usize {
        rdt::runtime().metrics().local_objects
    }

    /// `get_into` calls received in place (see `rdt::metrics::WorkerMetrics`).
    async fn in_place(&mut self) -> u64 {
        rdt::runtime().metrics().received_in_place
    }

    /// Answers (to tell whether it lives).
    async fn echo(&mut self, x: u64) -> u64 {
        x
    }

    /// A host copy of `t`.
    async fn copy_of(&mut self, t: Tensor) -> rdt::Result<Tensor> {
        t.to_cpu().map_err(tensor_err)
    }

    /// Keeps `t`.
    async fn hold(&mut self, t: Tensor) -> usize {
        self.held.push(t);
        self.held.len()
    }

    /// Sum of the held tensor `i` (read back from the GPU).
    async fn sum_held(&mut self, i: usize) -> rdt::Result<f64> {
        self.held[i].sum().map_err(tensor_err)
    }

    /// Drops the held tensors.
    async fn drop_held(&mut self) -> usize {
        let n = self.held.len();
        self.held.clear();
        n
    }

    /// cuda_ipc counts of this process: (new mappings, cached, events opened).
    async fn ipc_stats(&mut self) -> (u64, u64, u64) {
        let s = rdt::data::cuda_ipc::stats();
        (s.opened, s.cached, s.events_opened)
    }

    /// `t` read out through DLPack (`dlpack_cuda::read_out`): the same
    /// device address, and the sum read from there.
    async fn dlpack_read(&mut self, t: Tensor) -> rdt::Result<(bool, f64)> {
        crate::dlpack_cuda::read_out(&t)
    }

    /// Closes mappings of slabs their producer retired; returns (closed by
    /// this call, closed by this process so far).
    async fn close_retired(&mut self) -> (usize, u64) {
        let n = rdt::data::cuda_ipc::close_retired_mappings();
        (n, rdt::data::cuda_ipc::stats().closed)
    }

    /// Number of devices this worker sees.
    async fn devices(&mut self) -> usize {
        rdt::data::cuda::device_count()
    }

    /// UUIDs of the devices this worker sees, in local ordinal order.
    async fn uuids(&mut self) -> rdt::Result<Vec<String>> {
        (0..rdt::data::cuda::device_count())
            .map(|i| {
                rdt::data::cuda::gpu(i)
                    .map(|g| g.uuid().to_string())
                    .map_err(|e| tensor_err(e.into()))
            })
            .collect()
    }

    /// Where `t` lives (its device's UUID) and a copy of its elements made on
    /// this worker's GPU (device-to-device from the import, then to the
    /// host): checks that the consumer's own device can read the bytes.
    async fn inspect(&mut self, t: Tensor) -> rdt::Result<(String, Vec<f32>)> {
        let local = t.to_device(0).map_err(tensor_err)?;
        let v = local
            .to_cpu()
            .map_err(tensor_err)?
            .to_vec::<f32>()
            .map_err(tensor_err)?;
        let uuid = match t.device() {
            Device::Cuda { uuid, .. } => uuid.to_string(),
            Device::Cpu => "cpu".into(),
        };
        Ok((uuid, v))
    }

    /// This worker's NIXL counters (`rdt::data::nixl::stats`).
    async fn nixl_stats(&mut self) -> rdt::data::nixl::NixlStats {
        rdt::data::nixl::stats()
    }

    /// Sums of a pair and whether each is a CUDA tensor.
    async fn sum_mixed(&mut self, p: (Tensor, Tensor)) -> rdt::Result<(f64, bool, f64, bool)> {
        Ok((
            p.0.sum().map_err(tensor_err)?,
            p.0.is_cuda(),
            p.1.sum().map_err(tensor_err)?,
            p.1.is_cuda(),
        ))
    }

    /// This worker's host pool counters (`rdt::data::host_pool::stats`):
    /// hits, misses, bytes pinned for CUDA.
    async fn pool_stats(&mut self) -> (u64, u64, usize) {
        let s = rdt::data::host_pool::stats();
        (s.hits, s.misses, s.pinned_bytes)
    }
    /// Values this worker received straight from their producers (see
    /// `rdt::metrics::WorkerMetrics`).
    async fn straight(&mut self) -> u64 {
        rdt::runtime().metrics().straight_deliveries
    }

    /// Receives this worker's calls acknowledged with their `CallDone`
    /// (see `rdt::metrics::WorkerMetrics`).
    async fn acks_by_calls(&mut self) -> u64 {
        rdt::runtime().metrics().receives_acknowledged_by_calls
    }

    /// [`early_sum`](Self::early_sum) of a method that then runs on for
    /// `ms` milliseconds (longer than a short transfer deadline) before it
    /// sums.
    async fn early_sum_after(&mut self, t: Tensor, ms: u64) -> rdt::Result<(bool, f64)> {
        let early = !t.ready_event_passed().map_err(tensor_err)?;
        tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
        Ok((early, t.sum().map_err(tensor_err)?))
    }
}

/// An actor that is a client too: it calls other actors, puts, gets and
/// waits from inside its methods, and takes, keeps and returns refs and
/// handles.
#[rdt::actor]
pub struct Relay {
    kept: Vec<ObjectRef<Tensor>>,
}

#[rdt::actor]
impl Relay {
    fn new() -> Self {
        Relay { kept: Vec::new() }
    }

    /// Objects in this worker's store.
    async fn stored(&mut self) -> usize {
        rdt::runtime().metrics().local_objects
    }

    /// Puts small values until it is killed, keeping every ref: a `Put`
    /// frame and a count in the driver each.
    async fn put_forever(&mut self) -> rdt::Result<u64> {
        let mut kept = Vec::new();
        loop {
            kept.push(rdt::runtime().put(&vec![kept.len() as u8; 512])?);
            if kept.len() % 256 == 0 {
                tokio::task::yield_now().await;
            }
        }
    }

    /// Calls `c.sum` with the ref it was given, and gets the result.
    async fn sum_via(&mut self, c: ConsumerHandle, r: ObjectRef<Tensor>) -> rdt::Result<f64> {
        rdt::runtime().get(c.sum(&r).remote()).await
    }

    /// Calls `c.sum` with the ref and returns the ref to its result
    /// without waiting (a ref made by an actor, handed to the caller).
    async fn forward(&mut self, c: ConsumerHandle, r: ObjectRef<Tensor>) -> ObjectRef<f64> {
        c.sum(r).remote()
    }

    /// Gets every ref (all transfers started before any is awaited) and
    /// sums the tensors.
    async fn sum_all(&mut self, refs: Vec<ObjectRef<Tensor>>) -> rdt::Result<f64> {
        let mut s = 0.0;
        for t in rdt::runtime().get_all(&refs).await? {
            s += t.sum()?;
        }
        Ok(s)
    }

    /// Keeps the refs past the call; returns how many it keeps.
    async fn keep(&mut self, refs: Vec<ObjectRef<Tensor>>) -> usize {
        self.kept.extend(refs);
        self.kept.len()
    }

    /// Sum of the tensors behind the kept refs.
    async fn sum_kept(&mut self) -> rdt::Result<f64> {
        self.sum_all(self.kept.clone()).await
    }

    /// Drops the kept refs.
    async fn drop_kept(&mut self) -> usize {
        std::mem::take(&mut self.kept).len()
    }

    /// Hands the refs, nested in a value, to `next` to keep; returns what
    /// `next` then keeps.
    async fn hand_on(
        &mut self,
        next: RelayHandle,
        refs: Vec<ObjectRef<Tensor>>,
    ) -> rdt::Result<usize> {
        rdt::runtime().get(next.keep(refs).remote()).await
    }

    /// Puts a tensor of `n` f32 equal to `v` over `transport` and returns
    /// the ref.
    async fn put_tensor(
        &mut self,
        v: f32,
        n: usize,
        transport: String,
    ) -> rdt::Result<ObjectRef<Tensor>> {
        let t = Tensor::full(v, &[n]);
        rdt::runtime().put_with(&t, transport.parse()?).await
    }

    /// Gets the tensor and sums it.
    async fn get_sum(&mut self, r: ObjectRef<Tensor>) -> rdt::Result<f64> {
        Ok(rdt::runtime().get(&r).await?.sum()?)
    }

    /// `wait_many(refs, n, timeout)` inside the actor: (finished, pending).
    async fn wait_some(
        &mut self,
        refs: Vec<ObjectRef<u32>>,
        n: usize,
        timeout_ms: u64,
    ) -> rdt::Result<(usize, usize)> {
        let (done, pending) = rdt::runtime()
            .wait_many(&refs, n, Some(std::time::Duration::from_millis(timeout_ms)))
            .await?;
        Ok((done.len(), pending.len()))
    }

    /// Objects received over `transport` (see `rdt::metrics::WorkerMetrics`).
    async fn received(&mut self, transport: String) -> rdt::Result<u64> {
        Ok(rdt::runtime().metrics().received_over(transport.parse()?))
    }

    /// Gets the object, failing with its error (for error round trips).
    async fn get_u32(&mut self, r: ObjectRef<u32>) -> rdt::Result<u32> {
        rdt::runtime().get(&r).await
    }

    /// Calls `c.sum` (a GPU consumer) with the ref it was given, and gets
    /// the result: (sum, whether the consumer saw a CUDA tensor).
    async fn gpu_sum_via(
        &mut self,
        c: GpuConsumerHandle,
        r: ObjectRef<Tensor>,
    ) -> rdt::Result<(f64, bool)> {
        rdt::runtime().get(c.sum(&r).remote()).await
    }

    /// Puts a CUDA tensor of `n` f32 equal to `v` (on this actor's GPU)
    /// over `transport` and returns the ref.
    async fn put_cuda(
        &mut self,
        v: f32,
        n: usize,
        transport: String,
    ) -> rdt::Result<ObjectRef<Tensor>> {
        let t = Tensor::cuda_full(v, &[n], 0).map_err(|e| rdt::Error::Tensor(e.to_string()))?;
        rdt::runtime().put_with(&t, transport.parse()?).await
    }

    /// Reads a ref from JSON (serde outside rdt): the error it gives.
    async fn ref_from_json(&mut self, json: String) -> String {
        match serde_json::from_str::<ObjectRef<u32>>(&json) {
            Ok(r) => format!("read ref {}", r.id()),
            Err(e) => e.to_string(),
        }
    }
}

/// Built with a handle to a consumer (a handle in a constructor argument).
#[rdt::actor]
pub struct Delegate {
    consumer: ConsumerHandle,
}

#[rdt::actor]
impl Delegate {
    fn new(consumer: ConsumerHandle) -> Self {
        Delegate { consumer }
    }

    /// Has the consumer it was built with sum the tensor behind `r`.
    async fn sum(&mut self, r: ObjectRef<Tensor>) -> rdt::Result<f64> {
        rdt::runtime().get(self.consumer.sum(&r).remote()).await
    }
}

/// An actor that both produces and consumes `tcp` objects (traffic both
/// ways inside one group).
#[rdt::actor]
pub struct TwoWay {}

#[rdt::actor]
impl TwoWay {
    fn new() -> Self {
        TwoWay {}
    }

    /// `n` f32 equal to `v`, over `tcp`.
    #[rdt::method(tensor_transport = "tcp")]
    async fn make_tcp(&mut self, v: f32, n: usize) -> Tensor {
        Tensor::full(v, &[n])
    }

    /// The tensor's sum.
    async fn sum(&mut self, t: Tensor) -> rdt::Result<f64> {
        Ok(t.sum()?)
    }
}

/// An actor whose constructor takes `ms` milliseconds.
#[rdt::actor]
pub struct SlowStart {
    waited: u64,
}

#[rdt::actor]
impl SlowStart {
    fn new(ms: u64) -> Self {
        std::thread::sleep(std::time::Duration::from_millis(ms));
        SlowStart { waited: ms }
    }

    /// How long its constructor took.
    async fn waited(&mut self) -> u64 {
        self.waited
    }
}

/// Takes a ref in its constructor argument (which rdt refuses, clearly).
#[rdt::actor]
pub struct RefInConstructor {
    r: ObjectRef<u32>,
}

#[rdt::actor]
impl RefInConstructor {
    fn new(r: ObjectRef<u32>) -> Self {
        RefInConstructor { r }
    }

    /// The ref's id.
    async fn id_of(&mut self) -> u64 {
        self.r.id()
    }
}

/// A value whose encoding always fails (decoding is a unit).
pub struct Unencodable;

impl Serialize for Unencodable {
    fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
        Err(serde::ser::Error::custom(
            "this value refuses to be encoded",
        ))
    }
}

impl<'de> Deserialize<'de> for Unencodable {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        <()>::deserialize(d).map(|()| Unencodable)
    }
}

/// A serial actor that calls itself.
#[rdt::actor]
pub struct SelfCaller {
    pings: u32,
}

#[rdt::actor]
impl SelfCaller {
    fn new() -> Self {
        SelfCaller { pings: 0 }
    }

    /// How many pings ran, this one included.
    async fn ping(&mut self) -> u32 {
        self.pings += 1;
        self.pings
    }

    /// Calls `ping` on itself and waits for it inside this method: a
    /// serial actor runs the ping only after this method returned.
    async fn ping_self_and_wait(&mut self, me: SelfCallerHandle) -> rdt::Result<u32> {
        rdt::runtime().get(me.ping().remote()).await
    }

    /// The same, waiting with `wait` and a deadline of `ms`.
    async fn ping_self_and_wait_for(&mut self, me: SelfCallerHandle, ms: u64) -> rdt::Result<()> {
        let r = me.ping().remote();
        rdt::runtime()
            .get_timeout(&r, std::time::Duration::from_millis(ms))
            .await
            .map(|_| ())
    }

    /// Calls `ping` on itself twice and waits, with no deadline, for
    /// `n` of the two.
    async fn ping_self_and_wait_many(
        &mut self,
        me: SelfCallerHandle,
        n: usize,
    ) -> rdt::Result<usize> {
        let refs = vec![me.ping().remote(), me.ping().remote()];
        let (done, _) = rdt::runtime().wait_many(&refs, n, None).await?;
        Ok(done.len())
    }

    /// Takes a value that cannot be sent.
    async fn take(&mut self, _x: Unencodable) -> u32 {
        0
    }

    /// Calls `take` on itself with a value that does not encode, and
    /// waits: the call fails at submission, so the wait ends with that.
    async fn bad_self_call_and_wait(&mut self, me: SelfCallerHandle) -> rdt::Result<u32> {
        rdt::runtime().get(me.take(Unencodable).remote()).await
    }

    /// A tensor's sum.
    async fn sum_of(&mut self, t: Tensor) -> rdt::Result<f64> {
        Ok(t.sum()?)
    }

    /// Calls `sum_of` on itself with `refs[0]` and waits: with an object
    /// of a collective transport this actor shares no group with, the
    /// driver refuses the call at submission, so the wait ends with the
    /// driver's error.
    async fn refused_self_call_and_wait(
        &mut self,
        me: SelfCallerHandle,
        refs: Vec<ObjectRef<Tensor>>,
    ) -> rdt::Result<f64> {
        rdt::runtime().get(me.sum_of(&refs[0]).remote()).await
    }

    /// Calls `ping` on itself and hands the ref back without waiting.
    async fn ping_self_later(&mut self, me: SelfCallerHandle) -> ObjectRef<u32> {
        me.ping().remote()
    }
}

/// Views of `flat` (1000 elements of 4 bytes, as `Producer::views` makes
/// it): elements 0..100 as 10×10 f32; 100..300 as 200 f32; 50..150
/// (overlapping both) as 100 f32; the 16 bytes of 996..1000 read as u8;
/// `flat` itself.
pub fn flat_views(flat: Tensor) -> Vec<Tensor> {
    let v = |at: usize, dtype: DType, shape: &[usize]| {
        flat.view(at * 4, dtype, shape)
            .expect("a view within the flat buffer")
    };
    vec![
        v(0, DType::F32, &[10, 10]),
        v(100, DType::F32, &[200]),
        v(50, DType::F32, &[100]),
        v(996, DType::U8, &[16]),
        flat.clone(),
    ]
}

/// Logs at the level asked (the worker log tests).
#[rdt::actor]
pub struct Logger;

#[rdt::actor]
impl Logger {
    fn new() -> Self {
        Logger
    }

    /// `line` at `info`.
    fn info(&self, line: String) {
        tracing::info!(line = %line, "the actor says");
    }

    /// `line` at `warn`.
    fn warn(&self, line: String) {
        tracing::warn!(line = %line, "the actor warns");
    }

    /// Says so at `info`, then has `to` log `line` at `info`: a call made
    /// while running one (the trace tests).
    async fn relay(&self, to: LoggerHandle, line: String) -> rdt::Result<()> {
        tracing::info!("relaying");
        rdt::runtime().get(to.info(line).remote()).await
    }
}
