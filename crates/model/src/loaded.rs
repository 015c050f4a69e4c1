//! What loading a model gives: the weights, the tokenizer and the chat template, whichever source
//! they came from (`loader` for a GGUF file, `safetensors_folder` for a Hugging Face folder). Its
//! own module so that neither loader imports the other.

use crate::chat::ChatTemplate;
use crate::llama::LlamaModel;
use crate::tokenizer::Tokenizer;
use std::time::Duration;

pub struct LoadedModel {
    pub model: LlamaModel,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
    pub load_time: Duration,
    /// Bytes of weights mapped.
    pub weight_bytes: usize,
    pub name: String,
}
