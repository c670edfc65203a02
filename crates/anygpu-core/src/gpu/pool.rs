//! Buffer pool: freed GPU buffers are kept by size class and handed out again, so the
//! per-op allocations of a forward pass stop costing driver calls after the first one.

use std::collections::HashMap;
use std::sync::Mutex;

/// Storage buffers we hand out are usable by every kernel and by copies.
pub const STORAGE_USAGE: wgpu::BufferUsages =
    wgpu::BufferUsages::STORAGE.union(wgpu::BufferUsages::COPY_SRC).union(wgpu::BufferUsages::COPY_DST);

/// Rounds a size up to its class: powers of two split in 8 steps (at most 12.5% waste), and
/// at least 256 bytes. Large weights therefore cost little more than their own size.
pub fn size_class(bytes: u64) -> u64 {
    let bytes = bytes.max(256);
    let pow = 63 - bytes.leading_zeros() as u64; // floor(log2)
    let step = (1u64 << pow) / 8;
    bytes.div_ceil(step.max(1)) * step.max(1)
}

#[derive(Default)]
pub struct BufferPool {
    free: Mutex<HashMap<u64, Vec<wgpu::Buffer>>>,
    held_bytes: Mutex<u64>,
}

/// Free buffers kept beyond this are dropped instead of pooled.
const MAX_POOLED_BYTES: u64 = 2 << 30;

impl BufferPool {
    pub fn take(&self, class: u64) -> Option<wgpu::Buffer> {
        let mut free = self.free.lock().ok()?;
        let b = free.get_mut(&class)?.pop()?;
        if let Ok(mut held) = self.held_bytes.lock() {
            *held = held.saturating_sub(class);
        }
        Some(b)
    }

    pub fn give_back(&self, buffer: wgpu::Buffer) {
        let class = buffer.size();
        let (Ok(mut free), Ok(mut held)) = (self.free.lock(), self.held_bytes.lock()) else {
            return;
        };
        if *held + class > MAX_POOLED_BYTES {
            // Dropped, not destroyed: encoded work not yet submitted may still bind it (a
            // destroyed buffer would fail that submit); wgpu frees it once nothing uses it.
            drop(buffer);
            return;
        }
        *held += class;
        free.entry(class).or_default().push(buffer);
    }

    /// Drops every pooled buffer (e.g. before a big allocation that failed).
    pub fn clear(&self) {
        if let (Ok(mut free), Ok(mut held)) = (self.free.lock(), self.held_bytes.lock()) {
            for (_, v) in free.drain() {
                for b in v {
                    b.destroy();
                }
            }
            *held = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::size_class;

    #[test]
    fn size_classes_bound_waste() {
        assert_eq!(size_class(1), 256);
        assert_eq!(size_class(256), 256);
        assert_eq!(size_class(257), 288);
        for n in [1000u64, 4097, 1 << 20, (1 << 30) + 1, 123_456_789] {
            let c = size_class(n);
            assert!(c >= n && (c - n) as f64 <= n as f64 * 0.125 + 32.0, "{n} -> {c}");
            assert_eq!(c % 4, 0);
        }
    }
}
