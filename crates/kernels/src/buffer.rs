//! The memory weights live in: [`WeightBytes`], one tensor's bytes as a window into a shared
//! owner (the loader's memory map, or an owned buffer), and [`Buffer`], zeroed byte buffers for
//! packed weights. A large `Buffer` is an anonymous mapping that asks the
//! kernel for transparent huge pages (`madvise(MADV_HUGEPAGE)`, which `madvise`-mode THP, the
//! common default, needs) before any page is touched: decode streams every weight once per
//! token, and on 4 KB pages it crosses a page (a TLB miss, and the end of what the hardware
//! prefetchers follow) every 64 cache lines. A leaf: both the matrix (`weights`) and its int8
//! groups read in place (`packed`) hold a `WeightBytes`, so neither imports the other for it.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

/// Bytes of one tensor: a window into a shared owner (usually a memory-mapped file).
#[derive(Clone)]
pub struct WeightBytes {
    /// Keeps the memory alive; `ptr` points into it.
    _owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
    ptr: *const u8,
    len: usize,
}

// SAFETY: the bytes are immutable and owned by `_owner`, which is Send + Sync.
unsafe impl Send for WeightBytes {}
unsafe impl Sync for WeightBytes {}

impl WeightBytes {
    /// A window of `len` bytes at `start`; panics if it does not fit (a loader bug: loaders check
    /// tensor extents against the file first).
    pub fn new(owner: Arc<dyn AsRef<[u8]> + Send + Sync>, start: usize, len: usize) -> Self {
        let all = (*owner).as_ref();
        assert!(start.checked_add(len).is_some_and(|e| e <= all.len()), "weight window outside its buffer");
        let ptr = all[start..].as_ptr();
        Self { _owner: owner, ptr, len }
    }

    pub fn owned(bytes: Vec<u8>) -> Self {
        let len = bytes.len();
        Self::new(Arc::new(bytes), 0, len)
    }

    #[inline]
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr/len were taken from the owner's slice, which lives as long as self and never moves
        // (it is behind an Arc and immutable).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl std::fmt::Debug for WeightBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WeightBytes({} bytes)", self.len)
    }
}

/// Buffers from this size on are mapped (one huge page).
const MAP_FROM: usize = 2 << 20;

pub enum Buffer {
    Heap(Vec<u8>),
    Mapped(memmap2::MmapMut),
}

impl Buffer {
    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> Self {
        match map_huge(len) {
            Some(m) => Self::Mapped(m),
            None => Self::Heap(vec![0u8; len]),
        }
    }

    /// `len` zero bytes with every page resident (touched now, so a step never faults one in),
    /// or `None` if the memory cannot be had. Large ones are mapped on huge pages as
    /// [`Self::zeroed`]'s: a KV cache read at depth crosses a 4 KB page every block of a head.
    pub fn try_zeroed_resident(len: usize) -> Option<Self> {
        if let Some(mut m) = map_huge(len) {
            // SAFETY: the mapping is ours and `len` bytes long; volatile, so the writes of the
            // zeros already there are kept (they are what makes the pages resident).
            for i in (0..len).step_by(4096) {
                unsafe { std::ptr::write_volatile(m.as_mut_ptr().add(i), 0) };
            }
            return Some(Self::Mapped(m));
        }
        let mut v = Vec::new();
        v.try_reserve_exact(len).ok()?;
        v.resize(len, 0);
        Some(Self::Heap(v))
    }
}

/// A zeroed anonymous mapping of `len` bytes advised onto transparent huge pages, for `len` from
/// [`MAP_FROM`] on (`None` below it, with the advice turned off, or if the map fails).
fn map_huge(len: usize) -> Option<memmap2::MmapMut> {
    if len < MAP_FROM || !huge_pages_wanted() {
        return None;
    }
    let m = memmap2::MmapOptions::new().len(len).map_anon().ok()?;
    #[cfg(target_os = "linux")]
    {
        // advisory: without THP the pages are plain 4 KB ones
        let _ = m.advise(memmap2::Advice::HugePage);
    }
    Some(m)
}

/// `SPECULA_HUGE_PAGES=0` turns the advice off (to measure what it gives).
fn huge_pages_wanted() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("SPECULA_HUGE_PAGES").is_none_or(|v| v != "0"))
}

impl Clone for Buffer {
    fn clone(&self) -> Self {
        let mut b = Self::zeroed(self.len());
        b.copy_from_slice(self);
        b
    }
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Buffer({} bytes, {})", self.len(), if matches!(self, Self::Mapped(_)) { "mapped" } else { "heap" })
    }
}

impl Deref for Buffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Self::Heap(v) => v,
            Self::Mapped(m) => m,
        }
    }
}

impl DerefMut for Buffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            Self::Heap(v) => v,
            Self::Mapped(m) => m,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_and_large_buffers_are_zeroed_and_writable() {
        for len in [0, 100, MAP_FROM + 12345] {
            let mut b = Buffer::zeroed(len);
            assert_eq!(b.len(), len);
            assert!(b.iter().all(|&x| x == 0));
            if len > 0 {
                b[len - 1] = 7;
                assert_eq!(b[len - 1], 7);
            }
        }
    }
}
