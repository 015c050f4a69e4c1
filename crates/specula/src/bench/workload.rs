//! What a benchmark sends and when: random word prompts of a chosen length or the lines of a JSONL
//! file, and the times at which requests arrive (all at once, or a Poisson process).
//!
//! Random prompts are drawn from a list of common English words. Each word, with its leading space,
//! is a single token in the BPE vocabularies we meet (GPT-2, Llama, SmolLM, Qwen), so a prompt of
//! N words is about N tokens; the server's `usage.prompt_tokens` gives the exact count in results.

use anyhow::{bail, Context, Result};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::path::Path;

/// One request's worth of work.
#[derive(Debug, Clone, PartialEq)]
pub struct Prompt {
    pub text: String,
    /// Sent as `max_tokens`.
    pub max_tokens: usize,
    /// Word count: the input-token estimate used when a server reports no `usage`.
    pub approx_tokens: usize,
}

/// Common English words, each one token (with its leading space) in GPT-2/Llama-style vocabularies.
const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "was", "for", "that", "on", "with", "as", "by", "at", "from", "his", "her", "they", "this", "which", "be", "are",
    "have", "had", "not", "but", "or", "an", "were", "all", "their", "she", "he", "one", "you", "it", "we", "can", "more", "has", "been", "would", "will",
    "there", "so", "if", "no", "what", "when", "who", "them", "other", "its", "into", "about", "than", "some", "could", "then", "only", "out", "also", "time",
    "up", "new", "like", "may", "these", "two", "first", "any", "people", "over", "such", "after", "most", "very", "made", "many", "where", "our", "use",
    "just", "even", "much", "way", "state", "each", "well", "did", "your", "how", "between", "year", "because", "both", "those", "through", "during", "world",
    "own", "life", "same", "work", "still", "being", "here", "while", "before", "last", "make", "under", "three", "again", "never", "might", "home", "part",
    "since", "against", "off", "day", "great", "back", "place", "long", "show", "good", "end", "city", "old", "small", "high", "large", "water", "school",
    "house", "family", "group", "number", "game", "name", "book", "line", "found", "called", "known", "used", "become", "left", "right", "down", "around",
    "came", "went", "take", "took", "give", "gave", "find", "think", "know", "see", "look", "come", "want", "need", "read", "write", "open", "run", "play",
    "move", "live", "turn", "start", "keep", "hand", "head", "eye", "face", "room", "road", "car", "war", "music", "art", "film", "team", "light", "night",
    "power", "money", "story", "heart", "mind", "body", "land", "sea", "river", "tree", "fire", "food", "king", "law", "court", "market", "field", "system",
    "order", "form", "point", "level", "area", "side", "kind", "best", "real", "free", "full", "young", "black", "white", "red", "green", "blue", "early",
    "late", "next", "few", "every", "another", "without", "along", "often", "always", "together", "himself",
];

/// `n` prompts of about `input_len` words asking for `output_len` tokens each; with `range_ratio`
/// r > 0 each length is drawn uniformly from [len * (1 - r), len * (1 + r)] as vLLM's random dataset
/// does. The same seed gives the same prompts.
pub fn random_prompts(n: usize, input_len: usize, output_len: usize, range_ratio: f64, seed: u64) -> Vec<Prompt> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let words = jitter(&mut rng, input_len, range_ratio);
            let max_tokens = jitter(&mut rng, output_len, range_ratio);
            let text: Vec<&str> = (0..words).map(|_| *WORDS.choose(&mut rng).expect("word list is not empty")).collect();
            Prompt { text: text.join(" "), max_tokens, approx_tokens: words }
        })
        .collect()
}

fn jitter(rng: &mut StdRng, len: usize, ratio: f64) -> usize {
    let lo = ((len as f64) * (1.0 - ratio)).floor().max(1.0) as usize;
    let hi = ((len as f64) * (1.0 + ratio)).ceil().max(lo as f64) as usize;
    rng.gen_range(lo..=hi)
}

/// `n` prompts from a JSONL file of `{"prompt": "...", "max_tokens": 64}` lines (`max_tokens`
/// optional, `default_max_tokens` otherwise; blank lines skipped). Takes the first `n` lines, and
/// goes round the file again when it has fewer.
pub fn file_prompts(path: &Path, n: usize, default_max_tokens: usize) -> Result<Vec<Prompt>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read --dataset-path {}", path.display()))?;
    parse_prompts(&text, &path.display().to_string(), n, default_max_tokens)
}

/// [`file_prompts`] on text already read; `source` names it in errors.
pub fn parse_prompts(text: &str, source: &str, n: usize, default_max_tokens: usize) -> Result<Vec<Prompt>> {
    let mut lines = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{source}:{}", i + 1);
        let v: serde_json::Value = serde_json::from_str(line).with_context(|| format!("{}: not a JSON object", at()))?;
        let Some(prompt) = v.get("prompt").and_then(|p| p.as_str()) else {
            bail!("{}: expected {{\"prompt\": \"...\", \"max_tokens\": N}} (max_tokens optional), found {line:.80}", at());
        };
        let max_tokens = match v.get("max_tokens") {
            None | Some(serde_json::Value::Null) => default_max_tokens,
            Some(m) => m.as_u64().filter(|&m| m > 0).with_context(|| format!("{}: max_tokens must be a positive integer", at()))? as usize,
        };
        lines.push(Prompt { text: prompt.to_string(), max_tokens, approx_tokens: prompt.split_whitespace().count() });
    }
    if lines.is_empty() {
        bail!("--dataset-path {source} has no prompts");
    }
    Ok(lines.iter().cycle().take(n).cloned().collect())
}

/// Send times, in seconds from the start, of `n` requests arriving as a Poisson process of `rate`
/// requests/s (exponential gaps; the first at 0), or all at 0 when `rate` is `None`.
pub fn arrival_times(n: usize, rate: Option<f64>, seed: u64) -> Vec<f64> {
    let Some(rate) = rate else { return vec![0.0; n] };
    let mut rng = StdRng::seed_from_u64(seed);
    let mut t = 0.0;
    (0..n)
        .map(|i| {
            if i > 0 {
                let u: f64 = rng.gen();
                t += -(1.0 - u).ln() / rate;
            }
            t
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn random_prompts_have_the_asked_word_count_and_repeat_with_the_seed() {
        let a = random_prompts(3, 50, 16, 0.0, 7);
        assert_eq!(a.len(), 3);
        for p in &a {
            assert_eq!(p.text.split(' ').count(), 50);
            assert_eq!(p.approx_tokens, 50);
            assert_eq!(p.max_tokens, 16);
        }
        assert_eq!(a, random_prompts(3, 50, 16, 0.0, 7));
        assert_ne!(a, random_prompts(3, 50, 16, 0.0, 8));
        assert_ne!(a[0].text, a[1].text);
    }

    #[test]
    fn range_ratio_keeps_lengths_within_bounds() {
        for p in random_prompts(200, 100, 10, 0.5, 1) {
            assert!((50..=150).contains(&p.approx_tokens), "{}", p.approx_tokens);
            assert!((5..=15).contains(&p.max_tokens), "{}", p.max_tokens);
        }
    }

    #[test]
    fn file_prompts_read_jsonl_cycle_and_default_max_tokens() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        writeln!(f, "{{\"prompt\": \"copy this passage\", \"max_tokens\": 5}}\n\n{{\"prompt\": \"hello\"}}").unwrap();
        let p = file_prompts(f.path(), 3, 9).unwrap();
        assert_eq!(
            p.iter().map(|p| (p.text.as_str(), p.max_tokens)).collect::<Vec<_>>(),
            vec![("copy this passage", 5), ("hello", 9), ("copy this passage", 5)]
        );
        assert_eq!(p[0].approx_tokens, 3);
    }

    #[test]
    fn file_prompt_errors_name_the_line() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        writeln!(f, "{{\"prompt\": \"ok\"}}\n{{\"text\": \"wrong key\"}}").unwrap();
        let e = file_prompts(f.path(), 1, 9).unwrap_err().to_string();
        assert!(e.contains(":2: expected"), "{e}");
    }

    #[test]
    fn poisson_arrivals_start_at_zero_rise_and_average_one_over_rate() {
        assert_eq!(arrival_times(3, None, 0), vec![0.0, 0.0, 0.0]);
        let t = arrival_times(20_001, Some(4.0), 3);
        assert_eq!(t[0], 0.0);
        assert!(t.windows(2).all(|w| w[1] >= w[0]));
        let mean_gap = t[20_000] / 20_000.0;
        assert!((mean_gap - 0.25).abs() < 0.01, "mean gap {mean_gap}");
        assert_eq!(t, arrival_times(20_001, Some(4.0), 3));
    }
}
