//! The report's opening: every goal of every scenario, in scenario order
//! (each scenario measures one mechanism), with its verdict first, so that
//! a reader sees what the run found before any table.

use crate::Table;

/// What a goal's own line says of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// `...: met.`, or met on the median.
    Met,
    /// `...: not met.`, or not met on the median.
    NotMet,
    /// The goal could not be measured here; its line says why.
    NotMeasured,
    /// A figure with no verdict (a comparison reported, not judged).
    Reported,
}

impl Verdict {
    /// How the summary names it.
    fn label(self) -> &'static str {
        match self {
            Self::Met => "met",
            Self::NotMet => "not met",
            Self::NotMeasured => "not measured",
            Self::Reported => "reported",
        }
    }
}

/// The verdict a goal's line gives.
pub fn verdict(goal: &str) -> Verdict {
    if goal.contains("Not measured") || goal.contains("not measured") {
        Verdict::NotMeasured
    } else if goal.contains(": not met") {
        Verdict::NotMet
    } else if goal.contains(": met") {
        Verdict::Met
    } else {
        Verdict::Reported
    }
}

/// The report's opening: its title with how many goals were met, not met
/// and not measured, then a line per goal (the notes that start with
/// "Goal"), its scenario and verdict first, so that it fits a screen.
pub fn summary(tables: &[Table]) -> String {
    let goals: Vec<(&str, &str)> = tables
        .iter()
        .flat_map(|t| {
            let goals = t.notes.iter().filter(|n| n.starts_with("Goal"));
            goals.map(move |g| (t.scenario(), g.as_str()))
        })
        .collect();
    if goals.is_empty() {
        return "# Benchmarks\n\n".into();
    }
    let count = |v: Verdict| goals.iter().filter(|(_, g)| verdict(g) == v).count();
    let mut out = format!(
        "# Benchmarks: {} goals, {} met, {} not met, {} not measured\n\n",
        goals.len(),
        count(Verdict::Met),
        count(Verdict::NotMet),
        count(Verdict::NotMeasured),
    );
    for (name, goal) in goals {
        let text = goal.strip_prefix("Goal: ").unwrap_or(goal);
        out.push_str(&format!("- {name}, *{}*: {text}\n", verdict(goal).label()));
    }
    out + "\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_goal_line_gives_its_verdict() {
        assert_eq!(verdict("Goal: g. Measured: 0.5x: met."), Verdict::Met);
        let median = "Goal: g. Measured: 2x: met on the median; 2 of 3 runs met it alone.";
        assert_eq!(verdict(median), Verdict::Met);
        assert_eq!(verdict("Goal: g. Measured: 2x: not met."), Verdict::NotMet);
        let not_median = "Goal: g. Measured: 2x: not met on the median; 1 of 3 runs met it.";
        assert_eq!(verdict(not_median), Verdict::NotMet);
        let missing = "Goal: g. Not measured: no QEMU on this machine.";
        assert_eq!(verdict(missing), Verdict::NotMeasured);
        assert_eq!(verdict("Goal: g against QEMU: 2.09x."), Verdict::Reported);
    }

    #[test]
    fn the_summary_counts_every_goal_and_gives_each_a_line_in_scenario_order() {
        let mut halt = Table::new("halt: x", &["a"]);
        halt.note("setup");
        halt.note("Goal: own. Measured: 1x: not met.");
        halt.peer_goal("Goal: peer. Measured: 0.5x QEMU's: met.");
        let mut timer = Table::new("timer: y", &["a"]);
        timer.note("Goal: t. Not measured: no KVM.");
        let s = summary(&[halt, timer]);
        assert!(
            s.starts_with("# Benchmarks: 3 goals, 1 met, 1 not met, 1 not measured\n\n- halt"),
            "{s}"
        );
        let own = s.find("- halt, *not met*: own.").unwrap();
        let peer = s.find("- halt, *met*: peer.").unwrap();
        let timer = s
            .find("- timer, *not measured*: t. Not measured: no KVM.")
            .unwrap();
        assert!(own < peer && peer < timer, "{s}");
        assert!(!s.contains("setup"), "{s}");
        assert_eq!(summary(&[Table::new("halt: y", &[])]), "# Benchmarks\n\n");
    }
}
