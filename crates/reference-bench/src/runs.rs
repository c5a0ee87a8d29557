//! One measure over repeated runs: its median and spread, ratios paired run
//! by run with a baseline, and goals judged on the median.
//!
//! The machines are shared and noisy, so a single figure hides how far a
//! rerun could land from it. Every ratio is the median of per-run ratios
//! (run `i` of a variant over run `i` of its baseline, measured next to each
//! other) and is printed with its min-max over the runs; a goal is judged on
//! the unrounded median and says how many runs met it on their own.

/// The values one measure took, one per run.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Runs(pub Vec<f64>);

impl Runs {
    /// No runs yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a run's value.
    pub fn push(&mut self, value: f64) {
        self.0.push(value);
    }

    /// The median (the upper one of an even count; NaN for no runs).
    pub fn median(&self) -> f64 {
        test_support::summary::median(self.0.iter().copied())
    }

    /// The smallest and the largest value (NaN for no runs).
    pub fn range(&self) -> (f64, f64) {
        let min = self.0.iter().copied().fold(f64::NAN, f64::min);
        let max = self.0.iter().copied().fold(f64::NAN, f64::max);
        (min, max)
    }

    /// Run by run: `f` of this run's value and `other`'s.
    pub fn zip(&self, other: &Runs, f: impl Fn(f64, f64) -> f64) -> Runs {
        Runs(
            self.0
                .iter()
                .zip(&other.0)
                .map(|(&a, &b)| f(a, b))
                .collect(),
        )
    }

    /// Run by run: this over `base`.
    pub fn ratio_to(&self, base: &Runs) -> Runs {
        self.zip(base, |a, b| a / b)
    }

    /// Run by run: whether `pred` holds.
    pub fn each(&self, pred: impl Fn(f64) -> bool) -> Vec<bool> {
        self.0.iter().map(|&v| pred(v)).collect()
    }

    /// The median and, where the runs differ, the spread: `1.51x (1.42-1.61x)`.
    pub fn ratio_text(&self) -> String {
        let (min, max) = self.range();
        if min == max || self.0.len() < 2 {
            format!("{}x", ratio(self.median()))
        } else {
            format!("{}x ({}-{}x)", ratio(self.median()), ratio(min), ratio(max))
        }
    }
}

/// A ratio with two decimals, or two significant digits below 0.1 (so that
/// 0.0016 does not print as 0.00).
pub fn ratio(value: f64) -> String {
    let magnitude = value.abs();
    if !value.is_finite() || magnitude >= 0.1 || magnitude == 0.0 {
        return format!("{value:.2}");
    }
    let decimals = (1.0 - magnitude.log10().floor()) as usize;
    format!("{value:.decimals$}")
}

/// A goal's line: what it asks, what was measured, and whether the median
/// meets it; when the runs disagree, how many met it on their own, so a goal
/// that flips between reruns shows why.
pub fn goal(asks: &str, measured: &str, median_meets: bool, runs_meeting: &[bool]) -> String {
    let verdict = if median_meets { "met" } else { "not met" };
    let met = runs_meeting.iter().filter(|&&m| m).count();
    let agreement = if met == 0 || met == runs_meeting.len() {
        String::new()
    } else {
        format!(
            " on the median; {met} of {} runs met it alone, so a rerun may differ",
            runs_meeting.len()
        )
    };
    format!("Goal: {asks}. Measured: {measured}: {verdict}{agreement}.")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_range_and_paired_ratios() {
        let a = Runs(vec![3.0, 1.0, 2.0]);
        assert_eq!(a.median(), 2.0);
        assert_eq!(a.range(), (1.0, 3.0));
        let base = Runs(vec![1.0, 2.0, 4.0]);
        assert_eq!(a.ratio_to(&base), Runs(vec![3.0, 0.5, 0.5]));
        assert!(Runs::new().median().is_nan());
        assert_eq!(Runs(vec![4.0, 1.0]).median(), 4.0, "the upper of two");
    }

    #[test]
    fn ratios_keep_two_significant_digits_and_show_their_spread() {
        assert_eq!(ratio(1.5149), "1.51");
        assert_eq!(ratio(573.4), "573.40");
        assert_eq!(ratio(0.0016), "0.0016");
        assert_eq!(ratio(0.094), "0.094");
        assert_eq!(ratio(0.0), "0.00");
        assert_eq!(ratio(f64::NAN), "NaN");
        assert_eq!(
            Runs(vec![1.42, 1.61, 1.51]).ratio_text(),
            "1.51x (1.42-1.61x)"
        );
        assert_eq!(
            Runs(vec![2.0]).ratio_text(),
            "2.00x",
            "no spread for one run"
        );
    }

    #[test]
    fn a_goal_is_judged_on_the_median_and_says_when_runs_disagree() {
        assert_eq!(
            goal(
                "directed-yield at least 1.5x none",
                "1.51x (1.42-1.61x)",
                true,
                &[true, false, true]
            ),
            "Goal: directed-yield at least 1.5x none. Measured: 1.51x (1.42-1.61x): met on the median; \
             2 of 3 runs met it alone, so a rerun may differ."
        );
        assert_eq!(
            goal("x", "1x", false, &[false, false]),
            "Goal: x. Measured: 1x: not met."
        );
        assert_eq!(
            goal("x", "1x", true, &[true]),
            "Goal: x. Measured: 1x: met."
        );
    }
}
