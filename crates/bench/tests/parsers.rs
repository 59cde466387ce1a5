//! Property tests for the parsers and the percentile definition.

use proptest::prelude::*;
use std::time::Duration;
use strata_bench::args::{parse_duration, parse_slo};
use strata_bench::stats::{percentile, Summary};
use strata_bench::workload::parse_trace;

proptest! {
    #[test]
    fn duration_parser_never_panics(s in ".{0,24}") {
        let _ = parse_duration(&s);
    }

    #[test]
    fn durations_round_trip(ms in 0u64..10_000_000) {
        prop_assert_eq!(parse_duration(&format!("{ms}ms")).unwrap(), Duration::from_millis(ms));
        prop_assert_eq!(parse_duration(&format!("{ms}")).unwrap(), Duration::from_secs(ms));
    }

    #[test]
    fn slo_parser_never_panics(s in "[a-z0-9=,.ms ]{0,40}") {
        if let Ok(slo) = parse_slo(&s) {
            prop_assert!(!slo.is_empty());
        }
    }

    #[test]
    fn slo_values_are_milliseconds(ttft in 1u32..100_000, itl in 1u32..10_000) {
        let slo = parse_slo(&format!("ttft={ttft},itl={itl}ms")).unwrap();
        prop_assert_eq!(slo.ttft_ms, Some(f64::from(ttft)));
        prop_assert!((slo.itl_ms.unwrap() - f64::from(itl)).abs() < 1e-9);
    }

    #[test]
    fn trace_parser_never_panics(lines in prop::collection::vec(".{0,60}", 0..5)) {
        let _ = parse_trace(&lines.join("\n"), "prop");
    }

    #[test]
    fn trace_lines_parse_back(
        rows in prop::collection::vec((0u32..1_000_000, 1u32..100_000, 1u32..10_000,
                                       prop::collection::vec(0u64..1000, 0..8)), 1..20)
    ) {
        let text: String = rows
            .iter()
            .map(|(ts, i, o, h)| {
                format!("{{\"timestamp\": {ts}, \"input_length\": {i}, \"output_length\": {o}, \"hash_ids\": {h:?}}}\n")
            })
            .collect();
        let entries = parse_trace(&text, "prop").unwrap();
        prop_assert_eq!(entries.len(), rows.len());
        for (e, (ts, i, o, h)) in entries.iter().zip(&rows) {
            prop_assert_eq!(e.timestamp, f64::from(*ts));
            prop_assert_eq!(e.input_length, *i);
            prop_assert_eq!(e.output_length, *o);
            prop_assert_eq!(&e.hash_ids, h);
        }
    }

    #[test]
    fn percentiles_are_monotone_and_bounded(
        mut xs in prop::collection::vec(-1e6f64..1e6, 1..200),
        p in 0f64..100.0,
        q in 0f64..100.0,
    ) {
        let s = Summary::of(&mut xs).unwrap();
        let (lo, hi) = if p <= q { (p, q) } else { (q, p) };
        let a = percentile(&xs, lo).unwrap();
        let b = percentile(&xs, hi).unwrap();
        prop_assert!(a <= b + 1e-9);
        prop_assert!(s.min <= a && b <= s.max);
        prop_assert!(s.p50 <= s.p90 && s.p90 <= s.p99);
    }
}
