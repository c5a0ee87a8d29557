//! Results as tables: Markdown for people, JSON for tools.

use std::fmt::Write;

use crate::Runs;

/// One cell: its text, and its number for JSON where it has one.
#[derive(Clone, Debug, PartialEq)]
pub struct Cell {
    /// As printed.
    pub text: String,
    /// As a number.
    pub value: Option<f64>,
}

impl Cell {
    /// A text cell.
    pub fn text(text: impl Into<String>) -> Self {
        Self {
            text: text.into(),
            value: None,
        }
    }

    /// A number printed with `decimals` decimals.
    pub fn num(value: f64, decimals: usize) -> Self {
        Self {
            text: format!("{value:.decimals$}"),
            value: Some(value),
        }
    }

    /// A ratio over runs, printed as its median and spread, `1.23x
    /// (1.10-1.31x)`; its number is the median.
    pub fn ratio(runs: &Runs) -> Self {
        Self {
            text: runs.ratio_text(),
            value: Some(runs.median()),
        }
    }
}

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
            let _ = write!(out, "\n{note}\n");
        }
        out
    }

    /// The table as a JSON object: title, columns, rows (each an object
    /// keyed by column, with numbers where a cell has one), notes.
    pub fn json(&self) -> String {
        let strings = |v: &[String]| v.iter().map(|s| quote(s)).collect::<Vec<_>>().join(", ");
        let rows: Vec<String> = self
            .rows
            .iter()
            .map(|row| {
                let fields: Vec<String> = self
                    .columns
                    .iter()
                    .zip(row)
                    .map(|(column, c)| match c.value {
                        Some(v) if v.is_finite() => format!("{}: {v}", quote(column)),
                        _ => format!("{}: {}", quote(column), quote(&c.text)),
                    })
                    .collect();
                format!("{{{}}}", fields.join(", "))
            })
            .collect();
        format!(
            "{{\"title\": {}, \"columns\": [{}], \"rows\": [{}], \"notes\": [{}]}}",
            quote(&self.title),
            strings(&self.columns),
            rows.join(", "),
            strings(&self.notes)
        )
    }
}

/// A JSON string literal.
fn quote(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(
            t.json(),
            r#"{"title": "halt \"x\"", "columns": ["variant", "µs"], "rows": [{"variant": "own", "µs": 1.234}, {"variant": "off", "µs": 2}], "notes": ["goal: met"]}"#
        );
    }
}
