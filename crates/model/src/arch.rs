//! The model families specula loads (`Arch`) and, per family, one `ArchDescriptor`: what the
//! family changes in the Llama block, which of its values the file gives (the loader reads them
//! from the keys named here), and what the tiny GGUF writer (`testing`) puts in its files.
//! Adding a family is one variant of `Arch` and one descriptor below. Plain data: the forward
//! pass never sees the family, only the switches the loader copies into `ArchOptions`.
//! Not here: reading a file (`loader`), the per-model values themselves (`ModelConfig`).

pub mod tiny_chat;

use tiny_chat::{HARMONY_TEMPLATE, HARMONY_TOKENS, PHI3_TEMPLATE, PHI3_TOKENS, QWEN3_TEMPLATE, SMOLLM3_TEMPLATE};

/// A model family, as a GGUF's `general.architecture` names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arch {
    Llama,
    Mistral,
    SmolLm3,
    Qwen2,
    Qwen2Moe,
    Qwen3,
    Qwen3Moe,
    Gemma3,
    Phi3,
    GptOss,
    Qwen35,
    Qwen35Moe,
    Qwen3Next,
}

impl Arch {
    /// Every family, in the order errors and `--help` list them.
    pub const ALL: [Arch; 13] = [
        Arch::Llama,
        Arch::Mistral,
        Arch::SmolLm3,
        Arch::Qwen2,
        Arch::Qwen2Moe,
        Arch::Qwen3,
        Arch::Qwen3Moe,
        Arch::Gemma3,
        Arch::Phi3,
        Arch::GptOss,
        Arch::Qwen35,
        Arch::Qwen35Moe,
        Arch::Qwen3Next,
    ];

    /// What this family is and does, as data.
    pub fn descriptor(self) -> &'static ArchDescriptor {
        match self {
            Arch::Llama => &LLAMA,
            Arch::Mistral => &MISTRAL,
            Arch::SmolLm3 => &SMOLLM3,
            Arch::Qwen2 => &QWEN2,
            Arch::Qwen2Moe => &QWEN2MOE,
            Arch::Qwen3 => &QWEN3,
            Arch::Qwen3Moe => &QWEN3MOE,
            Arch::Gemma3 => &GEMMA3,
            Arch::Phi3 => &PHI3,
            Arch::GptOss => &GPT_OSS,
            Arch::Qwen35 => &QWEN35,
            Arch::Qwen35Moe => &QWEN35MOE,
            Arch::Qwen3Next => &QWEN3NEXT,
        }
    }

    /// The `general.architecture` string, also the prefix of the family's metadata keys
    /// (`qwen2.block_count`).
    pub fn name(self) -> &'static str {
        self.descriptor().name
    }

    /// The family `general.architecture` names; `None` for one specula does not load.
    pub fn from_name(name: &str) -> Option<Arch> {
        Arch::ALL.into_iter().find(|a| a.name() == name)
    }

    /// Every family's name, comma-separated, for the errors that refuse another.
    pub fn supported_names() -> String {
        Arch::ALL.map(Arch::name).join(", ")
    }
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.name())
    }
}

/// A name that is not one of `Arch::ALL`'s.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown architecture '{0}' (supported: {list})", list = Arch::supported_names())]
pub struct UnknownArch(pub String);

impl std::str::FromStr for Arch {
    type Err = UnknownArch;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Arch::from_name(s).ok_or_else(|| UnknownArch(s.to_string()))
    }
}

/// Feed-forward gate: `act(x Wgate) * (x Wup)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// SwiGLU (Llama, Qwen).
    SiluGate,
    /// GeGLU with the tanh approximation of GELU (Gemma).
    GeluTanhGate,
    /// gpt-oss's clamped SwiGLU: `min(g, 7) * sigmoid(1.702 min(g, 7)) * (clamp(u, -7, 7) + 1)`.
    SwigluOai,
}

/// One family. The switches (`qkv_bias` .. `attn_sinks`) are copied into `ArchOptions` as they
/// are; the `Option`s and rules say which metadata the loader reads and what it falls back to.
#[derive(Clone, Debug, PartialEq)]
pub struct ArchDescriptor {
    /// `general.architecture`, and the prefix of every `{name}.*` metadata key.
    pub name: &'static str,
    /// Biases on the Q/K/V projections (`attn_{q,k,v}.bias`).
    pub qkv_bias: bool,
    /// RMSNorm of every query and key head before RoPE (`attn_{q,k}_norm`).
    pub qk_norm: bool,
    /// Gemma's "sandwich" norms on the attention and FFN outputs (`post_attention_norm`,
    /// `post_ffw_norm`).
    pub post_norms: bool,
    /// A bias on the attention output projection (`attn_output.bias`).
    pub attn_out_bias: bool,
    /// One learned logit per query head in every attention softmax (`attn_sinks.weight`).
    pub attn_sinks: bool,
    /// The feed-forward's gate, dense and experts alike.
    pub activation: Activation,
    /// The multiplier of the token embeddings on the way in.
    pub embed_scale: EmbedScale,
    /// Every `n`-th layer applies no RoPE (llama.cpp's `n_no_rope_layer_step`, fixed per family,
    /// never in the file).
    pub no_rope_period: Option<usize>,
    /// Sliding-window layers, their window from `{name}.attention.sliding_window` (required).
    pub sliding: Option<SlidingLayers>,
    /// RoPE rotates the halves of each head (NeoX, pairs `i`, `i + d/2`) rather than adjacent
    /// pairs (Llama's converter permutes Q/K for those).
    pub rope_neox: bool,
    /// Phi-3's LongRoPE: `{name}.rope.scaling.attn_factor` (default 1) scales cos and sin; the
    /// per-frequency factors are the `rope_factors_{short,long}` tensors, read whenever present.
    pub long_rope: bool,
    /// The name of each layer's pre-FFN norm (`blk.N.{ffn_norm}.weight`).
    pub ffn_norm: &'static str,
    /// Whether the chosen experts' weights are renormalised to sum to 1.
    pub norm_topk: NormTopK,
    /// llama.cpp's converter fuses Q, K and V into one `attn_qkv` (rows Q, K, V). The tiny writer
    /// writes them so; the loader takes either form from any file, by the tensors present.
    pub fused_qkv: bool,
    /// The dense FFN's gate and up are one `ffn_up` of twice the width, gate first (no
    /// `ffn_gate`). As `fused_qkv`: the writer's form, the loader takes either.
    pub fused_gate_up: bool,
    /// Gated DeltaNet layers between gated-attention ones (Qwen3.5): see [`Hybrid`].
    pub hybrid: Option<Hybrid>,
    /// What the tiny writer puts in this family's files.
    pub tiny: TinyFiles,
}

/// The embedding multiplier's rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EmbedScale {
    /// 1 (Llama).
    One,
    /// sqrt(hidden size) (Gemma).
    SqrtHidden,
}

impl EmbedScale {
    pub fn factor(self, hidden: usize) -> f32 {
        match self {
            EmbedScale::One => 1.0,
            EmbedScale::SqrtHidden => (hidden as f32).sqrt(),
        }
    }
}

/// A family with sliding-window layers: of every `period` layers the first `period - 1` are
/// local, the last global.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SlidingLayers {
    /// The period when the file has no `{name}.attention.sliding_window_pattern` (llama.cpp fixes
    /// it per family: Gemma 3's 6, gpt-oss's 2).
    pub default_period: u32,
    /// The local layers' own RoPE base when the file has no `{name}.rope.local.freq_base`;
    /// `None`: they rotate with the model's RoPE and the key is not read.
    pub local_rope_base: Option<f32>,
}

/// A hybrid family's layers, as llama.cpp's `qwen35` reads them: the recurrent ones from
/// `{name}.attention.recurrent_layers` when the file lists them, else every layer but each
/// `full_attention_interval`-th (default `default_interval`); the recurrent layers' shape from
/// `{name}.ssm.*`; the attention layers gated (`ArchOptions::attn_output_gate`), with RoPE in
/// interleaved sections (`rope.dimension_sections`: text positions rotate every section alike, a
/// pair of the fourth section not at all).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hybrid {
    pub default_interval: u32,
    /// Qwen3-Next's layout (llama.cpp's `qwen3next`): each key head's value heads in a run
    /// (`RecurrentConfig::heads_interleaved`), beta and alpha in one projection grouped per key
    /// head (`ssm_ba`; older files also fuse q, k, v and z per key head in `ssm_in`), and
    /// plain partial NeoX RoPE (no sections). Off: Qwen3.5's.
    pub next_layout: bool,
}

/// How a mixture of experts weighs its top-k experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormTopK {
    /// Fixed by the family, whatever the file says (llama.cpp's rule).
    Fixed(bool),
    /// `{name}.expert_weights_norm`, on when absent (Mixtral's rule).
    FromFile,
}

/// What `testing::write_tiny_llama` writes for a family beyond the switches above.
#[derive(Clone, Debug, PartialEq)]
pub struct TinyFiles {
    /// The chat format: its template, control tokens, BOS and EOS.
    pub chat: TinyChat,
    /// Writes `output.weight` even when the spec ties it to the embedding (llama.cpp's gpt-oss
    /// requires its own).
    pub own_output: bool,
    /// Biases on the router and on every expert (`ffn_gate_inp.bias`, `ffn_{gate,up,down}_exps.bias`).
    pub expert_biases: bool,
    /// Writes `attention.sliding_window_pattern` (the spec's period); without it the loader's
    /// `SlidingLayers::default_period` holds.
    pub sliding_pattern_key: bool,
    /// Declares YaRN scaling (gpt-oss's factor 32 over 4096 positions, scaled down: 4 over 64).
    pub yarn: bool,
    /// Writes `expert_feed_forward_length` (the expert width) as gpt-oss files do; the others
    /// give it as `feed_forward_length` only, as Mixtral's do.
    pub expert_ffn_key: bool,
}

/// A tiny file's chat format. Tokens are named by their text: the writer finds them in its
/// vocabulary (256 bytes, `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, then `extra_tokens`).
#[derive(Clone, Debug, PartialEq)]
pub struct TinyChat {
    /// `tokenizer.chat_template`; `None` writes none (the loader then falls back to ChatML).
    pub template: Option<&'static str>,
    /// Control tokens after the tiny vocabulary (ids 259...).
    pub extra_tokens: &'static [&'static str],
    pub bos: &'static str,
    /// Generation's end (`tokenizer.ggml.eos_token_id`); end-of-turn tokens stop it too.
    pub eos: &'static str,
}

const CHATML: TinyChat = TinyChat { template: None, extra_tokens: &[], bos: "<|im_start|>", eos: "<|im_end|>" };

/// Llama's block as every other family starts from it; each descriptor below says what differs.
const LLAMA: ArchDescriptor = ArchDescriptor {
    name: "llama",
    qkv_bias: false,
    qk_norm: false,
    post_norms: false,
    attn_out_bias: false,
    attn_sinks: false,
    activation: Activation::SiluGate,
    embed_scale: EmbedScale::One,
    no_rope_period: None,
    sliding: None,
    rope_neox: false,
    long_rope: false,
    ffn_norm: "ffn_norm",
    norm_topk: NormTopK::FromFile,
    fused_qkv: false,
    fused_gate_up: false,
    hybrid: None,
    tiny: TinyFiles { chat: CHATML, own_output: false, expert_biases: false, sliding_pattern_key: false, yarn: false, expert_ffn_key: false },
};

const MISTRAL: ArchDescriptor = ArchDescriptor { name: "mistral", ..LLAMA };

/// Llama's block; every 4th layer without RoPE (llama.cpp's `n_no_rope_layer_step`).
const SMOLLM3: ArchDescriptor = ArchDescriptor {
    name: "smollm3",
    no_rope_period: Some(4),
    tiny: TinyFiles { chat: TinyChat { template: Some(SMOLLM3_TEMPLATE), ..CHATML }, ..LLAMA.tiny },
    ..LLAMA
};

const QWEN2: ArchDescriptor = ArchDescriptor { name: "qwen2", qkv_bias: true, rope_neox: true, ..LLAMA };

/// Qwen2-MoE keeps the chosen experts' softmax weights as they are.
const QWEN2MOE: ArchDescriptor = ArchDescriptor { name: "qwen2moe", norm_topk: NormTopK::Fixed(false), ..QWEN2 };

const QWEN3: ArchDescriptor = ArchDescriptor {
    name: "qwen3",
    qk_norm: true,
    rope_neox: true,
    tiny: TinyFiles { chat: TinyChat { template: Some(QWEN3_TEMPLATE), ..CHATML }, ..LLAMA.tiny },
    ..LLAMA
};

/// Qwen3-MoE renormalises the chosen experts' weights.
const QWEN3MOE: ArchDescriptor = ArchDescriptor { name: "qwen3moe", norm_topk: NormTopK::Fixed(true), ..QWEN3 };

/// q/k norms, sandwich norms, GeGLU, embeddings times sqrt(hidden); 5 local layers (base 10000
/// unless the file says) then 1 global.
const GEMMA3: ArchDescriptor = ArchDescriptor {
    name: "gemma3",
    qk_norm: true,
    post_norms: true,
    activation: Activation::GeluTanhGate,
    embed_scale: EmbedScale::SqrtHidden,
    sliding: Some(SlidingLayers { default_period: 6, local_rope_base: Some(10000.0) }),
    rope_neox: true,
    tiny: TinyFiles { sliding_pattern_key: true, ..LLAMA.tiny },
    ..LLAMA
};

/// Fused Q/K/V and gate/up, LongRoPE; Phi-4-mini's chat format, whose files end generation at
/// `<|endoftext|>` (BOS too) and turns at `<|end|>`.
const PHI3: ArchDescriptor = ArchDescriptor {
    name: "phi3",
    rope_neox: true,
    long_rope: true,
    fused_qkv: true,
    fused_gate_up: true,
    tiny: TinyFiles { chat: TinyChat { template: Some(PHI3_TEMPLATE), extra_tokens: &PHI3_TOKENS, bos: "<|endoftext|>", eos: "<|endoftext|>" }, ..LLAMA.tiny },
    ..LLAMA
};

/// Biases on Q/K/V and the output, a sink logit per head, clamped SwiGLU, every other layer
/// local with the model's own (YaRN) RoPE (llama.cpp: swa pattern 2, rope_freq_*_train_swa =
/// the global ones), the pre-FFN norm named `post_attention_norm`, the top-k renormalised;
/// harmony, whose `<|return|>` ends generation.
const GPT_OSS: ArchDescriptor = ArchDescriptor {
    name: "gpt-oss",
    qkv_bias: true,
    attn_out_bias: true,
    attn_sinks: true,
    activation: Activation::SwigluOai,
    sliding: Some(SlidingLayers { default_period: 2, local_rope_base: None }),
    rope_neox: true,
    ffn_norm: "post_attention_norm",
    norm_topk: NormTopK::Fixed(true),
    tiny: TinyFiles {
        chat: TinyChat { template: Some(HARMONY_TEMPLATE), extra_tokens: &HARMONY_TOKENS, bos: "<|im_start|>", eos: "<|return|>" },
        own_output: true,
        expert_biases: true,
        sliding_pattern_key: false,
        yarn: true,
        expert_ffn_key: true,
    },
    ..LLAMA
};

/// Qwen3.5: three Gated DeltaNet layers to one gated-attention layer (q/k norms, partial
/// interleaved RoPE), the pre-FFN norm named `post_attention_norm`; Qwen3's chat format.
const QWEN35: ArchDescriptor = ArchDescriptor {
    name: "qwen35",
    qk_norm: true,
    rope_neox: true,
    ffn_norm: "post_attention_norm",
    hybrid: Some(Hybrid { default_interval: 4, next_layout: false }),
    ..QWEN3
};

/// Qwen3.5's MoE hybrids (35B-A3B ...): the same layers, every FFN a mixture of experts whose
/// chosen weights are renormalised, with a shared expert gated by a sigmoid.
const QWEN35MOE: ArchDescriptor =
    ArchDescriptor { name: "qwen35moe", norm_topk: NormTopK::Fixed(true), tiny: TinyFiles { expert_ffn_key: true, ..QWEN35.tiny }, ..QWEN35 };

/// Qwen3-Next (80B-A3B): the MoE hybrid in its earlier layout (see `Hybrid::next_layout`).
const QWEN3NEXT: ArchDescriptor = ArchDescriptor { name: "qwen3next", hybrid: Some(Hybrid { default_interval: 4, next_layout: true }), ..QWEN35MOE };

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_round_trips() {
        for a in Arch::ALL {
            assert_eq!(Arch::from_name(a.name()), Some(a));
            assert_eq!(a.name().parse::<Arch>(), Ok(a));
            assert_eq!(a.to_string(), a.name());
            assert_eq!(a.descriptor().name, a.name());
        }
        let names: std::collections::HashSet<&str> = Arch::ALL.iter().map(|a| a.name()).collect();
        assert_eq!(names.len(), Arch::ALL.len(), "two families share a name");
        assert_eq!(format!("[{:>8}]", Arch::Qwen2), "[   qwen2]", "Display pads like a str");
    }

    #[test]
    fn all_lists_every_variant() {
        // a new variant fails to compile here until it is given an index, and the assertion
        // fails until it is in `ALL` at that index
        let index = |a: Arch| match a {
            Arch::Llama => 0,
            Arch::Mistral => 1,
            Arch::SmolLm3 => 2,
            Arch::Qwen2 => 3,
            Arch::Qwen2Moe => 4,
            Arch::Qwen3 => 5,
            Arch::Qwen3Moe => 6,
            Arch::Gemma3 => 7,
            Arch::Phi3 => 8,
            Arch::GptOss => 9,
            Arch::Qwen35 => 10,
            Arch::Qwen35Moe => 11,
            Arch::Qwen3Next => 12,
        };
        for (i, a) in Arch::ALL.into_iter().enumerate() {
            assert_eq!(index(a), i, "{a}");
        }
    }

    #[test]
    fn unknown_names_are_refused_with_the_supported_list() {
        for bad in ["mamba", "Llama", "qwen2 ", "", "gpt_oss"] {
            assert_eq!(Arch::from_name(bad), None);
            let e = bad.parse::<Arch>().unwrap_err().to_string();
            assert!(e.starts_with(&format!("unknown architecture '{bad}' (supported: ")), "{e}");
            assert!(Arch::ALL.iter().all(|a| e.contains(a.name())), "{e}");
        }
        assert_eq!(Arch::supported_names(), "llama, mistral, smollm3, qwen2, qwen2moe, qwen3, qwen3moe, gemma3, phi3, gpt-oss, qwen35, qwen35moe, qwen3next");
    }

    /// The table as llama.cpp fixes it per family (the rules the loader had as name matches).
    #[test]
    fn the_table_keeps_llama_cpp_s_per_family_rules() {
        let with = |p: fn(&ArchDescriptor) -> bool| -> Vec<&str> { Arch::ALL.iter().filter(|a| p(a.descriptor())).map(|a| a.name()).collect() };
        assert_eq!(with(|d| d.rope_neox), ["qwen2", "qwen2moe", "qwen3", "qwen3moe", "gemma3", "phi3", "gpt-oss", "qwen35", "qwen35moe", "qwen3next"]);
        assert_eq!(with(|d| d.qkv_bias), ["qwen2", "qwen2moe", "gpt-oss"]);
        assert_eq!(with(|d| d.qk_norm), ["qwen3", "qwen3moe", "gemma3", "qwen35", "qwen35moe", "qwen3next"]);
        assert_eq!(with(|d| d.post_norms), ["gemma3"]);
        assert_eq!(with(|d| d.sliding.is_some()), ["gemma3", "gpt-oss"]);
        assert_eq!(with(|d| d.norm_topk != NormTopK::FromFile), ["qwen2moe", "qwen3moe", "gpt-oss", "qwen35moe", "qwen3next"]);
        assert_eq!(with(|d| d.ffn_norm != "ffn_norm"), ["gpt-oss", "qwen35", "qwen35moe", "qwen3next"]);
        assert_eq!(with(|d| d.hybrid.is_some()), ["qwen35", "qwen35moe", "qwen3next"]);
        assert_eq!(with(|d| d.hybrid.is_some_and(|h| h.next_layout)), ["qwen3next"]);
        assert_eq!(with(|d| d.fused_qkv || d.fused_gate_up || d.long_rope), ["phi3"]);
        assert_eq!(with(|d| d.no_rope_period.is_some()), ["smollm3"]);
        assert_eq!(EmbedScale::SqrtHidden.factor(64), 8.0);
        assert_eq!(EmbedScale::One.factor(64), 1.0);
    }
}
