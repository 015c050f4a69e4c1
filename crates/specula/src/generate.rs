//! `specula generate`: one-shot generation from the terminal through the engine, streaming text
//! as it is produced and reporting prompt and generation speed on stderr.

use crate::engine_args::EngineArgs;
use crate::sampling_args::SamplingArgs;
use anyhow::{bail, Context, Result};
use clap::Args;
use specula_engine::{spawn_engine, GenerateRequest, RequestEvent};
use specula_model::{load_model_with, ChatMessage};
use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// The prompt text.
    #[arg(long)]
    pub prompt: String,
    /// Treat the prompt as a user message and apply the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// System message (with --chat).
    #[arg(long)]
    pub system: Option<String>,
}

pub fn run(args: GenerateArgs) -> Result<()> {
    let params = args.sampling.to_params();
    params.validate(usize::MAX).map_err(|e| anyhow::anyhow!("invalid --{}: {}", e.param.replace('_', "-"), e.message))?;
    let path = crate::fetch::resolve_model(&args.engine.model)?;
    let loaded = load_model_with(&path, &args.engine.load_options(&path, 1))?;
    eprintln!("loaded {} in {} ms", loaded.name, loaded.load_time.as_millis());
    let text = if args.chat {
        let tmpl = loaded.chat_template.as_ref().context("this model has no chat template; drop --chat")?;
        let mut msgs = Vec::new();
        if let Some(s) = &args.system {
            msgs.push(ChatMessage { role: "system".into(), content: s.clone() });
        }
        msgs.push(ChatMessage { role: "user".into(), content: args.prompt.clone() });
        tmpl.render(&msgs, true)?
    } else {
        args.prompt.clone()
    };
    let cfg = args.engine.to_config(&path, &loaded, 1)?;
    let tokenizer = Arc::new(loaded.tokenizer);
    let prompt = if args.chat { tokenizer.encode(&text)? } else { tokenizer.encode_prompt(&text)? };
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    if prompt.len() >= cfg.max_model_len {
        bail!("prompt has {} tokens but --max-model-len is {}", prompt.len(), cfg.max_model_len);
    }
    let spec = args.engine.spec.build(&loaded.model, &tokenizer, &cfg)?;
    let (handle, join) = spawn_engine(loaded.model, tokenizer, cfg, spec)?;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let start = Instant::now();
    let n_prompt = prompt.len();
    handle.submit(GenerateRequest { id: handle.next_request_id(), prompt, params, events: tx, grammar: None })?;
    let mut first: Option<Instant> = None;
    let mut out = std::io::stdout().lock();
    let result = loop {
        match rx.blocking_recv() {
            Some(RequestEvent::Delta { text, .. }) => {
                first.get_or_insert_with(Instant::now);
                out.write_all(text.as_bytes())?;
                out.flush()?;
            }
            Some(RequestEvent::Finished { reason, completion_tokens, cached_tokens, .. }) => break Ok((reason, completion_tokens, cached_tokens)),
            Some(RequestEvent::Failed { message }) => break Err(anyhow::anyhow!(message)),
            Some(RequestEvent::PromptLogprobs { .. }) => {}
            None => break Err(anyhow::anyhow!("the engine stopped unexpectedly")),
        }
    };
    writeln!(out)?;
    drop(handle);
    let _ = join.join();
    let (reason, n_gen, cached) = result?;
    let end = Instant::now();
    let ttft = first.map(|f| f - start).unwrap_or_default();
    let gen_time = first.map(|f| end - f).unwrap_or_default();
    eprintln!(
        "prompt: {n_prompt} tokens ({cached} from the prefix cache), {:.1} tokens/s, first token after {:.2} s | generation: {n_gen} tokens, {:.1} tokens/s | finish: {}",
        n_prompt as f64 / ttft.as_secs_f64().max(1e-9),
        ttft.as_secs_f64(),
        n_gen.saturating_sub(1) as f64 / gen_time.as_secs_f64().max(1e-9),
        reason.as_str()
    );
    Ok(())
}
