//! Summary statistics over latency samples: mean and percentiles with numpy's default
//! ("linear") interpolation, so our p50/p99 match what `vllm bench serve` prints for the same data.

use serde::Serialize;

/// The `q`-th percentile (0..=100) of `sorted` (ascending), interpolating linearly between the
/// two nearest ranks as `numpy.percentile(a, q)` does. `None` for an empty slice.
pub fn percentile(sorted: &[f64], q: f64) -> Option<f64> {
    let (first, last) = (sorted.first()?, sorted.last()?);
    if q <= 0.0 {
        return Some(*first);
    }
    if q >= 100.0 {
        return Some(*last);
    }
    let rank = q / 100.0 * (sorted.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    Some(sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64))
}

/// Mean and percentiles of one metric over one benchmark run, in the unit the samples were given.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Summary {
    pub count: usize,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl Summary {
    /// `None` when there are no samples (e.g. every request failed), so no one divides by zero.
    pub fn of(samples: &[f64]) -> Option<Summary> {
        let mut sorted = samples.to_vec();
        sorted.sort_by(f64::total_cmp);
        let p = |q| percentile(&sorted, q);
        Some(Summary {
            count: sorted.len(),
            mean: sorted.iter().sum::<f64>() / sorted.len().max(1) as f64,
            p50: p(50.0)?,
            p90: p(90.0)?,
            p99: p(99.0)?,
            max: p(100.0)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn percentile_interpolates_like_numpy() {
        // numpy.percentile([1, 2, 3, 4], [0, 25, 50, 99, 100]) == [1, 1.75, 2.5, 3.97, 4]
        let a = [1.0, 2.0, 3.0, 4.0];
        assert!(close(percentile(&a, 0.0).unwrap(), 1.0));
        assert!(close(percentile(&a, 25.0).unwrap(), 1.75));
        assert!(close(percentile(&a, 50.0).unwrap(), 2.5));
        assert!(close(percentile(&a, 99.0).unwrap(), 3.97));
        assert!(close(percentile(&a, 100.0).unwrap(), 4.0));
        // numpy.percentile([15, 20, 35, 40, 50], [40, 90]) == [29, 46]
        let b = [15.0, 20.0, 35.0, 40.0, 50.0];
        assert!(close(percentile(&b, 40.0).unwrap(), 29.0));
        assert!(close(percentile(&b, 90.0).unwrap(), 46.0));
    }

    #[test]
    fn percentile_of_one_sample_is_that_sample_and_of_none_is_none() {
        assert_eq!(percentile(&[7.0], 99.0), Some(7.0));
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(Summary::of(&[]), None);
    }

    #[test]
    fn summary_sorts_its_samples() {
        let s = Summary::of(&[4.0, 1.0, 3.0, 2.0]).unwrap();
        assert_eq!(s.count, 4);
        assert!(close(s.mean, 2.5));
        assert!(close(s.p50, 2.5));
        assert!(close(s.p99, 3.97));
        assert!(close(s.max, 4.0));
    }
}
