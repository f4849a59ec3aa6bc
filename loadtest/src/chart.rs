//! Charts as SVG text: no drawing library, just lines, bars and labels.

use std::fmt::Write as _;

use crate::report::Report;

/// A line of a chart.
#[derive(Debug, Clone)]
pub struct Series {
    /// Legend.
    pub name: String,
    /// Points (x, y).
    pub points: Vec<(f64, f64)>,
    /// Stroke colour.
    pub color: &'static str,
    /// Drawn dashed.
    pub dashed: bool,
}

/// Colours, in the order series take them.
pub const COLORS: [&str; 6] = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#555555"];

/// A panel: where a plot sits in the SVG.
#[derive(Debug, Clone, Copy)]
struct Panel {
    x: f64,
    y: f64,
    w: f64,
    h: f64,
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

fn nice_max(v: f64) -> f64 {
    if v <= 0.0 {
        return 1.0;
    }
    let p = 10f64.powf(v.log10().floor());
    for m in [1.0, 2.0, 2.5, 5.0, 10.0] {
        if m * p >= v {
            return m * p;
        }
    }
    10.0 * p
}

fn fmt_num(v: f64) -> String {
    if v.abs() >= 10_000.0 {
        format!("{:.0}k", v / 1000.0)
    } else if v.abs() >= 100.0 || v == v.trunc() {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

/// Draws `series` in panel `p` with axes and a legend.
fn plot(out: &mut String, p: Panel, title: &str, xl: &str, yl: &str, series: &[Series]) {
    let pts = series.iter().flat_map(|s| s.points.iter());
    let (mut x0, mut x1, mut y1) = (f64::MAX, f64::MIN, 0f64);
    for &(x, y) in pts {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y1 = y1.max(y);
    }
    if x0 > x1 {
        (x0, x1) = (0.0, 1.0);
    }
    if (x1 - x0).abs() < 1e-12 {
        x1 = x0 + 1.0;
    }
    let y1 = nice_max(y1 * 1.05);
    let (l, t, w, h) = (p.x + 60.0, p.y + 30.0, p.w - 80.0, p.h - 80.0);
    let sx = |x: f64| l + (x - x0) / (x1 - x0) * w;
    let sy = |y: f64| t + h - y / y1 * h;
    let _ = writeln!(
        out,
        r#"<text x="{}" y="{}" font-size="14" font-weight="bold">{}</text>"#,
        p.x + 10.0,
        p.y + 18.0,
        esc(title)
    );
    let _ = writeln!(
        out,
        r##"<rect x="{l}" y="{t}" width="{w}" height="{h}" fill="none" stroke="#999"/>"##
    );
    for i in 0..=4 {
        let v = y1 * f64::from(i) / 4.0;
        let y = sy(v);
        let _ = writeln!(
            out,
            r##"<line x1="{l}" y1="{y}" x2="{}" y2="{y}" stroke="#eee"/><text x="{}" y="{}" font-size="10" text-anchor="end">{}</text>"##,
            l + w,
            l - 4.0,
            y + 3.0,
            fmt_num(v)
        );
        let xv = x0 + (x1 - x0) * f64::from(i) / 4.0;
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{}" font-size="10" text-anchor="middle">{}</text>"#,
            sx(xv),
            t + h + 14.0,
            fmt_num(xv)
        );
    }
    let _ = writeln!(
        out,
        r#"<text x="{}" y="{}" font-size="11" text-anchor="middle">{}</text>"#,
        l + w / 2.0,
        t + h + 30.0,
        esc(xl)
    );
    let _ = writeln!(
        out,
        r#"<text x="{}" y="{}" font-size="11" transform="rotate(-90 {} {})" text-anchor="middle">{}</text>"#,
        p.x + 14.0,
        t + h / 2.0,
        p.x + 14.0,
        t + h / 2.0,
        esc(yl)
    );
    for (i, s) in series.iter().enumerate() {
        let d: Vec<String> =
            s.points.iter().map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y))).collect();
        let dash = if s.dashed { r#" stroke-dasharray="6 4""# } else { "" };
        let _ = writeln!(
            out,
            r#"<polyline points="{}" fill="none" stroke="{}" stroke-width="2"{dash}/>"#,
            d.join(" "),
            s.color
        );
        if s.points.len() <= 12 {
            for &(x, y) in &s.points {
                let _ = writeln!(
                    out,
                    r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{}"/>"#,
                    sx(x),
                    sy(y),
                    s.color
                );
            }
        }
        let ly = t + 14.0 + 14.0 * i as f64;
        let _ = writeln!(
            out,
            r#"<line x1="{}" y1="{ly}" x2="{}" y2="{ly}" stroke="{}" stroke-width="2"{dash}/><text x="{}" y="{}" font-size="11">{}</text>"#,
            l + 8.0,
            l + 28.0,
            s.color,
            l + 32.0,
            ly + 4.0,
            esc(&s.name)
        );
    }
}

fn svg(w: f64, h: f64, body: &str) -> String {
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\" font-family=\"sans-serif\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n{body}</svg>\n"
    )
}

/// A single line chart.
pub fn lines(title: &str, x_label: &str, y_label: &str, series: &[Series]) -> String {
    let mut b = String::new();
    plot(&mut b, Panel { x: 0.0, y: 0.0, w: 640.0, h: 360.0 }, title, x_label, y_label, series);
    svg(640.0, 360.0, &b)
}

/// Two line charts side by side.
pub fn pair(left: (&str, &str, &str, &[Series]), right: (&str, &str, &str, &[Series])) -> String {
    let mut b = String::new();
    plot(&mut b, Panel { x: 0.0, y: 0.0, w: 560.0, h: 360.0 }, left.0, left.1, left.2, left.3);
    plot(
        &mut b,
        Panel { x: 560.0, y: 0.0, w: 560.0, h: 360.0 },
        right.0,
        right.1,
        right.2,
        right.3,
    );
    svg(1120.0, 360.0, &b)
}

/// The chart of a run: admitted units per second against the exact model's allowance
/// (the limit) and the offered load; and the latency percentiles.
#[allow(clippy::cast_precision_loss)]
pub fn run_chart(r: &Report) -> String {
    let per = |f: fn(&crate::report::Second) -> u64| -> Vec<(f64, f64)> {
        r.per_second.iter().map(|s| (s.t as f64, f(s) as f64)).collect()
    };
    let rates = [
        Series {
            name: "offered requests/s".into(),
            points: per(|s| s.offered),
            color: COLORS[5],
            dashed: true,
        },
        Series {
            name: "admitted units/s".into(),
            points: per(|s| s.admitted_units),
            color: COLORS[0],
            dashed: false,
        },
        Series {
            name: "allowance (exact model)".into(),
            points: per(|s| s.ideal_units),
            color: COLORS[1],
            dashed: true,
        },
    ];
    let l = &r.latency;
    let q = [(50.0, l.p50), (90.0, l.p90), (99.0, l.p99), (99.9, l.p999)];
    let lat = [Series {
        name: format!("max {:.0} µs", l.max),
        points: q.iter().map(|&(p, v)| (p, v)).collect(),
        color: COLORS[3],
        dashed: false,
    }];
    pair(
        (&format!("{}: admitted against the limit", r.scenario), "seconds", "per second", &rates),
        ("latency percentiles", "percentile", "µs", &lat),
    )
}
