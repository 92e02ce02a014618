//! `probespec cost --svg FILE`: the forward cost curve as a line chart, the cost of a block of R rows over
//! the cost of one row, a line per cache length, and beside it llama.cpp's curve on the same file when
//! `--peer` gives `llama-bench -o json` output (`-p R1,R2,... -n 0 -d C`: one prompt-processing run per
//! block size after C cached tokens).
//!
//! The ratio, not milliseconds, is what decides whether speculation pays: a block of R rows is worth
//! sending when its expected accepted tokens beat cost(R)/cost(1).

use anyhow::{anyhow, bail, Context, Result};
use plotters::prelude::*;
use std::collections::BTreeMap;
use std::path::Path;

const WIDTH: u32 = 820;
const HEIGHT: u32 = 480;

/// One curve: its name and (rows, cost / cost(1)) points in increasing rows.
pub struct Curve {
    pub name: String,
    pub points: Vec<(usize, f64)>,
    /// Drawn dashed (the peer's curves).
    pub dashed: bool,
}

/// probespec's curves, one per cache length, from timed points (cache length, rows, cost / cost(1)).
pub fn curves_of(points: impl IntoIterator<Item = (usize, usize, f64)>, engine: &str) -> Vec<Curve> {
    let mut by_cache: BTreeMap<usize, Vec<(usize, f64)>> = BTreeMap::new();
    for (cache, rows, ratio) in points {
        by_cache.entry(cache).or_default().push((rows, ratio));
    }
    by_cache
        .into_iter()
        .map(|(cache, mut pts)| {
            pts.sort_by_key(|&(r, _)| r);
            Curve {
                name: format!("{engine}, {cache} cached"),
                points: pts,
                dashed: false,
            }
        })
        .collect()
}

/// llama.cpp's curves from `llama-bench -o json` output: each entry's `n_prompt` rows after `n_depth`
/// cached tokens took `avg_ns`; ratios to the 1-row entry of the same depth (a depth without one is
/// left out).
pub fn peer_curves(path: &Path) -> Result<Vec<Curve>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let runs: Vec<serde_json::Value> = serde_json::from_str(&text)
        .with_context(|| format!("{}: not llama-bench's JSON output (-o json)", path.display()))?;
    let mut by_depth: BTreeMap<u64, Vec<(usize, f64)>> = BTreeMap::new();
    for r in &runs {
        let field = |k: &str| {
            r.get(k)
                .and_then(serde_json::Value::as_f64)
                .ok_or_else(|| anyhow!("{}: an entry without a numeric {k}", path.display()))
        };
        let (rows, depth, ns) = (
            field("n_prompt")?,
            field("n_depth").unwrap_or(0.0),
            field("avg_ns")?,
        );
        if rows >= 1.0 {
            by_depth
                .entry(depth as u64)
                .or_default()
                .push((rows as usize, ns));
        }
    }
    let curves: Vec<Curve> = by_depth
        .into_iter()
        .filter_map(|(depth, mut pts)| {
            pts.sort_by_key(|&(r, _)| r);
            let one = pts.iter().find(|&&(r, _)| r == 1)?.1;
            Some(Curve {
                name: format!("llama.cpp, {depth} cached"),
                points: pts.into_iter().map(|(r, ns)| (r, ns / one)).collect(),
                dashed: true,
            })
        })
        .collect();
    if curves.is_empty() {
        bail!(
            "{}: no depth with a 1-row run (llama-bench -p 1,... -n 0 -d C)",
            path.display()
        );
    }
    Ok(curves)
}

/// The chart as SVG text: rows on a log2 axis (labelled at powers of two), cost / cost(1) on a linear one, the line y = 1 (a block
/// as cheap as a row) and y = rows (no cheaper than its rows one by one) for reference.
pub fn render_svg(title: &str, curves: &[Curve]) -> Result<String> {
    let err = |e: DrawingAreaErrorKind<std::io::Error>| anyhow!("cost chart: {e}");
    let max_rows = curves
        .iter()
        .flat_map(|c| c.points.iter().map(|&(r, _)| r))
        .max()
        .unwrap_or(1)
        .max(2);
    let y_max = curves
        .iter()
        .flat_map(|c| c.points.iter().map(|&(_, y)| y))
        .fold(1.0f64, f64::max)
        * 1.1;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 17))
            .margin(14)
            .x_label_area_size(40)
            .y_label_area_size(52)
            .build_cartesian_2d(0f64..(max_rows as f64).log2(), 0f64..y_max)
            .map_err(err)?;
        chart
            .configure_mesh()
            .light_line_style(WHITE)
            .x_desc("rows in the block")
            .y_desc("cost / cost of one row")
            // x is log2(rows): labelled at the powers of two.
            .x_labels(max_rows.ilog2() as usize + 1)
            .x_label_formatter(&|x| format!("{:.0}", x.exp2()))
            .y_label_formatter(&|y| format!("{y:.1}"))
            .draw()
            .map_err(err)?;
        let grey = BLACK.mix(0.35);
        let diagonal: Vec<(f64, f64)> = (0..=64)
            .map(|i| {
                let x = (max_rows as f64).log2() * i as f64 / 64.0;
                (x, x.exp2().min(y_max))
            })
            .collect();
        chart
            .draw_series(std::iter::once(PathElement::new(diagonal, grey.stroke_width(1))))
            .map_err(err)?
            .label("rows one by one")
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], grey.stroke_width(1)));
        chart
            .draw_series(std::iter::once(PathElement::new(
                vec![(0.0, 1.0), ((max_rows as f64).log2(), 1.0)],
                grey.stroke_width(1),
            )))
            .map_err(err)?;
        for (i, c) in curves.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let pts: Vec<(f64, f64)> = c.points.iter().map(|&(r, y)| ((r as f64).log2(), y)).collect();
            let style = color.stroke_width(2);
            let series = if c.dashed {
                chart.draw_series(DashedLineSeries::new(pts.clone(), 6, 4, style))
            } else {
                chart.draw_series(LineSeries::new(pts.clone(), style))
            };
            series
                .map_err(err)?
                .label(c.name.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], style));
            chart
                .draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))
                .map_err(err)?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK.mix(0.3))
            .draw()
            .map_err(err)?;
        root.present().map_err(err)?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(cache: usize, rows: usize, ratio: f64) -> (usize, usize, f64) {
        (cache, rows, ratio)
    }

    #[test]
    fn curves_group_by_cache_in_row_order() {
        let pts = [
            point(256, 4, 1.3),
            point(256, 1, 1.0),
            point(1024, 1, 1.0),
            point(1024, 4, 1.5),
        ];
        let cs = curves_of(pts, "probespec");
        assert_eq!(cs.len(), 2);
        assert_eq!(cs[0].name, "probespec, 256 cached");
        assert_eq!(cs[0].points, vec![(1, 1.0), (4, 1.3)]);
        assert_eq!(cs[1].points, vec![(1, 1.0), (4, 1.5)]);
    }

    #[test]
    fn peer_curves_are_ratios_to_the_one_row_run_of_each_depth() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("lb.json");
        std::fs::write(
            &f,
            r#"[{"n_prompt": 1, "n_depth": 256, "avg_ns": 2000000},
                {"n_prompt": 8, "n_depth": 256, "avg_ns": 5000000},
                {"n_prompt": 8, "n_depth": 0, "avg_ns": 4000000}]"#,
        )
        .unwrap();
        let cs = peer_curves(&f).unwrap();
        assert_eq!(cs.len(), 1, "depth 0 has no 1-row run");
        assert_eq!(cs[0].points, vec![(1, 1.0), (8, 2.5)]);
        assert!(cs[0].dashed);
        std::fs::write(&f, "not json").unwrap();
        let e = peer_curves(&f).err().unwrap().to_string();
        assert!(e.contains("llama-bench's JSON"), "{e}");
    }

    #[test]
    fn the_chart_names_every_curve() {
        let cs = curves_of([point(256, 1, 1.0), point(256, 8, 1.6)], "probespec");
        let svg = render_svg("SmolLM2", &cs).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("probespec, 256 cached"));
        assert!(svg.contains("rows in the block"));
    }
}
