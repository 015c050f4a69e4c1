//! Engine flags shared by `serve`, `generate` and `bench offline` (vLLM names where one exists).

use clap::Args;
use specula_engine::speculative::{DraftWeights, MethodChoice, Proposer, SpecConfig, SpecMethod};
use specula_engine::EngineConfig;
use std::path::PathBuf;

#[derive(Args, Debug, Clone)]
pub struct EngineArgs {
    /// GGUF file, Hugging Face folder or known model name (`specula fetch-model --list`, fetched on
    /// first use); default: the default model.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Compute threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    #[arg(long, default_value_t = 16)]
    pub max_num_seqs: usize,
    #[arg(long, default_value_t = 512)]
    pub max_num_batched_tokens: usize,
    /// Longest prompt + completion (default: the model's trained context, as its file says; lowered
    /// to what the KV cache can hold when the machine's memory cannot hold that much).
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// What the KV cache stores: f16 (auto), bf16, f32, or q8_0 (about half of f16's bytes; int8
    /// values with a scale per 32). Attention reads the stored type in place.
    #[arg(long, value_enum, default_value_t = KvDtypeArg::Auto)]
    pub kv_cache_dtype: KvDtypeArg,
    /// KV-cache size in tokens (default: max(16 x 2048, max-model-len) tokens, shrunk to 3/4 of
    /// the memory left after the weights when that does not fit).
    #[arg(long)]
    pub kv_cache_tokens: Option<usize>,
    /// KV-cache size in MiB (alternative to --kv-cache-tokens).
    #[arg(long)]
    pub kv_cache_memory: Option<usize>,
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Prefix caching (on by default; --enable-prefix-caching=false to disable).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub enable_prefix_caching: bool,
    /// Hybrid models (Qwen3.5, Qwen3-Next): snapshots of recurrent state kept for the prefix
    /// cache, each at the end of a prompt's last full block and the size of one sequence's state
    /// (logged at start-up); a resent conversation restarts from the deepest one it finds. 0:
    /// no prefix caching for these models.
    #[arg(long, default_value_t = specula_engine::config::DEFAULT_STATE_CHECKPOINTS)]
    pub state_checkpoints: usize,
    /// Host memory in MiB for prefix-cache blocks evicted from the KV cache, so that a
    /// conversation resent later skips its prefill (default: a third of the memory left after the
    /// weights and the KV cache, at most 8192; 0 turns it off).
    #[arg(long)]
    pub prefix_cache_memory: Option<usize>,
    /// Keep prefix-cache blocks in files under DIR too, so that later processes on this machine
    /// reuse them (keyed by the model's bytes, the KV type and the cache's shape; checksummed).
    #[arg(long, value_name = "DIR")]
    pub prefix_cache_dir: Option<PathBuf>,
    /// Most MiB of files kept in --prefix-cache-dir for this model and KV type (least recently
    /// used removed first).
    #[arg(long, default_value_t = 16384, value_name = "MIB")]
    pub prefix_cache_dir_size: u64,
    /// Requests allowed to wait before the server answers 503.
    #[arg(long, default_value_t = 256)]
    pub max_waiting: usize,
    /// Spread each mixture-of-experts layer's experts over the data-parallel ranks (rank r of N
    /// holds experts [r*E/N, (r+1)*E/N) and tokens are exchanged every MoE layer). Needs
    /// --data-parallel-mode lockstep and an N that divides the expert count.
    #[arg(long)]
    pub enable_expert_parallel: bool,
    /// Schedule and prepare step N+1 on a worker while step N computes (outputs are identical).
    #[arg(long)]
    pub async_scheduling: bool,
    /// Structured outputs: draft the tokens a request's grammar forces (schema keys, quotes,
    /// separators) so they are verified with the next token instead of one step each (on by
    /// default; outputs are identical; --structured-jump-forward=false to disable).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub structured_jump_forward: bool,
    /// How a mixture-of-experts model's expert weights are held: `repacked` (the fastest
    /// kernels; a private copy the size of the file), `mapped` (read in place from the file's
    /// pages: no copy, shared by every process that maps the file, slower), or `auto` (repacked
    /// when the file fits in nine tenths of the memory available).
    #[arg(long, value_enum, default_value_t = ExpertWeightsArg::Auto)]
    pub expert_weights: ExpertWeightsArg,
    #[command(flatten)]
    pub spec: SpecArgs,
}

/// `--kv-cache-dtype` (vLLM's flag): `auto` is f16.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvDtypeArg {
    Auto,
    F32,
    F16,
    Bf16,
    #[value(name = "q8_0")]
    Q8_0,
    #[value(name = "q4_0")]
    Q4_0,
}

impl From<KvDtypeArg> for specula_kernels::kv::KvDtype {
    fn from(a: KvDtypeArg) -> Self {
        use specula_kernels::kv::KvDtype;
        match a {
            KvDtypeArg::Auto | KvDtypeArg::F16 => KvDtype::F16,
            KvDtypeArg::F32 => KvDtype::F32,
            KvDtypeArg::Bf16 => KvDtype::Bf16,
            KvDtypeArg::Q8_0 => KvDtype::Q8_0,
            KvDtypeArg::Q4_0 => KvDtype::Q4_0,
        }
    }
}

/// `--expert-weights` (`specula_model::ExpertWeights`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertWeightsArg {
    Auto,
    Repacked,
    Mapped,
}

impl From<ExpertWeightsArg> for specula_model::ExpertWeights {
    fn from(a: ExpertWeightsArg) -> Self {
        match a {
            ExpertWeightsArg::Auto => Self::Auto,
            ExpertWeightsArg::Repacked => Self::Repacked,
            ExpertWeightsArg::Mapped => Self::Mapped,
        }
    }
}

/// Speculative decoding flags.
#[derive(Args, Debug, Clone)]
pub struct SpecArgs {
    /// ngram | draft | mtp, or ngram beside a model: ngram,draft | ngram,mtp (per sequence and
    /// step the drafts expected to keep more), or none. The n-gram method is on by default:
    /// adaptive k drafts only where its measured cost model says the drafts pay (outputs are
    /// identical with and without; docs/benchmarks.md, "Speculation by default").
    #[arg(long, default_value = "ngram", value_parser = choices::<MethodArg>(&["none", "ngram", "draft", "mtp", "ngram,draft", "ngram,mtp"]))]
    pub speculative_method: MethodArg,
    /// Draft tokens proposed per sequence and step (upper bound; adaptive k may use fewer).
    /// Default: 16 for the n-gram method (alone or beside a model: its drafts cost nothing and a
    /// copied span is long), 3 for a draft model or an mtp head alone.
    #[arg(long)]
    pub num_speculative_tokens: Option<usize>,
    /// Draft model (GGUF or HF folder) for --speculative-method draft, head file for mtp
    /// (default for mtp: the model file's own prediction layer, `nextn`, where it has one, else
    /// the head built in for the default model, heads/README.md).
    #[arg(long)]
    pub draft_model: Option<PathBuf>,
    /// With --speculative-method draft, or mtp through the model file's own prediction layer:
    /// the draft proposes only the first N token ids (BPE and SentencePiece vocabularies put
    /// frequent tokens first) and end-of-sequence tokens, and computes only those rows of its
    /// output projection (cheaper drafts, slightly fewer accepted); 0: the whole vocabulary. Default: 32768 for vocabularies over 65536 tokens,
    /// else the whole vocabulary.
    #[arg(long)]
    pub draft_vocab_size: Option<usize>,
    /// With --speculative-method draft: `q4_0` re-encodes the draft model's projections stored
    /// with more bits per weight as Q4_0 at load (a draft token costs the bytes it reads; the
    /// output stays exact), `stored` keeps the file's encoding.
    #[arg(long, default_value = "q4_0", value_parser = choices::<DraftWeights>(&["q4_0", "stored"]))]
    pub draft_weights: DraftWeights,
    /// Shortest match (tokens) of the text's suffix that the ngram method drafts from; the longest
    /// earlier match is found whatever its length, and the draft is at most as long as it.
    /// Adaptive k keeps one acceptance estimate per band of match length, so short matches are
    /// drafted only while their drafts pay.
    #[arg(long, default_value_t = 1)]
    pub ngram_min: usize,
    /// With --speculative-method ngram: tokens of recent finished outputs kept in the
    /// cross-request suffix index the method also drafts from (one index per API key; oldest
    /// output evicted first; about 150 bytes a token); 0 turns it off.
    #[arg(long, default_value_t = specula_engine::speculative::config::DEFAULT_CORPUS_TOKENS)]
    pub speculative_corpus_tokens: usize,
    /// DEBUG/BENCHMARK ONLY: accept every draft token. This CHANGES THE OUTPUT.
    #[arg(long)]
    pub speculative_force_accept: bool,
    /// Always propose k tokens (no adaptive k, no batch-size cut-off).
    #[arg(long)]
    pub no_speculative_adaptive: bool,
    /// With adaptive speculation, no drafts in steps where more sequences decode than this.
    #[arg(long, default_value_t = 8)]
    pub speculative_max_batch: usize,
    /// With adaptive speculation, at most this many tokens verified per step (a cap: within it the
    /// cost model picks each sequence's k from the measured verify curve at the step's batch size
    /// and the sequence's acceptance).
    #[arg(long, default_value_t = 32)]
    pub speculative_max_step_tokens: usize,
    /// With adaptive speculation, what verifying one more token costs relative to a one-token
    /// step, as a figure instead of a measurement. By default the loaded target's verify curve is
    /// measured at start-up (a second or two, logged, shown in /metrics); giving this skips that.
    #[arg(long, value_parser = parse_cost)]
    pub speculative_verify_cost: Option<f64>,
    /// With adaptive speculation, one draft token's work relative to a one-token target step, as a
    /// figure (default: a draft model's is measured with the verify curve; an mtp head's is
    /// estimated from its shape; n-gram's is 0).
    #[arg(long, value_parser = parse_cost)]
    pub speculative_draft_cost: Option<f64>,
    /// With adaptive speculation, an mtp head's greedy draft chain ends at the first token the
    /// head gives less than this probability (0 drafts whatever the head thinks).
    #[arg(long, default_value_t = specula_engine::speculative::config::DEFAULT_MTP_MIN_CONFIDENCE, value_parser = parse_probability)]
    pub speculative_min_confidence: f32,
}

/// Default `--num-speculative-tokens` with the n-gram method: on the agent traces at 16 it drafted
/// long copies whole (1.39x no speculation at c1, 1.05x at c8; docs/benchmarks.md).
const NGRAM_DEFAULT_K: usize = 16;
/// Default `--num-speculative-tokens` for a draft model or an mtp head alone.
const MODEL_DEFAULT_K: usize = 3;

/// `--speculative-method`: a method, or `none` (no speculation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MethodArg(pub Option<MethodChoice>);

impl std::fmt::Display for MethodArg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(m) => m.fmt(f),
            None => f.write_str("none"),
        }
    }
}

impl std::str::FromStr for MethodArg {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s.trim().eq_ignore_ascii_case("none") {
            Ok(Self(None))
        } else {
            s.parse().map(|m| Self(Some(m)))
        }
    }
}

/// A parser that accepts only `values` (listed by `--help` and in the error) and hands the one
/// given to `T`'s own parser.
fn choices<T>(values: &'static [&'static str]) -> impl clap::builder::TypedValueParser<Value = T>
where
    T: std::str::FromStr<Err = String> + Clone + Send + Sync + 'static,
{
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(values).try_map(|s| s.parse::<T>())
}

fn parse_cost(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("{e}"))?;
    if v.is_finite() && (0.0..=10.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{v} is not a relative cost in [0, 10]"))
    }
}

fn parse_probability(s: &str) -> Result<f32, String> {
    let v: f32 = s.parse().map_err(|e| format!("{e}"))?;
    if (0.0..=1.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{v} is not a probability in [0, 1]"))
    }
}

impl SpecArgs {
    /// Whether the proposer may be the target file's own prediction layer (`mtp` without
    /// `--draft-model`): only then is that layer loaded.
    pub fn wants_nextn(&self) -> bool {
        self.speculative_method.0.is_some_and(|c| c.method == SpecMethod::Mtp) && self.draft_model.is_none()
    }

    pub fn to_config(&self) -> Option<SpecConfig> {
        let choice = self.speculative_method.0?;
        let ngram = choice.method == SpecMethod::Ngram || choice.with_ngram;
        let k = self.num_speculative_tokens.unwrap_or(if ngram { NGRAM_DEFAULT_K } else { MODEL_DEFAULT_K });
        let mut c = SpecConfig::new(choice.method, k);
        c.with_ngram = choice.with_ngram;
        c.ngram_min = self.ngram_min;
        c.corpus_tokens = self.speculative_corpus_tokens;
        c.draft_model = self.draft_model.clone();
        c.draft_vocab = self.draft_vocab_size;
        c.draft_weights = self.draft_weights;
        c.force_accept = self.speculative_force_accept;
        c.adaptive = !self.no_speculative_adaptive;
        c.max_batch_for_speculation = self.speculative_max_batch;
        c.max_step_tokens_for_speculation = self.speculative_max_step_tokens;
        c.verify_cost_per_token = self.speculative_verify_cost;
        c.draft_cost = self.speculative_draft_cost;
        c.mtp_min_confidence = self.speculative_min_confidence;
        Some(c)
    }

    /// The proposer for these flags, if speculation is on (errors name the bad flag).
    pub fn build(
        &self,
        target: &specula_model::LlamaModel,
        target_tokenizer: &specula_model::Tokenizer,
        engine: &EngineConfig,
    ) -> anyhow::Result<Option<(SpecConfig, Box<dyn Proposer>)>> {
        let Some(mut cfg) = self.to_config() else { return Ok(None) };
        if cfg.force_accept {
            tracing::warn!("--speculative-force-accept is on: every draft token is accepted and the OUTPUT IS CHANGED (benchmarking only)");
        }
        // mtp with no --draft-model: the target file's own prediction layer where it has one
        // (loaded for this, `SpecArgs::wants_nextn`), else the head shipped for the default model
        // (the loader checks that the target is the one it was trained for)
        let shipped = cfg.method == SpecMethod::Mtp && cfg.draft_model.is_none() && target.nextn.is_none();
        cfg.end_tokens = (0..target.config.vocab_size as u32).filter(|&t| target_tokenizer.is_eos(t)).collect();
        if shipped {
            cfg.draft_model = Some(crate::shipped_head::materialise()?);
        } else if cfg.draft_model.is_some() {
            // a known model's name works here as for --model
            cfg.draft_model = Some(crate::fetch::resolve_model(&cfg.draft_model)?);
        }
        if let (SpecMethod::Draft, Some(path)) = (cfg.method, &cfg.draft_model) {
            let (draft_tokenizer, _) = specula_model::load_tokenizer(path)?;
            specula_engine::speculative::draft_model::check_same_tokenizer(&draft_tokenizer, target_tokenizer)?;
        }
        let p = specula_engine::speculative::build_proposer(&cfg, target, engine).map_err(|e| {
            let e = anyhow::Error::from(e);
            if shipped {
                e.context(format!(
                    "--speculative-method mtp without --draft-model uses the model file's own prediction layer (nextn), which this file has none of, or else the built-in head, trained for {}; for another model pass --draft-model HEAD.safetensors (see `specula-train-head`)",
                    crate::shipped_head::TARGET
                ))
            } else {
                e
            }
        })?;
        Ok(Some((cfg, p)))
    }
}

impl EngineArgs {
    /// `--enable-expert-parallel` for in-process ranks: spreads the experts of `ranks` (rank r at
    /// index r) over them. Call before `spawn_lockstep`; errors name the flag to change.
    pub fn setup_expert_parallel(&self, ranks: &mut [specula_engine::dp::RankSetup], lockstep: bool) -> anyhow::Result<()> {
        if self.expert_parallel_wanted(lockstep)? {
            specula_engine::dp::expert::enable_local_expert_parallel(ranks)?;
        }
        Ok(())
    }

    /// Whether `--enable-expert-parallel` is on; an error when the data-parallel mode cannot use it.
    fn expert_parallel_wanted(&self, lockstep: bool) -> anyhow::Result<bool> {
        if self.enable_expert_parallel && !lockstep {
            anyhow::bail!("--enable-expert-parallel needs --data-parallel-mode lockstep");
        }
        Ok(self.enable_expert_parallel)
    }

    /// `--enable-expert-parallel` for this MPI process's rank: call before describing the
    /// configuration for `check_same_config`, and pass an error to it so every rank stops.
    #[cfg(feature = "mpi")]
    pub fn setup_expert_parallel_mpi(&self, model: &mut specula_model::LlamaModel, lockstep: bool) -> anyhow::Result<()> {
        if self.expert_parallel_wanted(lockstep)? {
            specula_engine::dp::mpi_expert::enable_mpi_expert_parallel(model)?;
        }
        Ok(())
    }

    /// How to load the model at `path` for `copies` engines in this process (in-process data
    /// parallel ranks): `--expert-weights auto` is settled here for all of them, on the memory
    /// available before the first copy is made.
    pub fn load_options(&self, path: &std::path::Path, copies: usize) -> specula_model::LoadOptions {
        let file_bytes = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
        let expert_weights = specula_model::ExpertWeights::from(self.expert_weights)
            .settle(file_bytes.saturating_mul(copies.max(1) as u64), specula_model::kv_store::available_memory());
        specula_model::LoadOptions { expert_weights, nextn: self.spec.wants_nextn() }
    }

    /// The engine's configuration (one rank's) for `loaded` (read from `path`), the first of `ranks` in-process
    /// copies of the model: the default KV cache is sized from the memory available less the
    /// page cache the weights read in place need (which the machine counts as available) and the
    /// weights the other copies will hold, shared among the ranks.
    pub fn to_config(&self, path: &std::path::Path, loaded: &specula_model::LoadedModel, ranks: usize) -> anyhow::Result<EngineConfig> {
        let model = &loaded.model.config;
        let kv_cache_dtype = specula_kernels::kv::KvDtype::from(self.kv_cache_dtype);
        if !kv_cache_dtype.supports_head_dim(model.head_dim) {
            anyhow::bail!(
                "--kv-cache-dtype {kv_cache_dtype} stores heads in blocks of 32 values but this model's heads have {}; choose f16, bf16 or f32",
                model.head_dim
            );
        }
        let mut max_model_len = self.max_model_len.unwrap_or(model.context_length);
        let bytes_per_token = model.kv_bytes_per_token(kv_cache_dtype);
        // a hybrid's recurrent state (one slot per sequence and one for lockstep dummy batches,
        // the prefix cache's checkpoints, and with speculation what each slot keeps to roll its
        // last verify span back: about its state again) comes out of the same memory
        let checkpoints = if self.enable_prefix_caching { self.state_checkpoints } else { 0 };
        let kept = if self.spec.speculative_method.0.is_some() { self.max_num_seqs } else { 0 };
        let states = self.max_num_seqs + 1 + checkpoints + kept;
        let state_bytes = model.arch_options.recurrent.as_ref().map_or(0, |r| r.bytes_per_sequence().saturating_mul(states));
        let available = specula_model::kv_store::available_memory()
            .map(|a| kv_memory_per_rank(a, loaded.weight_bytes, loaded.model.in_place_bytes(), ranks).saturating_sub(state_bytes));
        let kv_tokens = match (self.kv_cache_tokens, self.kv_cache_memory) {
            (Some(t), _) => t,
            (None, Some(mib)) => mib * 1024 * 1024 / bytes_per_token,
            (None, None) => {
                // the model's whole context by default, unless the memory cannot hold one such
                // sequence: then as much as it can (a length the user chose is kept, and refused
                // later with what to change if it does not fit)
                let min = if self.max_model_len.is_some() { max_model_len } else { max_model_len.min(MIN_DEFAULT_CONTEXT) };
                fit_default_kv((16 * 2048).max(max_model_len), min, bytes_per_token, available)
            }
        };
        if self.max_model_len.is_none() && kv_tokens < max_model_len {
            tracing::warn!(
                "the model's context is {max_model_len} tokens but the KV cache holds {kv_tokens}: serving {kv_tokens} (choose with --max-model-len, or --kv-cache-dtype q8_0 to hold more)"
            );
            max_model_len = kv_tokens;
        }
        let host_bytes = match self.prefix_cache_memory {
            Some(mib) => mib << 20,
            // a third of what the KV cache leaves, up to 8 GiB (llama.cpp's --cache-ram default)
            None => available.map_or(1 << 30, |a| (a.saturating_sub(kv_tokens * bytes_per_token) / 3).min(8 << 30)),
        };
        Ok(EngineConfig {
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_model_len,
            block_size: self.block_size,
            num_kv_blocks: kv_tokens.div_ceil(self.block_size),
            kv_cache_dtype,
            enable_prefix_caching: self.enable_prefix_caching,
            state_checkpoints: self.state_checkpoints,
            prefix_tiers: specula_engine::kv_cache::PrefixTierConfig { host_bytes, disk: self.disk_tier(path)? },
            threads: self.threads.unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)),
            max_waiting: self.max_waiting,
            shutdown_grace: std::time::Duration::from_secs(10),
            async_scheduling: self.async_scheduling,
            jump_forward: self.structured_jump_forward,
            ..Default::default()
        })
    }
}

impl EngineArgs {
    /// `--prefix-cache-dir` for the model at `path` (its key read from the file), or `None`.
    fn disk_tier(&self, path: &std::path::Path) -> anyhow::Result<Option<specula_engine::kv_cache::DiskTierConfig>> {
        let Some(dir) = &self.prefix_cache_dir else { return Ok(None) };
        let model_key = specula_engine::kv_cache::disk_tier::model_key(path)
            .map_err(|e| anyhow::anyhow!("--prefix-cache-dir: cannot read the model {}: {e}", path.display()))?;
        Ok(Some(specula_engine::kv_cache::DiskTierConfig { dir: dir.clone(), max_bytes: self.prefix_cache_dir_size << 20, model_key }))
    }
}

/// The shortest context a defaulted `--max-model-len` is lowered to when memory is short (below it
/// the KV cache refuses to start, naming the flags).
const MIN_DEFAULT_CONTEXT: usize = 8192;

/// One rank's share of `available` bytes for its KV cache once `ranks` in-process copies of a
/// model of `weight_bytes` are loaded (the first already is): the weights read in place
/// (`in_place_bytes`, one page-cache copy for all) still count as available to the machine and
/// are taken off, so are the other copies' own weights, and the rest is shared.
fn kv_memory_per_rank(available: usize, weight_bytes: usize, in_place_bytes: usize, ranks: usize) -> usize {
    let ranks = ranks.max(1);
    let others = (ranks - 1).saturating_mul(weight_bytes.saturating_sub(in_place_bytes));
    available.saturating_sub(in_place_bytes).saturating_sub(others) / ranks
}

/// The default KV cache (`wanted` tokens), shrunk to three quarters of the memory still available
/// once the weights are loaded when it does not fit there (a 30B MoE on a 24 GB machine), never
/// below one `min`-token sequence: below that `KvStore` refuses with what to do. A size the user
/// gives (`--kv-cache-tokens`, `--kv-cache-memory`) is kept as given.
fn fit_default_kv(wanted: usize, min: usize, bytes_per_token: usize, available: Option<usize>) -> usize {
    let Some(available) = available else { return wanted };
    let fits = available / 4 * 3 / bytes_per_token.max(1);
    if wanted <= fits {
        return wanted;
    }
    let tokens = fits.max(min);
    tracing::warn!(
        "the default KV cache of {wanted} tokens needs {:.1} GiB but {:.1} GiB is available: using {tokens} tokens (choose with --kv-cache-tokens)",
        (wanted * bytes_per_token) as f64 / (1u64 << 30) as f64,
        available as f64 / (1u64 << 30) as f64
    );
    tokens
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn the_default_kv_cache_shrinks_to_the_memory_available_and_no_further_than_one_sequence() {
        let gib = 1usize << 30;
        // 196 KiB per token (Qwen3-30B-A3B): 32768 tokens are 6 GiB
        let per = 196 * 1024;
        assert_eq!(fit_default_kv(32768, 8192, per, Some(20 * gib)), 32768, "fits: kept");
        assert_eq!(fit_default_kv(32768, 8192, per, None), 32768, "unknown: kept");
        let fitted = fit_default_kv(32768, 8192, per, Some(5 * gib));
        assert!(fitted < 32768 && fitted * per <= 5 * gib / 4 * 3 && fitted >= 8192, "{fitted}");
        assert_eq!(fit_default_kv(32768, 8192, per, Some(gib)), 8192, "never below one sequence");
    }

    #[test]
    fn the_kv_memory_leaves_the_mapped_experts_and_the_other_ranks_weights() {
        let gb = 1usize << 30;
        assert_eq!(kv_memory_per_rank(20 * gb, 18 * gb, 0, 1), 20 * gb, "repacked: MemAvailable already excludes them");
        assert_eq!(kv_memory_per_rank(20 * gb, 18 * gb, 17 * gb, 1), 3 * gb, "the mapped experts' page cache is not for the KV cache");
        // two in-process ranks of a 30B-A3B with mapped experts: the second rank's 1 GB of dense
        // weights is still to come, and the rest is split
        assert_eq!(kv_memory_per_rank(22 * gb, 18 * gb, 17 * gb, 2), 2 * gb);
        assert_eq!(kv_memory_per_rank(gb, 18 * gb, 17 * gb, 4), 0, "never below zero");
    }

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        spec: SpecArgs,
    }

    #[test]
    fn adaptive_cost_and_confidence_flags_reach_the_config_and_are_range_checked() {
        let cli =
            Cli::try_parse_from(["x", "--speculative-method", "mtp", "--speculative-verify-cost", "0.02", "--speculative-min-confidence", "0.7"]).unwrap();
        let c = cli.spec.to_config().unwrap();
        assert_eq!((c.verify_cost_per_token, c.mtp_min_confidence), (Some(0.02), 0.7));
        let defaults = Cli::try_parse_from(["x", "--speculative-method", "ngram"]).unwrap().spec.to_config().unwrap();
        // measured at start-up unless given
        assert_eq!((defaults.verify_cost_per_token, defaults.draft_cost), (None, None));
        for bad in ["--speculative-verify-cost=-1", "--speculative-verify-cost=nan", "--speculative-min-confidence=1.5", "--speculative-min-confidence=x"] {
            let err = Cli::try_parse_from(["x", "--speculative-method", "mtp", bad]).err().expect("refused");
            assert_eq!(err.kind(), clap::error::ErrorKind::ValueValidation, "{bad}: {err}");
        }
    }

    #[test]
    fn the_method_and_draft_weights_list_their_values_in_help_and_errors() {
        use clap::CommandFactory;
        let mut cmd = Cli::command();
        let help = cmd.render_long_help().to_string();
        assert!(help.contains("none, ngram, draft, mtp, ngram,draft, ngram,mtp"), "{help}");
        assert!(help.contains("q4_0, stored"), "{help}");
        let c = Cli::try_parse_from(["x", "--speculative-method", "ngram,mtp", "--draft-weights", "stored"]).unwrap();
        assert_eq!(c.spec.speculative_method.0.map(|m| (m.method, m.with_ngram)), Some((SpecMethod::Mtp, true)));
        // n-gram speculation unless told otherwise
        let default = Cli::try_parse_from(["x"]).unwrap().spec.to_config().expect("speculation on by default");
        assert_eq!((default.method, default.with_ngram, default.adaptive, default.num_speculative_tokens), (SpecMethod::Ngram, false, true, 16));
        let k = |args: &[&str]| Cli::try_parse_from([&["x"], args].concat()).unwrap().spec.to_config().unwrap().num_speculative_tokens;
        assert_eq!(k(&["--speculative-method", "mtp"]), 3);
        assert_eq!(k(&["--speculative-method", "ngram,draft"]), 16);
        assert_eq!(k(&["--speculative-method", "draft", "--num-speculative-tokens", "5"]), 5);
        assert!(Cli::try_parse_from(["x", "--speculative-method", "none"]).unwrap().spec.to_config().is_none());
        // the start-up line names the method as the flag spells it
        for m in ["none", "ngram", "draft", "mtp", "ngram,draft", "ngram,mtp"] {
            assert_eq!(m.parse::<MethodArg>().unwrap().to_string(), m);
        }
        assert_eq!(c.spec.draft_weights, DraftWeights::Stored);
        let err = Cli::try_parse_from(["x", "--speculative-method", "eagle"]).err().expect("refused");
        assert_eq!(err.kind(), clap::error::ErrorKind::InvalidValue);
        assert!(err.to_string().contains("ngram,draft"), "{err}");
    }
}
