//! Per-dispatch GPU timing of the direct dispatch path ([`super::GpuContext::profile_dispatches`]):
//! each dispatch in a compute pass of its own between two timestamps, tallied by op name and
//! grid. The separate passes add their own cost, so the figures rank the ops of a workload
//! (a prefill, a forward pass); they do not add up to a normal run.

/// Dispatches timed per profile; later ones run untimed.
pub(super) const MAX_TIMED: u32 = 2048;

/// A profile being taken: the query set and, in order, what each pair of its timestamps timed.
pub(super) struct DispatchProfile {
    pub set: wgpu::QuerySet,
    /// Op name and grid of dispatch i (timestamps 2i and 2i + 1).
    pub ops: Vec<(String, [u32; 3])>,
}

impl DispatchProfile {
    pub fn new(device: &wgpu::Device) -> DispatchProfile {
        let set = device.create_query_set(&wgpu::QuerySetDescriptor {
            label: Some("dispatch profile"),
            ty: wgpu::QueryType::Timestamp,
            count: 2 * MAX_TIMED,
        });
        DispatchProfile { set, ops: Vec::new() }
    }

    /// The timestamp pair for the next dispatch, or None once the set is full.
    pub fn next(&mut self, op: &str, workgroups: [u32; 3]) -> Option<u32> {
        let i = self.ops.len() as u32;
        if i >= MAX_TIMED {
            return None;
        }
        self.ops.push((op.to_string(), workgroups));
        Some(i)
    }
}

/// GPU time per op and grid: (op and grid, dispatches, seconds), largest first.
pub type OpTimes = Vec<(String, usize, f64)>;

/// (op and grid, dispatches, seconds) per op and grid, largest first, from each dispatch's
/// name, grid and seconds: the products of different matrices are told apart by their grids.
pub fn tally(timed: impl IntoIterator<Item = (String, [u32; 3], f64)>) -> OpTimes {
    let mut by_op: Vec<(String, usize, f64)> = Vec::new();
    for (op, grid, s) in timed {
        let key = format!("{op} {grid:?}");
        match by_op.iter_mut().find(|(k, _, _)| *k == key) {
            Some(e) => {
                e.1 += 1;
                e.2 += s;
            }
            None => by_op.push((key, 1, s)),
        }
    }
    by_op.sort_by(|a, b| b.2.total_cmp(&a.2));
    by_op
}

/// Seconds between timestamps 2i and 2i + 1 of resolved `bytes`, for `n` pairs.
pub(super) fn pair_seconds(bytes: &[u8], n: usize, period_ns: f64) -> Vec<f64> {
    let t = |k: usize| {
        bytes.get(8 * k..8 * k + 8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes).unwrap_or_default()
    };
    (0..n).map(|i| t(2 * i + 1).saturating_sub(t(2 * i)) as f64 * period_ns * 1e-9).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tally_groups_by_op_and_grid_largest_first() {
        let t = tally([
            ("a".to_string(), [1, 1, 1], 1.0),
            ("b".to_string(), [2, 1, 1], 5.0),
            ("a".to_string(), [1, 1, 1], 2.0),
            ("a".to_string(), [3, 1, 1], 0.5),
        ]);
        assert_eq!(t.len(), 3);
        assert_eq!(t[0], ("b [2, 1, 1]".to_string(), 1, 5.0));
        assert_eq!(t[1], ("a [1, 1, 1]".to_string(), 2, 3.0));
        assert_eq!(t[2].1, 1);
    }

    #[test]
    fn pair_seconds_reads_pairs_and_never_goes_negative() {
        let mut b = Vec::new();
        for v in [10u64, 30, 50, 40] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        let s = pair_seconds(&b, 2, 1.0);
        assert_eq!(s, vec![20e-9, 0.0]);
    }
}
