//! Loading a Hugging Face model folder: config.json, one or more *.safetensors (F32, F16 or
//! BF16 tensors, memory-mapped) and tokenizer.json (+ tokenizer_config.json's chat template).

use crate::arch::Arch;
use crate::chat::ChatTemplate;
use crate::config::ModelConfig;
use crate::llama::{AttentionWeights, FeedForward, LayerWeights, LlamaModel, Mixer};
use crate::loaded::LoadedModel;
use crate::moe::DenseFfn;
use crate::tokenizer::Tokenizer;
use crate::ModelError;
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;
use specula_kernels::{QMatrix, WeightBytes, WeightFormat};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

struct Entry {
    file: Arc<Mmap>,
    start: usize,
    len: usize,
    dtype: Dtype,
    shape: Vec<usize>,
}

fn io(path: &Path, e: std::io::Error) -> ModelError {
    ModelError::Io { path: path.display().to_string(), source: e }
}

fn read_json(path: &Path) -> Result<Value, ModelError> {
    let s = std::fs::read_to_string(path).map_err(|e| io(path, e))?;
    serde_json::from_str(&s).map_err(|e| ModelError::BadInput(format!("{} is not valid JSON: {e}", path.display())))
}

pub fn load(dir: &Path) -> Result<LoadedModel, ModelError> {
    let cfg = read_json(&dir.join("config.json"))?;
    let get = |k: &str| {
        cfg.get(k)
            .and_then(Value::as_u64)
            .map(|x| x as usize)
            .ok_or_else(|| ModelError::MissingMetadata(format!("cannot find {k} in {}/config.json", dir.display())))
    };
    // a folder is read as Llama's plain block (HF layout, no per-family switches)
    let model_type = cfg.get("model_type").and_then(Value::as_str).unwrap_or("llama");
    let arch = match Arch::from_name(model_type) {
        Some(a @ (Arch::Llama | Arch::Mistral)) => a,
        _ => return Err(ModelError::Unsupported(format!("model_type '{model_type}' is not supported (llama-family only)"))),
    };
    let hidden = get("hidden_size")?;
    let n_heads = get("num_attention_heads")?;
    let linear_scale = match cfg.get("rope_scaling") {
        Some(Value::Object(m)) if m.get("type").or(m.get("rope_type")).and_then(Value::as_str) == Some("linear") => {
            m.get("factor").and_then(Value::as_f64).unwrap_or(1.0) as f32
        }
        Some(Value::Object(_)) => return Err(ModelError::Unsupported("only linear rope_scaling is supported".into())),
        _ => 1.0,
    };
    let config = ModelConfig {
        arch,
        vocab_size: get("vocab_size")?,
        hidden_size: hidden,
        intermediate_size: get("intermediate_size")?,
        n_layers: get("num_hidden_layers")?,
        n_heads,
        n_kv_heads: get("num_key_value_heads").unwrap_or(n_heads),
        head_dim: get("head_dim").unwrap_or(hidden / n_heads.max(1)),
        rms_eps: cfg.get("rms_norm_eps").and_then(Value::as_f64).unwrap_or(1e-5) as f32,
        rope_theta: cfg.get("rope_theta").and_then(Value::as_f64).unwrap_or(10000.0) as f32,
        rope_linear_scale: linear_scale,
        rope_neox: true,
        context_length: get("max_position_embeddings").unwrap_or(2048),
        tied_embeddings: cfg.get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(false),
        moe: None,
        arch_options: Default::default(),
    };

    let mut entries: HashMap<String, Entry> = HashMap::new();
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| io(dir, e))?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(ModelError::BadInput(format!("no *.safetensors files in {}", dir.display())));
    }
    let mut weight_bytes = 0;
    for p in &files {
        let f = std::fs::File::open(p).map_err(|e| io(p, e))?;
        // SAFETY: read-only mapping of a file specula does not modify.
        let mmap = Arc::new(unsafe { Mmap::map(&f) }.map_err(|e| io(p, e))?);
        let st = SafeTensors::deserialize(&mmap).map_err(|e| ModelError::BadInput(format!("{}: {e}", p.display())))?;
        let base = mmap.as_ptr() as usize;
        for (name, view) in st.tensors() {
            let start = view.data().as_ptr() as usize - base;
            weight_bytes += view.data().len();
            entries.insert(name, Entry { file: mmap.clone(), start, len: view.data().len(), dtype: view.dtype(), shape: view.shape().to_vec() });
        }
    }
    let matrix = |name: &str| -> Result<QMatrix, ModelError> {
        let e = entries.get(name).ok_or_else(|| ModelError::BadTensor { name: name.into(), message: format!("missing from {}", dir.display()) })?;
        let format = match e.dtype {
            Dtype::F32 => WeightFormat::F32,
            Dtype::F16 => WeightFormat::F16,
            Dtype::BF16 => WeightFormat::BF16,
            other => return Err(ModelError::UnsupportedTensorType { name: name.into(), dtype: format!("{other:?}") }),
        };
        let (rows, cols) = match e.shape.as_slice() {
            [r, c] => (*r, *c),
            [c] => (1, *c),
            s => return Err(ModelError::BadTensor { name: name.into(), message: format!("unexpected shape {s:?}") }),
        };
        let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = e.file.clone();
        QMatrix::new(format, rows, cols, WeightBytes::new(owner, e.start, e.len), name)
            .map_err(|er| ModelError::BadTensor { name: name.into(), message: er.to_string() })
    };
    let vector = |name: &str| -> Result<Vec<f32>, ModelError> {
        let m = matrix(name)?;
        let mut v = vec![0f32; m.cols * m.rows];
        for r in 0..m.rows {
            m.dequantize_row_into(r, &mut v[r * m.cols..(r + 1) * m.cols]);
        }
        Ok(v)
    };
    let mut layers = Vec::new();
    for i in 0..config.n_layers {
        let p = |n: &str| format!("model.layers.{i}.{n}.weight");
        layers.push(LayerWeights {
            attn_norm: vector(&p("input_layernorm"))?,
            mixer: Mixer::Attention(AttentionWeights {
                wq: matrix(&p("self_attn.q_proj"))?,
                wk: matrix(&p("self_attn.k_proj"))?,
                wv: matrix(&p("self_attn.v_proj"))?,
                wo: matrix(&p("self_attn.o_proj"))?,
            }),
            ffn_norm: vector(&p("post_attention_layernorm"))?,
            ffn: FeedForward::Dense(DenseFfn::new(matrix(&p("mlp.gate_proj"))?, matrix(&p("mlp.up_proj"))?, matrix(&p("mlp.down_proj"))?)),
        });
    }
    let embed = matrix("model.embed_tokens.weight")?;
    let lm_head = if entries.contains_key("lm_head.weight") { matrix("lm_head.weight")? } else { embed.clone() };
    let model = LlamaModel::new(config, embed, layers, vector("model.norm.weight")?, lm_head, None)?;

    let id_of = |v: Option<&Value>| -> Vec<u32> {
        match v {
            Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
            Some(Value::Array(a)) => a.iter().filter_map(Value::as_u64).map(|x| x as u32).collect(),
            _ => vec![],
        }
    };
    let bos = id_of(cfg.get("bos_token_id")).first().copied();
    let mut eos = id_of(cfg.get("eos_token_id"));
    // transformers stops at generation_config.json's EOS list (Qwen2.5-Instruct: <|im_end|> and
    // <|endoftext|>; Phi-4-mini: <|endoftext|> and <|end|>), which config.json may not name
    let gen = dir.join("generation_config.json");
    if gen.exists() {
        for id in id_of(read_json(&gen)?.get("eos_token_id")) {
            if !eos.contains(&id) {
                eos.push(id);
            }
        }
    }
    let mut tokenizer = Tokenizer::from_file(&dir.join("tokenizer.json"), bos, eos)?;
    // and where a chat format ends a turn, as a GGUF's tokenizer does
    tokenizer.add_end_of_turn_tokens();
    let tc = dir.join("tokenizer_config.json");
    let chat_template = if tc.exists() {
        let t = read_json(&tc)?;
        // Llama-2/3 style folders ask for BOS here; encode() itself never adds it.
        tokenizer.add_bos = t.get("add_bos_token").and_then(Value::as_bool).unwrap_or(false);
        let tok_str = |k: &str| match t.get(k) {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Object(o)) => o.get("content").and_then(Value::as_str).unwrap_or("").to_string(),
            _ => String::new(),
        };
        match t.get("chat_template").and_then(Value::as_str) {
            Some(src) => Some(ChatTemplate::new(src, &tok_str("bos_token"), &tok_str("eos_token"))?),
            None => None,
        }
    } else {
        None
    };
    let name = dir.file_name().map(|s| s.to_string_lossy().to_string()).unwrap_or_else(|| "model".into());
    Ok(LoadedModel { model, tokenizer, chat_template, load_time: Default::default(), weight_bytes, name })
}
