//! Loading: every bad file is a clear error (never a panic), and the tiny random model written
//! by `specula_model::testing` loads in every supported weight format and runs.

mod common;

use specula_model::testing::{write_tiny_llama, GgmlDType, TinySpec, TINY_IM_END, TINY_IM_START, TINY_VOCAB};
use specula_model::{load_model, LoadedModel, Mixer, ModelError};
use std::path::{Path, PathBuf};

fn tiny(dir: &Path, name: &str, spec: &TinySpec) -> PathBuf {
    let path = dir.join(name);
    write_tiny_llama(&path, spec).expect("write tiny model");
    path
}

fn load_err(path: &Path) -> ModelError {
    match load_model(path) {
        Ok(_) => panic!("{} loaded but should not have", path.display()),
        Err(e) => e,
    }
}

#[test]
fn missing_file_names_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("no-such-model.gguf");
    let err = load_err(&path);
    assert!(matches!(err, ModelError::Io { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("no-such-model.gguf") && msg.contains("cannot open"), "{msg}");
}

#[test]
fn file_that_is_not_gguf_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("notes.gguf");
    std::fs::write(&path, "this is a text file, not a model\n".repeat(20)).unwrap();
    let err = load_err(&path);
    assert!(matches!(err, ModelError::BadGguf { .. }), "{err:?}");
    assert!(err.to_string().contains("notes.gguf is not a valid GGUF file"), "{err}");
}

#[test]
fn empty_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("empty.gguf");
    std::fs::write(&path, b"").unwrap();
    assert!(matches!(load_err(&path), ModelError::BadGguf { .. }));
}

#[test]
fn truncated_gguf_is_refused_as_truncated() {
    let dir = tempfile::tempdir().unwrap();
    let full = std::fs::read(tiny(dir.path(), "full.gguf", &TinySpec::default())).unwrap();
    let path = dir.path().join("half.gguf");
    std::fs::write(&path, &full[..full.len() / 2]).unwrap();
    let err = load_err(&path);
    let msg = err.to_string();
    assert!(matches!(err, ModelError::BadGguf { .. }), "{err:?}");
    assert!(msg.contains("half.gguf") && msg.contains("truncated"), "{msg}");
}

#[test]
fn gguf_cut_anywhere_is_an_error_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let full = std::fs::read(tiny(dir.path(), "full.gguf", &TinySpec::default())).unwrap();
    let path = dir.path().join("cut.gguf");
    // every byte of the header region (magic, counts, metadata, tensor directory), then strides
    // through the tensor data, and one byte short of the end
    let mut cuts: Vec<usize> = (0..64).collect();
    cuts.extend((64..8192.min(full.len())).step_by(13));
    cuts.extend((8192..full.len()).step_by(997));
    cuts.push(full.len() - 1);
    for cut in cuts {
        std::fs::write(&path, &full[..cut]).unwrap();
        match load_model(&path) {
            Ok(_) => panic!("a file cut to {cut} of {} bytes loaded", full.len()),
            Err(e) => assert!(matches!(e, ModelError::BadGguf { .. }), "cut at {cut}: {e:?}"),
        }
    }
}

#[test]
fn unsupported_tensor_type_names_the_tensor_and_type() {
    let dir = tempfile::tempdir().unwrap();
    // Q8_K (blocks of 256, so a hidden size of 256: ggml's activation format, never a weight
    // format specula reads); Q2_K and Q3_K load since their kernels
    let spec = TinySpec { hidden: 256, tensor_formats: vec![("blk.1.attn_v.weight".into(), GgmlDType::Q8K)], ..Default::default() };
    let err = load_err(&tiny(dir.path(), "q8k.gguf", &spec));
    assert!(matches!(err, ModelError::UnsupportedTensorType { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("blk.1.attn_v.weight") && msg.contains("Q8_K") && msg.contains("supported:"), "{msg}");
}

/// Q2_K and Q3_K tensors (quantized by candle, an independent quantizer) load with their own
/// integer kernels, and the logits equal, up to the int8 rounding of the activations, those of the
/// same model with those tensors dequantized to F32 (the dequantization itself is checked against
/// the `gguf` package in python/tests/test_kquant_oracle.py).
#[test]
fn q2k_and_q3k_tensors_load_and_run_like_their_dequantized_weights() {
    use specula_kernels::{QMatrix, WeightBytes, WeightFormat};
    use specula_model::llama::FeedForward;
    fn as_f32(m: &QMatrix) -> QMatrix {
        let mut out = vec![0f32; m.rows * m.cols];
        for r in 0..m.rows {
            m.dequantize_row_into(r, &mut out[r * m.cols..(r + 1) * m.cols]);
        }
        let bytes = out.iter().flat_map(|x| x.to_le_bytes()).collect();
        QMatrix::new(WeightFormat::F32, m.rows, m.cols, WeightBytes::owned(bytes), "dequantized").unwrap()
    }
    let dir = tempfile::tempdir().unwrap();
    let prompt: Vec<u32> = "The quick brown fox jumps over the lazy dog.".bytes().map(u32::from).collect();
    let low = [
        ("blk.0.attn_q.weight", GgmlDType::Q2K),
        ("blk.0.attn_v.weight", GgmlDType::Q3K),
        ("blk.1.ffn_up.weight", GgmlDType::Q2K),
        ("blk.1.ffn_gate.weight", GgmlDType::Q3K),
    ];
    let spec = TinySpec {
        hidden: 256,
        ffn: 256,
        weight_format: GgmlDType::F32,
        tensor_formats: low.iter().map(|(n, f)| (n.to_string(), *f)).collect(),
        ..Default::default()
    };
    let path = tiny(dir.path(), "low.gguf", &spec);
    let m = load_model(&path).unwrap_or_else(|e| panic!("Q2_K / Q3_K: {e}"));
    let l = &m.model.layers;
    let a0 = l[0].attention().expect("an attention layer");
    assert_eq!([a0.wq.format, a0.wv.format], [WeightFormat::Q2K, WeightFormat::Q3K]);
    let mut r = load_model(&path).unwrap();
    let Mixer::Attention(l0) = &mut r.model.layers[0].mixer else { panic!("an attention layer") };
    (l0.wq, l0.wv) = (as_f32(&l0.wq), as_f32(&l0.wv));
    let FeedForward::Dense(ffn) = &mut r.model.layers[1].ffn else { panic!("a dense model") };
    (ffn.up, ffn.gate) = (as_f32(&ffn.up), as_f32(&ffn.gate));
    let logits = common::logits_alone(&m.model, &prompt, &[prompt.len()], 2);
    let reference = common::logits_alone(&r.model, &prompt, &[prompt.len()], 2);
    assert!(logits.iter().all(|x| x.is_finite()), "non-finite logits");
    let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (*x as f64) * (*y as f64)).sum::<f64>();
    for pos in 0..prompt.len() {
        let (a, b) = (&logits[pos * TINY_VOCAB..(pos + 1) * TINY_VOCAB], &reference[pos * TINY_VOCAB..(pos + 1) * TINY_VOCAB]);
        let cos = dot(a, b) / (dot(a, a) * dot(b, b)).sqrt();
        // int8 activations (blocks of 32) move logits by about 1%: a wrong scale or bit layout
        // moves them by far more
        assert!(cos > 0.995, "position {pos}: cosine {cos} to the dequantized weights' logits");
    }
}

#[test]
fn tiny_model_has_the_spec_shape_and_tokenizer() {
    let dir = tempfile::tempdir().unwrap();
    let m: LoadedModel = load_model(&tiny(dir.path(), "tiny.gguf", &TinySpec::default())).unwrap();
    let c = &m.model.config;
    assert_eq!((c.vocab_size, c.hidden_size, c.intermediate_size, c.n_layers), (TINY_VOCAB, 64, 128, 2));
    assert_eq!((c.n_heads, c.n_kv_heads, c.head_dim, c.context_length), (4, 2, 16, 512));
    assert!(c.tied_embeddings);
    assert_eq!(m.tokenizer.vocab_size(), TINY_VOCAB);
    assert_eq!(m.tokenizer.bos, Some(TINY_IM_START));
    assert_eq!(m.tokenizer.eos, vec![TINY_IM_END]);
    assert!(!m.tokenizer.add_bos);
    assert!(m.chat_template.is_some(), "ChatML tokens present: the ChatML template applies");

    // byte-level with no merges: one token per byte, control tokens matched whole
    let text = "héllo, wörld\n<|im_end|>";
    let ids = m.tokenizer.encode(text).unwrap();
    let bytes = "héllo, wörld\n".as_bytes();
    assert_eq!(&ids[..bytes.len()], &bytes.iter().map(|&b| b as u32).collect::<Vec<_>>()[..]);
    assert_eq!(ids[bytes.len()..], [TINY_IM_END]);
    assert_eq!(m.tokenizer.decode(&ids, false).unwrap(), text);
}

#[test]
fn tiny_model_runs_in_every_supported_format() {
    let dir = tempfile::tempdir().unwrap();
    let prompt: Vec<u32> = "The quick brown fox jumps over the lazy dog.".bytes().map(u32::from).collect();
    let formats = [GgmlDType::Q4_1, GgmlDType::Q4_0, GgmlDType::Q8_0, GgmlDType::F16, GgmlDType::F32];
    let mut last_rows = Vec::new();
    for (i, f) in formats.into_iter().enumerate() {
        for tied in [true, false] {
            let spec = TinySpec { weight_format: f, tied_embeddings: tied, ..Default::default() };
            let m = load_model(&tiny(dir.path(), &format!("tiny-{i}-{tied}.gguf"), &spec)).unwrap_or_else(|e| panic!("{f:?}: {e}"));
            assert_eq!(m.model.config.tied_embeddings, tied);
            let logits = common::logits_alone(&m.model, &prompt, &[prompt.len()], 2);
            assert_eq!(logits.len(), prompt.len() * TINY_VOCAB);
            assert!(logits.iter().all(|x| x.is_finite()), "{f:?}: non-finite logits");
            let last = &logits[(prompt.len() - 1) * TINY_VOCAB..];
            let (lo, hi) = last.iter().fold((f32::MAX, f32::MIN), |(lo, hi), &x| (lo.min(x), hi.max(x)));
            assert!(hi - lo > 1.0, "{f:?}: logits nearly flat ({lo}..{hi}): the random weights are too small");
            if tied {
                last_rows.push((f, last.to_vec()));
            }
        }
    }
    // the formats quantize the same random weights: F32 and F16 agree closely; Q8_0 less so
    let f32_row = &last_rows.iter().find(|(f, _)| *f == GgmlDType::F32).unwrap().1;
    let f16_row = &last_rows.iter().find(|(f, _)| *f == GgmlDType::F16).unwrap().1;
    let max_diff = f32_row.iter().zip(f16_row).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(max_diff < 0.05, "F16 logits drift {max_diff} from F32: same weights expected");
}
