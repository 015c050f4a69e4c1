//! `specula bench serve`: a load generator for any OpenAI-compatible server (specula, llama-server,
//! vLLM), with vLLM's `bench serve` flags. It sends the same prompts once per `--max-concurrency`
//! level, streaming every response, and prints throughput and TTFT/TPOT/ITL/E2E percentiles per
//! level (plus speculation acceptance when the server reports it); `--output-json` keeps them all.
//! It measures a server from outside; engine throughput without HTTP is `specula bench offline`.

use super::report::{self, BenchReport, LevelResult};
use super::request::{self, Endpoint, RequestOutcome};
use super::spec::{self, SpecCounters};
use super::workload::{self, Prompt};
use anyhow::{bail, Context, Result};
use clap::ValueEnum;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Map, Value};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

#[derive(clap::Args, Debug, Clone)]
pub struct BenchServeArgs {
    /// Server address, without the API path.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub base_url: String,
    /// API path: /v1/completions or /v1/chat/completions.
    #[arg(long, default_value = "/v1/completions")]
    pub endpoint: String,
    /// Model name sent in each request [default: the first model GET /v1/models lists].
    #[arg(long)]
    pub model: Option<String>,
    /// Sent as `Authorization: Bearer KEY`.
    #[arg(long, env = "OPENAI_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Where prompts come from: random words, or a JSONL file (--dataset-path).
    #[arg(long, value_enum, default_value_t = Dataset::Random)]
    pub dataset: Dataset,
    /// JSONL file for --dataset file, one {"prompt": "...", "max_tokens": N} per line (max_tokens
    /// optional; --random-output-len otherwise).
    #[arg(long)]
    pub dataset_path: Option<PathBuf>,
    /// Words per random prompt; about one token each for common English words.
    #[arg(long, default_value_t = 1024)]
    pub random_input_len: usize,
    /// Output tokens per random request (max_tokens, with ignore_eos and min_tokens so the server
    /// generates all of them); also max_tokens for file lines that give none.
    #[arg(long, default_value_t = 128)]
    pub random_output_len: usize,
    /// Draw each random length uniformly from [len * (1 - r), len * (1 + r)].
    #[arg(long, default_value_t = 0.0)]
    pub random_range_ratio: f64,
    /// Requests per level (a file shorter than this is gone round again).
    #[arg(long, default_value_t = 100)]
    pub num_prompts: usize,
    /// Seed for random prompts and arrival times.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Requests in flight at most; a comma list (1,4,8) runs one level after another
    /// [default: no limit].
    #[arg(long, value_delimiter = ',')]
    pub max_concurrency: Vec<usize>,
    /// Offered load in requests/s, as Poisson arrivals; inf sends every request at once (still
    /// limited by --max-concurrency).
    #[arg(long, default_value = "inf")]
    pub request_rate: f64,
    /// Sampling temperature of every request (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Send ignore_eos and min_tokens with file prompts too (random prompts always send them).
    #[arg(long)]
    pub ignore_eos: bool,
    /// JSON object merged into every request body, e.g. '{"top_k": 1}'; its keys win.
    #[arg(long)]
    pub extra_body: Option<String>,
    /// Write the configuration and every level's results here as JSON.
    #[arg(long)]
    pub output_json: Option<PathBuf>,
    /// Include every request's outcome (timings, tokens, error) in --output-json.
    #[arg(long)]
    pub save_detailed: bool,
    /// Name for this run (e.g. the server under test), shown in the tables and the JSON.
    #[arg(long)]
    pub label: Option<String>,
    /// No progress bar.
    #[arg(long, alias = "disable-tqdm")]
    pub no_progress: bool,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dataset {
    Random,
    File,
}

/// Which request and response shape the endpoint speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Api {
    Completions,
    Chat,
}

/// The arguments, checked once: everything a run needs besides the model name and prompts.
struct Plan {
    base_url: String,
    api: Api,
    endpoint: Arc<Endpoint>,
    /// One run per entry; `None` = no concurrency limit.
    levels: Vec<Option<usize>>,
    /// `None` = all requests at once.
    rate: Option<f64>,
    extra_body: Map<String, Value>,
    ignore_eos: bool,
}

impl Plan {
    fn from_args(a: &BenchServeArgs) -> Result<Plan> {
        let base_url = a.base_url.trim_end_matches('/').to_string();
        if base_url.starts_with("https://") {
            bail!("--base-url {base_url}: https is not supported (specula is built without TLS); use an http:// address");
        }
        if !base_url.starts_with("http://") {
            bail!("--base-url {base_url}: expected an address like http://127.0.0.1:8000");
        }
        if !a.endpoint.starts_with('/') {
            bail!("--endpoint {}: expected a path starting with '/', like /v1/completions", a.endpoint);
        }
        let api = if a.endpoint.ends_with("/chat/completions") {
            Api::Chat
        } else if a.endpoint.ends_with("/completions") {
            Api::Completions
        } else {
            bail!("--endpoint {}: only /v1/completions and /v1/chat/completions (or paths ending so) are supported", a.endpoint);
        };
        if a.num_prompts == 0 {
            bail!("--num-prompts must be at least 1");
        }
        if a.dataset == Dataset::Random && a.random_input_len == 0 {
            bail!("--random-input-len must be at least 1");
        }
        if a.random_output_len == 0 {
            bail!("--random-output-len must be at least 1 (it is the max_tokens of file lines that give none)");
        }
        if !(0.0..1.0).contains(&a.random_range_ratio) {
            bail!("--random-range-ratio {} must be in [0, 1)", a.random_range_ratio);
        }
        if a.dataset == Dataset::File && a.dataset_path.is_none() {
            bail!("--dataset file needs --dataset-path FILE.jsonl");
        }
        if a.max_concurrency.contains(&0) {
            bail!("--max-concurrency {:?}: each level must be at least 1", a.max_concurrency);
        }
        let rate = match a.request_rate {
            r if r.is_infinite() && r > 0.0 => None,
            r if r > 0.0 => Some(r),
            r => bail!("--request-rate {r} must be positive (or inf)"),
        };
        if !(a.temperature >= 0.0 && a.temperature.is_finite()) {
            bail!("--temperature {} must be a finite number >= 0", a.temperature);
        }
        let extra_body = match &a.extra_body {
            None => Map::new(),
            Some(text) => match serde_json::from_str(text) {
                Ok(Value::Object(m)) => m,
                Ok(_) => bail!("--extra-body must be a JSON object, e.g. '{{\"top_k\": 1}}'; got {text}"),
                Err(e) => bail!("--extra-body is not valid JSON ({e}): {text}"),
            },
        };
        let levels = if a.max_concurrency.is_empty() { vec![None] } else { a.max_concurrency.iter().map(|&c| Some(c)).collect() };
        Ok(Plan {
            endpoint: Arc::new(Endpoint { url: format!("{base_url}{}", a.endpoint), api_key: a.api_key.clone() }),
            base_url,
            api,
            levels,
            rate,
            extra_body,
            ignore_eos: a.ignore_eos || a.dataset == Dataset::Random,
        })
    }
}

/// Runs the benchmark, prints its tables and writes --output-json.
pub async fn run(args: BenchServeArgs) -> Result<()> {
    let report = benchmark(&args).await?;
    if report.results.len() > 1 {
        report::print_sweep(report.label.as_deref(), &report.results);
    }
    if let Some(path) = &args.output_json {
        let text = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, text + "\n").with_context(|| format!("cannot write --output-json {}", path.display()))?;
        eprintln!("results written to {}", path.display());
    }
    Ok(())
}

/// Every level in turn, each printed as it finishes. Errors only for bad arguments or an
/// unreachable model list; failed requests are counted in the results instead.
pub(crate) async fn benchmark(args: &BenchServeArgs) -> Result<BenchReport> {
    let plan = Plan::from_args(args)?;
    // a fresh connection per request: a kept-alive one the server closed while a conversation's
    // next turn was being prepared failed that turn ("connection closed before message
    // completed", once with llama-server); a local connect costs well under a millisecond
    let client =
        reqwest::Client::builder().connect_timeout(Duration::from_secs(10)).pool_max_idle_per_host(0).build().context("cannot build the HTTP client")?;
    let model = match &args.model {
        Some(m) => m.clone(),
        None => first_model(&client, &plan).await?,
    };
    let prompts = match args.dataset {
        Dataset::Random => workload::random_prompts(args.num_prompts, args.random_input_len, args.random_output_len, args.random_range_ratio, args.seed),
        Dataset::File => {
            let path = args.dataset_path.as_deref().expect("Plan::from_args checked that --dataset file has a path");
            workload::file_prompts(path, args.num_prompts, args.random_output_len)?
        }
    };
    if plan.api != Api::Chat && prompts.iter().any(|p| p.messages.is_some()) {
        bail!("the dataset has chat turns (\"messages\"): send them to --endpoint /v1/chat/completions");
    }
    let bodies: Vec<String> = prompts.iter().map(|p| request_body(&plan, &model, p, args.temperature).to_string()).collect();
    let approx_tokens: Vec<usize> = prompts.iter().map(|p| p.approx_tokens).collect();
    let sequences = workload::sequences(&prompts);
    let arrivals = workload::arrival_times(sequences.len(), plan.rate, args.seed);
    eprintln!(
        "bench serve: {} model {model}, {} prompts per level, request rate {}",
        plan.endpoint.url,
        prompts.len(),
        plan.rate.map_or("inf".into(), |r| r.to_string())
    );

    let mut results = Vec::new();
    for &level in &plan.levels {
        let before = spec_metrics(&client, &plan).await;
        let bar = progress_bar(prompts.len(), level, args.no_progress);
        let (duration_s, outcomes) = run_level(&client, &plan.endpoint, &bodies, &approx_tokens, &sequences, &arrivals, level, &bar).await;
        let kinds = report::kind_rows(&prompts, &outcomes);
        bar.finish_and_clear();
        let after = spec_metrics(&client, &plan).await;
        let metrics_diff = before.zip(after).map(|(b, a)| spec::diff(&b, &a));
        let result = LevelResult::new(level, plan.rate, duration_s, outcomes, metrics_diff, args.save_detailed);
        report::print_level(args.label.as_deref(), &result);
        report::print_kinds(&kinds);
        results.push(result);
    }
    Ok(BenchReport { label: args.label.clone(), config: config_json(args, &plan, &model), results })
}

/// Sends every sequence (a conversation's turns one after another, or one prompt;
/// [`workload::sequences`]) at its arrival time, at most `concurrency` sequences in flight (one
/// due while the limit is reached waits for a slot). Returns the wall time from first send to last
/// response, and the outcomes in prompt order.
#[allow(clippy::too_many_arguments)]
async fn run_level(
    client: &reqwest::Client,
    endpoint: &Arc<Endpoint>,
    bodies: &[String],
    approx_tokens: &[usize],
    sequences: &[Vec<usize>],
    arrivals: &[f64],
    concurrency: Option<usize>,
    bar: &ProgressBar,
) -> (f64, Vec<RequestOutcome>) {
    let slots = Arc::new(Semaphore::new(concurrency.unwrap_or(sequences.len()).clamp(1, Semaphore::MAX_PERMITS)));
    let start = Instant::now();
    let mut tasks = JoinSet::new();
    for (s, turns) in sequences.iter().enumerate() {
        tokio::time::sleep_until((start + Duration::from_secs_f64(arrivals[s])).into()).await;
        let slot = slots.clone().acquire_owned().await.expect("the semaphore is never closed");
        let turns: Vec<(usize, String, usize)> = turns.iter().map(|&i| (i, bodies[i].clone(), approx_tokens[i])).collect();
        let (client, endpoint, bar) = (client.clone(), endpoint.clone(), bar.clone());
        tasks.spawn(async move {
            let mut done = Vec::with_capacity(turns.len());
            for (i, body, approx) in turns {
                done.push((i, request::send(&client, &endpoint, body, approx).await));
                bar.inc(1);
            }
            drop(slot);
            done
        });
    }
    let mut outcomes = Vec::with_capacity(bodies.len());
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok(done) => outcomes.extend(done),
            Err(e) => outcomes.push((usize::MAX, panicked(&e))),
        }
    }
    let duration_s = start.elapsed().as_secs_f64();
    outcomes.sort_by_key(|(i, _)| *i);
    (duration_s, outcomes.into_iter().map(|(_, o)| o).collect())
}

/// A request task that panicked (a bug in this module) still counts, as a failure.
fn panicked(e: &tokio::task::JoinError) -> RequestOutcome {
    RequestOutcome {
        error: Some(format!("request task died: {e}")),
        prompt_tokens: 0,
        output_tokens: 0,
        output_tokens_from_usage: false,
        ttft_s: 0.0,
        e2e_s: 0.0,
        itl_s: Vec::new(),
        spec: SpecCounters::new(),
    }
}

fn request_body(plan: &Plan, model: &str, p: &Prompt, temperature: f64) -> Value {
    let mut body = json!({
        "model": model,
        "max_tokens": p.max_tokens,
        "temperature": temperature,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    match (plan.api, &p.messages) {
        (Api::Chat, Some(messages)) => body["messages"] = messages.clone(),
        (Api::Completions, _) => body["prompt"] = json!(p.text),
        (Api::Chat, None) => body["messages"] = json!([{"role": "user", "content": p.text}]),
    }
    if plan.ignore_eos {
        body["ignore_eos"] = json!(true);
        body["min_tokens"] = json!(p.max_tokens);
    }
    for (k, v) in &plan.extra_body {
        body[k] = v.clone();
    }
    body
}

/// The first model of GET /v1/models.
async fn first_model(client: &reqwest::Client, plan: &Plan) -> Result<String> {
    let url = format!("{}/v1/models", plan.base_url);
    let mut req = client.get(&url).timeout(Duration::from_secs(30));
    if let Some(key) = &plan.endpoint.api_key {
        req = req.bearer_auth(key);
    }
    let hint = "is the server up at --base-url? Or pass --model";
    let resp = req.send().await.with_context(|| format!("cannot list models at {url}; {hint}"))?;
    let status = resp.status();
    let body: Value = resp.json().await.with_context(|| format!("GET {url} ({status}) did not return JSON; {hint}"))?;
    match body["data"][0]["id"].as_str() {
        Some(id) if status.is_success() => Ok(id.to_string()),
        _ => bail!("GET {url} ({status}) lists no model: {body}; pass --model"),
    }
}

/// The server's speculation counters from GET /metrics, or `None` if it has no such page.
async fn spec_metrics(client: &reqwest::Client, plan: &Plan) -> Option<SpecCounters> {
    let mut req = client.get(format!("{}/metrics", plan.base_url)).timeout(Duration::from_secs(5));
    if let Some(key) = &plan.endpoint.api_key {
        req = req.bearer_auth(key);
    }
    let resp = req.send().await.ok().filter(|r| r.status().is_success())?;
    Some(spec::parse_prometheus(&resp.text().await.ok()?))
}

fn progress_bar(n: usize, concurrency: Option<usize>, hidden: bool) -> ProgressBar {
    if hidden {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(n as u64);
    if let Ok(style) = ProgressStyle::with_template("{prefix} [{elapsed_precise}] {wide_bar} {pos}/{len} requests") {
        bar.set_style(style);
    }
    bar.set_prefix(format!("concurrency {}", concurrency.map_or("unlimited".into(), |c| c.to_string())));
    bar
}

fn config_json(a: &BenchServeArgs, plan: &Plan, model: &str) -> Value {
    let finished = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    json!({
        "base_url": plan.base_url,
        "endpoint": a.endpoint,
        "model": model,
        "dataset": format!("{:?}", a.dataset).to_lowercase(),
        "dataset_path": a.dataset_path,
        "num_prompts": a.num_prompts,
        "random_input_len": a.random_input_len,
        "random_output_len": a.random_output_len,
        "random_range_ratio": a.random_range_ratio,
        "seed": a.seed,
        "max_concurrency": plan.levels,
        "request_rate": plan.rate,
        "temperature": a.temperature,
        "ignore_eos": plan.ignore_eos,
        "extra_body": plan.extra_body,
        "finished_unix_s": finished,
    })
}
