//! candle's own quantized Llama (candle-transformers' `quantized_llama`), timed on the same GGUF
//! as the first baseline of `specula bench offline`. Built only with the `candle-baseline` feature
//! (`cargo build --release -p specula --features candle-baseline`), so that the serving binary
//! does not compile candle-transformers; llama-family files only.

use anyhow::{Context, Result};
use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_llama::ModelWeights;
use std::path::Path;
use std::time::Instant;

pub const AVAILABLE: bool = true;

fn candle_model(path: &Path) -> Result<ModelWeights> {
    let mut f = std::fs::File::open(path)?;
    let content = gguf_file::Content::read(&mut f).context("candle could not read the GGUF")?;
    Ok(ModelWeights::from_gguf(content, &mut f, &Device::Cpu)?)
}

pub fn prefill_tps(path: &Path, prompt: &[u32]) -> Result<f64> {
    let mut m = candle_model(path)?;
    let x = Tensor::new(prompt, &Device::Cpu)?.unsqueeze(0)?;
    let start = Instant::now();
    m.forward(&x, 0)?;
    Ok(prompt.len() as f64 / start.elapsed().as_secs_f64())
}

pub fn decode_tps(path: &Path, batch: usize, steps: usize) -> Result<f64> {
    let mut m = candle_model(path)?;
    let prompt_len = 16;
    // candle's batched forward only handles one new position per sequence, so feed the prompt token by token
    let mut next = Tensor::zeros((batch, 1), candle_core::DType::U32, &Device::Cpu)?;
    for p in 0..prompt_len {
        let col: Vec<u32> = (0..batch as u32).map(|s| 200 + p as u32 * 13 + s).collect();
        let x = Tensor::new(col.as_slice(), &Device::Cpu)?.reshape((batch, 1))?;
        let logits = m.forward(&x, p)?;
        next = logits.argmax(candle_core::D::Minus1)?.reshape((batch, 1))?;
    }
    let start = Instant::now();
    for step in 0..steps {
        let logits = m.forward(&next, prompt_len + step)?;
        next = logits.argmax(candle_core::D::Minus1)?.reshape((batch, 1))?;
    }
    Ok((batch * steps) as f64 / start.elapsed().as_secs_f64())
}
