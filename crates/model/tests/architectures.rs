//! Qwen2, Qwen3, Gemma 3 and Llama 3 RoPE scaling on tiny random models: the loader reads each
//! architecture's switches, a prompt gives the same logits however it is chunked, sliding-window
//! layers forget what lies outside their window, and the load errors name what is wrong.
//! (Numerical agreement with an independent reference is python/tests/test_real_models.py.)

mod common;

use common::logits_alone;
use specula_model::config::{Activation, AttentionKind};
use specula_model::testing::{write_tiny_llama, GgmlDType, TinySpec};
use specula_model::{load_model, Arch, LlamaModel};
use std::path::Path;

fn tiny(dir: &Path, name: &str, spec: &TinySpec) -> LlamaModel {
    let path = dir.join(format!("{name}.gguf"));
    write_tiny_llama(&path, spec).unwrap();
    load_model(&path).unwrap_or_else(|e| panic!("{name}: {e}")).model
}

fn spec(arch: Arch) -> TinySpec {
    TinySpec { arch, weight_format: GgmlDType::Q8_0, seed: 5, ..Default::default() }
}

fn prompt(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + 11) % 259).collect()
}

#[test]
fn each_architecture_loads_its_switches() {
    let dir = tempfile::tempdir().unwrap();
    let q2 = tiny(dir.path(), "qwen2", &spec(Arch::Qwen2));
    let o = &q2.config.arch_options;
    assert!(o.qkv_bias && !o.qk_norm && !o.post_norms && q2.config.rope_neox);
    assert!(q2.extras.iter().all(|e| e.q_bias.is_some() && e.q_norm.is_none()));

    let q3 = tiny(dir.path(), "qwen3", &spec(Arch::Qwen3));
    let o = &q3.config.arch_options;
    assert!(!o.qkv_bias && o.qk_norm && !o.post_norms && q3.config.rope_neox);

    let g = tiny(dir.path(), "gemma3", &TinySpec { head_dim: Some(32), layers: 4, ..spec(Arch::Gemma3) });
    let (c, o) = (&g.config, &g.config.arch_options);
    assert!(o.qk_norm && o.post_norms && c.rope_neox && o.activation == Activation::GeluTanhGate);
    assert_eq!((c.head_dim, c.q_width(), c.hidden_size), (32, 128, 64), "head_dim is independent of hidden / heads");
    assert_eq!(o.embed_scale, 8.0);
    assert_eq!(c.attn_scale(), 1.0 / 32f32.sqrt());
    let kinds: Vec<AttentionKind> = (0..4).map(|l| c.attention_kind(l)).collect();
    let local = AttentionKind::Sliding { window: 4 };
    assert_eq!(kinds, [local, AttentionKind::Global, local, AttentionKind::Global]);

    // gpt-oss: biases, sinks, every other layer sliding with the model's own (YaRN) RoPE, clamped
    // SwiGLU experts with biases and a router bias
    let moe = specula_model::testing::TinyMoe { experts: 4, used: 2, ..Default::default() };
    let oss = tiny(dir.path(), "gpt-oss", &TinySpec { layers: 4, moe: Some(moe), ..spec(Arch::GptOss) });
    let (c, o) = (&oss.config, &oss.config.arch_options);
    assert!(o.qkv_bias && o.attn_out_bias && o.attn_sinks && c.rope_neox && o.activation == Activation::SwigluOai);
    let y = o.rope_yarn.as_ref().expect("YaRN from rope.scaling.type");
    assert_eq!((y.factor, y.original_context_length, y.ext_factor), (4.0, 64, 1.0));
    assert!((y.mscale() - (1.0 + 0.1 * 4f32.ln())).abs() < 1e-6, "cos and sin grow by 1 + 0.1 ln(factor)");
    let kinds: Vec<AttentionKind> = (0..4).map(|l| c.attention_kind(l)).collect();
    assert_eq!(kinds, [local, AttentionKind::Global, local, AttentionKind::Global]);
    assert!(oss.rope_sliding.is_none(), "the local layers rotate like the global ones");
    assert!(oss.extras.iter().all(|e| e.o_bias.is_some() && e.sinks.as_ref().is_some_and(|s| s.len() == c.n_heads)));
    for l in &oss.layers {
        let specula_model::llama::FeedForward::Moe(m) = &l.ffn else { panic!("gpt-oss is a mixture of experts") };
        assert!(m.router_bias.is_some() && m.experts.iter().flatten().all(|e| e.bias.is_some()));
    }

    // SmolLM3: Llama's block, every 4th layer without RoPE
    let s3 = tiny(dir.path(), "smollm3", &TinySpec { layers: 8, ..spec(Arch::SmolLm3) });
    let rotating: Vec<bool> = (0..8).map(|l| s3.config.layer_uses_rope(l)).collect();
    assert_eq!(rotating, [true, true, true, false, true, true, true, false]);
    assert!(!s3.config.rope_neox);

    // Phi-3: fused Q/K/V and gate/up split at load, NeoX RoPE over 8 of 16 dimensions, the
    // LongRoPE attention factor from the file
    let p3 = tiny(dir.path(), "phi3", &TinySpec { rope_dims: Some(8), ..spec(Arch::Phi3) });
    let (c, o) = (&p3.config, &p3.config.arch_options);
    assert!(c.rope_neox && (c.rope_dims(), c.head_dim) == (8, 16), "{:?}", o.rope_dims);
    assert!((o.rope_mscale - 1.1902381).abs() < 1e-6);
    let l = p3.layers[0].attention().expect("an attention layer");
    assert_eq!((l.wq.rows, l.wk.rows, l.wv.rows, l.wq.cols), (64, 32, 32, 64));
    // LongRoPE: the short factors within the original context (512 here), the long ones beyond
    let mut p3 = p3;
    let short = logits_alone(&p3, &prompt(12), &[12], 1);
    p3.fit_context(512);
    assert_eq!(logits_alone(&p3, &prompt(12), &[12], 1), short, "within the original context: the short factors");
    p3.fit_context(2048);
    let long = logits_alone(&p3, &prompt(12), &[12], 1);
    assert_ne!(long, short, "beyond it: the long factors");
    assert_eq!(long[..259], short[..259], "position 0 rotates by nothing either way");

    let l3 = tiny(dir.path(), "llama3", &TinySpec { rope_llama3: true, ..spec(Arch::Llama) });
    let r = l3.config.arch_options.rope_llama3.as_ref().expect("llama3 scaling read");
    assert_eq!((r.factor, r.low_freq_factor, r.high_freq_factor, r.original_context_length), (8.0, 1.0, 4.0, 32));
}

/// The descriptor table is what the loader goes by: every family written by the tiny writer
/// loads with its descriptor's switches, RoPE style, FFN norm, top-k rule, sliding layers and
/// the chat format's BOS and EOS (a mixture of experts for each family whose experts are
/// supported, its file asking not to renormalise).
#[test]
fn every_family_loads_what_its_descriptor_says() {
    use specula_model::arch::{NormTopK, TinyChat};
    use specula_model::testing::TinyMoe;
    let dir = tempfile::tempdir().unwrap();
    for arch in Arch::ALL {
        let d = arch.descriptor();
        let dense = TinySpec { layers: 4, ..spec(arch) };
        let moe = TinySpec { moe: Some(TinyMoe { norm_topk: Some(false), ..Default::default() }), ..dense.clone() };
        let moe_ok = d.activation != Activation::GeluTanhGate;
        for (kind, s) in [("dense", Some(dense)), ("moe", moe_ok.then_some(moe))] {
            let Some(s) = s else { continue };
            let path = dir.path().join(format!("{arch}-{kind}.gguf"));
            write_tiny_llama(&path, &s).unwrap_or_else(|e| panic!("{arch} {kind}: {e}"));
            let m = load_model(&path).unwrap_or_else(|e| panic!("{arch} {kind}: {e}"));
            let (c, o) = (&m.model.config, &m.model.config.arch_options);
            let what = format!("{arch} {kind}");
            assert_eq!(c.arch, arch, "{what}");
            assert_eq!(
                (o.qkv_bias, o.qk_norm, o.post_norms, o.attn_out_bias, o.attn_sinks),
                (d.qkv_bias, d.qk_norm, d.post_norms, d.attn_out_bias, d.attn_sinks),
                "{what}"
            );
            assert_eq!((o.activation, o.embed_scale, o.no_rope_period), (d.activation, d.embed_scale.factor(c.hidden_size), d.no_rope_period), "{what}");
            assert_eq!(c.rope_neox, d.rope_neox, "{what}");
            assert_eq!(o.rope_mscale != 1.0, d.long_rope, "{what}: LongRoPE's attention factor");
            match (&o.sliding, d.sliding) {
                (None, None) => {}
                (Some(w), Some(sl)) => {
                    let period = if d.tiny.sliding_pattern_key { s.sliding_period } else { sl.default_period as usize };
                    assert_eq!((w.window, w.period, w.rope_theta), (s.sliding_window, period, sl.local_rope_base), "{what}");
                    assert_eq!(m.model.rope_sliding.is_some(), sl.local_rope_base.is_some(), "{what}: the local layers' own RoPE");
                }
                (got, want) => panic!("{what}: sliding {got:?}, descriptor {want:?}"),
            }
            assert_eq!(o.rope_yarn.is_some(), d.tiny.yarn, "{what}");
            assert!(m.model.layers.iter().all(|l| l.ffn_norm.len() == c.hidden_size), "{what}: {} read", d.ffn_norm);
            if let Some(moe) = &c.moe {
                let want = match d.norm_topk {
                    NormTopK::Fixed(on) => on,
                    NormTopK::FromFile => false,
                };
                assert_eq!(moe.norm_topk, want, "{what}");
            }
            let TinyChat { template, bos, eos, .. } = &d.tiny.chat;
            let text = |id: Option<u32>| id.and_then(|i| m.tokenizer.id_to_token(i));
            assert_eq!(text(m.tokenizer.bos).as_deref(), Some(*bos), "{what}");
            assert_eq!(text(m.tokenizer.eos.first().copied()).as_deref(), Some(*eos), "{what}");
            // without a template of its own a file falls back to ChatML (every tiny file has <|im_start|>)
            assert!(m.chat_template.is_some(), "{what}: template {}", template.is_some());
        }
    }
}

/// Whole prompt, one token at a time, and uneven chunks: bitwise the same logits, for every
/// architecture (the sliding window is applied per query row, whatever the chunk).
#[test]
fn logits_do_not_depend_on_chunking_in_any_architecture() {
    let dir = tempfile::tempdir().unwrap();
    let p = prompt(29);
    for (name, s) in [
        ("qwen2", spec(Arch::Qwen2)),
        ("qwen3", spec(Arch::Qwen3)),
        ("gemma3", TinySpec { head_dim: Some(32), layers: 3, sliding_window: 5, ..spec(Arch::Gemma3) }),
        ("llama3", TinySpec { rope_llama3: true, ..spec(Arch::Llama) }),
        ("smollm3", TinySpec { layers: 4, ..spec(Arch::SmolLm3) }),
        ("phi3", TinySpec { rope_dims: Some(8), ..spec(Arch::Phi3) }),
        // three Gated DeltaNet layers and a gated-attention one: the recurrent state carries
        // across chunks, and a RoPE pair in the fourth section stays unrotated (rope dims 8: sections [2, 2, 0, 0])
        ("qwen35", TinySpec { layers: 4, ..spec(Arch::Qwen35) }),
        ("qwen35-rope8", TinySpec { layers: 4, rope_dims: Some(8), ..spec(Arch::Qwen35) }),
    ] {
        let m = tiny(dir.path(), name, &s);
        let whole = logits_alone(&m, &p, &[p.len()], 2);
        assert!(whole.iter().all(|v| v.is_finite()), "{name}");
        assert_eq!(logits_alone(&m, &p, &[1], 1), whole, "{name}: one token at a time");
        assert_eq!(logits_alone(&m, &p, &[3, 7, 2], 2), whole, "{name}: chunks of 3, 7, 2, 2, ...");
    }
}

/// Two local layers of window 4: position p sees tokens back to p - 6 and no further, so
/// changing token 0 changes the logits at positions 0..=6 and none after. With the second layer
/// global (the default period of 2), every later position changes.
#[test]
fn sliding_window_layers_forget_tokens_outside_the_window() {
    let dir = tempfile::tempdir().unwrap();
    let vocab = 259;
    let (a, mut b) = (prompt(16), prompt(16));
    b[0] = (a[0] + 1) % 259;
    let changed = |m: &LlamaModel| -> Vec<bool> {
        let (x, y) = (logits_alone(m, &a, &[16], 1), logits_alone(m, &b, &[16], 1));
        (0..16).map(|p| x[p * vocab..(p + 1) * vocab] != y[p * vocab..(p + 1) * vocab]).collect()
    };
    let local = tiny(dir.path(), "all-local", &TinySpec { sliding_window: 4, sliding_period: 3, ..spec(Arch::Gemma3) });
    assert!((0..2).all(|l| matches!(local.config.attention_kind(l), AttentionKind::Sliding { .. })));
    let c = changed(&local);
    assert!(c[..7].iter().all(|&x| x), "{c:?}");
    assert!(c[7..].iter().all(|&x| !x), "{c:?}");
    let mixed = tiny(dir.path(), "local-global", &TinySpec { sliding_window: 4, sliding_period: 2, ..spec(Arch::Gemma3) });
    assert!(changed(&mixed).iter().all(|&x| x));
}

#[test]
fn llama3_rope_scaling_changes_only_rotated_positions() {
    let dir = tempfile::tempdir().unwrap();
    let p = prompt(12);
    let plain = logits_alone(&tiny(dir.path(), "plain", &spec(Arch::Llama)), &p, &[12], 1);
    let scaled = logits_alone(&tiny(dir.path(), "scaled", &TinySpec { rope_llama3: true, ..spec(Arch::Llama) }), &p, &[12], 1);
    let v = 259;
    assert_eq!(plain[..v], scaled[..v], "position 0 is not rotated");
    assert_ne!(plain[v..], scaled[v..], "later positions see the scaled frequencies");
}

fn load_err(dir: &Path, name: &str, spec: &TinySpec) -> String {
    let path = dir.join(format!("{name}.gguf"));
    write_tiny_llama(&path, spec).unwrap();
    let e = load_model(&path).err().unwrap_or_else(|| panic!("{name} loaded")).to_string();
    assert!(!e.contains('\n'), "one line: {e}");
    e
}

#[test]
fn unknown_architecture_and_missing_tensors_are_one_line_errors_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    // a Llama file whose `general.architecture` is renamed in place (same length)
    let path = dir.path().join("mamba.gguf");
    write_tiny_llama(&path, &spec(Arch::Llama)).unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    let key = b"general.architecture";
    let at = bytes.windows(key.len()).position(|w| w == key).expect("the key") + key.len() + 4 + 8; // value type, string length
    assert_eq!(&bytes[at..at + 5], b"llama");
    bytes[at..at + 5].copy_from_slice(b"mamba");
    std::fs::write(&path, bytes).unwrap();
    let e = load_model(&path).err().expect("mamba loaded").to_string();
    assert!(!e.contains('\n'), "one line: {e}");
    assert!(e.contains("architecture 'mamba'") && e.contains(&format!("(supported: {})", Arch::supported_names())), "{e}");
    for (arch, tensor) in [
        (Arch::Qwen2, "blk.1.attn_k.bias"),
        (Arch::Qwen3, "blk.0.attn_q_norm.weight"),
        (Arch::Gemma3, "blk.1.post_ffw_norm.weight"),
        (Arch::Llama, "blk.0.ffn_up.weight"),
    ] {
        let e = load_err(dir.path(), arch.name(), &TinySpec { omit_tensors: vec![tensor.into()], ..spec(arch) });
        assert!(e.contains(tensor) && e.contains("missing"), "{arch}: {e}");
    }
    // Q8_K is ggml's activation format: no weight file has it, so nothing loads it
    let q8k = vec![("blk.0.attn_q.weight".into(), GgmlDType::Q8K)];
    let e = load_err(dir.path(), "q8k", &TinySpec { hidden: 256, tensor_formats: q8k, ..spec(Arch::Qwen2) });
    assert!(e.contains("blk.0.attn_q.weight") && e.contains("Q8_K"), "{e}");
}
