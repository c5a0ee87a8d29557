//! Plots beside the report, as SVG files (plotters' SVG backend: no system
//! libraries, text left to the viewer's fonts): latency distributions as
//! CDFs on a log axis, one measure against another per run, events over
//! time, and a value per vCPU.

use plotters::coord::Shift;
use plotters::prelude::*;

/// A plot of a scenario: its file name (without `.svg`), its caption and
/// its SVG text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plot {
    /// The file's name without `.svg`: lowercase, digits and dashes.
    pub name: String,
    /// What it shows, under it in the report.
    pub caption: String,
    /// The drawing.
    pub svg: String,
}

/// A named set of values, one line or one colour of points.
pub type Series<T> = (String, Vec<T>);

const SIZE: (u32, u32) = (900, 520);

/// Tableau's twenty colours, the ten strong ones first, which stay apart
/// on screen and in grey; the light ones after them for the 11th series on.
const COLOURS: [RGBColor; 20] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
    RGBColor(174, 199, 232),
    RGBColor(255, 187, 120),
    RGBColor(152, 223, 138),
    RGBColor(255, 152, 150),
    RGBColor(197, 176, 213),
    RGBColor(196, 156, 148),
    RGBColor(247, 182, 210),
    RGBColor(199, 199, 199),
    RGBColor(219, 219, 141),
    RGBColor(158, 218, 229),
];

fn colour(i: usize) -> RGBColor {
    COLOURS[i % COLOURS.len()]
}

/// The axes of a plot: their descriptions, and whether each is
/// logarithmic.
#[derive(Clone, Copy, Debug)]
pub struct Axes<'a> {
    /// The x axis' description.
    pub x: &'a str,
    /// The y axis' description.
    pub y: &'a str,
    /// A log x axis.
    pub log_x: bool,
    /// A log y axis.
    pub log_y: bool,
}

impl<'a> Axes<'a> {
    /// Linear axes described `x` and `y`.
    pub fn linear(x: &'a str, y: &'a str) -> Self {
        Self {
            x,
            y,
            log_x: false,
            log_y: false,
        }
    }
}

/// Each series' distribution as a CDF (the share of values at or below
/// x), x on a log axis: values at or below `floor` are drawn at it.
pub fn cdf(name: &str, caption: &str, x: &str, series: &[Series<f64>]) -> Result<Plot, String> {
    let floor = 0.1;
    let curves: Vec<Series<(f64, f64)>> = series
        .iter()
        .filter(|(_, v)| !v.is_empty())
        .map(|(label, values)| {
            let mut sorted: Vec<f64> = values.iter().map(|v| v.max(floor)).collect();
            sorted.sort_by(f64::total_cmp);
            let n = sorted.len() as f64;
            let points = sorted
                .iter()
                .enumerate()
                .map(|(i, &v)| (v, (i + 1) as f64 / n))
                .collect();
            (label.clone(), points)
        })
        .collect();
    let x = format!("{x} (log; {floor} and below drawn at {floor})");
    let axes = Axes {
        log_x: true,
        ..Axes::linear(&x, "share of samples at or below")
    };
    draw(name, caption, axes, &curves, Mark::Line)
}

/// One point per (x, y) of each series.
pub fn points(
    name: &str,
    caption: &str,
    axes: Axes,
    series: &[Series<(f64, f64)>],
) -> Result<Plot, String> {
    draw(name, caption, axes, series, Mark::Point)
}

/// Bars: each series' values side by side at x = 0, 1, 2... (a value per
/// vCPU, say).
pub fn bars(name: &str, caption: &str, axes: Axes, series: &[Series<f64>]) -> Result<Plot, String> {
    let indexed: Vec<Series<(f64, f64)>> = series
        .iter()
        .map(|(label, v)| {
            (
                label.clone(),
                (0..).map(f64::from).zip(v.iter().copied()).collect(),
            )
        })
        .collect();
    draw(name, caption, axes, &indexed, Mark::Bar(series.len()))
}

#[derive(Clone, Copy)]
enum Mark {
    Line,
    Point,
    /// Bars, this many series to a slot.
    Bar(usize),
}

fn draw(
    name: &str,
    caption: &str,
    axes: Axes,
    series: &[Series<(f64, f64)>],
    mark: Mark,
) -> Result<Plot, String> {
    let all: Vec<(f64, f64)> = series
        .iter()
        .flat_map(|(_, p)| p.iter().copied())
        .filter(|(x, y)| x.is_finite() && y.is_finite())
        .collect();
    if all.is_empty() {
        return Err(format!("{name}: nothing to plot"));
    }
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let x = match mark {
            // A slot a unit wide around each index.
            Mark::Bar(_) => span_slots(all.iter().map(|p| p.0)),
            _ => span(all.iter().map(|p| p.0), axes.log_x, false),
        };
        let y = span(all.iter().map(|p| p.1), axes.log_y, true);
        match (axes.log_x, axes.log_y) {
            (false, false) => chart(&root, caption, axes, x, y, series, mark),
            (true, false) => chart(&root, caption, axes, x.log_scale(), y, series, mark),
            (false, true) => chart(&root, caption, axes, x, y.log_scale(), series, mark),
            (true, true) => chart(
                &root,
                caption,
                axes,
                x.log_scale(),
                y.log_scale(),
                series,
                mark,
            ),
        }
        .map_err(|e| format!("{name}: {e}"))?;
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(Plot {
        name: name.to_owned(),
        caption: caption.to_owned(),
        svg,
    })
}

/// The range the values take, with a margin: from 0 for a linear axis
/// (with `from_zero`), a decade's fifth beyond each end on a log one.
fn span(values: impl Iterator<Item = f64>, log: bool, from_zero: bool) -> std::ops::Range<f64> {
    let (lo, hi) = values
        .filter(|v| !log || *v > 0.0)
        .fold((f64::MAX, f64::MIN), |(lo, hi), v| (lo.min(v), hi.max(v)));
    let (lo, hi) = if lo > hi { (1.0, 1.0) } else { (lo, hi) };
    match log {
        true => lo / 1.6..hi * 1.6,
        false if from_zero => lo.min(0.0)..hi.max(lo + 1e-9) * 1.08 + 1e-9,
        false => {
            let pad = ((hi - lo) * 0.05).max(1e-9);
            lo - pad..hi + pad
        }
    }
}

/// From half a slot before the first index to half a slot after the last.
fn span_slots(indices: impl Iterator<Item = f64>) -> std::ops::Range<f64> {
    let last = indices.fold(0.0, f64::max);
    -0.5..last + 0.5
}

fn chart<X, Y>(
    root: &DrawingArea<SVGBackend, Shift>,
    caption: &str,
    axes: Axes,
    x: X,
    y: Y,
    series: &[Series<(f64, f64)>],
    mark: Mark,
) -> Result<(), String>
where
    X: plotters::coord::ranged1d::AsRangedCoord<Value = f64>,
    Y: plotters::coord::ranged1d::AsRangedCoord<Value = f64>,
    X::CoordDescType: plotters::coord::ranged1d::ValueFormatter<f64>,
    Y::CoordDescType: plotters::coord::ranged1d::ValueFormatter<f64>,
{
    let mut chart = ChartBuilder::on(root)
        .caption(caption, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(x, y)
        .map_err(text)?;
    let whole = |x: &f64| match (x - x.round()).abs() < 1e-6 {
        true => format!("{x:.0}"),
        false => String::new(),
    };
    let mut mesh = chart.configure_mesh();
    mesh.x_desc(axes.x)
        .y_desc(axes.y)
        .light_line_style(WHITE.mix(0.0));
    if let Mark::Bar(_) = mark {
        // A label at each index, none between.
        mesh.x_labels(40).x_label_formatter(&whole).disable_x_mesh();
    }
    mesh.draw().map_err(text)?;
    for (i, (label, points)) in series.iter().enumerate() {
        let c = colour(i);
        let drawn = match mark {
            Mark::Line => chart
                .draw_series(LineSeries::new(points.clone(), c.stroke_width(2)))
                .map_err(text)?,
            Mark::Point => chart
                .draw_series(points.iter().map(|&p| Circle::new(p, 4, c.filled())))
                .map_err(text)?,
            Mark::Bar(n) => {
                let width = 0.8 / n as f64;
                let left = |x: f64| x - 0.4 + width * i as f64;
                chart
                    .draw_series(points.iter().map(|&(x, y)| {
                        Rectangle::new([(left(x), 0.0), (left(x) + width, y)], c.filled())
                    }))
                    .map_err(text)?
            }
        };
        drawn
            .label(label.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 16, y + 5)], c.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.4))
        .label_font(("sans-serif", 13))
        .draw()
        .map_err(text)?;
    Ok(())
}

fn text(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// A plot's file name from words: lowercase, digits, dashes (µ as u).
pub fn file_name(words: &str) -> String {
    let mut name = String::new();
    for c in words.chars() {
        match c {
            'µ' => name.push('u'),
            c if c.is_ascii_alphanumeric() => name.push(c.to_ascii_lowercase()),
            _ if !name.ends_with('-') && !name.is_empty() => name.push('-'),
            _ => {}
        }
    }
    name.trim_end_matches('-').to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cdf_draws_each_series_with_its_label_and_the_caption() {
        let series = vec![
            ("none".to_owned(), vec![-1.0, 2.0, 3.0, 40.0]),
            ("kvm".to_owned(), vec![1.0, 1.5]),
            ("empty".to_owned(), vec![]),
        ];
        let plot = cdf("timer-1000", "Timer lateness", "µs late", &series).unwrap();
        assert!(plot.svg.starts_with("<svg"), "{}", &plot.svg[..40]);
        for text in ["Timer lateness", "none", "kvm", "µs late"] {
            assert!(plot.svg.contains(text), "{text}");
        }
        assert!(
            !plot.svg.contains(">empty<"),
            "an empty series has no legend"
        );
        // A line in each series' colour (and its legend key).
        for colour in ["#1F77B4", "#FF7F0E"] {
            let line = format!("<polyline fill=\"none\" opacity=\"1\" stroke=\"{colour}\"");
            assert_eq!(plot.svg.matches(&line).count(), 1, "{colour}: {}", plot.svg);
        }
    }

    #[test]
    fn bars_put_a_rectangle_per_value_and_nothing_is_an_error() {
        let axes = Axes::linear("vCPU", "ms");
        let series = vec![
            ("a".to_owned(), vec![1.0, 2.0]),
            ("b".to_owned(), vec![3.0, 0.0]),
        ];
        let plot = bars("pauses", "Pauses", axes, &series).unwrap();
        // 4 bars, 2 legend keys, the background and the legend's box.
        assert!(plot.svg.matches("<rect").count() >= 6, "{}", plot.svg);
        let none: Vec<Series<f64>> = vec![("a".to_owned(), vec![])];
        assert!(bars("x", "x", axes, &none).is_err());
        let log = Axes {
            log_y: true,
            ..axes
        };
        let nan = vec![("a".to_owned(), vec![(1.0, f64::NAN), (2.0, 5.0)])];
        assert!(points("p", "p", log, &nan).is_ok());
    }

    #[test]
    fn file_names_are_lowercase_words_and_dashes() {
        assert_eq!(file_name("Timer, 1000 µs period"), "timer-1000-us-period");
        assert_eq!(file_name("--ring + limit--"), "ring-limit");
    }
}
