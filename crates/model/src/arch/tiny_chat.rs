//! The chat formats of the tiny GGUF files (`testing::write_tiny_llama`): compact templates
//! written here from each format, with the control tokens they add. The descriptors in `arch`
//! name them; real model files carry their makers' own templates.

/// The harmony control tokens a tiny gpt-oss file adds after the tiny vocabulary (ids 259...).
pub const HARMONY_TOKENS: [&str; 7] = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"];

/// A compact harmony chat template for the tiny gpt-oss files (written here from the format:
/// a system message with the reasoning effort, instructions and tools in a developer message,
/// past reasoning on the analysis channel, calls as commentary to `functions.NAME`, answers on
/// the final channel, tool results from `functions.NAME`; the generation prompt opens an
/// assistant message). Real gpt-oss files carry OpenAI's own template.
pub const HARMONY_TEMPLATE: &str = concat!(
    "{{- '<|start|>system<|message|>Reasoning: ' + (reasoning_effort if reasoning_effort is defined else 'medium') + '\n\n# Valid channels: analysis, commentary, final.<|end|>' }}",
    "{%- set ns = namespace(dev='', last_call='') -%}",
    "{%- for message in messages if message.role in ['system', 'developer'] -%}{%- set ns.dev = ns.dev + message.content -%}{%- endfor -%}",
    "{%- if ns.dev or tools -%}",
    "{{- '<|start|>developer<|message|>' }}",
    "{%- if ns.dev -%}{{- '# Instructions\n\n' + ns.dev }}{%- endif -%}",
    "{%- if tools -%}{{- '\n\n# Tools\n\nnamespace functions {\n' }}{%- for t in tools -%}{%- set f = t.function if t.function is defined else t -%}",
    "{{- '// ' + (f.description if f.description is defined else '') + '\ntype ' + f.name + ' = (_: ' + (f.parameters | tojson) + ') => any;\n' }}{%- endfor -%}{{- '} // namespace functions' }}{%- endif -%}",
    "{{- '<|end|>' }}",
    "{%- endif -%}",
    "{%- for message in messages -%}",
    "{%- if message.role == 'user' -%}{{- '<|start|>user<|message|>' + message.content + '<|end|>' }}",
    "{%- elif message.role == 'assistant' -%}",
    "{%- if message.thinking is defined and message.thinking -%}{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + '<|end|>' }}{%- endif -%}",
    "{%- if message.tool_calls is defined and message.tool_calls -%}{%- for tc in message.tool_calls -%}{%- set f = tc.function if tc.function is defined else tc -%}{%- set ns.last_call = f.name -%}",
    "{{- '<|start|>assistant to=functions.' + f.name + '<|channel|>commentary json<|message|>' + (f.arguments | tojson) + '<|call|>' }}{%- endfor -%}",
    "{%- else -%}{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' }}{%- endif -%}",
    "{%- elif message.role == 'tool' -%}{{- '<|start|>functions.' + ns.last_call + ' to=assistant<|channel|>commentary<|message|>' + (message.content | tojson) + '<|end|>' }}",
    "{%- endif -%}",
    "{%- endfor -%}",
    "{%- if add_generation_prompt -%}{{- '<|start|>assistant' }}{%- endif -%}",
);

/// The control tokens a tiny phi3 file adds after the tiny vocabulary (Phi-4-mini's chat format).
pub const PHI3_TOKENS: [&str; 6] = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|tool|>", "<|/tool|>"];

/// A compact Phi-4-mini chat template for the tiny phi3 files (written here from the format:
/// `<|role|>content<|end|>` per message, tools as JSON between `<|tool|>` and `<|/tool|>` in the
/// system message, `<|assistant|>` opens the answer). The file's EOS is `<|endoftext|>`, as in
/// Phi-4-mini's GGUF files: a turn ends at `<|end|>`, which only the end-of-turn rule stops at.
pub const PHI3_TEMPLATE: &str = concat!(
    "{%- for message in messages -%}",
    "{%- if message.role == 'system' and tools -%}{{- '<|system|>' + message.content + '<|tool|>' + (tools | tojson) + '<|/tool|><|end|>' }}",
    "{%- else -%}{{- '<|' + message.role + '|>' + message.content + '<|end|>' }}{%- endif -%}",
    "{%- endfor -%}",
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' }}{%- else -%}{{- eos_token }}{%- endif -%}",
);

/// A compact Qwen3 chat template for the tiny qwen3 / qwen3moe files (written here from the
/// format: ChatML, tools listed in the system message between `<tools>` tags, calls as
/// `<tool_call>` JSON, results as `<tool_response>` in a user turn; `enable_thinking: false`
/// closes an empty think block in the generation prompt). Real files carry Qwen's own template.
pub const QWEN3_TEMPLATE: &str = concat!(
    "{%- if tools -%}",
    "{{- '<|im_start|>system\n' + (messages[0].content + '\n\n' if messages and messages[0].role == 'system' else '') + '# Tools\n\n<tools>' }}",
    "{%- for t in tools -%}{{- '\n' + (t | tojson) }}{%- endfor -%}",
    "{{- '\n</tools>\n\nCall a function as <tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n' }}",
    "{%- elif messages and messages[0].role == 'system' -%}{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}",
    "{%- endif -%}",
    "{%- for message in messages -%}",
    "{%- if message.role == 'user' -%}{{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' }}",
    "{%- elif message.role == 'assistant' -%}{{- '<|im_start|>assistant\n' + (message.content if message.content is string else '') }}",
    "{%- if message.tool_calls is defined and message.tool_calls -%}{%- for tc in message.tool_calls -%}{%- set f = tc.function if tc.function is defined else tc -%}",
    "{{- '\n<tool_call>\n{\"name\": \"' + f.name + '\", \"arguments\": ' + (f.arguments if f.arguments is string else f.arguments | tojson) + '}\n</tool_call>' }}{%- endfor -%}{%- endif -%}",
    "{{- '<|im_end|>\n' }}",
    "{%- elif message.role == 'tool' -%}{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}",
    "{%- endif -%}",
    "{%- endfor -%}",
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' }}",
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\n\n</think>\n\n' }}{%- endif -%}{%- endif -%}",
);

/// A compact SmolLM3 chat template for the tiny smollm3 files (written here from the format:
/// ChatML with a metadata system message naming the reasoning mode, `/think` or `/no_think`,
/// chosen by `enable_thinking` or a flag in the system prompt; without thinking the generation
/// prompt closes an empty think block).
pub const SMOLLM3_TEMPLATE: &str = concat!(
    "{%- set ns = namespace(think=true, sys='') -%}",
    "{%- if enable_thinking is defined and enable_thinking is false -%}{%- set ns.think = false -%}{%- endif -%}",
    "{%- if messages and messages[0].role == 'system' -%}{%- set ns.sys = messages[0].content -%}{%- endif -%}",
    "{%- if '/no_think' in ns.sys -%}{%- set ns.think = false -%}{%- elif '/think' in ns.sys -%}{%- set ns.think = true -%}{%- endif -%}",
    "{%- set ns.sys = ns.sys | replace('/no_think', '') | replace('/think', '') | trim -%}",
    "{{- '<|im_start|>system\n## Metadata\n\nReasoning Mode: ' + ('/think' if ns.think else '/no_think') + '\n\n## Custom Instructions\n\n' + ns.sys + '\n\n<|im_end|>\n' }}",
    "{%- for message in messages -%}",
    "{%- if message.role == 'user' or message.role == 'tool' -%}{{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' }}",
    "{%- elif message.role == 'assistant' -%}{{- '<|im_start|>assistant\n' + message.content + '<|im_end|>\n' }}",
    "{%- endif -%}",
    "{%- endfor -%}",
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' + ('' if ns.think else '<think>\n\n</think>\n') }}{%- endif -%}",
);
