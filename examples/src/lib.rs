//! What the benchmark programs (`bench`, `bench_cuda`, `bench_nccl`) share:
//! the harness's row schema (see the book's Benchmarks page) and the
//! statistics every row is made of.

use serde::Serialize;

pub mod sync;

/// What a row's time is.
#[derive(Serialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// The bytes are copied: `gbps` is a bandwidth.
    Bandwidth,
    /// A zero-copy hand-off: no bandwidth, only a latency.
    HandoffLatency,
    /// A round trip of a tiny payload, or a latency under load.
    Latency,
}

impl Kind {
    /// The tables' label.
    pub fn label(self) -> &'static str {
        match self {
            Kind::Bandwidth => "bandwidth",
            Kind::HandoffLatency => "hand-off latency",
            Kind::Latency => "latency",
        }
    }
}

/// One row of a benchmark's table and JSON.
#[derive(Serialize, Clone, Debug)]
pub struct Row {
    /// The suite (`control`, `cuda`, `nccl`, ...).
    pub suite: String,
    /// What was measured.
    pub case: String,
    /// The path it took (`none`, `raw` for baselines).
    pub transport: String,
    /// Where the bytes were.
    pub device: String,
    /// Bytes per iteration.
    pub bytes: u64,
    /// Iterations timed.
    pub iters: usize,
    /// Median, µs.
    pub median_us: f64,
    /// 90th percentile, µs.
    pub p90_us: f64,
    /// What the time is.
    pub kind: Kind,
    /// `bytes` per median in GB/s (1e9 B/s), for `Kind::Bandwidth` rows only.
    pub gbps: Option<f64>,
    /// GPU suites: `same_gpu` or `cross_gpu`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub placement: Option<String>,
    /// GPU suites: the device's product name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_name: Option<String>,
    /// GPU suites: the commit the bundle was built from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub commit: Option<String>,
    /// `weightsync`: rollouts served per version.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rollouts: Option<usize>,
    /// `weightsync`: tensors per version.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tensors: Option<usize>,
    /// `weightsync`: exports of the trainer's memory over the run (one
    /// per version, whatever the rollouts).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exports: Option<u64>,
    /// `weightsync`: the largest peak resident memory of a rollout, KiB.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_rss_kib: Option<u64>,
}

impl Row {
    /// A row of `us` (one sample per iteration, µs): median, p90 and, for
    /// bandwidth rows, GB/s. The GPU fields are left empty.
    pub fn new(
        suite: &str,
        case: &str,
        transport: &str,
        device: &str,
        kind: Kind,
        bytes: u64,
        mut us: Vec<f64>,
    ) -> Row {
        us.sort_by(|a, b| a.partial_cmp(b).expect("no NaN sample"));
        let median = us[us.len() / 2];
        let p90 = us[(us.len() * 9 / 10).min(us.len() - 1)];
        Row {
            suite: suite.into(),
            case: case.into(),
            transport: transport.into(),
            device: device.into(),
            bytes,
            iters: us.len(),
            median_us: median,
            p90_us: p90,
            kind,
            gbps: (kind == Kind::Bandwidth && median > 0.0 && bytes > 0)
                .then(|| bytes as f64 / (median * 1e3)),
            placement: None,
            device_name: None,
            commit: None,
            rollouts: None,
            tensors: None,
            exports: None,
            peak_rss_kib: None,
        }
    }

    /// Prints the row as the GPU benchmarks do (the placement first, if
    /// it has one).
    pub fn print(&self) {
        let what = match (self.kind, self.gbps) {
            (Kind::Bandwidth, Some(g)) => format!("{g:>8.2} GB/s"),
            (Kind::HandoffLatency, _) => Kind::HandoffLatency.label().to_string(),
            _ => Kind::Latency.label().to_string(),
        };
        let placement = self
            .placement
            .as_ref()
            .map(|p| format!("{p:<10} "))
            .unwrap_or_default();
        println!(
            "{placement}{:<16} {:<13} {:>11} B {:>4} it  median {:>11.1} us  p90 {:>11.1} us  {}",
            self.case, self.transport, self.bytes, self.iters, self.median_us, self.p90_us, what
        );
    }
}

/// The median of `rows`' row for (`case`, `transport`, `bytes`), NaN if
/// there is none.
pub fn median_of<'a>(
    rows: impl IntoIterator<Item = &'a Row>,
    case: &str,
    transport: &str,
    bytes: u64,
) -> f64 {
    rows.into_iter()
        .find(|r| r.case == case && r.transport == transport && r.bytes == bytes)
        .map(|r| r.median_us)
        .unwrap_or(f64::NAN)
}

/// The command-line argument after `name` (`--json PATH` gives `PATH`),
/// if `name` is there and something follows it.
pub fn arg_value(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
}

/// A `/proc/<pid>/status` field in KiB (`VmRSS:`, `VmHWM:`), of process
/// `pid` or of this one; 0 where `/proc` does not tell.
pub fn status_kib(pid: Option<u32>, field: &str) -> u64 {
    let path = match pid {
        Some(pid) => format!("/proc/{pid}/status"),
        None => "/proc/self/status".to_string(),
    };
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(field))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// Microseconds since `t0`.
pub fn us_since(t0: std::time::Instant) -> f64 {
    t0.elapsed().as_secs_f64() * 1e6
}

/// The median of `v` (sorted in place); NaN when empty.
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// What a benchmark program's own steps fail with: a missing preparation,
/// a raw peer that failed, a library that is not there. The runtime's
/// errors convert into it; a method that returns it fails its call with
/// [`rdt::Error::Application`], as any application error does.
#[derive(Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct BenchError(pub String);

impl BenchError {
    /// An error saying `what`.
    pub fn new(what: impl std::fmt::Display) -> BenchError {
        BenchError(what.to_string())
    }
}

impl std::fmt::Display for BenchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// As `Display`: `main` prints it when it returns one.
impl std::fmt::Debug for BenchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BenchError {}

impl From<rdt::Error> for BenchError {
    fn from(e: rdt::Error) -> BenchError {
        BenchError::new(e)
    }
}

impl From<rdt::TensorError> for BenchError {
    fn from(e: rdt::TensorError) -> BenchError {
        BenchError::new(e)
    }
}

impl From<std::io::Error> for BenchError {
    fn from(e: std::io::Error) -> BenchError {
        BenchError::new(e)
    }
}

impl From<rdt::data::cuda::CudaError> for BenchError {
    fn from(e: rdt::data::cuda::CudaError) -> BenchError {
        BenchError::new(e)
    }
}

impl From<serde_json::Error> for BenchError {
    fn from(e: serde_json::Error) -> BenchError {
        BenchError::new(e)
    }
}

/// Records the timeline (`rdt::timeline`) in this process and in every
/// worker started after this call (they inherit `RDT_TIMELINE`); the
/// points go to standard error, merged by time with `sort -n -k2`.
pub fn record_timeline() {
    use tracing_subscriber::prelude::*;
    if std::env::var_os("RDT_TIMELINE").is_none() {
        std::env::set_var("RDT_TIMELINE", "1");
    }
    let _ = tracing_subscriber::registry()
        .with(rdt::timeline::layer())
        .try_init();
}
