//! `GET /v1/models`: the list of served models (vLLM adds `root`, `parent` and
//! `max_model_len` to OpenAI's card).

use serde::{Deserialize, Serialize};

use super::{OBJECT_LIST, OBJECT_MODEL};

/// One served model (or LoRA adapter).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelCard {
    /// The name clients put in `model`.
    pub id: String,
    /// Always `model`.
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    /// Owner label (vLLM says `vllm`).
    pub owned_by: String,
    /// The base model path or name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub root: Option<String>,
    /// For a LoRA adapter: the base model's id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    /// Context length in tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_model_len: Option<u32>,
}

impl ModelCard {
    /// A card with `object` set and no vLLM extras.
    pub fn new(id: impl Into<String>, created: u64, owned_by: impl Into<String>) -> Self {
        ModelCard {
            id: id.into(),
            object: OBJECT_MODEL.to_string(),
            created,
            owned_by: owned_by.into(),
            root: None,
            parent: None,
            max_model_len: None,
        }
    }
}

/// Response of `GET /v1/models`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelList {
    /// Always `list`.
    pub object: String,
    /// The cards.
    pub data: Vec<ModelCard>,
}

impl ModelList {
    /// A list with `object` set.
    pub fn new(data: Vec<ModelCard>) -> Self {
        ModelList {
            object: OBJECT_LIST.to_string(),
            data,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn model_list_shape() {
        let mut card = ModelCard::new("llama-3.2-1b", 1_700_000_000, "strata");
        card.max_model_len = Some(8192);
        let list = ModelList::new(vec![card]);
        let v = serde_json::to_value(&list).unwrap();
        assert_eq!(
            v,
            json!({"object": "list", "data": [{
                "id": "llama-3.2-1b", "object": "model", "created": 1_700_000_000u64,
                "owned_by": "strata", "max_model_len": 8192
            }]})
        );
        assert_eq!(serde_json::from_value::<ModelList>(v).unwrap(), list);
    }
}
