//! PNG plot: IOPS by queue count per target, and host memory per GiB stored.
//!
//! Text needs a TTF font, looked up at run time (no fontconfig); without one the
//! chart is still drawn, just without labels.

use crate::error::Result;
use crate::report::{summarize, RunResult, Summary};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::path::Path;

const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/truetype/noto/NotoSans-Regular.ttf",
];

/// Register a sans-serif font once; false if none is found.
fn load_font() -> bool {
    static LOADED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *LOADED.get_or_init(|| {
        let env = std::env::var("VZRAM_BENCH_FONT").ok();
        for p in env
            .iter()
            .map(String::as_str)
            .chain(FONT_PATHS.iter().copied())
        {
            if let Ok(bytes) = std::fs::read(p) {
                // plotters keeps a 'static reference; one font per process is fine.
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return true;
                }
            }
        }
        eprintln!("note: no TTF font found (set VZRAM_BENCH_FONT); plot drawn without text");
        false
    })
}

fn err<E: std::fmt::Display>(e: E) -> crate::error::Error {
    crate::error::Error(format!("plot: {e}"))
}

pub fn draw(results: &[RunResult], path: &Path) -> Result<()> {
    let text = load_font();
    let s = summarize(results);
    let root = BitMapBackend::new(path, (1400, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let (left, right) = root.split_horizontally(820);
    iops_chart(&left, &s, text)?;
    memory_chart(&right, &s, text)?;
    root.present().map_err(err)?;
    Ok(())
}

type Area<'a> = DrawingArea<BitMapBackend<'a>, plotters::coord::Shift>;

fn iops_chart(area: &Area, s: &[Summary], text: bool) -> Result<()> {
    // One series per (target, job, bs, qd), points at each queue count.
    let mut series: Vec<(String, Vec<(u32, f64)>)> = Vec::new();
    for x in s.iter().filter(|x| x.job != "fill") {
        let name = format!(
            "{} {} {} qd{}",
            x.target,
            x.job,
            crate::units::format_size(x.bs),
            x.iodepth
        );
        match series.iter_mut().find(|(n, _)| *n == name) {
            Some((_, pts)) => pts.push((x.queues, x.iops)),
            None => series.push((name, vec![(x.queues, x.iops)])),
        }
    }
    for (_, pts) in series.iter_mut() {
        pts.sort_by_key(|p| p.0);
    }
    let max_q = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|x| x.0))
        .max()
        .unwrap_or(1);
    let max_iops = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|x| x.1))
        .fold(1.0, f64::max);
    let mut b = ChartBuilder::on(area);
    b.margin(15);
    if text {
        b.caption("IOPS by queue count", ("sans-serif", 22))
            .x_label_area_size(40)
            .y_label_area_size(70);
    }
    // Headroom above the highest point, so the legend (upper left) hides no data.
    let mut chart = b
        .build_cartesian_2d(
            0.5f64..max_q as f64 + 0.5,
            0.0..max_iops * (1.2 + 0.05 * series.len() as f64),
        )
        .map_err(err)?;
    let mut mesh = chart.configure_mesh();
    mesh.x_labels((max_q as usize).min(16))
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| crate::units::kilo(*y));
    if text {
        mesh.x_desc("queues").y_desc("IOPS");
    } else {
        mesh.disable_axes();
    }
    mesh.draw().map_err(err)?;
    for (i, (name, pts)) in series.iter().enumerate() {
        let color = Palette99::pick(i).stroke_width(2);
        let data: Vec<(f64, f64)> = pts.iter().map(|&(q, v)| (q as f64, v)).collect();
        let line = chart
            .draw_series(LineSeries::new(data.clone(), color))
            .map_err(err)?;
        if text {
            line.label(name.as_str()).legend(move |(x, y)| {
                PathElement::new(
                    vec![(x, y), (x + 20, y)],
                    Palette99::pick(i).stroke_width(2),
                )
            });
        }
        chart
            .draw_series(
                data.iter()
                    .map(|&p| Circle::new(p, 4, Palette99::pick(i).filled())),
            )
            .map_err(err)?;
    }
    if text && !series.is_empty() {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .label_font(("sans-serif", 13))
            .draw()
            .map_err(err)?;
    }
    Ok(())
}

fn memory_chart(area: &Area, s: &[Summary], text: bool) -> Result<()> {
    // Per target: median memory per byte over its runs that stored data.
    let mut bars: Vec<(String, f64)> = Vec::new();
    for x in s {
        if let Some(m) = x.mem_per_byte {
            match bars.iter_mut().find(|(n, _)| *n == x.target) {
                Some((_, v)) => *v = v.max(m),
                None => bars.push((x.target.clone(), m)),
            }
        }
    }
    let max = bars.iter().map(|b| b.1).fold(1.0, f64::max) * 1.15;
    let n = bars.len().max(1) as u32;
    let mut b = ChartBuilder::on(area);
    b.margin(15);
    if text {
        b.caption("Host GiB per GiB stored", ("sans-serif", 22))
            .x_label_area_size(40)
            .y_label_area_size(60);
    }
    let mut chart = b
        // `a..b` segments into b-a+1 slots; a single bar gets a spare slot (0..0 is
        // degenerate).
        .build_cartesian_2d((0..n.max(2) - 1).into_segmented(), 0f64..max)
        .map_err(err)?;
    let labels: Vec<String> = bars.iter().map(|b| b.0.clone()).collect();
    let x_fmt = |x: &SegmentValue<u32>| match x {
        SegmentValue::CenterOf(i) => labels.get(*i as usize).cloned().unwrap_or_default(),
        _ => String::new(),
    };
    let mut mesh = chart.configure_mesh();
    mesh.disable_x_mesh()
        .x_labels(n as usize)
        .x_label_formatter(&x_fmt)
        .y_label_formatter(&|y| format!("{y:.2}"));
    if !text {
        mesh.disable_axes();
    }
    mesh.draw().map_err(err)?;
    for (i, (_, v)) in bars.iter().enumerate() {
        let i = i as u32;
        let mut bar = Rectangle::new(
            [
                (SegmentValue::Exact(i), 0.0),
                (SegmentValue::Exact(i + 1), *v),
            ],
            Palette99::pick(i as usize + 3).filled(),
        );
        bar.set_margin(0, 0, 12, 12);
        chart.draw_series(std::iter::once(bar)).map_err(err)?;
        if text {
            chart
                .draw_series(std::iter::once(Text::new(
                    format!("{v:.3}"),
                    (SegmentValue::CenterOf(i), *v + max * 0.03),
                    TextStyle::from(("sans-serif", 15).into_font())
                        .pos(Pos::new(HPos::Center, VPos::Bottom)),
                )))
                .map_err(err)?;
        }
    }
    Ok(())
}
