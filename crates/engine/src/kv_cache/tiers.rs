//! The prefix cache below the KV store: the host-memory tier and, with `--prefix-cache-dir`, the
//! disk tier, looked up in that order when a prompt's blocks are not in the store. What moves
//! where is decided by `KvCacheManager`; this keeps the bytes.

use super::block_hash::BlockHash;
use super::disk_tier::{DiskTier, DiskTierConfig};
use super::host_tier::HostTier;
use super::transfer::{SaveTo, SavedBlock};
use crate::types::TokenId;
use std::sync::Arc;

/// The lower tiers' sizes (`--prefix-cache-memory`, `--prefix-cache-dir`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrefixTierConfig {
    /// Bytes of evicted blocks kept in host memory (0: none).
    pub host_bytes: usize,
    pub disk: Option<DiskTierConfig>,
}

impl PrefixTierConfig {
    pub fn is_off(&self) -> bool {
        self.host_bytes == 0 && self.disk.is_none()
    }
}

/// What the lower tiers hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TierSizes {
    pub host_blocks: usize,
    pub host_bytes: usize,
    /// (blocks, bytes of files) on disk, with a disk tier.
    pub disk: Option<(usize, u64)>,
}

/// Which tier a prompt block came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Tier {
    Host,
    Disk,
}

pub(crate) struct PrefixTiers {
    host: HostTier,
    disk: Option<DiskTier>,
}

impl std::fmt::Debug for PrefixTiers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixTiers").field("sizes", &self.sizes()).finish()
    }
}

impl PrefixTiers {
    /// The tiers `cfg` asks for, for blocks of `block_bytes` bytes in the namespace `namespace`;
    /// `None` when it asks for none.
    pub(crate) fn open(cfg: &PrefixTierConfig, namespace: u64, block_bytes: usize) -> std::io::Result<Option<Self>> {
        if cfg.is_off() {
            return Ok(None);
        }
        let disk = cfg.disk.as_ref().map(|d| DiskTier::open(d, namespace, block_bytes)).transpose()?;
        Ok(Some(Self { host: HostTier::new(cfg.host_bytes), disk }))
    }

    /// The bytes of the block holding `tokens` after `parent`, from host memory, else from disk
    /// (then kept in host memory too, as the next hit's).
    pub(crate) fn get(&mut self, hash: BlockHash, parent: Option<BlockHash>, tokens: &[TokenId]) -> Option<(Arc<[u8]>, Tier)> {
        if let Some(b) = self.host.get(hash, parent, tokens) {
            return Some((b, Tier::Host));
        }
        let bytes: Arc<[u8]> = self.disk.as_mut()?.get(hash, parent, tokens)?.into();
        let key = super::transfer::BlockKey { hash, parent, tokens: tokens.into() };
        self.host.insert(key, bytes.clone());
        Some((bytes, Tier::Disk))
    }

    /// Whether a block evicted from the KV store is worth saving (a tier lacks it). A block saved
    /// twice (registered and evicted before the first save is back) is kept once.
    pub(crate) fn wants_evicted(&self, hash: BlockHash) -> bool {
        let host = self.host.budget() > 0 && !self.host.contains(hash);
        host || self.wants_registered(hash)
    }

    /// Whether a block just registered should be saved to disk now: there is a disk tier and it
    /// lacks the block.
    pub(crate) fn wants_registered(&self, hash: BlockHash) -> bool {
        self.disk.as_ref().is_some_and(|d| !d.contains(hash))
    }

    /// Keeps a saved block where its save was meant for.
    pub(crate) fn accept(&mut self, saved: SavedBlock) {
        if let Some(d) = self.disk.as_mut() {
            d.put(&saved.key, &saved.bytes);
        }
        if saved.to == SaveTo::Evicted {
            self.host.insert(saved.key, saved.bytes.into());
        }
    }

    pub(crate) fn sizes(&self) -> TierSizes {
        TierSizes { host_blocks: self.host.len(), host_bytes: self.host.used(), disk: self.disk.as_ref().map(|d| (d.len(), d.used())) }
    }
}
