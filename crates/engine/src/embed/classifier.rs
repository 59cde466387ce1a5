//! BERT sequence classification (`BertForSequenceClassification` checkpoints): the encoder,
//! its pooler (the `[CLS]` row through a dense layer and tanh) and a linear classifier over
//! the labels of `config.json`'s `id2label`.
//!
//! With one label the model is a cross-encoder: it reads a (query, document) pair as one
//! input, `[CLS] query [SEP] document [SEP]` with the document as token type 1, and its one
//! logit is their relevance (`/score`, `/rerank`). With several it is a classifier
//! (`/classify`): the logits become probabilities by softmax, or by sigmoid each when the
//! checkpoint says `problem_type: multi_label_classification`, as transformers' own
//! pipeline does.
//!
//! The encoder's dense layers run as the embedding model's do (8-bit by default, see
//! [`super::linear`]); the head is a pair of small products on one row per input, kept in
//! f32.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use candle_core::Tensor;
use serde::Deserialize;

use super::bert::{checked_f32, read_safetensors, BertModel};
use super::input::Segmented;
use super::linear::{EncoderWeights, Linear};
use super::{EmbedError, EncoderConfig};

/// The classification side of a checkpoint's `config.json`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassifierConfig {
    /// `id2label` in id order (`LABEL_i` where the file names none).
    pub labels: Vec<String>,
    /// `problem_type: multi_label_classification`: each label's probability on its own.
    pub multi_label: bool,
}

#[derive(Deserialize)]
struct RawHead {
    #[serde(default)]
    architectures: Vec<String>,
    #[serde(default)]
    id2label: Option<BTreeMap<String, String>>,
    #[serde(default)]
    num_labels: Option<usize>,
    #[serde(default)]
    problem_type: Option<String>,
}

/// Whether an architecture name is a sequence-classification model.
fn classifies(arch: &str) -> bool {
    arch.ends_with("ForSequenceClassification")
}

impl ClassifierConfig {
    /// The head a model directory's `config.json` describes; `None` when it names no
    /// sequence-classification architecture (a sentence encoder such as MiniLM).
    pub fn from_dir(dir: &Path) -> Result<Option<Self>, EmbedError> {
        let path = dir.join("config.json");
        let bad = |reason: String| EmbedError::Config {
            path: path.clone(),
            reason,
        };
        let text = std::fs::read_to_string(&path).map_err(|source| EmbedError::Io {
            path: path.clone(),
            source,
        })?;
        let raw: RawHead =
            serde_json::from_str(&text).map_err(|e| bad(format!("not a model config: {e}")))?;
        if !raw.architectures.iter().any(|a| classifies(a)) {
            return Ok(None);
        }
        let labels = match raw.id2label {
            Some(map) => Self::labels_in_order(map).map_err(bad)?,
            // transformers' default when the file says nothing: two labels.
            None => (0..raw.num_labels.unwrap_or(2))
                .map(|i| format!("LABEL_{i}"))
                .collect(),
        };
        if labels.is_empty() {
            return Err(bad("a classifier needs at least one label".into()));
        }
        if let Some(n) = raw.num_labels.filter(|&n| n != labels.len()) {
            return Err(bad(format!(
                "num_labels {n} disagrees with the {} labels of id2label",
                labels.len()
            )));
        }
        Ok(Some(ClassifierConfig {
            labels,
            multi_label: raw.problem_type.as_deref() == Some("multi_label_classification"),
        }))
    }

    /// `id2label`'s names by id; the ids must be `0..n`, each once.
    fn labels_in_order(map: BTreeMap<String, String>) -> Result<Vec<String>, String> {
        let mut by_id: Vec<(usize, String)> = map
            .into_iter()
            .map(|(k, v)| {
                k.parse::<usize>()
                    .map(|id| (id, v))
                    .map_err(|_| format!("id2label key `{k}` is not a label id"))
            })
            .collect::<Result<_, _>>()?;
        by_id.sort_by_key(|(id, _)| *id);
        if by_id.iter().enumerate().any(|(i, (id, _))| i != *id) {
            return Err("id2label's ids must be 0, 1, 2, ... without gaps".into());
        }
        Ok(by_id.into_iter().map(|(_, name)| name).collect())
    }

    pub fn num_labels(&self) -> usize {
        self.labels.len()
    }

    /// Whether the model scores pairs (one label: a cross-encoder).
    pub fn is_cross_encoder(&self) -> bool {
        self.labels.len() == 1
    }

    /// The logits as probabilities: sigmoid for one label or a multi-label model, softmax
    /// over the labels otherwise.
    pub fn probabilities(&self, logits: &[f32]) -> Vec<f32> {
        if self.multi_label || logits.len() == 1 {
            return logits.iter().map(|&z| sigmoid(z)).collect();
        }
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let exps: Vec<f64> = logits.iter().map(|&z| f64::from(z - max).exp()).collect();
        let sum: f64 = exps.iter().sum();
        exps.iter().map(|e| (e / sum) as f32).collect()
    }
}

/// `1 / (1 + e^-z)`, computed in f64 so that large logits saturate cleanly.
pub fn sigmoid(z: f32) -> f32 {
    (1.0 / (1.0 + (-f64::from(z)).exp())) as f32
}

/// The encoder with its pooler and classifier.
pub struct SequenceClassifier {
    pub bert: BertModel,
    pub head: ClassifierConfig,
    /// `[hidden, hidden]`, then tanh.
    pooler: Linear,
    /// `[labels, hidden]`.
    classifier: Linear,
}

impl SequenceClassifier {
    /// Loads `model.safetensors` with the encoder's weights in the format
    /// `STRATA_EMBED_WEIGHTS` names (as [`BertModel::load`]).
    pub fn load(
        dir: &Path,
        config: EncoderConfig,
        head: ClassifierConfig,
    ) -> Result<Self, EmbedError> {
        Self::load_as(dir, config, head, EncoderWeights::from_env()?)
    }

    /// [`SequenceClassifier::load`] with the encoder's weight format given.
    pub fn load_as(
        dir: &Path,
        config: EncoderConfig,
        head: ClassifierConfig,
        format: EncoderWeights,
    ) -> Result<Self, EmbedError> {
        let mut tensors = read_safetensors(dir)?;
        let h = config.hidden_size;
        let pooler_name = if tensors.contains_key("bert.pooler.dense.weight") {
            "bert.pooler.dense"
        } else {
            "pooler.dense"
        };
        let pooler = take_dense(&mut tensors, pooler_name, h, h)?;
        let classifier = take_dense(&mut tensors, "classifier", head.num_labels(), h)?;
        let bert = BertModel::from_checkpoint(tensors, config, format)?;
        Ok(Self {
            bert,
            head,
            pooler,
            classifier,
        })
    }

    /// Each input's logits, one per label (the inputs checked as
    /// [`BertModel::hidden_states`] says).
    pub fn logits<T: Segmented>(&self, inputs: &[T]) -> Result<Vec<Vec<f32>>, EmbedError> {
        if inputs.is_empty() {
            return Ok(Vec::new());
        }
        let h = self.bert.config.hidden_size;
        let (x, spans) = self.bert.hidden_states(inputs)?;
        let cls: Vec<f32> = spans
            .iter()
            .flat_map(|&(start, _)| x[start * h..(start + 1) * h].iter().copied())
            .collect();
        let mut pooled = self.pooler.forward(&cls, spans.len())?;
        pooled.iter_mut().for_each(|v| *v = v.tanh());
        let logits = self.classifier.forward(&pooled, spans.len())?;
        Ok(logits
            .chunks_exact(self.head.num_labels())
            .map(<[f32]>::to_vec)
            .collect())
    }
}

/// Removes `{name}.weight` (`[out, inp]`) and `{name}.bias` from the checkpoint's tensors
/// and makes an f32 layer of them.
fn take_dense(
    tensors: &mut HashMap<String, Tensor>,
    name: &str,
    out: usize,
    inp: usize,
) -> Result<Linear, EmbedError> {
    let mut take = |suffix: &str, shape: &[usize]| -> Result<Tensor, EmbedError> {
        let full = format!("{name}.{suffix}");
        let t = tensors.remove(&full);
        checked_f32(full, t.as_ref(), shape)
    };
    let w = take("weight", &[out, inp])?;
    let b = take("bias", &[out])?.to_vec1::<f32>()?;
    Linear::new(&w, b, EncoderWeights::F32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir_with(name: &str, config: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("strata-cls-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("config.json"), config).unwrap();
        d
    }

    #[test]
    fn reads_labels_in_id_order_and_tells_encoders_apart() {
        let d = dir_with(
            "labels",
            r#"{"architectures":["BertForSequenceClassification"],
                "id2label":{"1":"toxic","0":"safe","2":"spam"}}"#,
        );
        let c = ClassifierConfig::from_dir(&d).unwrap().unwrap();
        assert_eq!(c.labels, ["safe", "toxic", "spam"]);
        assert!(!c.multi_label && !c.is_cross_encoder());
        let d2 = dir_with("enc", r#"{"architectures":["BertModel"]}"#);
        assert_eq!(ClassifierConfig::from_dir(&d2).unwrap(), None);
        let d3 = dir_with(
            "one",
            r#"{"architectures":["BertForSequenceClassification"],"num_labels":1}"#,
        );
        let c3 = ClassifierConfig::from_dir(&d3).unwrap().unwrap();
        assert_eq!(c3.labels, ["LABEL_0"]);
        assert!(c3.is_cross_encoder());
        let d4 = dir_with(
            "gap",
            r#"{"architectures":["BertForSequenceClassification"],"id2label":{"0":"a","2":"b"}}"#,
        );
        assert!(ClassifierConfig::from_dir(&d4).is_err());
        for d in [d, d2, d3, d4] {
            let _ = std::fs::remove_dir_all(&d);
        }
    }

    #[test]
    fn probabilities_follow_the_problem_type() {
        let two = ClassifierConfig {
            labels: vec!["a".into(), "b".into()],
            multi_label: false,
        };
        let p = two.probabilities(&[0.0, 2.0_f32.ln()]);
        assert!((p[0] - 1.0 / 3.0).abs() < 1e-6 && (p[1] - 2.0 / 3.0).abs() < 1e-6);
        let multi = ClassifierConfig {
            multi_label: true,
            ..two
        };
        assert_eq!(multi.probabilities(&[0.0, 0.0]), [0.5, 0.5]);
        let one = ClassifierConfig {
            labels: vec!["LABEL_0".into()],
            multi_label: false,
        };
        assert_eq!(one.probabilities(&[0.0]), [0.5]);
        assert_eq!(sigmoid(200.0), 1.0);
        assert_eq!(sigmoid(-200.0), 0.0);
    }
}
