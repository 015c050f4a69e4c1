//! Chat templates: renders a conversation with the model's own Jinja template
//! (`tokenizer.chat_template`) through minijinja with Python-compatible string methods.

use crate::ModelError;
use minijinja::{context, Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    source: String,
}

/// ChatML, used when a model ships no template.
pub const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

impl ChatTemplate {
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, ModelError> {
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, Error> { Err(Error::new(ErrorKind::InvalidOperation, msg)) });
        env.add_template_owned("chat", source.to_string()).map_err(|e| ModelError::ChatTemplate(format!("the model's chat template does not compile: {e}")))?;
        Ok(Self { env, bos_token: bos_token.to_string(), eos_token: eos_token.to_string(), source: source.to_string() })
    }

    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, ModelError> {
        let tmpl = self.env.get_template("chat").map_err(|e| ModelError::ChatTemplate(e.to_string()))?;
        tmpl.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
        })
        .map_err(|e| ModelError::ChatTemplate(format!("rendering the chat template: {e}")))
    }

    /// The template's Jinja source (served by `/tokenizer_info`).
    pub fn source(&self) -> &str {
        &self.source
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage { role: role.into(), content: content.into() }
    }

    #[test]
    fn chatml_renders_with_generation_prompt() {
        let t = ChatTemplate::new(CHATML, "", "").unwrap();
        let s = t.render(&[msg("user", "hi")], true).unwrap();
        assert_eq!(s, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    }

    #[test]
    fn python_string_methods_and_raise_exception_work() {
        let src = "{% for m in messages %}{% if m['role'] not in ['user','assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}{{ m['content'].strip().upper() }}{% endfor %}";
        let t = ChatTemplate::new(src, "", "").unwrap();
        assert_eq!(t.render(&[msg("user", "  hey ")], false).unwrap(), "HEY");
        let err = t.render(&[msg("tool", "x")], false).unwrap_err().to_string();
        assert!(err.contains("bad role tool"), "{err}");
    }

    #[test]
    fn broken_template_is_a_clear_error() {
        let err = ChatTemplate::new("{% for %}", "", "").err().unwrap().to_string();
        assert!(err.contains("chat template"), "{err}");
    }
}
