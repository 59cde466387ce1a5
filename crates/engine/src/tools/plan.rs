//! A request's `tools`, `tool_choice` and `parallel_tool_calls`, checked against the
//! engine's flags into what to render, enforce and parse. Pure: flags and fields in,
//! plan or an OpenAI-shaped 400 out.

use serde_json::Value;
use strata_api::ApiError;

use super::ToolParser;

/// Most tools one request may define.
pub const MAX_TOOLS: usize = 128;
/// Most bytes the `tools` list may take, as JSON.
pub const MAX_TOOLS_BYTES: usize = 256 * 1024;

/// One function a request offers.
#[derive(Debug, Clone, PartialEq)]
pub struct Function {
    pub name: String,
    /// Its arguments' JSON schema (`{"type": "object"}` when none was given).
    pub parameters: Value,
    /// `strict: true`: no properties beyond the schema's.
    pub strict: bool,
}

/// What the model may or must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolMode {
    /// No calls are parsed (`none`, or no tools).
    None,
    /// The model chooses text or calls; calls are parsed.
    Auto,
    /// At least one call, enforced.
    Required,
    /// A call of this function, enforced.
    Named(String),
}

/// The checked tool fields of a request.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolPlan {
    pub functions: Vec<Function>,
    pub mode: ToolMode,
    /// Several calls allowed (`parallel_tool_calls`, default true).
    pub parallel: bool,
    /// The parser that reads the answer (`None` when nothing is parsed).
    pub parser: Option<ToolParser>,
}

impl ToolPlan {
    /// Whether the output is constrained to calls.
    pub fn enforced(&self) -> bool {
        matches!(self.mode, ToolMode::Required | ToolMode::Named(_))
    }

    /// The functions a constrained output may call.
    pub fn callable(&self) -> Vec<&Function> {
        match &self.mode {
            ToolMode::Named(n) => self.functions.iter().filter(|f| &f.name == n).collect(),
            _ => self.functions.iter().collect(),
        }
    }
}

/// Checks the tool fields. `auto_tool_choice` and `parser` are the engine's
/// `--enable-auto-tool-choice` and `--tool-call-parser`.
pub fn plan_tools(
    auto_tool_choice: bool,
    parser: Option<ToolParser>,
    tools: Option<&Value>,
    tool_choice: Option<&Value>,
    parallel_tool_calls: Option<bool>,
) -> Result<ToolPlan, ApiError> {
    let functions = functions(tools)?;
    let mode = match tool_choice {
        None | Some(Value::Null) if auto_tool_choice && parser.is_some() && !functions.is_empty() => {
            ToolMode::Auto
        }
        None | Some(Value::Null) => ToolMode::None,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolMode::None,
            "auto" => {
                if !auto_tool_choice || parser.is_none() {
                    return Err(ApiError::invalid(
                        "tool_choice",
                        "\"auto\" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set",
                    ));
                }
                if functions.is_empty() {
                    ToolMode::None
                } else {
                    ToolMode::Auto
                }
            }
            "required" => {
                if functions.is_empty() {
                    return Err(ApiError::invalid(
                        "tool_choice",
                        "tool_choice is \"required\" but the request defines no tools.",
                    ));
                }
                ToolMode::Required
            }
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("Invalid tool_choice {other:?}: expected \"none\", \"auto\", \"required\" or a named function."),
                ))
            }
        },
        Some(named) => {
            let name = named
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| named.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| {
                    ApiError::invalid(
                        "tool_choice",
                        "A named tool_choice must be {\"type\": \"function\", \"function\": {\"name\": ...}}.",
                    )
                })?;
            if !functions.iter().any(|f| f.name == name) {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("tool_choice names the function {name:?}, which is not among the request's tools."),
                ));
            }
            ToolMode::Named(name.to_string())
        }
    };
    if matches!(mode, ToolMode::Required | ToolMode::Named(_)) && parser.is_none() {
        return Err(ApiError::invalid(
            "tool_choice",
            "\"required\" and named tool choice require --tool-call-parser to be set",
        ));
    }
    // A named function is one call of it, as OpenAI makes it.
    Ok(ToolPlan {
        functions,
        parallel: parallel_tool_calls.unwrap_or(true) && !matches!(mode, ToolMode::Named(_)),
        parser: if mode == ToolMode::None { None } else { parser },
        mode,
    })
}

/// The `tools` list: bounded, each a function with a name OpenAI allows and an object
/// schema, no name twice.
fn functions(tools: Option<&Value>) -> Result<Vec<Function>, ApiError> {
    let Some(Value::Array(tools)) = tools else {
        return Ok(Vec::new());
    };
    if tools.len() > MAX_TOOLS {
        return Err(ApiError::invalid(
            "tools",
            format!(
                "At most {MAX_TOOLS} tools may be given; got {}.",
                tools.len()
            ),
        ));
    }
    let bytes = serde_json::to_vec(tools)
        .map(|v| v.len())
        .unwrap_or(usize::MAX);
    if bytes > MAX_TOOLS_BYTES {
        return Err(ApiError::invalid(
            "tools",
            format!("The tools list takes {bytes} bytes; at most {MAX_TOOLS_BYTES} are allowed."),
        ));
    }
    let mut out: Vec<Function> = Vec::with_capacity(tools.len());
    for (i, tool) in tools.iter().enumerate() {
        let f = function(i, tool)?;
        if out.iter().any(|o| o.name == f.name) {
            return Err(ApiError::invalid(
                format!("tools[{i}].function.name"),
                format!("The function name {:?} is given twice.", f.name),
            ));
        }
        out.push(f);
    }
    Ok(out)
}

fn function(i: usize, tool: &Value) -> Result<Function, ApiError> {
    if tool.get("type").and_then(Value::as_str) != Some("function") {
        return Err(ApiError::invalid(
            format!("tools[{i}].type"),
            "Only tools of type \"function\" are supported.",
        ));
    }
    let f = tool
        .get("function")
        .filter(|f| f.is_object())
        .ok_or_else(|| {
            ApiError::invalid(
                format!("tools[{i}].function"),
                "A tool needs a function object.",
            )
        })?;
    let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
    let name_ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if !name_ok {
        return Err(ApiError::invalid(
            format!("tools[{i}].function.name"),
            "A function name must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -.",
        ));
    }
    let mut parameters = match f.get("parameters") {
        None | Some(Value::Null) => serde_json::json!({"type": "object"}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(_) => {
            return Err(ApiError::invalid(
                format!("tools[{i}].function.parameters"),
                "parameters must be a JSON schema object.",
            ))
        }
    };
    let strict = f.get("strict").and_then(Value::as_bool).unwrap_or(false);
    if strict {
        if let Some(obj) = parameters.as_object_mut() {
            obj.entry("additionalProperties")
                .or_insert(Value::Bool(false));
        }
    }
    Ok(Function {
        name: name.to_string(),
        parameters,
        strict,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tools() -> Value {
        json!([
            {"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}},
            {"type": "function", "function": {"name": "b"}},
        ])
    }

    fn param(e: ApiError) -> String {
        e.param.unwrap_or_default()
    }

    #[test]
    fn modes() {
        let p = Some(ToolParser::Hermes);
        let t = tools();
        let plan = plan_tools(true, p, Some(&t), None, None).expect("auto");
        assert_eq!(plan.mode, ToolMode::Auto);
        let plan = plan_tools(false, p, Some(&t), None, None).expect("none");
        assert_eq!(plan.mode, ToolMode::None);
        let plan =
            plan_tools(true, p, Some(&t), Some(&json!("required")), Some(false)).expect("req");
        assert!(plan.enforced() && !plan.parallel);
        let named = json!({"type": "function", "function": {"name": "b"}});
        let plan = plan_tools(true, p, Some(&t), Some(&named), None).expect("named");
        assert_eq!(plan.callable().len(), 1);
    }

    #[test]
    fn refusals_name_the_field() {
        let t = tools();
        let e = plan_tools(false, None, Some(&t), Some(&json!("auto")), None).unwrap_err();
        assert_eq!(param(e), "tool_choice");
        let e = plan_tools(
            true,
            Some(ToolParser::Hermes),
            None,
            Some(&json!("required")),
            None,
        )
        .unwrap_err();
        assert_eq!(param(e), "tool_choice");
        let named = json!({"type": "function", "function": {"name": "zzz"}});
        let e =
            plan_tools(true, Some(ToolParser::Hermes), Some(&t), Some(&named), None).unwrap_err();
        assert_eq!(param(e), "tool_choice");
        let bad = json!([{"type": "function", "function": {"name": "a", "parameters": 5}}]);
        let e = plan_tools(true, Some(ToolParser::Hermes), Some(&bad), None, None).unwrap_err();
        assert_eq!(param(e), "tools[0].function.parameters");
        let many: Vec<Value> = (0..=MAX_TOOLS)
            .map(|i| json!({"type": "function", "function": {"name": format!("f{i}")}}))
            .collect();
        let e = plan_tools(
            true,
            Some(ToolParser::Hermes),
            Some(&Value::Array(many)),
            None,
            None,
        )
        .unwrap_err();
        assert_eq!(param(e), "tools");
    }
}
