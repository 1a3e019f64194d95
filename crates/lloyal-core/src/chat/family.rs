//! Which chat convention a model follows (Gemma, ChatML, Llama 3, Phi-3, Mistral), from its template
//! or architecture.

/// A chat convention: how turns are opened and closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChatFamily {
    /// `<start_of_turn>user\n...<end_of_turn>\n` (Gemma 1-3).
    Gemma,
    /// `<|im_start|>user\n...<|im_end|>\n` (Qwen, SmolLM, many fine-tunes).
    ChatMl,
    /// `<|start_header_id|>user<|end_header_id|>\n\n...<|eot_id|>` (Llama 3.x).
    Llama3,
    /// `<|user|>\n...<|end|>\n<|assistant|>\n` (Phi-3, Phi-3.5).
    Phi3,
    /// `[INST] ... [/INST]answer</s>` (Mistral 7B Instruct, Mixtral): the turn ends with EOS.
    Mistral,
}

impl ChatFamily {
    /// The family whose markers appear in `template`, else the one implied by `architecture`.
    pub fn detect(template: Option<&str>, architecture: &str) -> Option<ChatFamily> {
        if let Some(t) = template {
            if t.contains("<start_of_turn>") {
                return Some(ChatFamily::Gemma);
            }
            if t.contains("<|im_start|>") {
                return Some(ChatFamily::ChatMl);
            }
            if t.contains("<|start_header_id|>") {
                return Some(ChatFamily::Llama3);
            }
            if t.contains("<|assistant|>") && t.contains("<|end|>") {
                return Some(ChatFamily::Phi3);
            }
            // Llama 2 also writes [INST] but wraps the system prompt in <<SYS>> and opens every
            // turn with BOS: a different convention, left to the model's own template.
            if t.contains("[INST]") && !t.contains("<<SYS>>") {
                return Some(ChatFamily::Mistral);
            }
        }
        let arch = architecture.to_ascii_lowercase();
        if arch.starts_with("gemma") {
            Some(ChatFamily::Gemma)
        } else if arch.starts_with("qwen") || arch.starts_with("smollm") {
            Some(ChatFamily::ChatMl)
        } else if arch == "llama" && template.is_none() {
            // (a llama-architecture model whose template has none of Llama 3's markers is
            // another convention: Llama 2, Zephyr, a distilled model's own)
            Some(ChatFamily::Llama3)
        } else if arch == "phi3" {
            Some(ChatFamily::Phi3)
        } else {
            None
        }
    }

    /// The text that closes a turn and leads to the next one.
    pub fn turn_separator(self) -> &'static str {
        match self {
            ChatFamily::Gemma => "<end_of_turn>\n",
            ChatFamily::ChatMl => "<|im_end|>\n",
            ChatFamily::Llama3 => "<|eot_id|>",
            ChatFamily::Phi3 => "<|end|>\n",
            ChatFamily::Mistral => "</s>",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ChatFamily;

    #[test]
    fn template_markers_win_over_architecture() {
        let chatml = "{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}";
        assert_eq!(ChatFamily::detect(Some(chatml), "gemma3"), Some(ChatFamily::ChatMl));
        assert_eq!(ChatFamily::detect(None, "gemma3"), Some(ChatFamily::Gemma));
        assert_eq!(ChatFamily::detect(None, "llama"), Some(ChatFamily::Llama3));
        assert_eq!(ChatFamily::detect(None, "qwen2"), Some(ChatFamily::ChatMl));
        assert_eq!(ChatFamily::detect(Some("plain"), "mamba"), None);
        let phi3 = "{{'<|user|>\\n' + m + '<|end|>\\n'}}{{ '<|assistant|>\\n' }}";
        assert_eq!(ChatFamily::detect(Some(phi3), "phi3"), Some(ChatFamily::Phi3));
        assert_eq!(ChatFamily::detect(None, "phi3"), Some(ChatFamily::Phi3));
        let mistral = "{{ '[INST] ' + m + ' [/INST]' }}";
        assert_eq!(ChatFamily::detect(Some(mistral), "llama"), Some(ChatFamily::Mistral));
        let llama2 = "{{ '[INST] <<SYS>>\\n' + s + '\\n<</SYS>>\\n\\n' }}";
        assert_eq!(ChatFamily::detect(Some(llama2), "llama"), None);
        let zephyr = "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}</s>{% endfor %}";
        assert_eq!(ChatFamily::detect(Some(zephyr), "llama"), None);
        assert_eq!(ChatFamily::detect(None, "llama"), Some(ChatFamily::Llama3));
    }
}
