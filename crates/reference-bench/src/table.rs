//! Results as tables: Markdown for people, JSON for tools.

use std::fmt::Write;

use serde_json::{Value, json};

use crate::Runs;
use crate::plot::Plot;

/// One cell: its text, and its number for JSON where it has one.
#[derive(Clone, Debug, PartialEq)]
pub struct Cell {
    /// As printed.
    pub text: String,
    /// As a number.
    pub value: Option<f64>,
    /// The smallest and largest of the runs it is the median of, where it
    /// is one: a later report's figure moved if its runs and these do not
    /// overlap ([`crate::compare`]).
    pub spread: Option<(f64, f64)>,
}

impl Cell {
    /// A text cell.
    pub fn text(text: impl Into<String>) -> Self {
        Self {
            text: text.into(),
            value: None,
            spread: None,
        }
    }

    /// A number printed with `decimals` decimals.
    pub fn num(value: f64, decimals: usize) -> Self {
        Self {
            text: format!("{value:.decimals$}"),
            value: Some(value),
            spread: None,
        }
    }

    /// The median of `runs` printed with `decimals` decimals, keeping their
    /// spread.
    pub fn runs(runs: &Runs, decimals: usize) -> Self {
        Self {
            spread: Some(runs.range()).filter(|(lo, hi)| lo.is_finite() && hi.is_finite()),
            ..Self::num(runs.median(), decimals)
        }
    }

    /// A ratio over runs, printed as its median and spread, `1.23x
    /// (1.10-1.31x)`; its number is the median.
    pub fn ratio(runs: &Runs) -> Self {
        if runs.median().is_nan() {
            // Its baseline did not run (`--only`).
            return Self::text("-");
        }
        Self {
            text: runs.ratio_text(),
            value: Some(runs.median()),
            spread: Some(runs.range()).filter(|(lo, hi)| lo.is_finite() && hi.is_finite()),
        }
    }
}

/// How wide the report's prose runs.
pub const WIDTH: usize = 100;

/// `text` wrapped at [`WIDTH`] columns, between words (a word longer than
/// that stays whole), paragraph by paragraph: Markdown joins the lines
/// again.
pub fn wrap(text: &str) -> String {
    let paragraphs: Vec<String> = text.split("\n\n").map(wrap_paragraph).collect();
    paragraphs.join("\n\n")
}

fn wrap_paragraph(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut column = 0;
    for word in text.split([' ', '\n']).filter(|w| !w.is_empty()) {
        let len = word.chars().count();
        if column > 0 && column + 1 + len > WIDTH {
            out.push('\n');
            column = 0;
        } else if column > 0 {
            out.push(' ');
            column += 1;
        }
        out.push_str(word);
        column += len;
    }
    out
}

/// The key of a JSON row's spreads: column, then `[min, max]` of the runs.
pub const SPREAD: &str = "spread (min, max over runs)";

/// A scenario's table.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Table {
    /// What it measures.
    pub title: String,
    /// Column headings.
    pub columns: Vec<String>,
    /// Rows of cells, one per column.
    pub rows: Vec<Vec<Cell>>,
    /// Lines under the table: the setup, the goal and how it went.
    pub notes: Vec<String>,
    /// Of the notes, the goals against a peer VMM (the report's summary
    /// gathers every goal).
    pub peer_goals: Vec<String>,
    /// Its plots, written beside the report ([`crate::plot`]).
    pub plots: Vec<Plot>,
}

impl Table {
    /// An empty table titled `title` with `columns`.
    pub fn new(title: impl Into<String>, columns: &[&str]) -> Self {
        Self {
            title: title.into(),
            columns: columns.iter().map(|c| c.to_string()).collect(),
            ..Self::default()
        }
    }

    /// Adds a row.
    pub fn row(&mut self, cells: Vec<Cell>) {
        self.rows.push(cells);
    }

    /// Adds the note that says which way `what` is better, and how the
    /// figures over several runs are summed up.
    pub fn better(&mut self, what: &str) {
        self.note(format!(
            "Better: {what}. Values are medians over the runs; each ratio is the median of \
             per-run ratios to the baseline measured next to it, with their min-max."
        ));
    }

    /// Adds a note.
    pub fn note(&mut self, note: impl Into<String>) {
        self.notes.push(note.into());
    }

    /// Adds a plot, or a note saying why it could not be drawn.
    pub fn plot(&mut self, plot: Result<Plot, String>) {
        match plot {
            Ok(plot) => self.plots.push(plot),
            Err(e) => self.note(format!("No plot: {e}.")),
        }
    }

    /// Its plots as Markdown images, their files in `dir` (relative to
    /// the report).
    pub fn plot_links(&self, dir: &str) -> String {
        self.plots
            .iter()
            .map(|p| format!("![{}]({dir}/{}.svg)\n\n", p.caption, p.name))
            .collect()
    }

    /// Adds a note that is a goal against a peer VMM.
    pub fn peer_goal(&mut self, goal: impl Into<String>) {
        let goal = goal.into();
        self.peer_goals.push(goal.clone());
        self.notes.push(goal);
    }

    /// The scenario's name: its title up to the first colon.
    pub fn scenario(&self) -> &str {
        self.title.split(':').next().unwrap_or_default()
    }

    /// The table in Markdown, under a `###` heading.
    pub fn markdown(&self) -> String {
        let mut out = format!("### {}\n\n| {} |\n|", self.title, self.columns.join(" | "));
        out.push_str(&"---|".repeat(self.columns.len()));
        for row in &self.rows {
            let cells: Vec<&str> = row.iter().map(|c| c.text.as_str()).collect();
            let _ = write!(out, "\n| {} |", cells.join(" | "));
        }
        out.push('\n');
        for note in &self.notes {
            let _ = write!(out, "\n{}\n", wrap(note));
        }
        out
    }

    /// The table as a JSON object: title, columns, rows (each an object
    /// from column name to the cell's number, or its text where it has
    /// none), notes.
    pub fn json(&self) -> Value {
        let rows: Vec<Value> = self
            .rows
            .iter()
            .map(|row| {
                let cells = self.columns.iter().zip(row).map(|(column, c)| {
                    let value = match c.value.and_then(serde_json::Number::from_f64) {
                        Some(n) => Value::Number(n),
                        None => Value::String(c.text.clone()),
                    };
                    (column.clone(), value)
                });
                let mut object: serde_json::Map<String, Value> = cells.collect();
                let spreads: serde_json::Map<String, Value> = self
                    .columns
                    .iter()
                    .zip(row)
                    .filter_map(|(column, c)| Some((column.clone(), json!(c.spread?))))
                    .collect();
                if !spreads.is_empty() {
                    object.insert(SPREAD.into(), Value::Object(spreads));
                }
                Value::Object(object)
            })
            .collect();
        json!({
            "title": self.title,
            "columns": self.columns,
            "rows": rows,
            "notes": self.notes,
            "peer_goals": self.peer_goals,
            "plots": self.plots.iter().map(|p| format!("{}.svg", p.name)).collect::<Vec<_>>(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prose_wraps_between_words_and_keeps_long_words_whole() {
        let long = "word ".repeat(60);
        let wrapped = wrap(&long);
        assert!(
            wrapped.lines().all(|l| l.chars().count() <= WIDTH),
            "{wrapped}"
        );
        assert_eq!(wrapped.replace('\n', " "), long.trim_end());
        assert_eq!(wrap("a\nb\n\nc"), "a b\n\nc", "paragraph by paragraph");
        let url = "x".repeat(150);
        assert_eq!(wrap(&format!("see {url} now")), format!("see\n{url}\nnow"));
    }

    #[test]
    fn renders_markdown_and_json() {
        let mut t = Table::new("halt \"x\"", &["variant", "µs"]);
        t.row(vec![Cell::text("own"), Cell::num(1.234, 1)]);
        t.row(vec![Cell::text("off"), Cell::ratio(&Runs(vec![2.0]))]);
        t.note("goal: met");
        let md = t.markdown();
        assert!(
            md.contains("| variant | µs |\n|---|---|\n| own | 1.2 |\n| off | 2.00x |"),
            "{md}"
        );
        assert!(md.ends_with("\ngoal: met\n"));
        let json = t.json();
        assert_eq!(json["title"], "halt \"x\"");
        assert_eq!(json["columns"], json!(["variant", "µs"]));
        assert_eq!(json["rows"][0], json!({"variant": "own", "µs": 1.234}));
        let spread = json!({"µs": [2.0, 2.0]});
        assert_eq!(
            json["rows"][1],
            json!({"variant": "off", "µs": 2.0, SPREAD: spread})
        );
        // A ratio whose baseline did not run has no figure.
        assert_eq!(Cell::ratio(&Runs(vec![])).text, "-");
        assert_eq!(json["notes"], json!(["goal: met"]));
        t.peer_goal("Goal: against a peer: met.");
        assert_eq!(
            t.json()["peer_goals"],
            json!(["Goal: against a peer: met."])
        );
        assert!(t.markdown().ends_with("\nGoal: against a peer: met.\n"));
        assert_eq!(t.scenario(), "halt \"x\"");
        // Text where a number is not finite.
        t.row(vec![Cell::text("none"), Cell::num(f64::NAN, 1)]);
        assert_eq!(t.json()["rows"][2]["µs"], "NaN");
    }
}
