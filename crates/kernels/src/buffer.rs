//! Zeroed byte buffers for packed weights. A large one is an anonymous mapping that asks the
//! kernel for transparent huge pages (`madvise(MADV_HUGEPAGE)`, which `madvise`-mode THP, the
//! common default, needs) before any page is touched: decode streams every weight once per
//! token, and on 4 KB pages it crosses a page (a TLB miss, and the end of what the hardware
//! prefetchers follow) every 64 cache lines.

use std::ops::{Deref, DerefMut};

/// Buffers from this size on are mapped (one huge page).
const MAP_FROM: usize = 2 << 20;

pub enum Buffer {
    Heap(Vec<u8>),
    Mapped(memmap2::MmapMut),
}

impl Buffer {
    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> Self {
        if len >= MAP_FROM && huge_pages_wanted() {
            if let Ok(m) = memmap2::MmapOptions::new().len(len).map_anon() {
                #[cfg(target_os = "linux")]
                {
                    // advisory: without THP the pages are plain 4 KB ones
                    let _ = m.advise(memmap2::Advice::HugePage);
                }
                return Self::Mapped(m);
            }
        }
        Self::Heap(vec![0u8; len])
    }
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
