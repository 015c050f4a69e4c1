//! `specula-train-head quantize`: rewrites a head file with its matrices as Q8_0 blocks (the
//! shipped form: serving runs the head as Q8_0 anyway, so the file then holds exactly the weights
//! served, in about half the bytes of F16). Vectors stay exact (F32).

use crate::fit::load_head_weights;
use anyhow::{Context, Result};
use clap::Args;
use specula_engine::speculative::mtp_format::{save_head, StoredDtype};
use specula_model::load_model;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct QuantizeArgs {
    /// The target the head drafts for (a GGUF file or model folder); the head is checked
    /// against it as serving would.
    #[arg(long, env = "SPECULA_MODEL")]
    pub model: PathBuf,
    /// Head file to read (any stored type).
    #[arg(long)]
    pub input: PathBuf,
    /// Where the Q8_0 head is written.
    #[arg(long)]
    pub out: PathBuf,
}

pub fn run(a: QuantizeArgs) -> Result<()> {
    let path = crate::target_model(&a.model)?.to_path_buf();
    let target = load_model(&path)?.model;
    let (cfg, w) = load_head_weights(&a.input, &target).with_context(|| format!("reading {}", a.input.display()))?;
    save_head(&a.out, &w, &cfg, StoredDtype::Q8_0)?;
    let size = |p: &PathBuf| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    eprintln!("wrote {} ({} bytes; {} had {})", a.out.display(), size(&a.out), a.input.display(), size(&a.input));
    Ok(())
}
