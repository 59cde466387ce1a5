//! Command-line arguments of `strata bench`, checked into a [`LoadConfig`].

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Subcommand, ValueEnum};

use crate::client::{ClientConfig, Endpoint, PromptMode};
use crate::error::BenchError;
use crate::load::{Arrival, LoadConfig, LoadShape, StopCondition};
use crate::report::Slo;
use crate::workload::{
    parse_trace, MultiTurnSpec, RandomSpec, SharedPrefixSpec, TraceSpec, Workload,
};

/// Requests sent when neither `--requests` nor `--duration` is given.
pub const DEFAULT_REQUESTS: u64 = 100;

/// `strata bench`: run a benchmark, or `strata bench compare` saved reports.
#[derive(Debug, Clone, Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct BenchArgs {
    /// `compare`: plot several saved reports side by side.
    #[command(subcommand)]
    pub command: Option<BenchCommand>,
    /// The benchmark to run when no subcommand is given.
    #[command(flatten)]
    pub run: RunArgs,
}

/// Subcommands of `strata bench`.
#[derive(Debug, Clone, Subcommand)]
pub enum BenchCommand {
    /// Compare saved JSON reports: print a table and draw comparison charts.
    Compare(CompareArgs),
}

/// `strata bench compare a.json b.json [--plot DIR]`.
#[derive(Debug, Clone, Args)]
pub struct CompareArgs {
    /// Reports written by `strata bench --output`.
    #[arg(required = true, num_args = 1..)]
    pub reports: Vec<PathBuf>,
    /// Directory for the comparison charts (SVG).
    #[arg(long, default_value = "bench-compare")]
    pub plot: PathBuf,
}

/// The workload names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum WorkloadKind {
    /// Independent requests, drawn lengths, no reuse.
    Random,
    /// Groups of requests sharing a long system prompt.
    SharedPrefix,
    /// Conversations resending their growing history.
    MultiTurn,
    /// Replay of a Mooncake-style JSONL trace (`--trace FILE`).
    Trace,
}

/// Flags of a benchmark run.
#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// Base URL of an OpenAI-compatible server.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub url: String,
    /// Model name to request; default: the first model the server lists.
    #[arg(long)]
    pub model: Option<String>,
    /// Workload shape.
    #[arg(long, value_enum, default_value = "random")]
    pub workload: WorkloadKind,
    /// Route to call.
    #[arg(long, value_enum, default_value = "completions")]
    pub endpoint: Endpoint,

    /// Open loop: sessions arriving per second.
    #[arg(long, value_parser = positive_f64, conflicts_with = "concurrency")]
    pub rate: Option<f64>,
    /// Gap distribution under --rate.
    #[arg(long, value_enum, default_value = "poisson")]
    pub arrival: Arrival,
    /// Closed loop: this many users, each sending when its last request ends (default 1
    /// when no --rate is given; a trace without it replays its timestamps).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub concurrency: Option<u32>,
    /// Under --rate or trace replay: most sessions in flight (arrivals wait).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_concurrency: Option<u32>,

    /// Stop issuing after this long (`90`, `90s`, `2m`).
    #[arg(long, value_parser = parse_duration, conflicts_with = "requests")]
    pub duration: Option<Duration>,
    /// Requests to send (every turn counts; default: 100, or the whole trace).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub requests: Option<u64>,

    /// Requests sent (with the same load shape) before measuring, and not counted.
    #[arg(long, default_value_t = 0)]
    pub warmup: u64,

    /// Write the JSON report here.
    #[arg(long)]
    pub output: Option<PathBuf>,
    /// Draw plots (SVG) into this directory.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Name of this run in reports and comparisons (default: WORKLOAD@URL).
    #[arg(long)]
    pub label: Option<String>,
    /// Objectives for goodput, e.g. `ttft=500ms,itl=50ms` (also `tpot`, `e2e`; a bare
    /// number is milliseconds). `itl` must hold for every gap of a request.
    #[arg(long, value_parser = parse_slo)]
    pub slo: Option<Slo>,

    /// Prompt tokens (random workload).
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..))]
    pub input_len: u32,
    /// Output tokens per request (`max_tokens`).
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..))]
    pub output_len: u32,
    /// Spread of drawn lengths around --input-len/--output-len, in [0, 1).
    #[arg(long, default_value_t = 0.0, value_parser = range_ratio)]
    pub range_ratio: f64,

    /// shared-prefix: number of distinct system prompts.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..))]
    pub groups: u32,
    /// shared-prefix: questions per system prompt.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    pub prompts_per_group: u32,
    /// shared-prefix and multi-turn: system prompt tokens.
    #[arg(long, default_value_t = 2048)]
    pub system_len: u32,
    /// shared-prefix: question tokens; multi-turn: tokens per user message.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    pub question_len: u32,

    /// multi-turn: user turns per conversation.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    pub turns: u32,
    /// multi-turn: pause between a reply and the next user message (`0`, `500ms`, `2s`).
    #[arg(long, default_value = "0", value_parser = parse_duration)]
    pub think_time: Duration,

    /// trace: the Mooncake-style JSONL file.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// trace: replay speed factor (2 = twice as fast as recorded).
    #[arg(long, default_value_t = 1.0, value_parser = positive_f64)]
    pub speed: f64,
    /// trace: tokens per `hash_ids` block.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..))]
    pub block_size: u32,

    /// Send prompts as token ids on /v1/completions (exact lengths).
    #[arg(long)]
    pub prompt_token_ids: bool,
    /// Do not send `ignore_eos: true` (replies may stop before --output-len).
    #[arg(long)]
    pub no_ignore_eos: bool,
    /// Open a fresh connection for every request.
    #[arg(long)]
    pub no_keepalive: bool,
    /// Bound on one request, send to end of stream.
    #[arg(long, default_value = "600s", value_parser = parse_duration)]
    pub timeout: Duration,
    /// Seed for lengths, content and arrivals (default: random, recorded in the report).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Bearer token for servers that require one.
    #[arg(long, env = "STRATA_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// No progress bar.
    #[arg(long, short)]
    pub quiet: bool,
}

impl RunArgs {
    /// Checks the flags together and builds the run's configuration.
    pub fn load_config(&self, model: String, seed: u64) -> Result<LoadConfig, BenchError> {
        self.check_combinations()?;
        let workload = self.build_workload()?;
        let load = self.load_shape(&workload)?;
        let stop = self.stop_condition(matches!(workload, Workload::Trace(_)));
        let label = self
            .label
            .clone()
            .unwrap_or_else(|| format!("{}@{}", workload.name(), self.url));
        Ok(LoadConfig {
            client: self.client_config(model),
            workload,
            load,
            stop,
            seed,
            slo: self.slo.unwrap_or_default(),
            label,
        })
    }

    /// Refuses flags that contradict each other or the workload, before anything is read.
    fn check_combinations(&self) -> Result<(), BenchError> {
        let bad = |m: &str| Err(BenchError::InvalidArgs(m.to_string()));
        if self.workload == WorkloadKind::Trace && self.trace.is_none() {
            return bad("--workload trace needs --trace FILE (Mooncake-style JSONL)");
        }
        if self.workload != WorkloadKind::Trace && self.trace.is_some() {
            return bad("--trace is only used with --workload trace");
        }
        if self.workload == WorkloadKind::Trace && self.rate.is_some() {
            return bad("a trace replays its own timestamps: use --speed instead of --rate");
        }
        if self.prompt_token_ids && self.endpoint == Endpoint::Chat {
            return bad("--prompt-token-ids needs --endpoint completions");
        }
        if self.prompt_token_ids && self.workload == WorkloadKind::MultiTurn {
            return bad("--prompt-token-ids cannot carry multi-turn history (replies are text)");
        }
        if self.max_concurrency.is_some() && self.concurrency.is_some() {
            return bad(
                "--max-concurrency caps --rate or trace replay; with --concurrency it is redundant",
            );
        }
        if self.workload == WorkloadKind::SharedPrefix && self.system_len == 0 {
            return bad("shared-prefix needs --system-len of at least 1");
        }
        Ok(())
    }

    /// The workload from its flags; a trace is read and parsed here.
    fn build_workload(&self) -> Result<Workload, BenchError> {
        Ok(match self.workload {
            WorkloadKind::Random => Workload::Random(RandomSpec {
                input_len: self.input_len,
                output_len: self.output_len,
                range_ratio: self.range_ratio,
            }),
            WorkloadKind::SharedPrefix => Workload::SharedPrefix(SharedPrefixSpec {
                groups: self.groups,
                prompts_per_group: self.prompts_per_group,
                system_len: self.system_len,
                question_len: self.question_len,
                output_len: self.output_len,
            }),
            WorkloadKind::MultiTurn => Workload::MultiTurn(MultiTurnSpec {
                turns: self.turns,
                system_len: self.system_len,
                user_len: self.question_len,
                output_len: self.output_len,
                think_time: self.think_time,
            }),
            WorkloadKind::Trace => {
                let path = self.trace.as_ref().ok_or_else(|| {
                    BenchError::InvalidArgs("--workload trace needs --trace FILE".into())
                })?;
                let text = std::fs::read_to_string(path).map_err(|source| BenchError::Io {
                    path: path.clone(),
                    source,
                })?;
                let source = path.display().to_string();
                Workload::Trace(TraceSpec {
                    entries: parse_trace(&text, &source)?,
                    source,
                    block_size: self.block_size,
                    speed: self.speed,
                })
            }
        })
    }

    /// Open loop (`--rate`), closed loop (`--concurrency`, one user by default), or a
    /// trace's recorded timestamps.
    fn load_shape(&self, workload: &Workload) -> Result<LoadShape, BenchError> {
        let max_concurrency = self.max_concurrency.map(|n| n as usize);
        Ok(match (self.rate, self.concurrency, workload) {
            (Some(rate), _, _) => LoadShape::Rate {
                rate,
                arrival: self.arrival,
                max_concurrency,
            },
            (None, Some(users), _) => LoadShape::Concurrency {
                users: users as usize,
            },
            (None, None, Workload::Trace(_)) => LoadShape::Recorded { max_concurrency },
            (None, None, _) => {
                if max_concurrency.is_some() {
                    return Err(BenchError::InvalidArgs(
                        "--max-concurrency needs --rate (or a trace)".to_string(),
                    ));
                }
                LoadShape::Concurrency { users: 1 }
            }
        })
    }

    /// When to stop issuing: `--requests`, `--duration`, the end of a trace, or
    /// [`DEFAULT_REQUESTS`].
    fn stop_condition(&self, is_trace: bool) -> StopCondition {
        StopCondition {
            max_requests: match (self.requests, self.duration) {
                (Some(n), _) => Some(n),
                (None, Some(_)) => None,
                (None, None) if is_trace => None,
                (None, None) => Some(DEFAULT_REQUESTS),
            },
            duration: self.duration,
        }
    }

    /// The HTTP side of the run.
    fn client_config(&self, model: String) -> ClientConfig {
        ClientConfig {
            url: self.url.clone(),
            model,
            endpoint: self.endpoint,
            prompt_mode: if self.prompt_token_ids {
                PromptMode::TokenIds
            } else {
                PromptMode::Text
            },
            ignore_eos: !self.no_ignore_eos,
            keepalive: !self.no_keepalive,
            timeout: self.timeout,
            api_key: self.api_key.clone(),
        }
    }
}

/// A positive, finite number.
fn positive_f64(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a number"))?;
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(format!("must be a positive number, got `{s}`"))
    }
}

/// A number in [0, 1).
fn range_ratio(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a number"))?;
    if (0.0..1.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("must be in [0, 1), got `{s}`"))
    }
}

/// `90`, `90s`, `1.5m`, `500ms`, `1h`: a bare number is seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let secs = parse_with_unit(s, 1.0)?;
    Duration::try_from_secs_f64(secs).map_err(|e| format!("`{s}`: {e}"))
}

/// A non-negative number with an optional unit (`us`, `ms`, `s`, `m`, `h`), in units of
/// `unit_secs` seconds; a bare number is already in those units.
fn parse_with_unit(s: &str, unit_secs: f64) -> Result<f64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a duration (try `500ms`, `30s`, `2m`)"))?;
    let secs = match unit.trim() {
        "" => return Ok(v),
        "us" => 1e-6,
        "ms" => 1e-3,
        "s" => 1.0,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        other => {
            return Err(format!(
                "unknown unit `{other}` in `{s}` (use ms, s, m or h)"
            ))
        }
    };
    // Exact for whole numbers of the target unit: 8008ms is 8008.0, not 8007.999...
    let ratio = secs / unit_secs;
    Ok(if ratio >= 1.0 {
        v * ratio.round()
    } else {
        v / (unit_secs / secs).round()
    })
}

/// `ttft=500ms,itl=50ms,tpot=..,e2e=..`; bare numbers are milliseconds.
pub fn parse_slo(s: &str) -> Result<Slo, String> {
    let mut slo = Slo::default();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (key, value) = part
            .split_once('=')
            .ok_or_else(|| format!("`{part}` is not key=value (e.g. ttft=500ms)"))?;
        let ms = parse_with_unit(value, 1e-3)?;
        if ms <= 0.0 {
            return Err(format!("objective `{part}` must be positive"));
        }
        let slot = match key.trim() {
            "ttft" => &mut slo.ttft_ms,
            "itl" => &mut slo.itl_ms,
            "tpot" => &mut slo.tpot_ms,
            "e2e" => &mut slo.e2e_ms,
            other => {
                return Err(format!(
                    "unknown objective `{other}` (use ttft, itl, tpot or e2e)"
                ))
            }
        };
        *slot = Some(ms);
    }
    if slo.is_empty() {
        return Err("give at least one objective, e.g. ttft=500ms,itl=50ms".into());
    }
    Ok(slo)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        bench: BenchArgs,
    }

    fn parse(args: &[&str]) -> Result<BenchArgs, String> {
        let mut argv = vec!["bench"];
        argv.extend_from_slice(args);
        Cli::try_parse_from(argv)
            .map(|c| c.bench)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn durations_and_slos_parse() {
        assert_eq!(parse_duration("90").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert!(parse_duration("fast").is_err());
        assert!(parse_duration("3 weeks").is_err());
        let slo = parse_slo("ttft=0.5s,itl=50").unwrap();
        assert_eq!(slo.ttft_ms, Some(500.0));
        assert_eq!(slo.itl_ms, Some(50.0));
        assert!(parse_slo("latency=5")
            .unwrap_err()
            .contains("unknown objective"));
        assert!(parse_slo("ttft").is_err());
        assert!(parse_slo("").is_err());
    }

    #[test]
    fn defaults_make_a_random_closed_loop_run() {
        let a = parse(&["--model", "m"]).unwrap();
        assert!(a.command.is_none());
        let c = a.run.load_config("m".into(), 1).unwrap();
        assert_eq!(c.load, LoadShape::Concurrency { users: 1 });
        assert_eq!(c.stop.max_requests, Some(DEFAULT_REQUESTS));
        assert_eq!(c.workload.name(), "random");
        assert!(c.client.ignore_eos && c.client.keepalive);
    }

    #[test]
    fn rate_and_duration_shape_the_load() {
        let a = parse(&["--rate", "5", "--arrival", "constant", "--duration", "10s"]).unwrap();
        let c = a.run.load_config("m".into(), 1).unwrap();
        assert_eq!(
            c.load,
            LoadShape::Rate {
                rate: 5.0,
                arrival: Arrival::Constant,
                max_concurrency: None
            }
        );
        assert_eq!(c.stop.max_requests, None);
        assert_eq!(c.stop.duration, Some(Duration::from_secs(10)));
    }

    #[test]
    fn bad_flag_values_are_rejected_with_clear_messages() {
        let e = parse(&["--workload", "bursty"]).unwrap_err();
        assert!(
            e.contains("invalid value 'bursty'") && e.contains("shared-prefix"),
            "{e}"
        );
        let e = parse(&["--concurrency", "0"]).unwrap_err();
        assert!(e.contains("--concurrency"), "{e}");
        let e = parse(&["--rate=-1"]).unwrap_err();
        assert!(e.contains("positive"), "{e}");
        let e = parse(&["--rate", "1", "--concurrency", "2"]).unwrap_err();
        assert!(e.contains("cannot be used with"), "{e}");
        let e = parse(&["--requests", "5", "--duration", "5"]).unwrap_err();
        assert!(e.contains("cannot be used with"), "{e}");
        let e = parse(&["--arrival", "bursty"]).unwrap_err();
        assert!(e.contains("poisson"), "{e}");
        let e = parse(&["--slo", "ttft=fast"]).unwrap_err();
        assert!(e.contains("not a duration"), "{e}");
        let e = parse(&["--range-ratio", "1.5"]).unwrap_err();
        assert!(e.contains("[0, 1)"), "{e}");
    }

    #[test]
    fn inconsistent_flags_are_rejected() {
        let check = |args: &[&str], want: &str| {
            let a = parse(args).unwrap();
            let e = a.run.load_config("m".into(), 1).unwrap_err().to_string();
            assert!(e.contains(want), "{args:?}: {e}");
        };
        check(&["--workload", "trace"], "needs --trace");
        check(&["--trace", "x.jsonl"], "only used with --workload trace");
        check(
            &["--prompt-token-ids", "--endpoint", "chat"],
            "--endpoint completions",
        );
        check(
            &["--prompt-token-ids", "--workload", "multi-turn"],
            "multi-turn",
        );
        check(&["--max-concurrency", "2"], "needs --rate");
        check(
            &["--workload", "trace", "--trace", "/nonexistent/t.jsonl"],
            "/nonexistent/t.jsonl",
        );
    }

    #[test]
    fn works_as_a_subcommand_of_the_strata_binary() {
        #[derive(Debug, Parser)]
        struct Strata {
            #[command(subcommand)]
            command: Command,
        }
        #[derive(Debug, clap::Subcommand)]
        enum Command {
            Bench(BenchArgs),
        }
        let Command::Bench(b) = Strata::try_parse_from(["strata", "bench", "--concurrency", "2"])
            .unwrap()
            .command;
        assert!(b.command.is_none());
        assert_eq!(b.run.concurrency, Some(2));
        let Command::Bench(b) = Strata::try_parse_from(["strata", "bench", "compare", "a.json"])
            .unwrap()
            .command;
        assert!(matches!(b.command, Some(BenchCommand::Compare(_))));
        let e = Strata::try_parse_from(["strata", "bench", "--workload", "nope"]).unwrap_err();
        assert!(e.to_string().contains("possible values"), "{e}");
    }

    #[test]
    fn compare_subcommand_parses() {
        let a = parse(&["compare", "a.json", "b.json", "--plot", "out"]).unwrap();
        match a.command {
            Some(BenchCommand::Compare(c)) => {
                assert_eq!(c.reports.len(), 2);
                assert_eq!(c.plot, PathBuf::from("out"));
            }
            other => panic!("{other:?}"),
        }
        assert!(parse(&["compare"]).is_err());
    }
}
