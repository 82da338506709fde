//! The book's plots, as SVG, from committed benchmark JSON:
//!
//! ```sh
//! cargo run --example plots -- --transports bench-results/DIR/transports.json \
//!     --weightsync bench-results/DIR/weightsync.json [--ray bench-results/DIR/ray.json] \
//!     --label "2026-12-02, 2-core dev VM, 1a2b3c4" --out book/src/plots
//! ```
//!
//! - `cpu-transports.svg`: GB/s against size per CPU transport, beside the
//!   raw floors of the same run (`transports` suite);
//! - `weightsync-tensors.svg`: ms per version against the number of
//!   tensors the same bytes are split into (`weightsync` many-tensor
//!   series): the slope is the per-tensor cost;
//! - `weightsync-rollouts.svg`: ms per version against rollouts, with N
//!   warm copies at once as the floor and Ray 2.60's figures as reference
//!   points (`--ray`: the `summary` lines of `ray_cpu_weightsync.py`).

use std::collections::BTreeMap;
use std::path::PathBuf;

use clap::Parser;
use plotters::prelude::*;
use serde::Deserialize;

#[derive(Parser)]
struct Args {
    /// `bench transports --json` output.
    #[arg(long)]
    transports: Option<PathBuf>,
    /// `bench weightsync --json` output.
    #[arg(long)]
    weightsync: Option<PathBuf>,
    /// Ray's figures: a JSON array of `{"transport", "warm_median_ms"}`.
    #[arg(long)]
    ray: Option<PathBuf>,
    /// Date, machine and commit, printed under every title.
    #[arg(long)]
    label: String,
    /// Where the SVGs go.
    #[arg(long)]
    out: PathBuf,
}

#[derive(Deserialize, Clone)]
struct Row {
    case: String,
    transport: String,
    bytes: u64,
    median_us: f64,
    gbps: Option<f64>,
    #[serde(default)]
    rollouts: Option<usize>,
    #[serde(default)]
    tensors: Option<usize>,
}

#[derive(Deserialize)]
struct RayFigure {
    transport: String,
    warm_median_ms: f64,
}

type Plot = Result<(), Box<dyn std::error::Error>>;

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

fn read(path: &PathBuf) -> Result<Vec<Row>, Box<dyn std::error::Error>> {
    Ok(serde_json::from_str(&std::fs::read_to_string(path)?)?)
}

/// Lines of (x, y) points by name (floors, `raw_*`, `memcpy*` and
/// "copies", thin; rdt's thick), `log_x` plotting x on a log scale (its
/// labels the values themselves), `marks` as labelled reference points.
#[allow(clippy::too_many_arguments)]
fn lines(
    path: &PathBuf,
    title: &str,
    label: &str,
    x_desc: &str,
    y_desc: &str,
    series: &BTreeMap<String, Vec<(f64, f64)>>,
    log_x: bool,
    marks: &[(String, f64, f64)],
) -> Plot {
    let fx = |x: f64| if log_x { x.log10() } else { x };
    let root = SVGBackend::new(path, (760, 460)).into_drawing_area();
    root.fill(&WHITE)?;
    let (top, rest) = root.split_vertically(46);
    top.draw(&Text::new(title.to_string(), (10, 6), ("sans-serif", 17)))?;
    top.draw(&Text::new(label.to_string(), (10, 28), ("sans-serif", 12)))?;
    let all = series
        .values()
        .flatten()
        .copied()
        .chain(marks.iter().map(|m| (m.1, m.2)));
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, 0f64, 0f64);
    for (x, y) in all {
        x0 = x0.min(fx(x));
        x1 = x1.max(fx(x));
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    let pad = ((x1 - x0) * 0.06).max(0.3);
    let mut c = ChartBuilder::on(&rest)
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(x0 - pad..x1 + pad, y0 * 1.1..y1 * 1.15)?;
    let x_label = |v: &f64| {
        if log_x {
            format!("{}", 10f64.powf(*v).round())
        } else {
            format!("{v}")
        }
    };
    c.configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .x_label_formatter(&x_label)
        .draw()?;
    for (i, (name, pts)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let floor = name.starts_with("raw_")
            || name.starts_with("memcpy")
            || name.contains("copies")
            || name.contains("bar");
        let style = ShapeStyle::from(&color).stroke_width(if floor { 1 } else { 3 });
        // Drawn in order of x, whatever order the rows came in.
        let mut pts: Vec<(f64, f64)> = pts.iter().map(|&(x, y)| (fx(x), y)).collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        c.draw_series(LineSeries::new(pts.clone(), style))?
            .label(name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], style));
        c.draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
    }
    for (name, x, y) in marks {
        let at = (fx(*x), *y);
        c.draw_series(std::iter::once(TriangleMarker::new(at, 6, BLACK.filled())))?;
        c.draw_series(std::iter::once(Text::new(
            format!("  {name}: {y:.1}"),
            at,
            ("sans-serif", 11).into_font().color(&BLACK),
        )))?;
    }
    c.configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    println!("wrote {}", path.display());
    Ok(())
}

fn main() -> Plot {
    let args = Args::parse();
    std::fs::create_dir_all(&args.out)?;
    if let Some(p) = &args.transports {
        let rows = read(p)?;
        let mut series: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
        for r in rows
            .iter()
            .filter(|r| r.case.starts_with("pass ") && r.bytes >= 1 << 20)
        {
            if let Some(g) = r.gbps {
                series
                    .entry(r.transport.clone())
                    .or_default()
                    .push((r.bytes as f64 / (1 << 20) as f64, g));
            }
        }
        lines(
            &args.out.join("cpu-transports.svg"),
            "One tensor per pass on the CPU: GB/s against size, beside the raw floors",
            &args.label,
            "tensor size (MiB)",
            "GB/s",
            &series,
            true,
            &[],
        )?;
    }
    if let Some(p) = &args.weightsync {
        let rows = read(p)?;
        // Time per version against the number of tensors of the same
        // bytes: a flat line is no per-tensor cost (its slope, µs per
        // tensor, is in the chapter's table; the differences at 100
        // tensors are within this VM's noise).
        let mut per_count: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
        for r in rows
            .iter()
            .filter(|r| r.case.ends_with("tensors of 40.96 MB"))
        {
            per_count
                .entry(r.transport.clone())
                .or_default()
                .push((r.tensors.unwrap_or(1) as f64, r.median_us / 1e3));
        }
        if !per_count.is_empty() {
            lines(
                &args.out.join("weightsync-tensors.svg"),
                "40.96 MB per version as 1 to 10 000 tensors: ms per version (flat: no per-tensor cost)",
                &args.label,
                "tensors per version",
                "ms per version (warm median)",
                &per_count,
                true,
                &[],
            )?;
        }
        // ms per version against rollouts.
        let mut per_rollouts: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
        for r in rows
            .iter()
            .filter(|r| r.case.starts_with("version ") && r.rollouts.is_some())
        {
            if matches!(r.transport.as_str(), "raw_tcp" | "raw_nixl" | "memcpy_flat") {
                continue;
            }
            let name = if r.transport == "memcpy" {
                "N warm copies at once".to_string()
            } else {
                r.transport.clone()
            };
            per_rollouts
                .entry(name)
                .or_default()
                .push((r.rollouts.unwrap_or(1) as f64, r.median_us / 1e3));
        }
        let mut marks = Vec::new();
        if let Some(p) = &args.ray {
            let figures: Vec<RayFigure> = serde_json::from_str(&std::fs::read_to_string(p)?)?;
            for f in figures {
                marks.push((format!("Ray 2.60 {}", f.transport), 1.0, f.warm_median_ms));
            }
        }
        if !per_rollouts.is_empty() {
            lines(
                &args.out.join("weightsync-rollouts.svg"),
                "Weight sync, 1 000 f32 tensors of 64 KiB per version: ms per version against rollouts",
                &args.label,
                "rollouts",
                "ms per version (warm median)",
                &per_rollouts,
                false,
                &marks,
            )?;
        }
    }
    Ok(())
}
