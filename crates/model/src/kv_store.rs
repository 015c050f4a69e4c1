//! The KV cache's storage: per layer, one plane of keys and one of values in the chosen
//! [`KvDtype`], indexed by slot (block * block_size + offset). Which slots a sequence owns is the
//! engine's business (engine::kv_cache); this type only holds the numbers.

use crate::config::ModelConfig;
use crate::delta_net::RecurrentStore;
use specula_kernels::attention::KvLayout;
use specula_kernels::kv::{KvDtype, KvPlane, KvRole};

pub struct KvStore {
    pub layout: KvLayout,
    pub num_blocks: usize,
    pub dtype: KvDtype,
    /// One plane per attention layer (a hybrid's recurrent layers have none).
    pub k: Vec<KvPlane>,
    pub v: Vec<KvPlane>,
    /// The sequences' recurrent state (hybrid models), beside the blocks.
    pub recurrent: Option<RecurrentStore>,
}

/// The KV store cannot be had: more than the machine has available, refused by the allocator, or
/// a type the model's heads cannot be stored in.
#[derive(Debug, thiserror::Error)]
pub enum KvAllocError {
    #[error("cannot allocate the KV cache: {tokens} tokens need {:.2} GiB{}; lower --kv-cache-tokens (or --kv-cache-memory), or store it smaller (--kv-cache-dtype q8_0 or q4_0)", *bytes as f64 / GIB, .available.map(|a| format!(" but only {:.2} GiB is available", a as f64 / GIB)).unwrap_or_default())]
    Memory {
        tokens: usize,
        bytes: usize,
        /// What the machine had available (Linux: `MemAvailable`), when that was the reason.
        available: Option<usize>,
    },
    #[error("cannot allocate the recurrent state: {sequences} sequences need {:.2} GiB but only {:.2} GiB is available; lower --max-num-seqs", *bytes as f64 / GIB, *available as f64 / GIB)]
    State { sequences: usize, bytes: usize, available: usize },
    #[error("--kv-cache-dtype {dtype} stores heads in blocks of 32 values but this model's heads have {head_dim}; choose f16, bf16 or f32")]
    HeadDim { dtype: KvDtype, head_dim: usize },
}

/// Bytes offered for a KV block are not one block of this store (another model, type or block
/// size), or the block is past the store.
#[derive(Debug, thiserror::Error)]
#[error("{got} bytes cannot fill KV block {block}: a block of this cache is {want} bytes")]
pub struct BlockBytesError {
    pub block: usize,
    pub got: usize,
    pub want: usize,
}

const GIB: f64 = (1u64 << 30) as f64;

impl KvStore {
    /// Allocates the store and writes it once, so that its pages are resident from the start:
    /// the process's memory is then its whole budget before the first request and stays flat
    /// under any load (lazily mapped zero pages would make resident memory creep up for as long
    /// as the free list rotates through blocks never touched before, which looks like a leak),
    /// and a machine without that memory fails here, with a clear error, not under load later.
    /// A store larger than the memory the machine has available is refused before allocating.
    pub fn new(n_layers: usize, layout: KvLayout, num_blocks: usize, dtype: KvDtype) -> Result<Self, KvAllocError> {
        if !dtype.supports_head_dim(layout.head_dim) {
            return Err(KvAllocError::HeadDim { dtype, head_dim: layout.head_dim });
        }
        let tokens = num_blocks.saturating_mul(layout.block_size);
        let bytes = tokens.saturating_mul(Self::bytes_per_token(n_layers, &layout, dtype));
        let fail = |available| KvAllocError::Memory { tokens, bytes, available };
        if let Some(available) = available_memory() {
            if bytes > available {
                return Err(fail(Some(available)));
            }
        }
        let plane = |role| KvPlane::new(role, dtype, layout, num_blocks).map_err(|_| fail(None));
        let k = (0..n_layers).map(|_| plane(KvRole::Keys)).collect::<Result<_, _>>()?;
        let v = (0..n_layers).map(|_| plane(KvRole::Values)).collect::<Result<_, _>>()?;
        Ok(Self { layout, num_blocks, dtype, k, v, recurrent: None })
    }

    /// The store `config`'s model needs: a plane of keys and of values per attention layer and,
    /// for a hybrid, the recurrent state of `sequences` sequence slots (each counted against the
    /// memory available as the blocks are).
    pub fn for_model(config: &ModelConfig, layout: KvLayout, num_blocks: usize, dtype: KvDtype, sequences: usize) -> Result<Self, KvAllocError> {
        let Some(r) = &config.arch_options.recurrent else {
            return Self::new(config.kv_layers(), layout, num_blocks, dtype);
        };
        let state = r.bytes_per_sequence().saturating_mul(sequences);
        if let Some(available) = available_memory().filter(|&a| state > a) {
            return Err(KvAllocError::State { sequences, bytes: state, available });
        }
        let mut store = Self::new(config.kv_layers(), layout, num_blocks, dtype)?;
        store.recurrent = Some(RecurrentStore::new(r, sequences));
        Ok(store)
    }

    pub fn num_slots(&self) -> usize {
        self.num_blocks * self.layout.block_size
    }

    /// Bytes one block takes over all layers, keys and values ([`Self::copy_block_out`]'s length).
    pub fn block_bytes(&self) -> usize {
        self.k.iter().chain(&self.v).map(|p| p.block_bytes()).sum()
    }

    /// Appends block `block`'s stored keys and values, every layer's keys then every layer's
    /// values, to `out` (what the prefix cache's host and disk tiers keep).
    pub fn copy_block_out(&self, block: usize, out: &mut Vec<u8>) {
        out.reserve(self.block_bytes());
        for p in self.k.iter().chain(&self.v) {
            p.copy_block_out(block, out);
        }
    }

    /// Overwrites block `block` with bytes [`Self::copy_block_out`] gave on a store of the same
    /// model, type and block size; refuses any other length, changing nothing.
    pub fn copy_block_in(&mut self, block: usize, bytes: &[u8]) -> Result<(), BlockBytesError> {
        if bytes.len() != self.block_bytes() || block >= self.num_blocks {
            return Err(BlockBytesError { block, got: bytes.len(), want: self.block_bytes() });
        }
        let mut rest = bytes;
        for p in self.k.iter_mut().chain(self.v.iter_mut()) {
            let (this, next) = rest.split_at(p.block_bytes());
            p.copy_block_in(block, this);
            rest = next;
        }
        Ok(())
    }

    /// Bytes one token's keys and values take over all layers.
    pub fn bytes_per_token(n_layers: usize, layout: &KvLayout, dtype: KvDtype) -> usize {
        2 * n_layers * dtype.bytes(layout.kv_width())
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
    fn a_store_is_zeroed_and_sized_by_its_blocks_and_type() {
        for dtype in KvDtype::ALL {
            let kv = KvStore::new(3, layout(), 5, dtype).unwrap();
            assert_eq!((kv.k.len(), kv.v.len()), (3, 3));
            assert!(kv.k.iter().chain(&kv.v).all(|p| p.slots() == 5 * 16 && p.dtype() == dtype && (0..80).all(|s| p.read(s).iter().all(|&x| x == 0.0))));
            let per_token: usize = kv.k.iter().chain(&kv.v).map(|p| p.bytes()).sum::<usize>() / 80;
            assert_eq!(per_token, KvStore::bytes_per_token(3, &layout(), dtype), "{dtype}");
        }
        // f16 is half of f32, q8_0 17/32 of f16, q4_0 9/32
        assert_eq!(KvStore::bytes_per_token(3, &layout(), KvDtype::F16) * 2, KvStore::bytes_per_token(3, &layout(), KvDtype::F32));
        assert_eq!(KvStore::bytes_per_token(3, &layout(), KvDtype::Q8_0) * 32, KvStore::bytes_per_token(3, &layout(), KvDtype::F16) * 17);
        assert_eq!(KvStore::bytes_per_token(3, &layout(), KvDtype::Q4_0) * 32, KvStore::bytes_per_token(3, &layout(), KvDtype::F16) * 9);
    }

    #[test]
    fn a_block_moves_between_stores_whole_and_other_lengths_are_refused() {
        for dtype in KvDtype::ALL {
            let mut a = KvStore::new(2, layout(), 3, dtype).unwrap();
            for (l, p) in a.k.iter_mut().chain(a.v.iter_mut()).enumerate() {
                for slot in 16..32 {
                    p.write(slot, &(0..128).map(|i| (l * 1000 + slot * 128 + i) as f32 * 1e-3).collect::<Vec<_>>());
                }
            }
            let mut bytes = Vec::new();
            a.copy_block_out(1, &mut bytes);
            assert_eq!(bytes.len(), a.block_bytes());
            assert_eq!(a.block_bytes(), 16 * KvStore::bytes_per_token(2, &layout(), dtype));
            let mut b = KvStore::new(2, layout(), 3, dtype).unwrap();
            b.copy_block_in(0, &bytes).unwrap();
            for (pa, pb) in a.k.iter().chain(&a.v).zip(b.k.iter().chain(&b.v)) {
                assert!((0..16).all(|s| pa.read(16 + s) == pb.read(s)), "{dtype}");
            }
            assert!(b.copy_block_in(0, &bytes[1..]).is_err());
            assert!(b.copy_block_in(3, &bytes).is_err(), "past the store");
        }
    }

    #[test]
    fn q8_0_refuses_heads_that_are_not_whole_blocks() {
        let l = KvLayout { block_size: 16, n_heads: 4, n_kv_heads: 2, head_dim: 48 };
        let e = KvStore::new(2, l, 4, KvDtype::Q8_0).err().expect("refused");
        assert!(e.to_string().contains("heads have 48"), "{e}");
        assert!(KvStore::new(2, l, 4, KvDtype::F16).is_ok());
    }

    #[test]
    fn a_store_larger_than_the_machine_is_an_error_not_an_abort() {
        // 2^40 tokens of 128 floats: far beyond any machine
        let e = KvStore::new(24, layout(), 1 << 36, KvDtype::F16).err().expect("a petabyte KV store was allocated");
        let msg = e.to_string();
        assert!(msg.contains("cannot allocate the KV cache") && msg.contains("--kv-cache-tokens"), "{msg}");
        if available_memory().is_some() {
            assert!(msg.contains("available"), "{msg}");
        }
    }
}
