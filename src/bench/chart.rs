//! `chart.svg`: grouped bar charts of tau and of speedup over `ar`, one bar per configuration in each
//! group (and overall), drawn with plotters' SVG backend.
//!
//! Plotters places axis labels at "nice" numbers of its own choosing, so the group names are drawn as
//! text under the centre of each group, from the chart's own coordinate mapping.

use super::questions::group_title;
use super::report::{GroupStats, Report};
use anyhow::{anyhow, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

const WIDTH: u32 = 1100;
const PANEL_HEIGHT: u32 = 380;
/// The legend gets a column of its own, so it never covers the bars.
const LEGEND_WIDTH: u32 = 170;

/// Renders the chart to SVG text.
pub fn render_svg(report: &Report) -> Result<String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, 2 * PANEL_HEIGHT)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| anyhow!("chart: {e}"))?;
        let (plots, legend_area) = root.split_horizontally(WIDTH - LEGEND_WIDTH);
        legend(&legend_area, report)?;
        let (top, bottom) = plots.split_vertically(PANEL_HEIGHT);
        panel(
            &top,
            report,
            "tau (#MAT): tokens committed per model call",
            None,
            |s| s.tau,
        )?;
        let baseline = report.reference.as_ref().map(|_| 1.0);
        let title = match &report.reference {
            Some(_) => "speedup over ar (mean tokens/s per question)",
            None => "speedup: no ar records",
        };
        panel(&bottom, report, title, baseline, |s| s.speedup)?;
        root.present().map_err(|e| anyhow!("chart: {e}"))?;
    }
    Ok(svg)
}

/// One panel: bars of `value` per group and configuration, an optional dashed baseline.
fn panel(
    area: &DrawingArea<SVGBackend, Shift>,
    report: &Report,
    title: &str,
    baseline: Option<f64>,
    value: impl Fn(&GroupStats) -> Option<f64>,
) -> Result<()> {
    let err = |e: DrawingAreaErrorKind<std::io::Error>| anyhow!("chart: {e}");
    let groups = report.groups.len().max(1);
    let configs = report.configs.len().max(1);
    let cell = |c: usize, g: &str| {
        report
            .configs
            .get(c)
            .and_then(|cs| cs.groups.get(g))
            .and_then(&value)
    };
    let top = report
        .groups
        .iter()
        .flat_map(|g| (0..report.configs.len()).filter_map(move |c| cell(c, g)))
        .fold(baseline.unwrap_or(0.0), f64::max);
    let y_max = if top > 0.0 { top * 1.18 } else { 1.0 };

    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(34)
        .y_label_area_size(48)
        .build_cartesian_2d(0f64..groups as f64, 0f64..y_max)
        .map_err(err)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .x_label_formatter(&|_| String::new())
        .y_labels(6)
        .y_label_formatter(&|y| format!("{y:.1}"))
        .draw()
        .map_err(err)?;

    // Bars fill 80% of a group's width, side by side in configuration order.
    let bar = 0.8 / configs as f64;
    let label_values = groups * configs <= 60;
    for c in 0..report.configs.len() {
        let color = Palette99::pick(c).to_rgba();
        let bars: Vec<(f64, f64)> = report
            .groups
            .iter()
            .enumerate()
            .filter_map(|(g, name)| cell(c, name).map(|v| (g as f64 + 0.1 + c as f64 * bar, v)))
            .collect();
        chart
            .draw_series(
                bars.iter()
                    .map(|&(x, v)| Rectangle::new([(x, 0.0), (x + bar * 0.92, v)], color.filled())),
            )
            .map_err(err)?;
        if label_values {
            let style =
                TextStyle::from(("sans-serif", 10).into_font()).pos(Pos::new(HPos::Center, VPos::Bottom));
            chart
                .draw_series(bars.iter().map(|&(x, v)| {
                    EmptyElement::at((x + bar * 0.46, v))
                        + Text::new(format!("{v:.2}"), (0, -2), style.clone())
                }))
                .map_err(err)?;
        }
    }
    if let Some(b) = baseline {
        chart
            .draw_series(std::iter::once(PathElement::new(
                vec![(0.0, b), (groups as f64, b)],
                BLACK.mix(0.6).stroke_width(1),
            )))
            .map_err(err)?;
    }

    // Group names under the centre of each group, in the panel's pixel space.
    let base = area.get_base_pixel();
    let style = TextStyle::from(("sans-serif", 13).into_font()).pos(Pos::new(HPos::Center, VPos::Top));
    for (g, name) in report.groups.iter().enumerate() {
        let (x, y) = chart.backend_coord(&(g as f64 + 0.5, 0.0));
        area.draw(&Text::new(
            short_title(name),
            (x - base.0, y - base.1 + 8),
            style.clone(),
        ))
        .map_err(err)?;
    }
    Ok(())
}

/// Group names short enough for seven groups side by side.
fn short_title(group: &str) -> String {
    match group {
        "mt_bench" => "MT-bench".into(),
        "qa" => "QA".into(),
        "math_reasoning" => "Math".into(),
        "rag" => "RAG".into(),
        g => group_title(g),
    }
}

/// A colour swatch and the name of each configuration, top to bottom.
fn legend(area: &DrawingArea<SVGBackend, Shift>, report: &Report) -> Result<()> {
    let err = |e: DrawingAreaErrorKind<std::io::Error>| anyhow!("chart: {e}");
    let style = TextStyle::from(("sans-serif", 13).into_font()).pos(Pos::new(HPos::Left, VPos::Center));
    for (c, cs) in report.configs.iter().enumerate() {
        let y = 60 + 22 * c as i32;
        area.draw(&Rectangle::new(
            [(8, y - 7), (22, y + 7)],
            Palette99::pick(c).to_rgba().filled(),
        ))
        .map_err(err)?;
        area.draw(&Text::new(cs.config.clone(), (30, y), style.clone()))
            .map_err(err)?;
    }
    Ok(())
}
