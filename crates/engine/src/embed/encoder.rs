//! What the embedding worker runs: a sentence encoder or a sequence classifier. Either
//! turns a batch of inputs into one vector each, in one forward: an embedding, or the
//! labels' logits.

use super::bert::BertModel;
use super::classifier::{ClassifierConfig, SequenceClassifier};
use super::input::EncoderInput;
use super::EmbedError;

pub enum Encoder {
    /// Pooled, L2-normalised sentence vectors (`/v1/embeddings`; `/score` and `/rerank`
    /// by cosine similarity).
    Embedding(Box<BertModel>),
    /// Logits per label (`/classify`; `/score` and `/rerank` when it has one label).
    Classifier(Box<SequenceClassifier>),
}

impl Encoder {
    /// One forward over `batch`: a vector per input, in order.
    pub fn forward(&self, batch: &[EncoderInput]) -> Result<Vec<Vec<f32>>, EmbedError> {
        match self {
            Encoder::Embedding(m) => m.embed_segmented(batch),
            Encoder::Classifier(m) => m.logits(batch),
        }
    }

    /// The BERT encoder underneath.
    pub fn bert(&self) -> &BertModel {
        match self {
            Encoder::Embedding(m) => m,
            Encoder::Classifier(m) => &m.bert,
        }
    }

    /// The classification head's labels, for a classifier.
    pub fn classifier(&self) -> Option<&ClassifierConfig> {
        match self {
            Encoder::Embedding(_) => None,
            Encoder::Classifier(m) => Some(&m.head),
        }
    }
}
