//! The embedding worker: one thread owns the encoder and turns whatever is queued into as
//! few forwards as the token budget allows.
//!
//! A request's inputs are never split across rounds, and requests queued while a forward
//! runs are coalesced into the next one, so concurrent clients share forwards the way one
//! client's batched request does. A request whose client went away before its round is
//! skipped, and one whose forward fails hears that error while the others of its round are
//! unaffected.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;

use tokio::sync::oneshot;

use super::encoder::Encoder;
use super::input::EncoderInput;
use super::EmbedError;

/// Limits of the worker.
#[derive(Debug, Clone, Copy)]
pub struct WorkerConfig {
    /// Tokens in one forward (inputs are whole: a forward holds at least one).
    pub max_batch_tokens: usize,
    /// Requests that may wait for the worker before new ones are refused.
    pub max_waiting: usize,
}

/// Why a request got no vectors.
#[derive(Debug, thiserror::Error)]
pub enum EmbedFailure {
    #[error("the embedding queue is full ({0} requests waiting)")]
    QueueFull(usize),
    #[error("the embedding worker has stopped")]
    Stopped,
    #[error(transparent)]
    Model(#[from] EmbedError),
}

struct Job {
    inputs: Vec<EncoderInput>,
    reply: oneshot::Sender<Result<Vec<Vec<f32>>, EmbedError>>,
}

/// The server's side of the worker; cheap to clone.
#[derive(Clone)]
pub struct EmbedHandle {
    tx: SyncSender<Job>,
    waiting: Arc<AtomicUsize>,
    max_waiting: usize,
    forwards: Arc<AtomicUsize>,
}

impl EmbedHandle {
    /// Embeds `inputs` (checked token ids), waiting for the worker's next round.
    pub async fn embed(&self, inputs: Vec<Vec<u32>>) -> Result<Vec<Vec<f32>>, EmbedFailure> {
        self.forward(inputs.into_iter().map(EncoderInput::single).collect())
            .await
    }

    /// Runs `inputs` (checked token ids, one segment or a pair each) through the model,
    /// waiting for the worker's next round: a vector per input (an embedding, or logits).
    pub async fn forward(&self, inputs: Vec<EncoderInput>) -> Result<Vec<Vec<f32>>, EmbedFailure> {
        let (reply, rx) = oneshot::channel();
        self.waiting.fetch_add(1, Ordering::SeqCst);
        match self.tx.try_send(Job { inputs, reply }) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                self.waiting.fetch_sub(1, Ordering::SeqCst);
                return Err(EmbedFailure::QueueFull(self.max_waiting));
            }
            Err(TrySendError::Disconnected(_)) => {
                self.waiting.fetch_sub(1, Ordering::SeqCst);
                return Err(EmbedFailure::Stopped);
            }
        }
        match rx.await {
            Ok(result) => Ok(result?),
            Err(_) => Err(EmbedFailure::Stopped),
        }
    }

    /// Requests queued and not yet taken into a round.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }

    /// Forwards run so far (tests use it to see that requests were coalesced).
    pub fn forwards(&self) -> usize {
        self.forwards.load(Ordering::SeqCst)
    }
}

/// Starts the worker thread; it ends when every handle is dropped.
pub fn start(
    model: Arc<Encoder>,
    config: WorkerConfig,
) -> std::io::Result<(EmbedHandle, JoinHandle<()>)> {
    let (tx, rx) = mpsc::sync_channel(config.max_waiting.max(1));
    let waiting = Arc::new(AtomicUsize::new(0));
    let forwards = Arc::new(AtomicUsize::new(0));
    let handle = EmbedHandle {
        tx,
        waiting: waiting.clone(),
        max_waiting: config.max_waiting.max(1),
        forwards: forwards.clone(),
    };
    let thread = std::thread::Builder::new()
        .name("strata-embed".into())
        .spawn(move || run(&model, &rx, config, &waiting, &forwards))?;
    Ok((handle, thread))
}

fn run(
    model: &Encoder,
    rx: &Receiver<Job>,
    config: WorkerConfig,
    waiting: &AtomicUsize,
    forwards: &AtomicUsize,
) {
    let budget = config.max_batch_tokens.max(1);
    while let Ok(first) = rx.recv() {
        waiting.fetch_sub(1, Ordering::SeqCst);
        let mut round = vec![first];
        let mut tokens: usize = round[0].inputs.iter().map(|i| i.ids.len()).sum();
        while tokens < budget {
            match rx.try_recv() {
                Ok(job) => {
                    waiting.fetch_sub(1, Ordering::SeqCst);
                    tokens += job.inputs.iter().map(|i| i.ids.len()).sum::<usize>();
                    round.push(job);
                }
                Err(_) => break,
            }
        }
        // Clients that went away while queued cost nothing.
        round.retain(|job| !job.reply.is_closed());
        serve_round(model, round, budget, forwards);
    }
}

/// Runs the round's inputs as forwards of at most `budget` tokens and replies to each job.
fn serve_round(model: &Encoder, round: Vec<Job>, budget: usize, forwards: &AtomicUsize) {
    let mut outputs: Vec<Result<Vec<Vec<f32>>, EmbedError>> = round
        .iter()
        .map(|j| Ok(Vec::with_capacity(j.inputs.len())))
        .collect();
    // (job, input) pairs in order, cut into chunks by the token budget.
    let pairs: Vec<(usize, usize)> = round
        .iter()
        .enumerate()
        .flat_map(|(j, job)| (0..job.inputs.len()).map(move |i| (j, i)))
        .collect();
    let mut start = 0;
    while start < pairs.len() {
        let mut end = start;
        let mut tokens = 0;
        while end < pairs.len() {
            let (j, i) = pairs[end];
            let n = round[j].inputs[i].ids.len();
            if end > start && tokens + n > budget {
                break;
            }
            tokens += n;
            end += 1;
        }
        let chunk = &pairs[start..end];
        // A job that already failed in an earlier chunk gets no more work.
        let live: Vec<(usize, usize)> = chunk
            .iter()
            .copied()
            .filter(|&(j, _)| outputs[j].is_ok())
            .collect();
        let batch: Vec<EncoderInput> = live
            .iter()
            .map(|&(j, i)| round[j].inputs[i].clone())
            .collect();
        if !batch.is_empty() {
            forwards.fetch_add(1, Ordering::SeqCst);
            // Inside the pool, the matrix products fork from a worker thread instead of
            // waking the pool from outside for each one.
            match rayon::scope(|_| model.forward(&batch)) {
                Ok(vectors) => {
                    for (&(j, _), v) in live.iter().zip(vectors) {
                        if let Ok(out) = &mut outputs[j] {
                            out.push(v);
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "embedding forward failed");
                    for &(j, _) in &live {
                        outputs[j] = Err(EmbedError::Forward(e.to_string()));
                    }
                }
            }
        }
        start = end;
    }
    for (job, out) in round.into_iter().zip(outputs) {
        // A client that left mid-round simply does not read its reply.
        let _ = job.reply.send(out);
    }
}
