//! Chat templates: renders a conversation with the model's own Jinja template
//! (`tokenizer.chat_template`) through minijinja, set up like Hugging Face's
//! `apply_chat_template` environment: `trim_blocks` and `lstrip_blocks`, Python string methods,
//! `raise_exception`, a `tojson` that writes what Python's `json.dumps` writes, `strftime_now`,
//! and an optional `tools` list. [`ChatTemplate::render_tokens`] also tokenizes the render so
//! that control tokens come only from the template's markup, never from the client's strings.

use crate::tokenizer::{TokenId, Tokenizer};
use crate::ModelError;
use minijinja::value::{Kwargs, ValueKind};
use minijinja::{context, Environment, Error, ErrorKind, Value};
use serde::{Deserialize, Serialize};

/// A plain text message. Templates get any `Serialize` message (see
/// [`ChatTemplate::render_with`]), so richer ones (`tool_calls`, `tool_call_id`, ...) need no
/// change here.
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
        // As transformers' chat-template environment.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_function("raise_exception", |msg: String| -> Result<String, Error> { Err(Error::new(ErrorKind::InvalidOperation, msg)) });
        env.add_function("strftime_now", |format: String| -> String { strftime_utc(&format, now_unix()) });
        env.add_filter("tojson", py_tojson);
        env.add_template_owned("chat", source.to_string()).map_err(|e| ModelError::ChatTemplate(format!("the model's chat template does not compile: {e}")))?;
        Ok(Self { env, bos_token: bos_token.to_string(), eos_token: eos_token.to_string(), source: source.to_string() })
    }

    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, ModelError> {
        self.render_with(messages, None, add_generation_prompt)
    }

    /// Renders any serializable messages (e.g. JSON objects with `tool_calls`), with `tools`
    /// (a JSON list of tool definitions, OpenAI style) passed to the template as `tools`; `None`
    /// leaves `tools` none, as transformers does.
    pub fn render_with<M: Serialize>(&self, messages: &[M], tools: Option<&serde_json::Value>, add_generation_prompt: bool) -> Result<String, ModelError> {
        self.render_with_kwargs(messages, tools, add_generation_prompt, &serde_json::Map::new())
    }

    /// [`Self::render_with`] with extra template variables (`chat_template_kwargs`, e.g.
    /// `{"enable_thinking": false}` for Qwen3), as transformers passes `**kwargs`; they never
    /// replace `messages`, `tools`, `add_generation_prompt` or the special tokens.
    pub fn render_with_kwargs<M: Serialize>(
        &self,
        messages: &[M],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, ModelError> {
        let tmpl = self.env.get_template("chat").map_err(|e| ModelError::ChatTemplate(e.to_string()))?;
        tmpl.render(context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
            ..Value::from_serialize(kwargs)
        })
        .map_err(|e| ModelError::ChatTemplate(format!("rendering the chat template: {e}")))
    }

    /// Renders as [`Self::render_with`] and tokenizes the render (no BOS added: templates write
    /// their own) so that control tokens come only from the template's markup: a control-token
    /// spelling in any of the client's strings (message content, names, tool calls and results,
    /// tool definitions) is tokenized as the text it is, so a message cannot close its turn and
    /// open a forged one. A conversation that spells none renders once and tokenizes exactly as
    /// `tokenizer.encode(render)`; one that does renders a second time with those spellings
    /// neutralized, to find the template's markup (`Tokenizer::encode_template_render`).
    pub fn render_tokens<M: Serialize>(
        &self,
        tokenizer: &Tokenizer,
        messages: &[M],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<RenderedChat, ModelError> {
        let text = self.render_with_kwargs(messages, tools, add_generation_prompt, kwargs)?;
        let as_json = |what: &str, e: serde_json::Error| ModelError::ChatTemplate(format!("the {what} cannot be passed to the template: {e}"));
        let mut neutral_messages = serde_json::to_value(messages).map_err(|e| as_json("messages", e))?;
        let mut neutral_tools = tools.cloned();
        let mut spelled = neutralize_strings(&mut neutral_messages, tokenizer);
        if let Some(t) = neutral_tools.as_mut() {
            spelled |= neutralize_strings(t, tokenizer);
        }
        if !spelled {
            let tokens = tokenizer.encode(&text)?;
            return Ok(RenderedChat { text, tokens });
        }
        let neutral_messages = match neutral_messages {
            serde_json::Value::Array(list) => list,
            other => vec![other],
        };
        let neutral = self.render_with_kwargs(&neutral_messages, neutral_tools.as_ref(), add_generation_prompt, kwargs)?;
        let tokens = tokenizer.encode_template_render(&text, &neutral)?;
        Ok(RenderedChat { text, tokens })
    }

    /// The template's Jinja source (served by `/tokenizer_info`).
    pub fn source(&self) -> &str {
        &self.source
    }
}

/// A conversation rendered by [`ChatTemplate::render_tokens`].
#[derive(Clone, Debug, PartialEq)]
pub struct RenderedChat {
    /// The template's output.
    pub text: String,
    /// `text` tokenized, control tokens only where the template wrote them.
    pub tokens: Vec<TokenId>,
}

/// Neutralizes control-token spellings in every string of `value` (keys included: a template can
/// print them); true when there was one.
fn neutralize_strings(value: &mut serde_json::Value, tokenizer: &Tokenizer) -> bool {
    use serde_json::Value as J;
    match value {
        J::String(s) => match tokenizer.neutralize_controls(s) {
            Some(n) => {
                *s = n;
                true
            }
            None => false,
        },
        J::Array(items) => items.iter_mut().fold(false, |any, v| neutralize_strings(v, tokenizer) | any),
        J::Object(map) => {
            let mut any = false;
            if map.keys().any(|k| tokenizer.neutralize_controls(k).is_some()) {
                let old = std::mem::take(map);
                for (k, v) in old {
                    let k = tokenizer.neutralize_controls(&k).unwrap_or(k);
                    map.insert(k, v);
                }
                any = true;
            }
            map.values_mut().fold(any, |any, v| neutralize_strings(v, tokenizer) | any)
        }
        J::Null | J::Bool(_) | J::Number(_) => false,
    }
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False, indent=indent,
/// separators=separators, sort_keys=sort_keys)`, so ", " and ": " separators (", " becomes ","
/// with an indent), non-ASCII kept, no HTML escaping. Maps come out in insertion order, as
/// Python's dicts do (minijinja and serde_json are built with `preserve_order`), so a tool
/// definition is printed with its keys as the request gave them.
fn py_tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_py_json(value, indent, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

fn write_py_json(v: &Value, indent: Option<usize>, level: usize, out: &mut String) -> Result<(), Error> {
    let newline = |out: &mut String, level: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * level));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number if v.is_integer() => out.push_str(&v.to_string()),
        ValueKind::Number => {
            let x: f64 = f64::try_from(v.clone())?;
            out.push_str(&if x.is_finite() && x == x.trunc() && x.abs() < 1e16 { format!("{x:.1}") } else { format!("{x}") });
        }
        ValueKind::String => {
            out.push_str(&serde_json::to_string(v.as_str().unwrap_or_default()).map_err(|e| Error::new(ErrorKind::BadSerialization, e.to_string()))?)
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, level + 1);
                write_py_json(item, indent, level + 1, out)?;
            }
            newline(out, level);
            out.push(']');
        }
        ValueKind::Map => {
            let keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, level + 1);
                let key = k.as_str().map(str::to_string).unwrap_or_else(|| k.to_string());
                out.push_str(&serde_json::to_string(&key).unwrap_or_default());
                out.push_str(": ");
                write_py_json(&v.get_item(k)?, indent, level + 1, out)?;
            }
            newline(out, level);
            out.push('}');
        }
        _ => return Err(Error::new(ErrorKind::InvalidOperation, format!("tojson: cannot serialize a {}", v.kind()))),
    }
    Ok(())
}

fn now_unix() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0)
}

/// A small `strftime` (UTC) for templates that print today's date (Llama 3.2's
/// `strftime_now("%d %b %Y")`): %d %m %Y %y %b %B %H %M %S %j %%; other directives are kept.
fn strftime_utc(format: &str, unix: i64) -> String {
    const MONTHS: [&str; 12] = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November", "December"];
    let days = unix.div_euclid(86_400);
    let secs = unix.rem_euclid(86_400);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(month - 1) as usize] + day + i64::from(leap && month > 2);
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('b') => out.push_str(&MONTHS[(month - 1) as usize][..3]),
            Some('B') => out.push_str(MONTHS[(month - 1) as usize]),
            Some('H') => out.push_str(&format!("{:02}", secs / 3600)),
            Some('M') => out.push_str(&format!("{:02}", secs / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", secs % 60)),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
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
    fn template_kwargs_reach_the_template_but_never_replace_messages() {
        let src = "{% for m in messages %}{{ m.content }}{% endfor %}|{{ enable_thinking is defined and enable_thinking is false }}";
        let t = ChatTemplate::new(src, "", "").unwrap();
        assert_eq!(t.render(&[msg("user", "x")], false).unwrap(), "x|False");
        let kwargs = serde_json::json!({"enable_thinking": false, "messages": []});
        let s = t.render_with_kwargs(&[msg("user", "x")], None, false, kwargs.as_object().unwrap()).unwrap();
        assert_eq!(s, "x|True");
    }

    #[test]
    fn broken_template_is_a_clear_error() {
        let err = ChatTemplate::new("{% for %}", "", "").err().unwrap().to_string();
        assert!(err.contains("chat template"), "{err}");
    }

    #[test]
    fn tools_reach_the_template_and_tojson_writes_like_python() {
        let src = "{% if tools %}{% for t in tools %}{{ t | tojson }}|{% endfor %}{% else %}none{% endif %}";
        let t = ChatTemplate::new(src, "", "").unwrap();
        assert_eq!(t.render(&[msg("user", "x")], false).unwrap(), "none");
        let tools = serde_json::json!([{"a": [1, 2.5, 3.0, null, true], "b": {"c": "é<\"\n"}}, {}]);
        let s = t.render_with(&[msg("user", "x")], Some(&tools), false).unwrap();
        assert_eq!(s, "{\"a\": [1, 2.5, 3.0, null, true], \"b\": {\"c\": \"é<\\\"\\n\"}}|{}|");
        // keys in insertion order, not sorted (Python's dicts)
        let tools = serde_json::json!([{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"b": 1, "a": 2}}}]);
        let s = t.render_with(&[msg("user", "x")], Some(&tools), false).unwrap();
        assert_eq!(s, "{\"type\": \"function\", \"function\": {\"name\": \"f\", \"description\": \"d\", \"parameters\": {\"b\": 1, \"a\": 2}}}|");
        let t = ChatTemplate::new("{{ tools | tojson(indent=2) }}", "", "").unwrap();
        assert_eq!(t.render_with(&[msg("user", "x")], Some(&serde_json::json!([{"a": [1]}])), false).unwrap(), "[\n  {\n    \"a\": [\n      1\n    ]\n  }\n]");
    }

    #[test]
    fn messages_with_tool_calls_render() {
        let src = "{% for m in messages %}{{ m.role }}{% if m.tool_calls %}{% for c in m.tool_calls %}:{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}{% endif %}{% if m.tool_call_id is defined %}#{{ m.tool_call_id }}{% endif %};{% endfor %}";
        let t = ChatTemplate::new(src, "", "").unwrap();
        let msgs = serde_json::json!([
            {"role": "assistant", "content": null, "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
            {"role": "tool", "content": "2", "tool_call_id": "call_1"}]);
        let msgs = msgs.as_array().unwrap();
        assert_eq!(t.render_with(msgs, None, false).unwrap(), "assistant:f{\"x\": 1};tool#call_1;");
    }

    #[test]
    fn trim_and_lstrip_blocks_as_transformers() {
        let t = ChatTemplate::new("{% for m in messages %}\n  {% if true %}\n{{ m.content }}\n  {% endif %}\n{% endfor %}", "", "").unwrap();
        assert_eq!(t.render(&[msg("user", "a"), msg("user", "b")], false).unwrap(), "a\nb\n");
    }

    #[test]
    fn strftime_formats_a_known_date() {
        // 2024-07-26 13:05:09 UTC
        assert_eq!(strftime_utc("%d %b %Y %H:%M:%S %B %j %%", 1_721_999_109), "26 Jul 2024 13:05:09 July 208 %");
        assert_eq!(strftime_utc("%Y-%m-%d", 951_782_400), "2000-02-29");
    }
}
