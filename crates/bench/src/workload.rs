//! Workloads: what each conversation sends.
//!
//! Every workload yields [`Session`]s: a system prompt and one or more user turns. The
//! single-shot workloads (`random`, `shared-prefix`, `trace`) yield one-turn sessions;
//! `multi-turn` yields conversations that resend their growing history. Content is
//! described by seeded [`Segment`]s, so a shared system prompt or a trace block with the
//! same hash id renders to the same tokens in every request that uses it.

use std::time::Duration;

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::error::BenchError;
use crate::prompt::{mix, Segment};

/// Seed domains, so a system prompt never renders like a question with the same index.
const TAG_RANDOM: u64 = 1;
const TAG_SYSTEM: u64 = 2;
const TAG_QUESTION: u64 = 3;
const TAG_TURN: u64 = 4;
const TAG_BLOCK: u64 = 5;
const TAG_FILL: u64 = 6;

/// A workload and its shape parameters.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Workload {
    /// Independent requests with drawn input and output lengths; no reuse.
    Random(RandomSpec),
    /// `groups` shared system prompts, each followed by distinct questions.
    SharedPrefix(SharedPrefixSpec),
    /// Conversations resending their growing history turn after turn.
    MultiTurn(MultiTurnSpec),
    /// Replay of a Mooncake-style JSONL trace.
    Trace(TraceSpec),
}

impl Workload {
    /// The workload's name as the CLI spells it.
    pub fn name(&self) -> &'static str {
        match self {
            Workload::Random(_) => "random",
            Workload::SharedPrefix(_) => "shared-prefix",
            Workload::MultiTurn(_) => "multi-turn",
            Workload::Trace(_) => "trace",
        }
    }
}

/// `random`: lengths drawn uniformly in `[len * (1 - range_ratio), len * (1 + range_ratio)]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RandomSpec {
    /// Mean prompt length in tokens.
    pub input_len: u32,
    /// Mean output length in tokens (`max_tokens`).
    pub output_len: u32,
    /// Spread of both lengths around their mean, in `[0, 1)`.
    pub range_ratio: f64,
}

/// `shared-prefix`: every request is one group's system prompt plus a fresh question.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SharedPrefixSpec {
    /// Number of distinct system prompts.
    pub groups: u32,
    /// Distinct questions per group in one pass; later passes draw new questions.
    pub prompts_per_group: u32,
    /// System prompt length in tokens.
    pub system_len: u32,
    /// Question length in tokens.
    pub question_len: u32,
    /// Output length in tokens.
    pub output_len: u32,
}

/// `multi-turn`: a system prompt, then `turns` user messages, each sent with the whole
/// history so far (earlier user messages and the server's actual replies).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MultiTurnSpec {
    /// User turns per conversation.
    pub turns: u32,
    /// System prompt length in tokens (0 for none); shared by all conversations.
    pub system_len: u32,
    /// Length of each user message in tokens.
    pub user_len: u32,
    /// Output length per turn in tokens.
    pub output_len: u32,
    /// Pause between a reply and the next user message.
    #[serde(with = "secs")]
    pub think_time: Duration,
}

/// `trace`: one request per line, sent at `timestamp / speed`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TraceSpec {
    /// The parsed lines.
    #[serde(skip)]
    pub entries: Vec<TraceEntry>,
    /// Where they came from (for the report).
    pub source: String,
    /// Tokens per `hash_ids` block (512 in the Mooncake traces).
    pub block_size: u32,
    /// Replay speed factor: 2.0 sends twice as fast as recorded.
    pub speed: f64,
}

/// One line of a Mooncake-style trace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceEntry {
    /// Arrival time in milliseconds from the trace's start.
    #[serde(default)]
    pub timestamp: f64,
    /// Prompt length in tokens.
    pub input_length: u32,
    /// Output length in tokens.
    pub output_length: u32,
    /// Ids of the prompt's blocks; equal ids are equal content.
    #[serde(default)]
    pub hash_ids: Vec<u64>,
}

/// Parses a JSONL trace; blank lines are skipped, any other bad line is an error naming it.
pub fn parse_trace(text: &str, source: &str) -> Result<Vec<TraceEntry>, BenchError> {
    let mut entries = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let entry: TraceEntry = serde_json::from_str(line).map_err(|e| BenchError::Trace {
            source_name: source.to_string(),
            line: i + 1,
            message: e.to_string(),
        })?;
        if !entry.timestamp.is_finite() || entry.timestamp < 0.0 {
            return Err(BenchError::Trace {
                source_name: source.to_string(),
                line: i + 1,
                message: "timestamp must be a non-negative number of milliseconds".into(),
            });
        }
        entries.push(entry);
    }
    if entries.is_empty() {
        return Err(BenchError::Trace {
            source_name: source.to_string(),
            line: 0,
            message: "the trace has no requests".into(),
        });
    }
    Ok(entries)
}

/// One user turn of a session.
#[derive(Debug, Clone, PartialEq)]
pub struct Turn {
    /// The user message.
    pub user: Vec<Segment>,
    /// `max_tokens` for the reply.
    pub max_tokens: u32,
}

/// One conversation: a system prompt and its turns.
#[derive(Debug, Clone, PartialEq)]
pub struct Session {
    /// The system prompt (empty for none).
    pub system: Vec<Segment>,
    /// The user turns, sent in order.
    pub turns: Vec<Turn>,
    /// Pause between a reply and the next turn.
    pub think_time: Duration,
    /// For trace replay: when to send, from the start of the run, before speed scaling.
    pub arrival: Option<Duration>,
    /// Conversation id for session-affine routing (multi-turn only).
    pub id: Option<u64>,
}

/// Yields the sessions of a workload, deterministically from a seed.
#[derive(Debug)]
pub struct SessionSource {
    workload: Workload,
    seed: u64,
    rng: StdRng,
    /// Sessions yielded so far.
    count: u64,
    /// shared-prefix: this pass's (group, question) order, and the pass number.
    order: Vec<(u32, u32)>,
    pass: u64,
}

impl SessionSource {
    /// A source for `workload` with content and lengths drawn from `seed`.
    pub fn new(workload: Workload, seed: u64) -> Self {
        SessionSource {
            workload,
            seed,
            rng: StdRng::seed_from_u64(seed),
            count: 0,
            order: Vec::new(),
            pass: 0,
        }
    }

    /// The next session; `None` once a trace is exhausted (the other workloads never end).
    pub fn next_session(&mut self) -> Option<Session> {
        let index = self.count;
        let seed = self.seed;
        let session = match &self.workload {
            Workload::Random(spec) => {
                let input = draw_len(&mut self.rng, spec.input_len, spec.range_ratio);
                let output = draw_len(&mut self.rng, spec.output_len, spec.range_ratio);
                Session {
                    system: Vec::new(),
                    turns: vec![Turn {
                        user: vec![Segment::new(mix(&[seed, TAG_RANDOM, index]), input)],
                        max_tokens: output,
                    }],
                    think_time: Duration::ZERO,
                    arrival: None,
                    id: None,
                }
            }
            Workload::SharedPrefix(spec) => {
                if self.order.is_empty() {
                    self.order = (0..spec.groups)
                        .flat_map(|g| (0..spec.prompts_per_group).map(move |q| (g, q)))
                        .collect();
                    self.order.shuffle(&mut self.rng);
                    self.order.reverse();
                    self.pass += 1;
                }
                let (group, question) = self.order.pop()?;
                let system =
                    Segment::new(mix(&[seed, TAG_SYSTEM, u64::from(group)]), spec.system_len);
                let question = Segment::new(
                    mix(&[
                        seed,
                        TAG_QUESTION,
                        u64::from(group),
                        u64::from(question),
                        self.pass,
                    ]),
                    spec.question_len,
                );
                Session {
                    system: if spec.system_len > 0 {
                        vec![system]
                    } else {
                        Vec::new()
                    },
                    turns: vec![Turn {
                        user: vec![question],
                        max_tokens: spec.output_len,
                    }],
                    think_time: Duration::ZERO,
                    arrival: None,
                    id: None,
                }
            }
            Workload::MultiTurn(spec) => {
                let system = Segment::new(mix(&[seed, TAG_SYSTEM]), spec.system_len);
                let turns = (0..spec.turns)
                    .map(|t| Turn {
                        user: vec![Segment::new(
                            mix(&[seed, TAG_TURN, index, u64::from(t)]),
                            spec.user_len,
                        )],
                        max_tokens: spec.output_len,
                    })
                    .collect();
                Session {
                    system: if spec.system_len > 0 {
                        vec![system]
                    } else {
                        Vec::new()
                    },
                    turns,
                    think_time: spec.think_time,
                    arrival: None,
                    id: Some(index),
                }
            }
            Workload::Trace(spec) => {
                let entry = spec.entries.get(usize::try_from(index).ok()?)?;
                let first = spec.entries.first().map_or(0.0, |e| e.timestamp);
                let arrival_ms = (entry.timestamp - first).max(0.0) / spec.speed;
                Session {
                    system: Vec::new(),
                    turns: vec![Turn {
                        user: trace_segments(entry, spec.block_size, seed, index),
                        max_tokens: entry.output_length.max(1),
                    }],
                    think_time: Duration::ZERO,
                    arrival: Some(Duration::from_secs_f64(arrival_ms / 1000.0)),
                    id: None,
                }
            }
        };
        self.count += 1;
        Some(session)
    }
}

/// A trace line's prompt: one segment per hash id (the last one cut to what is left of
/// `input_length`), then unique filler if the ids cover less than `input_length`.
fn trace_segments(entry: &TraceEntry, block_size: u32, seed: u64, index: u64) -> Vec<Segment> {
    let mut left = entry.input_length.max(1);
    let mut segments = Vec::with_capacity(entry.hash_ids.len() + 1);
    for &id in &entry.hash_ids {
        if left == 0 {
            break;
        }
        let len = left.min(block_size);
        segments.push(Segment::new(mix(&[seed, TAG_BLOCK, id]), len));
        left -= len;
    }
    if left > 0 {
        segments.push(Segment::new(mix(&[seed, TAG_FILL, index]), left));
    }
    segments
}

/// A length drawn uniformly around `mean`, at least 1.
fn draw_len(rng: &mut StdRng, mean: u32, ratio: f64) -> u32 {
    if ratio <= 0.0 {
        return mean.max(1);
    }
    let lo = (f64::from(mean) * (1.0 - ratio)).round().max(1.0) as u32;
    let hi = (f64::from(mean) * (1.0 + ratio)).round().max(1.0) as u32;
    rng.random_range(lo..=hi.max(lo))
}

/// Serde for a `Duration` as fractional seconds.
mod secs {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let v = f64::deserialize(d)?;
        Duration::try_from_secs_f64(v).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn take(source: &mut SessionSource, n: usize) -> Vec<Session> {
        (0..n).map_while(|_| source.next_session()).collect()
    }

    #[test]
    fn random_draws_lengths_in_range_without_reuse() {
        let w = Workload::Random(RandomSpec {
            input_len: 100,
            output_len: 20,
            range_ratio: 0.5,
        });
        let sessions = take(&mut SessionSource::new(w, 7), 200);
        let mut seeds = std::collections::HashSet::new();
        for s in &sessions {
            let t = &s.turns[0];
            assert!((50..=150).contains(&t.user[0].len));
            assert!((10..=30).contains(&t.max_tokens));
            assert!(seeds.insert(t.user[0].seed));
        }
        // Same seed, same sessions.
        let w2 = Workload::Random(RandomSpec {
            input_len: 100,
            output_len: 20,
            range_ratio: 0.5,
        });
        assert_eq!(take(&mut SessionSource::new(w2, 7), 200), sessions);
    }

    #[test]
    fn shared_prefix_covers_every_group_and_question_once_per_pass() {
        let w = Workload::SharedPrefix(SharedPrefixSpec {
            groups: 3,
            prompts_per_group: 4,
            system_len: 50,
            question_len: 5,
            output_len: 8,
        });
        let mut src = SessionSource::new(w, 1);
        let pass1 = take(&mut src, 12);
        let systems: std::collections::HashSet<_> =
            pass1.iter().map(|s| s.system[0].seed).collect();
        assert_eq!(systems.len(), 3);
        let questions: std::collections::HashSet<_> =
            pass1.iter().map(|s| s.turns[0].user[0].seed).collect();
        assert_eq!(questions.len(), 12);
        // The next pass reuses the system prompts but asks new questions.
        let pass2 = take(&mut src, 12);
        assert!(pass2.iter().all(|s| systems.contains(&s.system[0].seed)));
        assert!(pass2
            .iter()
            .all(|s| !questions.contains(&s.turns[0].user[0].seed)));
    }

    #[test]
    fn multi_turn_has_turns_and_think_time() {
        let w = Workload::MultiTurn(MultiTurnSpec {
            turns: 3,
            system_len: 10,
            user_len: 4,
            output_len: 6,
            think_time: Duration::from_millis(5),
        });
        let s = SessionSource::new(w, 2).next_session().unwrap();
        assert_eq!(s.turns.len(), 3);
        assert_eq!(s.system.len(), 1);
        assert_eq!(s.think_time, Duration::from_millis(5));
        assert!(s
            .turns
            .iter()
            .all(|t| t.max_tokens == 6 && t.user[0].len == 4));
    }

    #[test]
    fn trace_blocks_share_content_by_hash_id() {
        let text = r#"{"timestamp": 1000, "input_length": 1100, "output_length": 3, "hash_ids": [1, 2, 3]}

{"timestamp": 3000, "input_length": 600, "output_length": 5, "hash_ids": [1, 9]}
{"timestamp": 4000, "input_length": 10, "output_length": 5}
"#;
        let entries = parse_trace(text, "t.jsonl").unwrap();
        assert_eq!(entries.len(), 3);
        let w = Workload::Trace(TraceSpec {
            entries,
            source: "t.jsonl".into(),
            block_size: 512,
            speed: 2.0,
        });
        let s = take(&mut SessionSource::new(w, 3), 10);
        assert_eq!(s.len(), 3);
        let a = &s[0].turns[0].user;
        let b = &s[1].turns[0].user;
        assert_eq!(a.iter().map(|x| x.len).collect::<Vec<_>>(), [512, 512, 76]);
        assert_eq!(b.iter().map(|x| x.len).collect::<Vec<_>>(), [512, 88]);
        assert_eq!(a[0], b[0]);
        assert_ne!(a[1].seed, b[1].seed);
        assert_eq!(s[0].arrival, Some(Duration::ZERO));
        assert_eq!(s[1].arrival, Some(Duration::from_secs(1)));
        assert_eq!(s[2].turns[0].user.iter().map(|x| x.len).sum::<u32>(), 10);
    }

    #[test]
    fn bad_trace_lines_are_named() {
        let err = parse_trace(
            "{\"input_length\": 5, \"output_length\": 1}\nnot json\n",
            "x",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("line 2"), "{err}");
        let err = parse_trace("\n\n", "x").unwrap_err().to_string();
        assert!(err.contains("no requests"), "{err}");
        let err = parse_trace("{\"input_length\": 5}", "x")
            .unwrap_err()
            .to_string();
        assert!(err.contains("output_length"), "{err}");
    }
}
