//! `strata sim` and `strata plan` without the rest of the `strata` binary, for release
//! builds of the simulator alone (the scale measurements in `docs/SIM.md`):
//! `cargo run --release -p strata-sim --example sim -- sim --replicas 1000 ...`.

use clap::Parser;

#[derive(Parser)]
enum Cli {
    /// `strata sim`.
    Sim(Box<strata_sim::SimArgs>),
    /// `strata plan`.
    Plan(Box<strata_sim::PlanArgs>),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    strata_sim::heap::restart_with_huge_pages();
    let result = match cli {
        Cli::Sim(a) => strata_sim::run_sim(*a),
        Cli::Plan(a) => strata_sim::run_plan(*a),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
