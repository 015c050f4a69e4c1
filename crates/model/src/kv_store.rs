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

impl KvStore {
    pub fn new(n_layers: usize, layout: KvLayout, num_blocks: usize) -> Self {
        let n = num_blocks * layout.block_size * layout.kv_width();
        Self { layout, num_blocks, k: (0..n_layers).map(|_| vec![0f32; n]).collect(), v: (0..n_layers).map(|_| vec![0f32; n]).collect() }
    }

    pub fn num_slots(&self) -> usize {
        self.num_blocks * self.layout.block_size
    }

    /// Bytes one token's keys and values take over all layers.
    pub fn bytes_per_token(n_layers: usize, layout: &KvLayout) -> usize {
        2 * n_layers * layout.kv_width() * std::mem::size_of::<f32>()
    }
}
