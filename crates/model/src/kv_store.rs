//! The KV cache's storage: per layer, one f32 buffer of keys and one of values, indexed by slot
//! (block * block_size + offset). Which slots a sequence owns is the engine's business
//! (engine::kv_cache); this type only holds the numbers.

use specula_kernels::attention::KvLayout;

pub struct KvStore {
    pub layout: KvLayout,
    pub num_blocks: usize,
    pub k: Vec<Vec<f32>>,
    pub v: Vec<Vec<f32>>,
}

/// The KV store cannot be had: more than the machine has available, or refused by the allocator.
#[derive(Debug, thiserror::Error)]
#[error("cannot allocate the KV cache: {tokens} tokens need {:.2} GiB{}; lower --kv-cache-tokens (or --kv-cache-memory)", *bytes as f64 / GIB, .available.map(|a| format!(" but only {:.2} GiB is available", a as f64 / GIB)).unwrap_or_default())]
pub struct KvAllocError {
    pub tokens: usize,
    pub bytes: usize,
    /// What the machine had available (Linux: `MemAvailable`), when that was the reason.
    pub available: Option<usize>,
}

const GIB: f64 = (1u64 << 30) as f64;

impl KvStore {
    /// Allocates the store and writes it once, so that its pages are resident from the start:
    /// the process's memory is then its whole budget before the first request and stays flat
    /// under any load (lazily mapped zero pages would make resident memory creep up for as long
    /// as the free list rotates through blocks never touched before, which looks like a leak),
    /// and a machine without that memory fails here, with a clear error, not under load later.
    /// A store larger than the memory the machine has available is refused before allocating.
    pub fn new(n_layers: usize, layout: KvLayout, num_blocks: usize) -> Result<Self, KvAllocError> {
        let tokens = num_blocks.saturating_mul(layout.block_size);
        let n = tokens.saturating_mul(layout.kv_width());
        let bytes = n.saturating_mul(2 * n_layers * std::mem::size_of::<f32>());
        let fail = |available| KvAllocError { tokens, bytes, available };
        if let Some(available) = available_memory() {
            if bytes > available {
                return Err(fail(Some(available)));
            }
        }
        let buffer = || -> Result<Vec<f32>, KvAllocError> {
            let mut v = Vec::new();
            v.try_reserve_exact(n).map_err(|_| fail(None))?;
            v.resize(n, 0.0);
            Ok(v)
        };
        let k = (0..n_layers).map(|_| buffer()).collect::<Result<_, _>>()?;
        let v = (0..n_layers).map(|_| buffer()).collect::<Result<_, _>>()?;
        Ok(Self { layout, num_blocks, k, v })
    }

    pub fn num_slots(&self) -> usize {
        self.num_blocks * self.layout.block_size
    }

    /// Bytes one token's keys and values take over all layers.
    pub fn bytes_per_token(n_layers: usize, layout: &KvLayout) -> usize {
        2 * n_layers * layout.kv_width() * std::mem::size_of::<f32>()
    }
}

/// Bytes of memory the machine has available for new allocations (Linux `MemAvailable`); `None`
/// where that is not known.
pub fn available_memory() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KvLayout {
        KvLayout { block_size: 16, n_heads: 4, n_kv_heads: 2, head_dim: 64 }
    }

    #[test]
    fn a_store_is_zeroed_and_sized_by_its_blocks() {
        let kv = KvStore::new(3, layout(), 5).unwrap();
        assert_eq!(kv.k.len(), 3);
        assert_eq!(kv.v.len(), 3);
        assert!(kv.k.iter().chain(&kv.v).all(|b| b.len() == 5 * 16 * layout().kv_width() && b.iter().all(|&x| x == 0.0)));
    }

    #[test]
    fn a_store_larger_than_the_machine_is_an_error_not_an_abort() {
        // 2^40 tokens of 128 floats: far beyond any machine
        let e = KvStore::new(24, layout(), 1 << 36).err().expect("a petabyte KV store was allocated");
        let msg = e.to_string();
        assert!(msg.contains("cannot allocate the KV cache") && msg.contains("--kv-cache-tokens"), "{msg}");
        if available_memory().is_some() {
            assert!(msg.contains("available"), "{msg}");
        }
    }
}
