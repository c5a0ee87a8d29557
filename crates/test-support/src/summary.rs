//! Summaries of repeated measurements.

use std::borrow::Borrow;

/// The median of `values`: the upper one of an even count, NaN for none.
pub fn median<V: Borrow<f64>>(values: impl IntoIterator<Item = V>) -> f64 {
    quantile(values, 0.5)
}

/// The `q` quantile of `values` (0: the least, 1: the greatest): the value
/// at the nearest rank, the upper of two equally near; NaN for none.
pub fn quantile<V: Borrow<f64>>(values: impl IntoIterator<Item = V>, q: f64) -> f64 {
    let mut v: Vec<f64> = values.into_iter().map(|v| *v.borrow()).collect();
    v.sort_by(f64::total_cmp);
    let rank = ((v.len() as f64 - 1.0) * q.clamp(0.0, 1.0)).round();
    v.get(rank as usize).copied().unwrap_or(f64::NAN)
}
