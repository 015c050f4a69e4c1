//! Speculative decoding: proposers guess the next k tokens of each sequence cheaply, the target
//! model scores all 1 + k positions in one batched pass, and the rejection sampler keeps a prefix
//! of the guesses so that the output distribution is exactly the target's (greedy: token for
//! token). Not the scheduler's business: it only sees a sequence's extra draft tokens.

pub mod adaptive;
pub mod combined;
pub mod config;
pub mod corpus;
pub mod cost;
pub mod draft_model;
pub mod edits;
pub mod metrics;
pub mod mtp;
pub mod mtp_format;
pub mod ngram;
pub mod proposer;
pub mod rejection;
pub mod suffix;
pub mod vocab_map;

pub use config::{DraftWeights, MethodChoice, SpecConfig, SpecMethod};
pub use metrics::SpecMetrics;
pub use proposer::{Draft, DraftRequest, Proposer, SeqDrafting, Support};
pub use rejection::{verify, Verdict};

/// Why speculation could not be set up or run.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("invalid speculative decoding configuration: {0}")]
    Config(String),
    #[error("draft model: {0}")]
    Model(#[from] specula_model::ModelError),
    #[error("draft KV cache: {0}")]
    Kv(#[from] crate::kv_cache::KvCacheError),
    #[error(transparent)]
    KvAlloc(#[from] specula_model::kv_store::KvAllocError),
    #[error("sampling: {0}")]
    Sampling(#[from] crate::sampling::SamplingError),
    /// The mtp head file is unreadable, malformed or made for another target.
    #[error("mtp head {path}: {message}")]
    Head { path: String, message: String },
}

/// What `build_proposer` knows of the target: its shape always, its weights when the caller has
/// them loaded (the mtp head uses the target's token embedding and checks its fingerprint).
#[derive(Clone, Copy)]
pub enum ProposerTarget<'a> {
    Config(&'a specula_model::ModelConfig),
    Model(&'a specula_model::LlamaModel),
}

impl ProposerTarget<'_> {
    pub fn config(&self) -> &specula_model::ModelConfig {
        match self {
            Self::Config(c) => c,
            Self::Model(m) => &m.config,
        }
    }
}

impl<'a> From<&'a specula_model::ModelConfig> for ProposerTarget<'a> {
    fn from(c: &'a specula_model::ModelConfig) -> Self {
        Self::Config(c)
    }
}

impl<'a> From<&'a specula_model::LlamaModel> for ProposerTarget<'a> {
    fn from(m: &'a specula_model::LlamaModel) -> Self {
        Self::Model(m)
    }
}

/// Builds the proposer a configuration names. The draft model is loaded here, and checked
/// against the target's vocabulary. `target` is the target's config or, for `mtp`, the loaded
/// target model itself.
pub fn build_proposer<'a>(
    cfg: &SpecConfig,
    target: impl Into<ProposerTarget<'a>>,
    engine: &crate::config::EngineConfig,
) -> Result<Box<dyn Proposer>, SpecError> {
    let model = build_one(cfg, target.into(), engine)?;
    Ok(if cfg.with_ngram && cfg.method != SpecMethod::Ngram {
        Box::new(combined::CombinedProposer::new(ngram::NgramProposer::with_corpus(cfg.ngram_min, cfg.corpus_tokens), model))
    } else {
        model
    })
}

/// The proposer of `cfg.method` alone.
fn build_one(cfg: &SpecConfig, target: ProposerTarget, engine: &crate::config::EngineConfig) -> Result<Box<dyn Proposer>, SpecError> {
    cfg.validate().map_err(SpecError::Config)?;
    match cfg.method {
        SpecMethod::Ngram => Ok(Box::new(ngram::NgramProposer::with_corpus(cfg.ngram_min, cfg.corpus_tokens))),
        SpecMethod::Draft => {
            let path = cfg.draft_model.as_ref().ok_or_else(|| SpecError::Config("--speculative-method draft needs --draft-model PATH".into()))?;
            let loaded = specula_model::load_model(path)?;
            let vocab = loaded.model.config.vocab_size;
            let eos: Vec<crate::types::TokenId> = (0..vocab as crate::types::TokenId).filter(|&t| loaded.tokenizer.is_eos(t)).collect();
            let p =
                draft_model::DraftModelProposer::new(loaded.model, target.config().vocab_size, engine.num_kv_blocks, engine.block_size, engine.max_num_seqs)?;
            let n = config::draft_vocab_size(cfg.draft_vocab, vocab);
            // re-encoded after the output is restricted: only the rows kept are converted
            let p = p.with_draft_vocab(n, &eos)?;
            Ok(Box::new(if cfg.draft_weights == config::DraftWeights::Q4_0 { p.with_q4_0_weights()? } else { p }))
        }
        SpecMethod::Mtp => {
            let ProposerTarget::Model(model) = target else {
                return Err(SpecError::Config(
                    "the mtp proposer reads the target's weights: build it from the loaded target model, not only its config".into(),
                ));
            };
            // without adaptive speculation every step drafts exactly k
            let gate = if cfg.adaptive { cfg.mtp_min_confidence } else { 0.0 };
            // a head file when one is given, else the target file's own prediction layer
            let proposer = match &cfg.draft_model {
                Some(path) => mtp::MtpProposer::load(path, model)?,
                None => {
                    let vocab = model.config.vocab_size;
                    let keep = config::first_ids_and(config::draft_vocab_size(cfg.draft_vocab, vocab), &cfg.end_tokens, vocab);
                    mtp::MtpProposer::from_nextn(model, &keep)?
                }
            };
            Ok(Box::new(proposer.with_min_confidence(gate)))
        }
    }
}

/// The cost model `cfg` asks for: given figures, or the target's verify curve measured now on
/// `pool` (a second or two; logged), attention's cost per token of context over a cache of
/// `kv_dtype` and the proposer's draft token measured with it.
pub fn cost_model(
    cfg: &SpecConfig,
    proposer: &mut dyn Proposer,
    target: &specula_model::LlamaModel,
    kv_dtype: specula_kernels::kv::KvDtype,
    pool: &rayon::ThreadPool,
) -> Result<cost::CostModel, SpecError> {
    let model = match cfg.verify_cost_per_token {
        Some(per_token) => cost::CostModel::linear(per_token, cfg.draft_cost.unwrap_or_else(|| proposer.cost_per_draft_token(&target.config))),
        None => {
            let start = std::time::Instant::now();
            let times = cost::measure(target, cfg.num_speculative_tokens, cfg.max_batch_for_speculation, pool)?;
            let m = match cfg.draft_cost {
                Some(d) => cost::CostModel::from_times(&times, d),
                None => match proposer.draft_step_seconds(&cost::draft_batches(cfg.max_batch_for_speculation), pool)? {
                    Some(draft) => cost::CostModel::from_times(&times, 0.0).with_draft_times(&draft, times[0].1),
                    None => cost::CostModel::from_times(&times, proposer.cost_per_draft_token(&target.config)),
                },
            };
            let attention = pool.install(|| cost::time_attention(&target.config, kv_dtype, &cost::attention_points(cfg.num_speculative_tokens), 2))?;
            let m = m.with_attention_times(&attention, times[0].1, cost::layer_windows(&target.config));
            tracing::info!(
                "speculation cost model: {} ({:.1} s; give --speculative-verify-cost and --speculative-draft-cost to skip)",
                m.describe(),
                start.elapsed().as_secs_f64()
            );
            m
        }
    };
    model.publish();
    Ok(model)
}

/// One sequence's speculation state (adaptive k), kept in its compute-side record
/// (`crate::record::SeqRecord::spec`), so it goes when the sequence does.
#[derive(Clone, Debug, Default)]
pub struct SeqSpec {
    /// Acceptance of its own drafts (started from the engine-wide estimate on first use).
    tracker: Option<adaptive::AcceptanceTracker>,
    /// The support band of its draft that awaits verification (credited then).
    supported: Option<usize>,
    /// A combined proposer's share of its recent steps that the n-gram drafted (a moving
    /// average, [`NGRAM_SHARE_WEIGHT`]): how soon a draft model called back is expected to hand
    /// over again, so what its catch-up is repaid over ([`Speculation::model_horizon`]); `None`:
    /// no step chose yet (the engine-wide prior stands in).
    ngram_share: Option<f64>,
    /// What the proposer keeps of the sequence between steps (lent with its requests).
    pub(crate) drafting: SeqDrafting,
}

impl SeqSpec {
    /// Its acceptance tracker, started from the engine-wide estimate on first use.
    fn tracker(&mut self, global: &adaptive::AcceptanceTracker) -> &mut adaptive::AcceptanceTracker {
        self.tracker.get_or_insert_with(|| adaptive::AcceptanceTracker::from_global(global))
    }
}

/// Speculative decoding state of an engine: the proposer, the counters and the engine-wide
/// acceptance estimates (adaptive k; each sequence's own are in its [`SeqSpec`]). It travels with
/// the step's compute job.
pub struct Speculation {
    pub cfg: SpecConfig,
    pub proposer: Box<dyn Proposer>,
    pub metrics: SpecMetrics,
    /// Acceptance over every sequence: where a new sequence's estimate starts.
    pub(crate) global: adaptive::AcceptanceTracker,
    /// What a step with drafts costs on this target and machine (adaptive k).
    pub cost: cost::CostModel,
    /// `cost` with free drafts: what an n-gram draft costs (of a combined proposer too).
    ngram_cost: cost::CostModel,
    /// Lengths of the finished outputs: the tokens a catch-up is repaid over.
    pub(crate) output_lengths: adaptive::OutputLengths,
    /// Engine-wide acceptance per band of the proposer's support (`Support::band`), for a
    /// proposer that reports one.
    pub(crate) by_support: Vec<adaptive::AcceptanceTracker>,
    /// The n-gram's share ([`SeqSpec::ngram_share`]) over every sequence's steps: where a new sequence's starts, so a draft
    /// model's catch-up with a fresh prompt is priced by what the workload's sequences have been
    /// doing (on code edits the n-gram drafts most steps: the draft model's prefill of each prompt
    /// was spent for a few steps and delayed every first token).
    ngram_share_prior: f64,
}

/// Weight of the newest step in a sequence's `ngram_share`.
const NGRAM_SHARE_WEIGHT: f64 = 0.125;
/// Weight of the newest step (of any sequence) in `ngram_share_prior`.
const NGRAM_SHARE_PRIOR_WEIGHT: f64 = 1.0 / 256.0;

impl Speculation {
    /// `cost` from [`cost_model`].
    pub fn new(cfg: SpecConfig, proposer: Box<dyn Proposer>, cost: cost::CostModel) -> Self {
        let metrics = SpecMetrics::new(cfg.num_speculative_tokens);
        Self {
            cfg,
            proposer,
            metrics,
            global: adaptive::AcceptanceTracker::global(),
            ngram_cost: cost.without_drafts(),
            cost,
            output_lengths: adaptive::OutputLengths::default(),
            by_support: (0..2 * adaptive::SUPPORT_BANDS).map(|_| adaptive::AcceptanceTracker::global()).collect(),
            ngram_share_prior: 0.0,
        }
    }

    /// Prices the next steps at a mean context of `tokens` per decoding sequence: at depth each
    /// verified row pays its attention over the whole context ([`cost::CostModel::set_context`]).
    pub(crate) fn set_context(&mut self, tokens: usize) {
        self.cost.set_context(tokens);
        self.ngram_cost.set_context(tokens);
    }

    /// Most drafts per sequence this step, when `decoding` sequences decode: the configured k, or
    /// with adaptive speculation the batch caps' share, cut to what could pay at this batch size
    /// even if every draft were accepted (none when nothing could: then no sequence probes either,
    /// and a draft model is not run at all).
    pub(crate) fn batch_k_limit(&self, decoding: usize) -> usize {
        let c = &self.cfg;
        if c.adaptive {
            let cap = adaptive::batch_k_limit(decoding, c.num_speculative_tokens, c.max_batch_for_speculation, c.max_step_tokens_for_speculation);
            // a combined proposer's n-gram drafts cost nothing: they may pay where the model's do not
            let cost = if self.proposer.combined() { &self.ngram_cost } else { &self.cost };
            adaptive::best_k(1.0, cap, cost, decoding)
        } else {
            c.num_speculative_tokens
        }
    }

    /// Most forced draft tokens (jump-forward) per sequence this step, `decoding` sequences
    /// decoding: they are accepted by construction, so as many as pay if every draft is accepted
    /// (the configured k without adaptive speculation). The proposer's drafts after them share
    /// the engine's k.
    pub(crate) fn forced_limit(&self, decoding: usize) -> usize {
        let c = &self.cfg;
        if c.adaptive {
            adaptive::best_k(1.0, c.num_speculative_tokens, &self.cost, decoding)
        } else {
            c.num_speculative_tokens
        }
    }

    /// Records a verification of `proposed` drafts of which `accepted` were kept: a draft backed
    /// by a support is credited to its band, any other to the sequence's own estimate (so a
    /// combined proposer's model keeps an estimate of its own drafts only).
    pub(crate) fn record(&mut self, st: &mut SeqSpec, proposed: usize, accepted: usize) {
        self.metrics.record(proposed, accepted);
        self.global.record(proposed, accepted);
        match st.supported.take() {
            Some(band) => self.by_support[band].record(proposed, accepted),
            None => st.tracker(&self.global).record(proposed, accepted),
        }
    }

    /// Draft length for `seq` this step, at most `k_limit` (the batch's budget; without adaptive
    /// speculation, exactly `k_limit`), `decoding` sequences decoding in the step. `catch_up`: the
    /// sequence's tokens the proposer must process first ([`Proposer::backlog`]) and the tokens it
    /// may still generate, and the batch expected once the waiting prompts are in; at its first
    /// decode step the proposer catches up with its prompt (as a draft model prefilling beside
    /// the target) unless drafting stops once that batch forms, later only where catching up the
    /// whole batch repays itself in it ([`adaptive::catch_up_pays`], [`CatchUp::batch_backlog`]). `support`: how far the
    /// proposer's draft is backed ([`Proposer::support`]); where given, the acceptance of its
    /// band decides instead of the sequence's own, and no more than that many tokens are drafted.
    pub(crate) fn next_k(
        &mut self,
        seq: crate::types::SeqId,
        st: &mut SeqSpec,
        k_limit: usize,
        decoding: usize,
        catch_up: CatchUp,
        support: Option<Support>,
    ) -> usize {
        if !self.cfg.adaptive {
            return k_limit;
        }
        st.supported = None;
        let (k, alpha) = match support {
            Some(Support { len: 0, .. }) => return 0,
            Some(support) => {
                // an n-gram draft (a supported one) costs its verification only
                let t = &mut self.by_support[support.band()];
                let k = t.next_k(k_limit.min(support.len), &self.ngram_cost, decoding);
                if k > 0 {
                    st.supported = Some(support.band());
                }
                (k, t.alpha())
            }
            None => {
                let t = st.tracker(&self.global);
                (t.next_k(k_limit, &self.cost, decoding), t.alpha())
            }
        };
        if k == 0 || catch_up.backlog == 0 {
            return k;
        }
        // a catch-up is repaid over the steps after it, in the batch the sequences still
        // prefilling are about to make: none where drafting stops then (a draft model fed the
        // prompts of the first few sequences to finish their prefill, at c8, only to stop
        // drafting once the other prompts were in)
        let soon = catch_up.batch_soon.max(decoding);
        if soon > decoding && self.batch_k_limit(soon) == 0 {
            return 0;
        }
        if catch_up.first_decode {
            tracing::debug!(%seq, backlog = catch_up.backlog, decoding, soon, k, "proposer catches up with a prompt");
            return k;
        }
        let remaining = self.output_lengths.expected_remaining(catch_up.generated, catch_up.room);
        let remaining = self.model_horizon(st, remaining, adaptive::expected_tokens(alpha, k));
        let batch_backlog = catch_up.batch_backlog.max(catch_up.backlog);
        if adaptive::catch_up_pays(alpha, k, &self.cost, soon, batch_backlog, remaining) {
            if catch_up.backlog > 1 {
                // (one token behind is a draft model's usual state after its drafts were kept)
                tracing::debug!(%seq, backlog = catch_up.backlog, batch_backlog, decoding, soon, k, alpha, remaining, "proposer catches up");
            }
            k
        } else {
            0
        }
    }

    /// Learns from a sequence of `tenant` that finished with `output` (not one that failed): its
    /// length, and its text for the proposer's cross-request index.
    pub(crate) fn record_finished(&mut self, tenant: crate::types::Tenant, output: &[crate::types::TokenId]) {
        self.output_lengths.record(output.len());
        self.proposer.finished(tenant, output);
    }

    /// Forgets a sequence that ended (its own estimates went with its record).
    pub(crate) fn remove(&mut self, seq: crate::types::SeqId) {
        self.proposer.remove(seq);
    }

    /// The tokens a draft model's catch-up for `seq` is repaid over: the sequence's expected
    /// `remaining` tokens, or, with a combined proposer whose n-gram drafted a share `s` of the
    /// sequence's recent steps, the ~1/s steps (of `per_step` tokens) the model is expected to
    /// draft before the n-gram takes over again and the model falls behind anew. On the agent
    /// traces' edits the n-gram drafts most steps, and a model called back at each short match
    /// caught up with every copy in between (benchmarks.md, "Agent traces").
    fn model_horizon(&self, st: &SeqSpec, remaining: usize, per_step: f64) -> usize {
        match st.ngram_share.unwrap_or(self.ngram_share_prior) {
            share if share > 0.0 => remaining.min((per_step.max(1.0) / share).ceil() as usize),
            _ => remaining,
        }
    }

    /// Draft planning for one step: for each sequence that goes on decoding (`cands`), how many
    /// tokens it may draft (its room and the engine's k beside the tokens its grammar forces,
    /// the batch's budget, the proposer's catch-up and support, adaptive k), as the proposer's
    /// requests, in `cands`' order. `pending_prefill`, `arrived` and `max_num_seqs` give the batch
    /// expected soon ([`CatchUp::batch_soon`]).
    pub(crate) fn plan_drafts<'a>(
        &mut self,
        cands: Vec<DraftCandidate<'a>>,
        pending_prefill: usize,
        arrived: usize,
        max_num_seqs: usize,
    ) -> Vec<DraftRequest<'a>> {
        let decoding = cands.len();
        let k_limit = self.batch_k_limit(decoding);
        // forced and proposed drafts together: at most the engine's k (what a decode scheduled
        // ahead reserved); a proposer that reads the target's hidden states drafts only where
        // nothing is forced
        let k_engine = self.cfg.num_speculative_tokens;
        let needs_hidden = self.proposer.needs_hidden();
        let batch_soon = CatchUp::batch_soon(decoding, pending_prefill, arrived, max_num_seqs);
        let may_draft = |c: &DraftCandidate| k_limit > 0 && !c.params.disable_speculation;
        // what the proposer must process first for each sequence that may draft (0 for the others)
        let backlogs: Vec<usize> = cands.iter().map(|c| if may_draft(c) { self.proposer.backlog(c.seq, c.known) } else { 0 }).collect();
        let batch_backlog = CatchUp::batch_backlog(cands.iter().zip(&backlogs).filter(|(c, _)| !c.first_decode()).map(|(_, &b)| b));
        cands
            .into_iter()
            .zip(&backlogs)
            .map(|(c, &backlog)| {
                let k = if may_draft(&c) {
                    let mut support = self.proposer.support(c.seq, c.tokens, c.prompt_len, c.params.tenant, &mut c.spec.drafting);
                    if self.proposer.combined() {
                        let remaining = self.output_lengths.expected_remaining(c.generated(), c.room);
                        support = self.choose(c.spec, support, k_limit, decoding, backlog, remaining);
                    }
                    // an n-gram draft waits for no model to catch up
                    let backlog = if support.is_some() { 0 } else { backlog };
                    let catch_up = CatchUp { backlog, first_decode: c.first_decode(), room: c.room, generated: c.generated(), batch_soon, batch_backlog };
                    self.next_k(c.seq, c.spec, k_limit, decoding, catch_up, support)
                } else {
                    0
                };
                let max_draft = if c.forced > 0 && needs_hidden { 0 } else { k.min(c.room.saturating_sub(c.forced)).min(k_engine.saturating_sub(c.forced)) };
                DraftRequest {
                    seq: c.seq,
                    tokens: c.tokens,
                    prompt_len: c.prompt_len,
                    max_draft,
                    params: c.params,
                    hidden: c.hidden,
                    rng: Some(c.rng),
                    drafting: &mut c.spec.drafting,
                }
            })
            .collect()
    }

    /// For a combined proposer, `decoding` sequences in the step: the n-gram's draft (its
    /// `support` kept) where its match's band is expected to give at least as many tokens per
    /// unit of step cost as the model's drafts for the sequence, else the model's (None: the
    /// sequence's estimate decides k). The model's drafts are priced at their acceptance, the
    /// draft model's cost and its catch-up over the `backlog` tokens it missed while the n-gram
    /// drafted, spread over the steps it is expected to draft before the n-gram takes over again
    /// ([`Self::model_horizon`]; a draft model called back after a long copy first feeds all of
    /// it: on the agent traces' edits that cost more than it gained, benchmarks.md). Without
    /// adaptive k the model always.
    fn choose(&mut self, st: &mut SeqSpec, support: Option<Support>, k_limit: usize, decoding: usize, backlog: usize, remaining: usize) -> Option<Support> {
        let ngram = self.cfg.adaptive
            && support.is_some_and(|s| {
                let by_ngram = adaptive::best_k_gain(self.by_support[s.band()].alpha(), k_limit.min(s.len), &self.ngram_cost, decoding).1;
                let alpha = st.tracker(&self.global).alpha();
                let (k, gain) = adaptive::best_k_gain(alpha, k_limit, &self.cost, decoding);
                // the catch-up, relative to the batch's plain step, per step it is repaid over
                let per_step = adaptive::expected_tokens(alpha, k);
                let horizon = self.model_horizon(st, remaining, per_step);
                let catch_up = self.cost.catch_up(backlog) / self.cost.plain_step(decoding) / (horizon as f64 / per_step).max(1.0);
                let by_model = if k == 0 { gain } else { per_step / (per_step / gain + catch_up) };
                s.len > 0 && by_ngram >= by_model
            });
        if self.cfg.adaptive {
            let chose = f64::from(u8::from(ngram));
            let share = st.ngram_share.get_or_insert(self.ngram_share_prior);
            *share += NGRAM_SHARE_WEIGHT * (chose - *share);
            self.ngram_share_prior += NGRAM_SHARE_PRIOR_WEIGHT * (chose - self.ngram_share_prior);
        }
        st.drafting.ngram_next = ngram;
        if ngram {
            support
        } else {
            None
        }
    }

    /// Accounts one sequence's verification: `num_drafts` drafted, of which the first `forced`
    /// were forced by its grammar (jump-forward: counted apart from the proposer's), `accepted`
    /// kept; the proposer rolls back to `kept_end`, where the sequence's valid KV ends (the one
    /// rollback rule, `step::kept_end`). Without speculation only the forced counters move.
    pub(crate) fn record_verification(
        spec: Option<&mut Self>,
        seq: crate::types::SeqId,
        st: &mut SeqSpec,
        num_drafts: usize,
        forced: usize,
        accepted: usize,
        kept_end: usize,
    ) {
        if num_drafts == 0 {
            return;
        }
        let forced_accepted = accepted.min(forced);
        match spec {
            Some(sp) => {
                if forced > 0 {
                    sp.metrics.record_forced(forced, forced_accepted);
                }
                if num_drafts > forced {
                    sp.record(st, num_drafts - forced, accepted - forced_accepted);
                }
                sp.proposer.rollback(seq, kept_end);
            }
            None => metrics::record_forced(forced, forced_accepted),
        }
    }
}

/// One sequence that goes on decoding, as draft planning sees it (`Speculation::plan_drafts`).
pub(crate) struct DraftCandidate<'a> {
    pub seq: crate::types::SeqId,
    /// Its tokens, followed by those its grammar forces next when the proposer drafts after them.
    pub tokens: &'a [crate::types::TokenId],
    /// Its tokens without the forced ones (what the proposer has seen of it is measured against).
    pub known: usize,
    pub prompt_len: usize,
    pub params: &'a crate::api::SamplingParams,
    /// Tokens its grammar forces next (drafted first).
    pub forced: usize,
    /// Tokens it may still get after the next one.
    pub room: usize,
    /// Its hidden-state rows, for a proposer that reads them.
    pub hidden: Option<&'a [f32]>,
    pub rng: &'a crate::sampling::SeqRng,
    /// Its speculation state (in its record).
    pub spec: &'a mut SeqSpec,
}

impl DraftCandidate<'_> {
    fn generated(&self) -> usize {
        self.known - self.prompt_len
    }

    /// Only the token its prefill sampled is output so far.
    fn first_decode(&self) -> bool {
        self.generated() <= 1
    }
}

/// A sequence's standing with the proposer when its draft length is chosen
/// (`Speculation::next_k`).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct CatchUp {
    /// Tokens the proposer must process before drafting, beyond the newest ([`Proposer::backlog`]).
    pub backlog: usize,
    /// The sequence's first decode step (only the token its prefill sampled is output).
    pub first_decode: bool,
    /// Tokens it may still generate (`max_tokens` and the context allow).
    pub room: usize,
    /// Tokens it has generated.
    pub generated: usize,
    /// Sequences expected to decode once the prompts being prefilled are in (this step's
    /// decoding ones and `StepPlan::pending_prefill`).
    pub batch_soon: usize,
    /// Tokens the proposer must process for all the step's sequences that may draft and are past
    /// their first decode, this one included ([`CatchUp::batch_backlog`]).
    pub batch_backlog: usize,
}

impl CatchUp {
    /// The batch expected once the prompts on their way are in, for `decoding` sequences: the
    /// step plan's `pending_prefill`, or the requests submitted and not yet scheduled when the
    /// job proposes (`arrived`, read live) where more, up to `max_num_seqs` in all. A plan made
    /// before the requests came saw none of them: at concurrency 8 the first sequence's draft
    /// model caught up with its 300-token prompt, to stop drafting one step later.
    pub fn batch_soon(decoding: usize, plan_pending: usize, arrived: usize, max_num_seqs: usize) -> usize {
        decoding + plan_pending.max(arrived.min(max_num_seqs.saturating_sub(decoding)))
    }

    /// The backlog a late catch-up is weighed with: the whole batch's. A batch's steps grow
    /// shorter only once all its sequences draft; one sequence drafting among others that do not
    /// shortens no step until it is the last one left, while its catch-up stalls them all. At
    /// concurrency 8, two sequences of a batch of three caught up together with 500 tokens each
    /// (2.1 s), each judged as if its own catch-up made the batch's steps shorter, and the rest of
    /// the run did not repay it.
    pub fn batch_backlog(backlogs: impl IntoIterator<Item = usize>) -> usize {
        backlogs.into_iter().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::SeqId;

    /// A draft model's catch-up with its prompt at a sequence's first decode: taken while the
    /// batch it will decode in keeps drafting, skipped where the sequences still prefilling will
    /// make a batch too large to draft for (the catch-up would be wasted).
    #[test]
    fn a_first_decode_catches_up_only_if_drafting_goes_on_once_the_waiting_prompts_are_in() {
        let mut cfg = SpecConfig::new(SpecMethod::Draft, 4);
        cfg.max_batch_for_speculation = 4;
        let cost = cost::CostModel::linear(0.05, 0.1);
        let mut sp = Speculation::new(cfg, Box::new(ngram::NgramProposer::new(2)), cost);
        let mut st = vec![SeqSpec::default(); 5];
        let first = |batch_soon| CatchUp { backlog: 500, first_decode: true, room: 256, generated: 1, batch_soon, batch_backlog: 0 };
        let k_limit = sp.batch_k_limit(1);
        assert!(k_limit > 0);
        // alone, or with a batch of 4 to come: drafting goes on, the catch-up is worth it
        assert!(sp.next_k(SeqId(1), &mut st[1], k_limit, 1, first(1), None) > 0);
        assert!(sp.next_k(SeqId(2), &mut st[2], k_limit, 1, first(4), None) > 0);
        // 7 prompts still prefilling: a batch of 8 drafts nothing, so no catch-up now
        assert_eq!(sp.batch_k_limit(8), 0);
        assert_eq!(sp.next_k(SeqId(3), &mut st[3], k_limit, 1, first(8), None), 0);
        // nothing to catch up with (an n-gram proposer): the batch to come does not matter
        assert!(sp.next_k(SeqId(4), &mut st[4], k_limit, 1, CatchUp { backlog: 0, ..first(8) }, None) > 0);
    }

    /// Draft planning: each sequence drafts at most its room and the engine's k beside its forced
    /// tokens, one that disables speculation drafts nothing, and without adaptive k every other
    /// gets k.
    #[test]
    fn plan_drafts_keeps_each_draft_within_room_k_and_forced_tokens() {
        let mut cfg = SpecConfig::new(SpecMethod::Ngram, 4);
        cfg.adaptive = false;
        let mut sp = Speculation::new(cfg, Box::new(ngram::NgramProposer::new(1)), cost::CostModel::linear(0.05, 0.1));
        let tokens: Vec<crate::types::TokenId> = (0..20).collect();
        let (plain, off) =
            (crate::api::SamplingParams::greedy(64), crate::api::SamplingParams { disable_speculation: true, ..crate::api::SamplingParams::greedy(64) });
        let rng = crate::sampling::SeqRng::new(Some(1), 0);
        let mut st = vec![SeqSpec::default(); 4];
        let cands: Vec<DraftCandidate> = st
            .iter_mut()
            .zip([(1, &plain, 0, 100), (2, &plain, 0, 2), (3, &plain, 3, 100), (4, &off, 0, 100)])
            .map(|(spec, (seq, params, forced, room))| DraftCandidate {
                seq: SeqId(seq),
                tokens: &tokens,
                known: 20,
                prompt_len: 10,
                params,
                forced,
                room,
                hidden: None,
                rng: &rng,
                spec,
            })
            .collect();
        let reqs = sp.plan_drafts(cands, 0, 0, 8);
        let max: Vec<usize> = reqs.iter().map(|r| r.max_draft).collect();
        assert_eq!(max, vec![4, 2, 1, 0], "k; room 2; k 4 less 3 forced; speculation disabled");
        assert_eq!(reqs.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![SeqId(1), SeqId(2), SeqId(3), SeqId(4)]);
    }

    #[test]
    fn the_batch_to_come_counts_requests_that_arrived_after_the_plan() {
        // the plan saw none waiting, seven arrived since: a batch of eight
        assert_eq!(CatchUp::batch_soon(1, 0, 7, 16), 8);
        // never more than the engine runs at once
        assert_eq!(CatchUp::batch_soon(1, 0, 20, 8), 8);
        assert_eq!(CatchUp::batch_soon(8, 0, 5, 8), 8);
        // the plan's count where it is larger (sequences part-way through their prefill)
        assert_eq!(CatchUp::batch_soon(2, 3, 1, 16), 5);
        assert_eq!(CatchUp::batch_soon(2, 0, 0, 16), 2);
    }

    /// A later catch-up is weighed against what the sequence is expected to still generate: with
    /// outputs that ended near 200 tokens, one at 190 tokens is not repaid; at 20 it is.
    #[test]
    fn a_late_catch_up_is_weighed_against_the_lengths_of_finished_outputs() {
        let cfg = SpecConfig::new(SpecMethod::Draft, 4);
        // a catch-up over 60 tokens costs about 3 target steps here
        let cost = cost::CostModel::linear(0.5, 0.1);
        let mut sp = Speculation::new(cfg, Box::new(ngram::NgramProposer::new(2)), cost);
        let mut st = vec![SeqSpec::default(); 5];
        let k_limit = sp.batch_k_limit(1);
        let late = |generated| CatchUp { backlog: 60, first_decode: false, room: 1000 - generated, generated, batch_soon: 1, batch_backlog: 60 };
        // no finished output yet: the horizon, which repays the catch-up
        assert!(sp.next_k(SeqId(1), &mut st[1], k_limit, 1, late(190), None) > 0);
        for len in [195, 198, 200, 202, 205] {
            sp.record_finished(crate::types::Tenant::default(), &vec![0; len]);
        }
        assert_eq!(sp.output_lengths.expected_remaining(190, 810), 10);
        assert_eq!(sp.next_k(SeqId(1), &mut st[1], k_limit, 1, late(190), None), 0);
        assert!(sp.next_k(SeqId(2), &mut st[2], k_limit, 1, late(20), None) > 0);
    }

    /// With a combined proposer, a draft model called back for a sequence the n-gram drafted most
    /// of its recent steps repays its catch-up over the few steps before the n-gram takes over
    /// again, not over the rest of the output: the same catch-up pays for a sequence the model
    /// drafts, and not for one the n-gram drafted 9 steps in 10.
    #[test]
    fn a_catch_up_is_repaid_only_until_the_n_gram_is_expected_to_take_over() {
        let cfg = SpecConfig::new(SpecMethod::Draft, 4);
        // a catch-up over 60 tokens costs about 3 target steps here
        let cost = cost::CostModel::linear(0.5, 0.1);
        let mut sp = Speculation::new(cfg, Box::new(ngram::NgramProposer::new(2)), cost);
        let mut st = vec![SeqSpec::default(); 5];
        let k_limit = sp.batch_k_limit(1);
        let late = CatchUp { backlog: 60, first_decode: false, room: 800, generated: 20, batch_soon: 1, batch_backlog: 60 };
        assert!(sp.next_k(SeqId(1), &mut st[1], k_limit, 1, late, None) > 0);
        st[1].ngram_share = Some(0.9);
        st[2].ngram_share = Some(0.0);
        assert_eq!(sp.next_k(SeqId(1), &mut st[1], k_limit, 1, late, None), 0);
        assert!(sp.next_k(SeqId(2), &mut st[2], k_limit, 1, late, None) > 0);
        assert_eq!(sp.model_horizon(&st[1], 800, 2.0), 3);
        assert_eq!(sp.model_horizon(&st[3], 800, 2.0), 800);
        // a new sequence starts from the share over every sequence's steps
        sp.ngram_share_prior = 0.5;
        assert_eq!(sp.model_horizon(&st[3], 800, 2.0), 4);
        sp.ngram_share_prior = 0.0;
        // a new sequence under the same id (its record was forgotten) starts afresh
        st[1] = SeqSpec::default();
        assert!(sp.next_k(SeqId(1), &mut st[1], k_limit, 1, late, None) > 0);
    }

    /// A late catch-up is weighed as the whole batch's: one sequence 500 tokens behind, alone,
    /// catches up; three of them in a batch of three (1500 tokens, all needed before the batch's
    /// steps grow shorter) do not; one behind among two that draft already does.
    #[test]
    fn a_late_catch_up_is_weighed_as_the_whole_batch_s() {
        let cfg = SpecConfig::new(SpecMethod::Draft, 4);
        // the figures measured at start-up for Qwen2.5-Coder-1.5B with the 0.5B as draft (2
        // threads): a catch-up over 500 tokens costs about 27 target steps, over 1500 about 81
        let verify = [(1, 1.0), (2, 1.04), (3, 1.07), (4, 1.18), (6, 1.39), (8, 1.77), (12, 2.76), (16, 3.47), (32, 6.93)];
        let draft = [(1, 0.21), (2, 0.23), (3, 0.29), (4, 0.37), (6, 0.46), (8, 0.50), (12, 0.70), (16, 0.90), (32, 1.76)];
        let cost = cost::CostModel::from_times(&verify, 0.0).with_draft_times(&draft, 1.0);
        let mut sp = Speculation::new(cfg, Box::new(ngram::NgramProposer::new(2)), cost);
        let mut st = vec![SeqSpec::default(); 5];
        // drafts that are kept (as the 0.5B's on code edits, 0.94)
        for _ in 0..50 {
            sp.record(&mut st[1], 4, 4);
            sp.record(&mut st[1], 4, 3);
        }
        let late = |batch, batch_backlog| CatchUp { backlog: 500, first_decode: false, room: 600, generated: 100, batch_soon: batch, batch_backlog };
        let k_limit = sp.batch_k_limit(3);
        assert!(k_limit > 0);
        assert!(sp.next_k(SeqId(1), &mut st[1], k_limit, 1, late(1, 500), None) > 0);
        assert_eq!(sp.next_k(SeqId(1), &mut st[1], k_limit, 3, late(3, 1500), None), 0);
        assert!(sp.next_k(SeqId(1), &mut st[1], k_limit, 3, late(3, 502), None) > 0);
        // (the sequence's own backlog is never weighed as less than itself)
        assert!(sp.next_k(SeqId(1), &mut st[1], k_limit, 3, late(3, 0), None) > 0);
        assert_eq!(CatchUp::batch_backlog([500, 1, 999]), 1500);
    }

    /// With a proposer's support, each band's own acceptance decides: after short matches whose
    /// drafts are all rejected they stop being drafted (a probe now and then), while long matches
    /// that are copied keep drafting, never past the match; a sequence's own record is unchanged.
    #[test]
    fn each_band_of_support_keeps_its_own_acceptance() {
        let mut cfg = SpecConfig::new(SpecMethod::Ngram, 16);
        cfg.max_step_tokens_for_speculation = 17;
        let cost = cost::CostModel::linear(0.05, 0.0);
        let mut sp = Speculation::new(cfg, Box::new(ngram::NgramProposer::new(1)), cost);
        let mut st = vec![SeqSpec::default(); 5];
        let k_limit = sp.batch_k_limit(1);
        assert_eq!(k_limit, 16);
        let none = CatchUp::default();
        // no match: nothing to draft, not even a probe
        assert_eq!(sp.next_k(SeqId(1), &mut st[1], k_limit, 1, none, Some(Support::own(0))), 0);
        for _ in 0..40 {
            let k = sp.next_k(SeqId(1), &mut st[1], k_limit, 1, none, Some(Support::own(1)));
            if k > 0 {
                assert_eq!(k, 1, "never past the match");
                sp.record(&mut st[1], k, 0);
            }
            let k = sp.next_k(SeqId(1), &mut st[1], k_limit, 1, none, Some(Support::own(20)));
            assert!(k > 0 && k <= 16);
            sp.record(&mut st[1], k, k);
        }
        let short = sp.by_support[adaptive::support_band(1)].alpha();
        let long = sp.by_support[adaptive::support_band(20)].alpha();
        assert!(short < 0.1 && long > 0.95, "{short} {long}");
        // short matches are now drafted only as a probe, one step in PROBE_EVERY
        let drafted = (0..2 * adaptive::PROBE_EVERY).filter(|_| sp.next_k(SeqId(1), &mut st[1], k_limit, 1, none, Some(Support::own(1))) > 0).count();
        assert_eq!(drafted, 2);
        assert!(sp.next_k(SeqId(1), &mut st[1], k_limit, 1, none, Some(Support::own(9))) > 0, "an untried band starts from the prior");
        assert_eq!(sp.next_k(SeqId(1), &mut st[1], k_limit, 1, none, Some(Support::own(20))), 16);
        // a draft no support backed credits the sequence's own estimate, no band
        let before = sp.by_support[adaptive::support_band(1)].alpha();
        sp.record(&mut SeqSpec::default(), 1, 1);
        assert_eq!(sp.by_support[adaptive::support_band(1)].alpha(), before);
    }

    /// A model proposer for tests: drafts `[7; max_draft]` and remembers what it was asked.
    struct Asked(std::sync::Arc<std::sync::Mutex<Vec<(SeqId, usize)>>>);

    impl Proposer for Asked {
        fn propose(&mut self, reqs: &mut [DraftRequest], _pool: &rayon::ThreadPool) -> Result<Vec<Draft>, SpecError> {
            self.0.lock().unwrap().extend(reqs.iter().map(|r| (r.seq, r.max_draft)));
            Ok(reqs.iter().map(|r| Draft { tokens: vec![7; r.max_draft], probs: None }).collect())
        }
    }

    /// `ngram,draft`: a sequence whose text matches far back takes the n-gram's draft once that
    /// band keeps more than the model's drafts for it; the model is then asked for nothing for it,
    /// and the other sequence (no match) is the model's.
    #[test]
    fn a_combined_proposer_drafts_each_sequence_with_the_method_expected_to_keep_more() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let asked = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let combined = combined::CombinedProposer::new(ngram::NgramProposer::new(1), Box::new(Asked(asked.clone())));
        let mut sp = Speculation::new(SpecConfig::new(SpecMethod::Draft, 4), Box::new(combined), cost::CostModel::linear(0.05, 0.1));
        let mut st = vec![SeqSpec::default(); 5];
        // seq 1 repeats 24 tokens (a long match), seq 2 never repeats
        let copy: Vec<crate::types::TokenId> = (100..124).chain(100..112).collect();
        let fresh: Vec<crate::types::TokenId> = (200..236).collect();
        let params = crate::api::SamplingParams::greedy(64);
        let rng = crate::sampling::SeqRng::new(Some(1), 0);
        fn cand<'a>(
            seq: u64,
            tokens: &'a [crate::types::TokenId],
            params: &'a crate::api::SamplingParams,
            rng: &'a crate::sampling::SeqRng,
            spec: &'a mut SeqSpec,
        ) -> DraftCandidate<'a> {
            DraftCandidate { seq: SeqId(seq), tokens, known: tokens.len(), prompt_len: 4, params, forced: 0, room: 100, hidden: None, rng, spec }
        }
        let (copy, fresh): (&'static [_], &'static [_]) = (copy.leak(), fresh.leak());
        // the model's drafts for seq 1 are rarely kept, the long band's always
        for _ in 0..20 {
            sp.record(&mut st[1], 4, 0);
            st[3].supported = Some(Support::own(12).band());
            sp.record(&mut st[3], 4, 4);
        }
        let [_, s1, s2, ..] = &mut st[..] else { unreachable!() };
        let mut reqs = sp.plan_drafts(vec![cand(1, copy, &params, &rng, s1), cand(2, fresh, &params, &rng, s2)], 0, 0, 8);
        assert!(reqs.iter().all(|r| r.max_draft > 0), "both draft: {:?}", reqs.iter().map(|r| r.max_draft).collect::<Vec<_>>());
        // the choice is kept in each sequence's drafting state
        assert_eq!(reqs.iter().map(|r| r.drafting.ngram_next).collect::<Vec<_>>(), vec![true, false]);
        let drafts = sp.proposer.propose(&mut reqs, &pool).unwrap();
        // seq 1: the n-gram continues the earlier "112 113 ..."; seq 2: the model's 7s
        assert_eq!(drafts[0].tokens, (112..112 + reqs[0].max_draft as u32).collect::<Vec<_>>());
        assert_eq!(drafts[1].tokens, vec![7; reqs[1].max_draft]);
        assert_eq!(*asked.lock().unwrap(), vec![(SeqId(1), 0), (SeqId(2), reqs[1].max_draft)]);
        // each choice moves the sequence's n-gram share (what a later catch-up is repaid over)
        // (seq 2 started from the prior seq 1's choice moved, then chose the model)
        let seq_2 = NGRAM_SHARE_PRIOR_WEIGHT * (1.0 - NGRAM_SHARE_WEIGHT);
        drop(reqs);
        assert_eq!((st[1].ngram_share, st[2].ngram_share), (Some(NGRAM_SHARE_WEIGHT), Some(seq_2)));
        assert!(sp.ngram_share_prior > 0.0 && sp.ngram_share_prior < NGRAM_SHARE_PRIOR_WEIGHT);
        // once the model's drafts for seq 1 are kept better than the band's, the model drafts it
        for _ in 0..40 {
            sp.record(&mut st[1], 4, 4);
            st[3].supported = Some(Support::own(12).band());
            sp.record(&mut st[3], 4, 0);
        }
        asked.lock().unwrap().clear();
        let mut reqs = sp.plan_drafts(vec![cand(1, copy, &params, &rng, &mut st[1])], 0, 0, 8);
        let drafts = sp.proposer.propose(&mut reqs, &pool).unwrap();
        assert_eq!(drafts[0].tokens, vec![7; reqs[0].max_draft]);
        assert!(reqs[0].max_draft > 0);
    }
}
