//! The prefix cache's disk tier (`--prefix-cache-dir`): the KV of full blocks in files, so that an
//! agent's system prompt and tools are prefilled once per machine, not once per process.
//!
//! - Keyed: files live in `DIR/<namespace>/`, the namespace a hash of the model's bytes
//!   ([`model_key`]), the KV type, the block size and the cache's shape; each file is named by its
//!   block's chain hash and holds the hash, its parent's, its tokens and the namespace again, all
//!   compared before a load. The chat template is not in the key: the key is the token ids
//!   themselves, and equal tokens on the same weights give equal KV, whatever template made them.
//! - Checksummed: a CRC-32 over the whole file. A corrupt, truncated or foreign file is ignored
//!   with a warning, never loaded (a corrupt one is deleted).
//! - Bounded in bytes, least recently used out first: the index is rebuilt from the files'
//!   modification times at start-up and a hit touches its file, so the order survives restarts.
//! - Written off the step path: files are written (to a temporary name, then renamed, so a
//!   reader never sees half a file, even from another process) and removed by a writer thread;
//!   a full queue drops the write. Reads happen where a prompt is admitted.

use super::block_hash::BlockHash;
use super::byte_lru::ByteLru;
use super::transfer::BlockKey;
use crate::types::TokenId;
use sha2::{Digest, Sha256};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::thread::JoinHandle;
use std::time::SystemTime;

const MAGIC: &[u8; 8] = b"SPKVBLK\0";
/// 2: q8_0 blocks hold rotated heads (`specula_kernels::kv::rotate`), so a version-1 q8_0 file
/// would read as other keys. 3: the plain types' keys are stored dimension-major within a block
/// (`specula_kernels::kv::KvOrder::DimMajor`), so a version-2 f16 block would read transposed.
const VERSION: u32 = 3;
const EXTENSION: &str = "kvb";
/// Writes waiting for the writer thread before new ones are dropped.
const WRITE_QUEUE: usize = 1024;

/// `--prefix-cache-dir` and its limits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskTierConfig {
    pub dir: PathBuf,
    /// Most bytes of files kept in this namespace.
    pub max_bytes: u64,
    /// What identifies the model's weights ([`model_key`]).
    pub model_key: u64,
}

/// A 64-bit key of the model at `path` (a GGUF file or a folder of files): its files' names and
/// lengths, their first 4 MiB (header, metadata, tokenizer) and 64 KiB at 64 places spread over
/// each (the weights), so that another file or another fine-tune of the same shape gets another key
/// without reading gigabytes at start-up.
pub fn model_key(path: &Path) -> std::io::Result<u64> {
    let mut files = if path.is_dir() {
        let mut v: Vec<PathBuf> = std::fs::read_dir(path)?.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.is_file()).collect();
        v.sort();
        v
    } else {
        vec![path.to_path_buf()]
    };
    files.retain(|p| p.extension().is_none_or(|e| e != "md"));
    let mut h = Sha256::new();
    let mut buf = Vec::with_capacity(4 << 20);
    // up to `n` bytes from where the file is, hashed
    let mut hash_next = |h: &mut Sha256, f: &mut std::fs::File, n: u64| -> std::io::Result<()> {
        buf.clear();
        f.take(n).read_to_end(&mut buf)?;
        h.update(&buf);
        Ok(())
    };
    for p in files {
        let mut f = std::fs::File::open(&p)?;
        let len = f.metadata()?.len();
        h.update(p.file_name().map(|n| n.as_encoded_bytes()).unwrap_or_default());
        h.update(len.to_le_bytes());
        hash_next(&mut h, &mut f, 4 << 20)?;
        const SAMPLES: u64 = 64;
        for i in 0..SAMPLES {
            f.seek(SeekFrom::Start(len / SAMPLES * i))?;
            hash_next(&mut h, &mut f, 64 << 10)?;
        }
    }
    Ok(first_u64(&h.finalize()))
}

fn first_u64(digest: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&digest[..8]);
    u64::from_le_bytes(b)
}

/// The namespace of one KV cache's blocks: the model, the KV type and the cache's shape (anything
/// that changes a block's bytes), and this format's version.
pub fn namespace(model_key: u64, shape: &str) -> u64 {
    first_u64(&Sha256::digest(format!("specula kv block v{VERSION} model {model_key:016x} {shape}")))
}

enum Op {
    Write { path: PathBuf, bytes: Vec<u8> },
    Remove(PathBuf),
    Touch(PathBuf),
}

pub(crate) struct DiskTier {
    dir: PathBuf,
    namespace: u64,
    block_bytes: usize,
    /// The files in this namespace: block hash -> file size.
    index: ByteLru<()>,
    writer: Option<(SyncSender<Op>, JoinHandle<()>)>,
}

/// Why a file was not loaded.
#[derive(Debug, thiserror::Error)]
enum FileError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("corrupt: {0}")]
    Corrupt(&'static str),
    #[error("written for another model or KV cache (namespace {0:016x})")]
    Foreign(u64),
    #[error("holds another block than its name says")]
    OtherBlock,
}

impl DiskTier {
    /// Opens (creating) the namespace's folder under `cfg.dir` and indexes the block files there,
    /// least recently used first, trimmed to the budget.
    pub(crate) fn open(cfg: &DiskTierConfig, namespace: u64, block_bytes: usize) -> std::io::Result<Self> {
        let dir = cfg.dir.join(format!("{namespace:016x}"));
        std::fs::create_dir_all(&dir)?;
        let mut found: Vec<(SystemTime, BlockHash, u64)> = Vec::new();
        for e in std::fs::read_dir(&dir)?.flatten() {
            let p = e.path();
            let Some(hash) = hash_of_file(&p) else { continue };
            let Ok(m) = e.metadata() else { continue };
            found.push((m.modified().unwrap_or(SystemTime::UNIX_EPOCH), hash, m.len()));
        }
        found.sort();
        let (tx, rx) = sync_channel::<Op>(WRITE_QUEUE);
        let handle = std::thread::Builder::new().name("specula-prefix-disk".into()).spawn(move || {
            for op in rx {
                run_op(op);
            }
        })?;
        let mut t = Self { dir, namespace, block_bytes, index: ByteLru::new(cfg.max_bytes), writer: Some((tx, handle)) };
        for (_, hash, bytes) in found {
            t.add(hash, bytes);
        }
        tracing::info!(dir = %t.dir.display(), blocks = t.index.len(), mib = t.index.used() >> 20, "prefix cache on disk");
        Ok(t)
    }

    #[cfg(test)]
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    pub(crate) fn len(&self) -> usize {
        self.index.len()
    }

    pub(crate) fn used(&self) -> u64 {
        self.index.used()
    }

    pub(crate) fn contains(&self, hash: BlockHash) -> bool {
        self.index.contains(hash)
    }

    fn path(&self, hash: BlockHash) -> PathBuf {
        self.dir.join(format!("{:016x}.{EXTENSION}", hash.0))
    }

    /// Indexes `hash`'s file of `bytes` as the most recently used; the files the budget then has
    /// no room for are removed.
    fn add(&mut self, hash: BlockHash, bytes: u64) {
        for (old, ()) in self.index.insert(hash, (), bytes) {
            let path = self.path(old);
            self.send(Op::Remove(path));
        }
    }

    fn send(&mut self, op: Op) -> bool {
        let Some((tx, _)) = &self.writer else { return false };
        match tx.try_send(op) {
            Ok(()) => true,
            Err(TrySendError::Full(_)) => {
                tracing::debug!("prefix cache disk writer is behind: a block was not written");
                false
            }
            Err(TrySendError::Disconnected(_)) => false,
        }
    }

    /// The KV of the block holding `tokens` after `parent`, if a file has it and passes every
    /// check; a file that fails one is dropped from the index with a warning.
    pub(crate) fn get(&mut self, hash: BlockHash, parent: Option<BlockHash>, tokens: &[TokenId]) -> Option<Vec<u8>> {
        if !self.index.contains(hash) {
            return None;
        }
        let path = self.path(hash);
        let read = std::fs::read(&path).map_err(FileError::from).and_then(|file| {
            let (key, len) = decode(&file, self.namespace).map(|(k, p)| (k, p.len()))?;
            Ok((key, len, file))
        });
        match read {
            Ok((key, len, mut file)) if key.hash == hash && key.matches(parent, tokens) && len == self.block_bytes => {
                self.index.touch(hash);
                self.send(Op::Touch(path));
                // the payload is the file's tail before the checksum
                file.truncate(file.len() - 4);
                Some(file.split_off(file.len() - len))
            }
            Ok((key, len, _)) => {
                if key.hash == hash && key.matches(parent, tokens) {
                    tracing::warn!(file = %path.display(), "prefix cache file holds {len} bytes where a block is {}: ignored", self.block_bytes);
                } else if key.hash != hash {
                    tracing::warn!(file = %path.display(), "prefix cache file {}: ignored", FileError::OtherBlock);
                } else {
                    // same chain hash, other tokens: a hash collision, or a forged file
                    tracing::warn!(file = %path.display(), "prefix cache file holds other tokens than the prompt under its hash: ignored");
                }
                self.index.remove(hash);
                None
            }
            Err(FileError::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => {
                // another process removed it
                self.index.remove(hash);
                None
            }
            Err(e) => {
                tracing::warn!(file = %path.display(), "prefix cache file ignored: {e}");
                self.index.remove(hash);
                if matches!(e, FileError::Corrupt(_)) {
                    self.send(Op::Remove(path));
                }
                None
            }
        }
    }

    /// Writes `key`'s block unless a file has it already; the least recently used files go to
    /// keep the budget.
    pub(crate) fn put(&mut self, key: &BlockKey, payload: &[u8]) {
        if self.index.contains(key.hash) || payload.len() != self.block_bytes {
            return;
        }
        let file = encode(self.namespace, key, payload);
        let size = file.len() as u64;
        if size > self.index.budget() {
            return;
        }
        let path = self.path(key.hash);
        if self.send(Op::Write { path, bytes: file }) {
            self.add(key.hash, size);
        }
    }

    /// Waits until every queued write and removal is done; no more are queued after it.
    fn flush(&mut self) {
        if let Some((tx, handle)) = self.writer.take() {
            drop(tx);
            let _ = handle.join();
        }
    }
}

impl Drop for DiskTier {
    /// Finishes the queued writes, so that what this process computed is there for the next one.
    fn drop(&mut self) {
        self.flush();
    }
}

fn run_op(op: Op) {
    match op {
        Op::Write { path, bytes } => {
            let tmp = path.with_extension(format!("{}.tmp", std::process::id()));
            let r = std::fs::write(&tmp, &bytes).and_then(|()| std::fs::rename(&tmp, &path));
            if let Err(e) = r {
                let _ = std::fs::remove_file(&tmp);
                tracing::warn!(file = %path.display(), "cannot write a prefix cache block: {e}");
            }
        }
        Op::Remove(path) => {
            let _ = std::fs::remove_file(path);
        }
        Op::Touch(path) => {
            if let Ok(f) = std::fs::File::options().append(true).open(&path) {
                let _ = f.set_modified(SystemTime::now());
            }
        }
    }
}

/// The block hash a file's name gives (`<16 hex digits>.kvb`).
fn hash_of_file(p: &Path) -> Option<BlockHash> {
    if p.extension()? != EXTENSION {
        return None;
    }
    let stem = p.file_stem()?.to_str()?;
    (stem.len() == 16).then(|| u64::from_str_radix(stem, 16).ok().map(BlockHash)).flatten()
}

/// A block file: magic, version, namespace, hash, parent (flag and hash), token count and tokens,
/// payload length and payload, then a CRC-32 of everything before it; integers little-endian.
fn encode(namespace: u64, key: &BlockKey, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + 4 * key.tokens.len() + payload.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&namespace.to_le_bytes());
    out.extend_from_slice(&key.hash.0.to_le_bytes());
    out.push(u8::from(key.parent.is_some()));
    out.extend_from_slice(&key.parent.map_or(0, |p| p.0).to_le_bytes());
    out.extend_from_slice(&(key.tokens.len() as u32).to_le_bytes());
    for t in key.tokens.iter() {
        out.extend_from_slice(&t.to_le_bytes());
    }
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(payload);
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// Reads a bounded little-endian field off the front of a byte slice.
struct Fields<'a>(&'a [u8]);

impl<'a> Fields<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], FileError> {
        if self.0.len() < n {
            return Err(FileError::Corrupt("truncated"));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u32(&mut self) -> Result<u32, FileError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64, FileError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
}

/// The key and payload of a block file, after checking its magic, version, checksum, lengths and
/// namespace.
fn decode(file: &[u8], namespace: u64) -> Result<(BlockKey, &[u8]), FileError> {
    if file.len() < MAGIC.len() + 4 + 4 || &file[..MAGIC.len()] != MAGIC {
        return Err(FileError::Corrupt("not a block file"));
    }
    let (body, crc) = file.split_at(file.len() - 4);
    if crc32fast::hash(body).to_le_bytes() != crc {
        return Err(FileError::Corrupt("checksum mismatch"));
    }
    let mut f = Fields(&body[MAGIC.len()..]);
    if f.u32()? != VERSION {
        return Err(FileError::Corrupt("another format version"));
    }
    let ns = f.u64()?;
    if ns != namespace {
        return Err(FileError::Foreign(ns));
    }
    let hash = BlockHash(f.u64()?);
    let has_parent = f.take(1)?[0];
    let parent = f.u64()?;
    let parent = match has_parent {
        0 => None,
        1 => Some(BlockHash(parent)),
        _ => return Err(FileError::Corrupt("bad parent flag")),
    };
    let n = f.u32()? as usize;
    let raw = f.take(n.checked_mul(4).ok_or(FileError::Corrupt("token count"))?)?;
    let tokens: Box<[TokenId]> = raw.chunks_exact(4).map(|b| TokenId::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    let len = usize::try_from(f.u64()?).map_err(|_| FileError::Corrupt("payload length"))?;
    let payload = f.take(len)?;
    if !f.0.is_empty() {
        return Err(FileError::Corrupt("trailing bytes"));
    }
    Ok((BlockKey { hash, parent, tokens }, payload))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_cache::block_hash::hash_block;

    fn key(parent: Option<BlockHash>, tokens: &[TokenId]) -> BlockKey {
        BlockKey { hash: hash_block(parent, tokens), parent, tokens: tokens.into() }
    }

    fn cfg(dir: &Path, max_bytes: u64) -> DiskTierConfig {
        DiskTierConfig { dir: dir.to_path_buf(), max_bytes, model_key: 7 }
    }

    #[test]
    fn a_block_written_by_one_tier_is_read_by_the_next_and_checked() {
        let tmp = tempfile::tempdir().unwrap();
        let a = key(None, &[1, 2, 3, 4]);
        let b = key(Some(a.hash), &[5, 6, 7, 8]);
        let payload: Vec<u8> = (0..64).collect();
        {
            let mut t = DiskTier::open(&cfg(tmp.path(), 1 << 20), 11, 64).unwrap();
            t.put(&a, &payload);
            t.put(&b, &payload.iter().map(|x| x ^ 0xff).collect::<Vec<_>>());
            t.put(&key(None, &[9, 9, 9, 9]), &payload[..10]); // not one block: refused
            assert_eq!(t.len(), 2);
        } // dropped: writes finished
        let mut t = DiskTier::open(&cfg(tmp.path(), 1 << 20), 11, 64).unwrap();
        assert_eq!(t.len(), 2, "the second process indexes the first one's files");
        assert_eq!(t.get(a.hash, None, &[1, 2, 3, 4]), Some(payload.clone()));
        assert_eq!(t.get(b.hash, Some(a.hash), &[5, 6, 7, 8]).map(|p| p[0]), Some(0xff));
        // a request whose tokens differ under the same hash (a forged collision) is not served
        assert_eq!(t.get(a.hash, None, &[1, 2, 3, 5]), None);
        // another namespace (model, KV type, shape) has its own folder: nothing there
        let mut other = DiskTier::open(&cfg(tmp.path(), 1 << 20), 12, 64).unwrap();
        assert_eq!(other.get(a.hash, None, &[1, 2, 3, 4]), None);
    }

    #[test]
    fn corrupt_truncated_and_foreign_files_are_ignored_never_loaded() {
        let tmp = tempfile::tempdir().unwrap();
        let blocks: Vec<BlockKey> = (0..4u32).map(|i| key(None, &[i, i, i, i])).collect();
        let payload = vec![42u8; 32];
        let mut t = DiskTier::open(&cfg(tmp.path(), 1 << 20), 5, 32).unwrap();
        for k in &blocks {
            t.put(k, &payload);
        }
        t.flush();
        let dir = tmp.path().join(format!("{:016x}", 5u64));
        let path = |k: &BlockKey| dir.join(format!("{:016x}.kvb", k.hash.0));
        // a flipped payload byte: the checksum fails
        let mut bytes = std::fs::read(path(&blocks[0])).unwrap();
        let at = bytes.len() - 10;
        bytes[at] ^= 1;
        std::fs::write(path(&blocks[0]), &bytes).unwrap();
        // cut short
        let bytes = std::fs::read(path(&blocks[1])).unwrap();
        std::fs::write(path(&blocks[1]), &bytes[..bytes.len() / 2]).unwrap();
        // a valid file of another namespace under this one's name
        std::fs::write(path(&blocks[2]), encode(6, &blocks[2], &payload)).unwrap();
        let mut t = DiskTier::open(&cfg(tmp.path(), 1 << 20), 5, 32).unwrap();
        assert_eq!(t.len(), 4);
        for k in &blocks[..3] {
            assert_eq!(t.get(k.hash, None, &k.tokens), None, "{k:?}");
            assert!(!t.contains(k.hash), "dropped from the index");
        }
        assert_eq!(t.get(blocks[3].hash, None, &blocks[3].tokens), Some(payload));
        t.flush();
        assert!(!path(&blocks[0]).exists() && !path(&blocks[1]).exists(), "corrupt files are removed");
        assert!(path(&blocks[2]).exists(), "a foreign file is left alone");
    }

    #[test]
    fn the_budget_holds_and_the_least_recently_used_go_first_across_restarts() {
        let tmp = tempfile::tempdir().unwrap();
        let payload = vec![1u8; 1000];
        let file_size = encode(1, &key(None, &[0; 4]), &payload).len() as u64;
        let blocks: Vec<BlockKey> = (0..3u32).map(|i| key(None, &[i; 4])).collect();
        {
            let mut t = DiskTier::open(&cfg(tmp.path(), 3 * file_size), 1, 1000).unwrap();
            for k in &blocks {
                t.put(k, &payload);
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            t.flush();
        }
        let mut t = DiskTier::open(&cfg(tmp.path(), 3 * file_size), 1, 1000).unwrap();
        // block 0 used: block 1 is now the least recently used
        assert!(t.get(blocks[0].hash, None, &blocks[0].tokens).is_some());
        t.put(&key(None, &[9; 4]), &payload);
        assert!(t.used() <= 3 * file_size);
        assert!(t.contains(blocks[0].hash) && !t.contains(blocks[1].hash) && t.contains(blocks[2].hash));
        t.flush();
        let files = std::fs::read_dir(t.dir()).unwrap().count();
        assert_eq!(files, 3, "the evicted file was removed");
        // a smaller budget at the next start trims to it
        let t = DiskTier::open(&cfg(tmp.path(), file_size), 1, 1000).unwrap();
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn the_model_key_follows_the_bytes() {
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("m.gguf");
        std::fs::write(&p, vec![3u8; 100_000]).unwrap();
        let k1 = model_key(&p).unwrap();
        assert_eq!(model_key(&p).unwrap(), k1);
        let mut b = vec![3u8; 100_000];
        b[50_000] = 4;
        std::fs::write(&p, b).unwrap();
        assert_ne!(model_key(&p).unwrap(), k1);
        assert_ne!(namespace(k1, "f16 bs16"), namespace(k1, "q8_0 bs16"));
    }
}
