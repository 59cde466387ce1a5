//! The generation APIs an upstream may serve besides chat, as `apis:` in an upstream's
//! config names them ([`crate::passthrough`] decides from them). A leaf: the config reads
//! it, and it reads nothing of the gateway.

use serde::{Deserialize, Serialize};

/// A generation API besides chat.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Api {
    /// `chat` (always served; accepted for completeness in `apis:`).
    Chat,
    /// Anthropic's Messages API, `/v1/messages` and `/v1/messages/count_tokens`.
    Messages,
    /// OpenAI's Responses API, `/v1/responses`.
    Responses,
}
