//! Invariant 1 of docs/architecture.md (batch invariance): a sequence's logits do not depend on how its prompt is chunked, on
//! which sequences share its batch, or on the thread count — bit for bit. On the tiny random model
//! (always) and on the default model (when SPECULA_MODEL is set; required under CI).

mod common;

use specula_model::load_model;
use specula_model::testing::{model_for_tests, write_tiny_llama, GgmlDType, TinySpec};

#[test]
fn tiny_model_chunked_prefill_is_bitwise_identical_to_one_shot() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    write_tiny_llama(&path, &TinySpec::default()).unwrap();
    let m = load_model(&path).unwrap();
    let prompt: Vec<u32> = "Once upon a time, in a land far away, there lived a small model.".bytes().map(u32::from).collect();
    let one_shot = common::logits_alone(&m.model, &prompt, &[prompt.len()], 2);
    for chunks in [&[1][..], &[3], &[7, 100], &[16], &[15, 1, 17]] {
        let chunked = common::logits_alone(&m.model, &prompt, chunks, 2);
        common::assert_bitwise_eq(&format!("chunks {chunks:?}"), &one_shot, &chunked, m.model.config.vocab_size);
    }
}

#[test]
fn tiny_model_is_batch_invariant_on_int8_and_f32_paths() {
    let dir = tempfile::tempdir().unwrap();
    for f in [GgmlDType::Q4_1, GgmlDType::Q8_0, GgmlDType::F32] {
        let path = dir.path().join(format!("tiny-{f:?}.gguf"));
        write_tiny_llama(&path, &TinySpec { weight_format: f, seed: 7, ..Default::default() }).unwrap();
        let m = load_model(&path).unwrap();
        let prompt: Vec<u32> = (0..75u32).map(|i| (i * 37 + 11) % 259).collect();
        common::assert_batch_invariant(&m.model, &prompt);
    }
}

/// A hybrid (Gated DeltaNet and gated attention, Qwen3.5's): each sequence's recurrent state is
/// its own, whatever shares the batch, and the delta rule reduces in the same order on any thread.
#[test]
fn hybrid_model_is_batch_invariant() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny-qwen35.gguf");
    let spec = TinySpec { arch: specula_model::Arch::Qwen35, layers: 4, weight_format: GgmlDType::Q8_0, seed: 9, ..Default::default() };
    write_tiny_llama(&path, &spec).unwrap();
    let m = load_model(&path).unwrap();
    let prompt: Vec<u32> = (0..75u32).map(|i| (i * 37 + 11) % 259).collect();
    common::assert_batch_invariant(&m.model, &prompt);
    // the MoE hybrid (qwen35moe): routed experts and a gated shared expert after each mixer
    let path = dir.path().join("tiny-qwen35moe.gguf");
    let moe = specula_model::testing::TinyMoe { experts: 8, used: 2, shared_ffn: Some(32), ..Default::default() };
    specula_model::testing::write_tiny_moe(&path, &TinySpec { arch: specula_model::Arch::Qwen35Moe, moe: Some(moe), ..spec }).unwrap();
    let m = load_model(&path).unwrap();
    assert!(m.model.config.moe.as_ref().is_some_and(|c| c.norm_topk && c.shared_ffn == Some(32)));
    common::assert_batch_invariant(&m.model, &prompt);
}

#[test]
fn default_model_is_batch_invariant() {
    let Some(path) = model_for_tests("default_model_is_batch_invariant") else { return };
    let m = load_model(&path).unwrap();
    let text = "<|im_start|>user\nWrite a short poem about the sea, the wind and a lighthouse keeper who counts the waves.<|im_end|>\n<|im_start|>assistant\n";
    let prompt = m.tokenizer.encode(text).unwrap();
    assert!(prompt.len() > 24, "prompt of {} tokens is too short to chunk", prompt.len());
    common::assert_batch_invariant(&m.model, &prompt);
}
