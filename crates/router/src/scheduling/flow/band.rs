//! One priority band: a FCFS queue per flow, served round-robin across the flows that
//! have requests, `weight` requests per turn.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

/// A request in a queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Queued {
    pub id: u64,
    pub bytes: u64,
    pub arrived: Duration,
    pub deadline: Duration,
}

#[derive(Debug, Default)]
struct Flow {
    queue: VecDeque<Queued>,
    bytes: u64,
}

/// The flows of one band.
#[derive(Debug, Default)]
pub struct Band {
    flows: BTreeMap<String, Flow>,
    /// Flows with requests, in turn order; the front one is being served.
    ring: VecDeque<String>,
    /// Requests the front flow has had in its current turn.
    served_in_turn: u32,
    requests: usize,
    bytes: u64,
}

impl Band {
    pub fn requests(&self) -> usize {
        self.requests
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn is_empty(&self) -> bool {
        self.requests == 0
    }

    /// Appends `q` to flow `flow`; a flow that had nothing waits for its turn behind the
    /// flows already waiting.
    pub fn push(&mut self, flow: &str, q: Queued) {
        let f = match self.flows.get_mut(flow) {
            Some(f) => f,
            None => {
                self.ring.push_back(flow.to_string());
                self.flows.entry(flow.to_string()).or_default()
            }
        };
        f.queue.push_back(q);
        f.bytes = f.bytes.saturating_add(q.bytes);
        self.requests += 1;
        self.bytes = self.bytes.saturating_add(q.bytes);
    }

    /// The next request by round robin: the front flow's oldest; the turn passes once the
    /// flow has had `weight(flow)` requests in it, or has none left.
    pub fn pop(&mut self, weight: impl Fn(&str) -> u32) -> Option<(String, Queued)> {
        let key = self.ring.front()?.clone();
        let f = self.flows.get_mut(&key)?;
        let q = f.queue.pop_front()?;
        f.bytes = f.bytes.saturating_sub(q.bytes);
        let emptied = f.queue.is_empty();
        self.requests -= 1;
        self.bytes = self.bytes.saturating_sub(q.bytes);
        self.served_in_turn += 1;
        if emptied {
            self.flows.remove(&key);
            self.ring.pop_front();
            self.served_in_turn = 0;
        } else if self.served_in_turn >= weight(&key).max(1) {
            self.ring.rotate_left(1);
            self.served_in_turn = 0;
        }
        Some((key, q))
    }

    /// Takes request `id` out of flow `flow` (evicted or cancelled).
    pub fn remove(&mut self, flow: &str, id: u64) -> Option<Queued> {
        let f = self.flows.get_mut(flow)?;
        let i = f.queue.iter().position(|q| q.id == id)?;
        let q = f.queue.remove(i)?;
        f.bytes = f.bytes.saturating_sub(q.bytes);
        self.requests -= 1;
        self.bytes = self.bytes.saturating_sub(q.bytes);
        if f.queue.is_empty() {
            self.flows.remove(flow);
            if let Some(pos) = self.ring.iter().position(|k| k == flow) {
                self.ring.remove(pos);
                if pos == 0 {
                    self.served_in_turn = 0;
                }
            }
        }
        Some(q)
    }

    /// `(flow, requests, bytes, oldest arrival)` per flow with requests, by name.
    pub fn flows(&self) -> impl Iterator<Item = (&str, usize, u64, Option<Duration>)> {
        self.flows.iter().map(|(k, f)| {
            (
                k.as_str(),
                f.queue.len(),
                f.bytes,
                f.queue.front().map(|q| q.arrived),
            )
        })
    }
}
