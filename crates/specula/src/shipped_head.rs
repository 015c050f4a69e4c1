//! The mtp head shipped for the default model (heads/README.md): built into the binary, written
//! once into `$SPECULA_CACHE/heads/` (checksum verified) so `--speculative-method mtp` works with
//! no `--draft-model` from a clean clone, wherever the binary is run from. The head's loader still
//! checks its target fingerprint, so another model is refused with a clear error.

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// File name of the shipped head (in heads/ and in the cache).
pub const NAME: &str = "smollm2-135m-instruct-q4_1.mtp.safetensors";
/// What the head was trained for, for error messages.
pub const TARGET: &str = "SmolLM2-135M-Instruct Q4_1 (the default model)";

static BYTES: &[u8] = include_bytes!("../../../heads/smollm2-135m-instruct-q4_1.mtp.safetensors");
/// `sha256sum` line of the file: "<hex>  <name>".
const SHA256_LINE: &str = include_str!("../../../heads/smollm2-135m-instruct-q4_1.mtp.safetensors.sha256");

fn hex_sha256(bytes: &[u8]) -> String {
    format!("{:x}", Sha256::digest(bytes))
}

/// The checksum committed beside the head.
pub fn expected_sha256() -> Result<&'static str> {
    SHA256_LINE.split_whitespace().next().filter(|h| h.len() == 64).context("heads/*.sha256 is malformed (expected a sha256sum line)")
}

/// Path of the shipped head in the cache, writing it there first if it is missing or damaged.
pub fn materialise() -> Result<PathBuf> {
    materialise_in(&crate::fetch::cache_dir())
}

/// [`materialise`] under the cache folder `cache`.
pub fn materialise_in(cache: &Path) -> Result<PathBuf> {
    let expected = expected_sha256()?;
    let built_in = hex_sha256(BYTES);
    if built_in != expected {
        bail!("the mtp head built into this binary has sha256 {built_in} but heads/{NAME}.sha256 says {expected}; rebuild specula from a clean checkout");
    }
    let dir = cache.join("heads");
    let path = dir.join(format!("{}-{NAME}", &expected[..12]));
    if std::fs::read(&path).is_ok_and(|b| hex_sha256(&b) == expected) {
        return Ok(path);
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let tmp = dir.join(format!(".{NAME}.{}.tmp", std::process::id()));
    std::fs::write(&tmp, BYTES).with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| format!("cannot move the head into {}", path.display()))?;
    tracing::info!("wrote the built-in mtp head to {}", path.display());
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_built_in_head_matches_its_committed_checksum_and_is_small() {
        assert_eq!(hex_sha256(BYTES), expected_sha256().unwrap());
        assert!(BYTES.len() <= 16_000_000, "the shipped head is {} bytes", BYTES.len());
        let on_disk = std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/../../heads/smollm2-135m-instruct-q4_1.mtp.safetensors")).unwrap();
        assert!(on_disk == BYTES, "heads/{NAME} changed since this binary was built");
    }

    #[test]
    fn materialise_writes_a_verified_copy_and_repairs_a_damaged_one() {
        let dir = tempfile::tempdir().unwrap();
        let p = materialise_in(dir.path()).unwrap();
        assert!(p.starts_with(dir.path()));
        assert_eq!(hex_sha256(&std::fs::read(&p).unwrap()), expected_sha256().unwrap());
        std::fs::write(&p, b"damaged").unwrap();
        assert_eq!(materialise_in(dir.path()).unwrap(), p);
        assert_eq!(hex_sha256(&std::fs::read(&p).unwrap()), expected_sha256().unwrap());
    }
}
