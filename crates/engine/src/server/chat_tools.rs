//! Chat's tool calling: the request's tool fields checked against the engine's flags
//! ([`crate::tools::plan_tools`]), the prompt's messages with their tool fields, the
//! grammar that enforces required and named calls, and the answer split by the parser.

use serde_json::Value;
use strata_api::types::{ChatCompletionRequest, FinishReason as ApiFinish, ResponseMessage};
use strata_api::validate::ValidatedChat;
use strata_api::ApiError;

use super::state::AppState;
use crate::chat_template::{ChatMessage, RenderExtras};
use crate::tools::{
    after_reasoning, auto_grammar, call_grammar, new_call_id, plan_tools, Function, ToolMode,
    ToolParser, ToolPlan,
};

/// The raw tool fields `validate_chat` does not keep: taken from the request first.
pub(super) struct RawTools {
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
    /// Per message: `tool_calls`, `tool_call_id`, `name`.
    messages: Vec<(Option<Value>, Option<String>, Option<String>)>,
}

impl RawTools {
    pub(super) fn take(req: &mut ChatCompletionRequest) -> Self {
        Self {
            tool_choice: req.tool_choice.take(),
            parallel_tool_calls: req.parallel_tool_calls.take(),
            messages: req
                .messages
                .iter()
                .map(|m| {
                    (
                        m.tool_calls.clone().filter(|v| !v.is_null()),
                        m.tool_call_id.clone(),
                        m.name.clone(),
                    )
                })
                .collect(),
        }
    }
}

/// A chat request's tool side, ready for rendering and generation.
pub(super) struct ChatTools {
    pub plan: ToolPlan,
    /// The messages as the template sees them.
    pub messages: Vec<ChatMessage>,
    pub extras: RenderExtras,
    /// The grammar that holds the calls to their schemas (required, named, or `auto`'s
    /// lazy one).
    pub grammar: Option<String>,
}

/// Checks the request's tools and builds what rendering and generation need.
pub(super) fn prepare(
    state: &AppState,
    raw: RawTools,
    chat: &ValidatedChat,
) -> Result<ChatTools, ApiError> {
    let plan = plan_tools(
        state.tools.auto_tool_choice,
        state.tools.parser,
        chat.tools.as_ref(),
        raw.tool_choice.as_ref(),
        raw.parallel_tool_calls,
    )?;
    check_schemas(state, &plan)?;
    let mut grammar = enforcing_grammar(&plan, chat)?;
    // With a reasoning parser, required and named calls come after the thinking (a
    // continued assistant message may already be past it: left as it is). `auto`'s text
    // already lets the model think.
    if let (Some(reasoning), true) = (
        state.tools.reasoning_parser,
        plan.enforced() && chat.add_generation_prompt,
    ) {
        grammar = grammar.map(|g| after_reasoning(&g, reasoning));
    }
    let messages = chat
        .messages
        .iter()
        .zip(raw.messages)
        .map(|(m, (tool_calls, tool_call_id, name))| ChatMessage {
            role: m.role.as_str().to_string(),
            content: m.content.clone(),
            tool_calls,
            tool_call_id,
            name,
        })
        .collect();
    let extras = RenderExtras {
        tools: chat.tools.clone(),
        kwargs: chat
            .chat_template_kwargs
            .as_ref()
            .and_then(Value::as_object)
            .cloned(),
    };
    Ok(ChatTools {
        plan,
        messages,
        extras,
        grammar,
    })
}

/// Every function's `parameters` must be a schema the grammar compiler accepts (it is
/// what an enforced call is held to).
fn check_schemas(state: &AppState, plan: &ToolPlan) -> Result<(), ApiError> {
    let Some(compiler) = &state.grammar else {
        return Ok(());
    };
    for (i, f) in plan.functions.iter().enumerate() {
        compiler.check_json_schema(&f.parameters).map_err(|e| {
            ApiError::invalid(
                format!("tools[{i}].function.parameters"),
                format!(
                    "The parameters of {:?} are not a usable JSON schema: {e}",
                    f.name
                ),
            )
        })?;
    }
    Ok(())
}

fn enforcing_grammar(plan: &ToolPlan, chat: &ValidatedChat) -> Result<Option<String>, ApiError> {
    let Some(parser) = plan.parser else {
        return Ok(None);
    };
    if plan.mode == ToolMode::Auto {
        // `auto` with response_format or guided decoding: that constraint holds the
        // whole output (calls are parsed, not held); pythonic calls are parsed only.
        if chat.sampling.structured.is_some() {
            return Ok(None);
        }
        return Ok(auto_grammar(parser, &plan.callable(), plan.parallel));
    }
    if !plan.enforced() {
        return Ok(None);
    }
    if chat.sampling.structured.is_some() {
        return Err(ApiError::invalid(
            "tool_choice",
            "A required or named tool_choice cannot be combined with response_format or guided decoding.",
        ));
    }
    call_grammar(parser, &plan.callable(), plan.parallel)
        .map(Some)
        .ok_or_else(|| {
            ApiError::invalid(
                "tool_choice",
                format!(
                    "The {} tool-call format cannot be enforced; use tool_choice \"auto\".",
                    parser.name()
                ),
            )
        })
}

/// A whole answer's message through `parser`: content, calls, and `tool_calls` as the
/// finish reason when the model called and stopped by itself.
pub(super) fn split_answer(
    parser: ToolParser,
    functions: &[Function],
    text: &str,
    finish: Option<ApiFinish>,
) -> (ResponseMessage, Option<ApiFinish>) {
    let parsed = parser.parse(text, functions, new_call_id);
    let mut message = ResponseMessage::assistant("");
    message.content = parsed.content;
    if parsed.calls.is_empty() {
        return (message, finish);
    }
    message.tool_calls = Some(parsed.calls.iter().map(|c| c.to_json()).collect());
    let finish = match finish {
        Some(ApiFinish::Stop) => Some(ApiFinish::ToolCalls),
        other => other,
    };
    (message, finish)
}
