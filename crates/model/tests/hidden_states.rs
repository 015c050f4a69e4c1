//! The hidden states a forward pass hands out (`ForwardBatch::hidden_layers`, what an mtp head
//! reads): each asked-for layer's residual stream of each logits row, in the asked order; the
//! final layer's is the state the logits come from.

mod common;

use common::BLOCK_SIZE;
use specula_model::testing::{write_tiny_llama, TinySpec};
use specula_model::{load_model, ForwardBatch, LlamaModel, ModelError, SeqSpan};

/// One prefill of `tokens` with logits for `rows`, asking for `layers`.
fn run(model: &LlamaModel, tokens: &[u32], rows: &[usize], layers: &[usize]) -> Result<(Vec<f32>, Vec<f32>), ModelError> {
    let mut cache = common::Cache::new(model, tokens.len().div_ceil(BLOCK_SIZE) + 1);
    let seq = cache.seq(tokens);
    let slots: Vec<usize> = (0..tokens.len()).map(|p| seq.table[p / BLOCK_SIZE] as usize * BLOCK_SIZE + p % BLOCK_SIZE).collect();
    let spans = [SeqSpan { q_start: 0, q_len: tokens.len(), context_len: tokens.len(), block_table: &seq.table }];
    let out =
        model.forward(&ForwardBatch { tokens, seqs: &spans, slots: &slots, logits_rows: rows, hidden_layers: layers, state_slots: &[] }, &mut cache.kv)?;
    Ok((out.logits, out.hidden))
}

#[test]
fn hidden_states_come_per_row_in_the_asked_layer_order_and_the_last_gives_the_logits() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    write_tiny_llama(&path, &TinySpec { seed: 3, ..Default::default() }).unwrap();
    let m = load_model(&path).unwrap().model;
    let (h, last) = (m.config.hidden_size, m.config.n_layers - 1);
    assert!(last >= 1, "the test needs two layers");
    let tokens: Vec<u32> = (0..21u32).map(|i| (i * 29 + 5) % 259).collect();
    let rows = [3usize, 20, 11];

    let (logits, none) = run(&m, &tokens, &rows, &[]).unwrap();
    assert!(none.is_empty());
    let (logits2, fin) = run(&m, &tokens, &rows, &[last]).unwrap();
    assert_eq!(logits, logits2, "asking for states changes nothing else");
    assert_eq!(fin.len(), rows.len() * h);
    assert_eq!(m.logits(&fin).unwrap(), logits, "the final layer's states are what the logits are computed from");

    let (_, both) = run(&m, &tokens, &rows, &[0, last]).unwrap();
    let (_, swapped) = run(&m, &tokens, &rows, &[last, 0]).unwrap();
    let (_, first) = run(&m, &tokens, &rows, &[0]).unwrap();
    for j in 0..rows.len() {
        let row = &both[j * 2 * h..(j + 1) * 2 * h];
        assert_eq!(&row[..h], &first[j * h..(j + 1) * h], "row {j}: layer 0 first");
        assert_eq!(&row[h..], &fin[j * h..(j + 1) * h], "row {j}: then the final layer");
        assert_eq!(&swapped[j * 2 * h..j * 2 * h + h], &row[h..], "row {j}: the asked order");
        assert_ne!(&row[..h], &row[h..], "row {j}: two layers' states differ");
    }
    let e = run(&m, &tokens, &rows, &[last + 1]).unwrap_err().to_string();
    assert!(e.contains(&format!("layer {}", last + 1)), "{e}");
}
