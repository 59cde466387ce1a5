//! The simulator's heap on glibc: transparent huge pages.
//!
//! A fleet of simulated replicas is gigabytes of small arrays (each replica's block pool
//! and prefix-cache table, the router's indexes) read at random, so most of those reads
//! miss the TLB as well as the cache. Backed by 2 MiB pages, the 1M-request run over a
//! thousand replicas takes about a fifth less CPU at the same peak memory (`docs/SIM.md`).
//!
//! Where the kernel's THP mode is `madvise` (the common default), only memory that asks
//! gets huge pages, and glibc asks for its heap only when `GLIBC_TUNABLES` holds
//! `glibc.malloc.hugetlb=1`, which it reads once, at start. So `strata sim` and `strata
//! plan` restart themselves once, at the very beginning, with that set (and
//! `mmap_threshold` raised, so that blocks up to 32 MiB, a replica's arrays among them,
//! come from that heap too). Nothing else changes: the same arguments, the same process
//! (an `exec`), the same report.
//!
//! No restart when the environment already sets `GLIBC_TUNABLES` (the operator's choice
//! stands), when `STRATA_SIM_HUGE_PAGES=0`, when the kernel has no THP or has it off, or on
//! another C library.

use std::ffi::OsStr;

/// What `strata sim` sets.
pub const TUNABLES: &str = "glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=33554432";

/// The kernel's THP switch.
pub const THP_ENABLED: &str = "/sys/kernel/mm/transparent_hugepage/enabled";

/// Turns the restart off when `0`.
pub const OPT_OUT: &str = "STRATA_SIM_HUGE_PAGES";

/// Whether to restart with [`TUNABLES`]: the environment's own `GLIBC_TUNABLES` and
/// [`OPT_OUT`], and the contents of [`THP_ENABLED`] (`None`: unreadable). The kernel
/// marks its mode in brackets (`always [madvise] never`).
pub fn should_restart(
    tunables: Option<&OsStr>,
    opt_out: Option<&OsStr>,
    thp_enabled: Option<&str>,
) -> bool {
    if tunables.is_some() || opt_out.is_some_and(|v| v == "0") {
        return false;
    }
    thp_enabled.is_some_and(|mode| mode.contains("[madvise]") || mode.contains("[always]"))
}

/// Restarts this process with [`TUNABLES`] when [`should_restart`] says so; returns
/// (and the run goes on as it is) when not, or when the restart fails.
pub fn restart_with_huge_pages() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        use std::os::unix::process::CommandExt;
        let thp = std::fs::read_to_string(THP_ENABLED).ok();
        let tunables = std::env::var_os("GLIBC_TUNABLES");
        let opt_out = std::env::var_os(OPT_OUT);
        if !should_restart(tunables.as_deref(), opt_out.as_deref(), thp.as_deref()) {
            return;
        }
        let Ok(exe) = std::env::current_exe() else {
            return;
        };
        let mut args = std::env::args_os();
        let arg0 = args.next().unwrap_or_else(|| exe.clone().into_os_string());
        // `exec` returns only on failure; the run then goes on without huge pages. Said
        // on stderr: logging is not set up yet, this early.
        let err = std::process::Command::new(&exe)
            .arg0(arg0)
            .args(args)
            .env("GLIBC_TUNABLES", TUNABLES)
            .exec();
        eprintln!("note: running without huge pages (restart failed: {err})");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restarts_only_where_the_kernel_gives_huge_pages_and_nobody_chose_otherwise() {
        let madvise = Some("always [madvise] never\n");
        let always = Some("[always] madvise never\n");
        let never = Some("always madvise [never]\n");
        assert!(should_restart(None, None, madvise));
        assert!(should_restart(None, None, always));
        assert!(should_restart(None, Some(OsStr::new("1")), madvise));
        assert!(!should_restart(None, None, never));
        assert!(!should_restart(None, None, None), "no THP in this kernel");
        assert!(
            !should_restart(Some(OsStr::new("glibc.malloc.arena_max=1")), None, madvise),
            "the operator's tunables stand (and the restarted process has them set)"
        );
        assert!(!should_restart(None, Some(OsStr::new("0")), madvise));
    }
}
