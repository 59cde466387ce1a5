//! The Prometheus text exposition format, as engines serve it at `GET /metrics`, and the
//! arithmetic every reader of those pages needs: cumulative histograms, their deltas between
//! two scrapes and their quantiles (the definition of PromQL's `histogram_quantile`).
//!
//! Reading is deliberately small and tolerant: only sample lines are read, and a line that
//! does not parse is skipped (and counted by [`samples`]), so one odd line never hides the
//! rest of a page. What a page *means* (which names an engine kind uses) is
//! [`crate::model_server`]'s business.
//!
//! Upstream: the text format is "Exposition formats" in the Prometheus documentation; the
//! OpenMetrics subset engines emit (`# EOF`, `_created` series) reads the same way.

/// One sample line: name, labels, value. Borrowed from the page it was read from.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<'a> {
    pub name: &'a str,
    pub labels: Vec<(&'a str, String)>,
    pub value: f64,
}

impl Sample<'_> {
    /// The value of label `key`, if the sample has it.
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.as_str())
    }

    /// The `le` bound of a histogram bucket sample (`+Inf` included).
    pub fn le(&self) -> Option<f64> {
        self.label("le").and_then(parse_value)
    }
}

/// A float as the format writes it (`+Inf`, `-Inf`, `NaN` included).
pub fn parse_value(v: &str) -> Option<f64> {
    match v {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        v => v.parse::<f64>().ok(),
    }
}

/// Parses one sample line; `None` for comments, blanks and anything malformed.
pub fn parse_sample(line: &str) -> Option<Sample<'_>> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line
        .find(|c: char| c == '{' || c.is_ascii_whitespace())
        .unwrap_or(line.len());
    let name = &line[..name_end];
    if name.is_empty()
        || name.starts_with(|c: char| c.is_ascii_digit())
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b':')
    {
        return None;
    }
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(after) = rest.strip_prefix('{') {
        let (parsed, tail) = parse_labels(after)?;
        labels = parsed;
        rest = tail;
    }
    let value = parse_value(rest.split_ascii_whitespace().next()?)?;
    Some(Sample {
        name,
        labels,
        value,
    })
}

/// Parses `k="v",k2="v2"}` and returns the labels and what follows the `}`.
fn parse_labels(mut s: &str) -> Option<(Vec<(&str, String)>, &str)> {
    let mut labels = Vec::new();
    loop {
        s = s.trim_start();
        if let Some(tail) = s.strip_prefix('}') {
            return Some((labels, tail));
        }
        let eq = s.find('=')?;
        let key = s[..eq].trim();
        if key.is_empty() {
            return None;
        }
        s = s[eq + 1..].trim_start().strip_prefix('"')?;
        let mut value = String::new();
        let mut chars = s.char_indices();
        let end = loop {
            let (i, c) = chars.next()?;
            match c {
                '"' => break i,
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                c => value.push(c),
            }
        };
        labels.push((key, value));
        s = s[end + 1..].trim_start();
        if let Some(tail) = s.strip_prefix(',') {
            s = tail;
        }
    }
}

/// Every sample of a page, and how many non-comment lines did not parse.
pub fn samples(text: &str) -> (Vec<Sample<'_>>, usize) {
    let mut out = Vec::new();
    let mut bad = 0;
    for line in text.lines() {
        let t = line.trim();
        if t.is_empty() || t.starts_with('#') {
            continue;
        }
        match parse_sample(t) {
            Some(s) => out.push(s),
            None => bad += 1,
        }
    }
    (out, bad)
}

/// A cumulative histogram: `(upper bound, count of observations ≤ bound)`, sorted by bound,
/// the last bound `+Inf` when the page had it.
pub type Buckets = Vec<(f64, f64)>;

/// Adds `count` to the bucket with bound `le` (summing series with other labels), keeping
/// the buckets sorted.
pub fn add_bucket(buckets: &mut Buckets, le: f64, count: f64) {
    match buckets.binary_search_by(|(b, _)| b.total_cmp(&le)) {
        Ok(i) => buckets[i].1 += count,
        Err(i) => buckets.insert(i, (le, count)),
    }
}

/// Bucket-wise sum of two histograms.
pub fn add_histogram(into: &mut Buckets, add: &[(f64, f64)]) {
    for &(le, c) in add {
        add_bucket(into, le, c);
    }
}

/// The `q`-quantile of a cumulative histogram as PromQL's `histogram_quantile` computes it:
/// linear interpolation inside the bucket the rank falls in, from 0 for the first bucket; a
/// rank in the `+Inf` bucket is the largest finite bound. `None` without observations.
pub fn histogram_quantile(buckets: &[(f64, f64)], q: f64) -> Option<f64> {
    let total = buckets.last()?.1;
    if total.is_nan() || total <= 0.0 {
        return None;
    }
    let rank = q.clamp(0.0, 1.0) * total;
    let (mut lower, mut below) = (0.0, 0.0);
    for &(le, cum) in buckets {
        if cum >= rank && cum > below {
            if le.is_infinite() {
                return Some(lower);
            }
            return Some(lower + (le - lower) * (rank - below) / (cum - below));
        }
        if le.is_finite() {
            lower = le;
        }
        below = cum;
    }
    Some(lower)
}

/// Bucket-wise `now - before`: what was observed between two scrapes. A bucket that went
/// down, or a different set of bounds, means the engine restarted: everything in `now` is
/// new.
pub fn histogram_delta(now: &[(f64, f64)], before: &[(f64, f64)]) -> Buckets {
    let restarted =
        now.len() != before.len() || now.iter().zip(before).any(|(a, b)| a.0 != b.0 || a.1 < b.1);
    if restarted {
        return now.to_vec();
    }
    now.iter()
        .zip(before)
        .map(|(a, b)| (a.0, a.1 - b.1))
        .collect()
}

/// `now - before` for a counter; a decrease is a restart, so all of `now` is new.
pub fn counter_delta(now: f64, before: f64) -> f64 {
    if now >= before {
        now - before
    } else {
        now
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_escapes_and_malformed_lines() {
        let s = parse_sample(r#"x{a="q\"b\\c",b="2"} 1 123"#).unwrap();
        assert_eq!(
            s.labels,
            vec![("a", "q\"b\\c".to_string()), ("b", "2".to_string())]
        );
        assert_eq!(s.value, 1.0);
        assert_eq!(s.label("b"), Some("2"));
        for bad in [
            "bad name 1",
            "x{a=1} 1",
            "x{=\"1\"} 1",
            "9x 1",
            "x{a=\"unterminated 3",
            "x",
            "x{a=\"1\"}",
        ] {
            assert!(parse_sample(bad).is_none(), "{bad}");
        }
        assert!(parse_sample("# HELP x y").is_none());
        assert_eq!(parse_sample("x +Inf").unwrap().value, f64::INFINITY);
        let (all, bad) = samples("# c\nx 1\n\ngarbage here\ny{l=\"v\"} 2\n");
        assert_eq!(all.len(), 2);
        assert_eq!(bad, 1);
    }

    #[test]
    fn quantiles_interpolate_inside_buckets() {
        let b = vec![(0.1, 10.0), (0.5, 20.0), (1.0, 20.0), (f64::INFINITY, 20.0)];
        // Rank 10 of 20: the top of the first bucket.
        assert!((histogram_quantile(&b, 0.5).unwrap() - 0.1).abs() < 1e-12);
        assert!((histogram_quantile(&b, 0.1).unwrap() - 0.02).abs() < 1e-12);
        // Rank 18: 8 of 10 into (0.1, 0.5].
        assert!((histogram_quantile(&b, 0.9).unwrap() - 0.42).abs() < 1e-12);
        // In the +Inf bucket: the largest finite bound.
        let tail = vec![(0.5, 1.0), (f64::INFINITY, 10.0)];
        assert_eq!(histogram_quantile(&tail, 0.99), Some(0.5));
        assert_eq!(
            histogram_quantile(&[(0.1, 0.0), (f64::INFINITY, 0.0)], 0.5),
            None
        );
        assert_eq!(histogram_quantile(&[], 0.5), None);
    }

    #[test]
    fn deltas_treat_a_decrease_as_a_restart() {
        let before = vec![(1.0, 2.0), (f64::INFINITY, 3.0)];
        let now = vec![(1.0, 5.0), (f64::INFINITY, 7.0)];
        assert_eq!(
            histogram_delta(&now, &before),
            vec![(1.0, 3.0), (f64::INFINITY, 4.0)]
        );
        let restarted = vec![(1.0, 1.0), (f64::INFINITY, 1.0)];
        assert_eq!(histogram_delta(&restarted, &before), restarted);
        assert_eq!(counter_delta(10.0, 4.0), 6.0);
        assert_eq!(counter_delta(3.0, 4.0), 3.0);
    }

    #[test]
    fn buckets_sum_across_label_sets_in_order() {
        let mut b = Buckets::new();
        add_bucket(&mut b, f64::INFINITY, 2.0);
        add_bucket(&mut b, 0.5, 1.0);
        add_bucket(&mut b, 0.5, 1.0);
        add_bucket(&mut b, 0.1, 1.0);
        assert_eq!(b, vec![(0.1, 1.0), (0.5, 2.0), (f64::INFINITY, 2.0)]);
    }
}
