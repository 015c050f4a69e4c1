//! Content hashes that name full KV blocks in the prefix cache. A block's hash chains its parent
//! block's hash with its own token ids, so equal hashes mean equal prefixes up to that block.
//! The function is 64-bit FNV-1a written out here, so hashes are stable across Rust versions and
//! processes (std's `DefaultHasher` promises neither). Not a cryptographic hash: the pool still
//! compares token ids on every hit, so a collision cannot hand out the wrong KV.

use crate::types::TokenId;

/// Hash of a full block of tokens together with every block before it in its sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u64);

const FNV_OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// 64-bit FNV-1a, continuing from `state` (start with [`FNV_OFFSET_BASIS`]).
fn fnv1a_update(mut state: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        state ^= u64::from(b);
        state = state.wrapping_mul(FNV_PRIME);
    }
    state
}

/// The hash of the block holding `tokens` whose preceding block hashed to `parent` (`None` for
/// the first block of a sequence).
///
/// Byte stream hashed: a marker byte (0 = no parent, 1 = parent follows), the parent hash as 8
/// little-endian bytes when present, then each token id as 4 little-endian bytes.
pub fn hash_block(parent: Option<BlockHash>, tokens: &[TokenId]) -> BlockHash {
    let mut state = FNV_OFFSET_BASIS;
    match parent {
        None => state = fnv1a_update(state, &[0]),
        Some(BlockHash(p)) => {
            state = fnv1a_update(state, &[1]);
            state = fnv1a_update(state, &p.to_le_bytes());
        }
    }
    for &t in tokens {
        state = fnv1a_update(state, &t.to_le_bytes());
    }
    BlockHash(state)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_matches_the_published_test_vectors() {
        // From the FNV reference (isthe.com/chongo/tech/comp/fnv): "" and "a" and "foobar".
        assert_eq!(fnv1a_update(FNV_OFFSET_BASIS, b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a_update(FNV_OFFSET_BASIS, b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a_update(FNV_OFFSET_BASIS, b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn block_hash_values_are_pinned() {
        // Computed independently (Python, same byte stream); a change here invalidates nothing
        // on disk today but would break cross-process prefix sharing if we ever add it.
        assert_eq!(hash_block(None, &[1, 2, 3, 4]), BlockHash(HASH_ROOT_1234));
        assert_eq!(hash_block(Some(BlockHash(HASH_ROOT_1234)), &[5, 6, 7, 8]), BlockHash(HASH_CHILD_5678));
    }

    #[test]
    fn parent_changes_the_hash() {
        let a = hash_block(None, &[5, 6, 7, 8]);
        let b = hash_block(Some(hash_block(None, &[1, 2, 3, 4])), &[5, 6, 7, 8]);
        let c = hash_block(Some(hash_block(None, &[1, 2, 3, 9])), &[5, 6, 7, 8]);
        assert_ne!(a, b);
        assert_ne!(b, c);
    }

    #[test]
    fn token_order_changes_the_hash() {
        assert_ne!(hash_block(None, &[1, 2]), hash_block(None, &[2, 1]));
    }

    const HASH_ROOT_1234: u64 = 0xf17a_d4f0_d13c_fa1b;
    const HASH_CHILD_5678: u64 = 0xf7a7_2731_5498_4997;
}
