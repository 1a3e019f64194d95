//! Chat: render messages with a Jinja template (`render`), the chat conventions (`family`),
//! built-in templates for models without one (`templates`), and parsing of model output into
//! content, reasoning and tool calls (`parse`).

pub mod family;
pub mod parse;
pub mod render;
pub mod templates;

pub use family::ChatFamily;
pub use parse::{parse_chat_output, ChatOutput, ToolCall, END_MARKERS, STRUCTURE_MARKERS};
pub use render::{ChatOptions, FormattedChat};

#[cfg(test)]
mod tests;
