//! This run against an earlier one: each figure of both that has the
//! spread of its runs ([`Cell::spread`](crate::Cell)) moved if the runs of
//! one lie wholly above or below the other's, criterion's "regressed" and
//! "improved" without saying which is better (the table's header does).
//!
//! The earlier run is read from the JSON the bench writes beside each
//! Markdown report (`all.json` beside `all.md`), or from `--baseline`.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::Table;
use crate::table::SPREAD;

/// An earlier run's tables, as JSON.
#[derive(Clone, Debug)]
pub struct Baseline {
    path: PathBuf,
    tables: Vec<Value>,
}

/// A figure that moved: where, and its median and spread in each run.
#[derive(Clone, Debug, PartialEq)]
pub struct Moved {
    /// The scenario, the row's names and the column.
    pub what: String,
    /// The earlier median and spread.
    pub before: (f64, (f64, f64)),
    /// This run's.
    pub now: (f64, (f64, f64)),
}

impl Baseline {
    /// Reads the tables of an earlier run (the bench's JSON: a report
    /// written with `--json`, or the one beside a Markdown report).
    pub fn load(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let tables = match serde_json::from_str(&text) {
            Ok(Value::Array(tables)) => tables,
            Ok(_) => return Err(format!("{}: not a list of tables", path.display())),
            Err(e) => return Err(format!("{}: not the bench's JSON: {e}", path.display())),
        };
        Ok(Self {
            path: path.to_owned(),
            tables,
        })
    }

    /// The figures of `tables` that moved since this run, and how many
    /// were compared.
    pub fn moved(&self, tables: &[Table]) -> (Vec<Moved>, usize) {
        let mut moved = Vec::new();
        let mut compared = 0;
        for t in tables {
            let Some(old) = self.tables.iter().find(|o| o["title"] == t.title.as_str()) else {
                continue;
            };
            let old_rows = old["rows"].as_array().map_or(&[][..], Vec::as_slice);
            for row in &t.rows {
                let key = row_key(t, row);
                let Some(old_row) = old_rows.iter().find(|r| json_key(t, r) == key) else {
                    continue;
                };
                for (column, cell) in t.columns.iter().zip(row) {
                    let (Some(value), Some(spread)) = (cell.value, cell.spread) else {
                        continue;
                    };
                    let Some(before) = old_figure(old_row, column) else {
                        continue;
                    };
                    compared += 1;
                    if spread.0 > before.1.1 || spread.1 < before.1.0 {
                        let scenario = t.title.split(':').next().unwrap_or_default();
                        moved.push(Moved {
                            what: format!("{scenario}, {key}: {column}"),
                            before,
                            now: (value, spread),
                        });
                    }
                }
            }
        }
        (moved, compared)
    }

    /// The report's section on what moved since this run.
    pub fn section(&self, tables: &[Table]) -> String {
        let (moved, compared) = self.moved(tables);
        let mut out = format!("## Against {}\n\n", self.path.display());
        if compared == 0 {
            out += "No figure of this run is in it with its spread: nothing compared.\n\n";
            return out;
        }
        out += &format!(
            "{compared} figures compared; {} moved beyond the spread of both runs (this run's \
             runs all above or all below the earlier ones).\n\n",
            moved.len()
        );
        for m in &moved {
            let arrow = if m.now.0 > m.before.0 { "up" } else { "down" };
            out += &format!(
                "- {}: {} ({}–{}) → {} ({}–{}), {arrow}\n",
                m.what,
                short(m.before.0),
                short(m.before.1.0),
                short(m.before.1.1),
                short(m.now.0),
                short(m.now.1.0),
                short(m.now.1.1)
            );
        }
        out + "\n"
    }
}

/// A row's names: its cells without a number, joined.
fn row_key(t: &Table, row: &[crate::Cell]) -> String {
    let names: Vec<&str> = t
        .columns
        .iter()
        .zip(row)
        .filter(|(_, c)| c.value.is_none())
        .map(|(_, c)| c.text.as_str())
        .collect();
    names.join(" / ")
}

/// A JSON row's names, as [`row_key`] makes them.
fn json_key(t: &Table, row: &Value) -> String {
    let names: Vec<&str> = t
        .columns
        .iter()
        .filter_map(|c| row[c.as_str()].as_str())
        .collect();
    names.join(" / ")
}

/// A JSON row's median and spread in `column`, if it has both.
fn old_figure(row: &Value, column: &str) -> Option<(f64, (f64, f64))> {
    let value = row[column].as_f64()?;
    let spread = row[SPREAD][column].as_array()?;
    Some((value, (spread.first()?.as_f64()?, spread.get(1)?.as_f64()?)))
}

/// Three significant digits.
fn short(v: f64) -> String {
    let digits = if v.abs() >= 100.0 {
        0
    } else if v.abs() >= 10.0 {
        1
    } else {
        2
    };
    format!("{v:.digits$}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Cell, Runs};

    fn table(latency: &[f64]) -> Table {
        let mut t = Table::new("halt: x", &["variant", "latency (µs)", "note"]);
        t.row(vec![
            Cell::text("kvm"),
            Cell::runs(&Runs(latency.to_vec()), 1),
            Cell::num(3.0, 0),
        ]);
        t.row(vec![
            Cell::text("off"),
            Cell::runs(&Runs(vec![5.0, 6.0]), 1),
            Cell::num(1.0, 0),
        ]);
        t
    }

    fn baseline(t: &Table) -> Baseline {
        let path = std::env::temp_dir().join(format!("compare-{}.json", std::process::id()));
        std::fs::write(&path, serde_json::to_string(&vec![t.json()]).unwrap()).unwrap();
        let baseline = Baseline::load(&path).unwrap();
        std::fs::remove_file(path).unwrap();
        baseline
    }

    #[test]
    fn a_figure_moved_only_where_the_runs_do_not_overlap() {
        let before = baseline(&table(&[10.0, 11.0, 12.0]));
        let (moved, compared) = before.moved(&[table(&[11.5, 12.5, 13.0])]);
        assert_eq!((moved.len(), compared), (0, 2), "overlapping: not moved");
        let (moved, _) = before.moved(&[table(&[12.5, 13.0, 14.0])]);
        assert_eq!(moved.len(), 1);
        assert_eq!(moved[0].what, "halt, kvm: latency (µs)");
        assert_eq!(moved[0].before, (11.0, (10.0, 12.0)));
        let section = before.section(&[table(&[2.0, 3.0])]);
        assert!(section.contains("2 figures compared; 1 moved"), "{section}");
        assert!(
            section.contains("11.0 (10.0–12.0) → 3.00 (2.00–3.00), down"),
            "{section}"
        );
        // Another scenario's tables compare nothing.
        let other = Table::new("timer: y", &["a"]);
        assert!(before.section(&[other]).contains("nothing compared"));
    }

    #[test]
    fn a_baseline_that_is_not_the_bench_json_is_a_clear_error() {
        let path = std::env::temp_dir().join(format!("compare-bad-{}.json", std::process::id()));
        std::fs::write(&path, "{\"a\": 1}").unwrap();
        let e = Baseline::load(&path).unwrap_err();
        assert!(e.contains("not a list of tables"), "{e}");
        std::fs::write(&path, "# Benchmarks").unwrap();
        assert!(
            Baseline::load(&path)
                .unwrap_err()
                .contains("not the bench's JSON")
        );
        std::fs::remove_file(&path).unwrap();
        assert!(Baseline::load(&path).is_err());
    }
}
