//! Budget periods as pure policy: UTC calendar windows (`daily`, `weekly` from Monday,
//! `monthly` from the 1st), the spend of one budget holder (tenant, key or user) per
//! window, and whether a budget is spent — state, input and `now` in, answer out, so tests
//! and the simulator roll a period over without waiting for it.
//!
//! A holder's spend is kept for all three windows at once (and for its lifetime), so a
//! budget whose period changes finds the right figure at once. A window whose start is
//! not the current period's start belongs to a past period and counts as zero spend.

use serde::{Deserialize, Serialize};

const DAY: i64 = 86_400;

/// How often a budget resets. No period: a lifetime cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Period {
    Daily,
    Weekly,
    Monthly,
}

impl Period {
    pub const ALL: [Period; 3] = [Period::Daily, Period::Weekly, Period::Monthly];

    pub fn as_str(self) -> &'static str {
        match self {
            Period::Daily => "daily",
            Period::Weekly => "weekly",
            Period::Monthly => "monthly",
        }
    }

    pub fn parse(s: &str) -> Option<Period> {
        Period::ALL.into_iter().find(|p| p.as_str() == s)
    }

    fn index(self) -> usize {
        self as usize
    }

    /// Unix seconds of the start of the period holding `now` (UTC).
    pub fn start(self, now: i64) -> i64 {
        let day = now.div_euclid(DAY);
        match self {
            Period::Daily => day * DAY,
            // 1970-01-01 was a Thursday: day 0 is 3 days after a Monday.
            Period::Weekly => (day - (day + 3).rem_euclid(7)) * DAY,
            Period::Monthly => {
                let (y, m, _) = civil_from_days(day);
                days_from_civil(y, m, 1) * DAY
            }
        }
    }

    /// Unix seconds of the start of the next period after the one holding `now`.
    pub fn end(self, now: i64) -> i64 {
        match self {
            Period::Daily => self.start(now) + DAY,
            Period::Weekly => self.start(now) + 7 * DAY,
            Period::Monthly => {
                let (y, m, _) = civil_from_days(now.div_euclid(DAY));
                let (y, m) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
                days_from_civil(y, m, 1) * DAY
            }
        }
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (i64::from(m) + 9) % 12;
    let doy = (153 * mp + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The date of a day count since 1970-01-01.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// Spend in one period window: the window's start and the micro-dollars spent since.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Window {
    pub start: i64,
    pub micros: i64,
}

/// A budget holder's spend: lifetime and per period window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Spend {
    pub lifetime: i64,
    /// Indexed like [`Period::ALL`].
    pub windows: [Window; 3],
}

impl Spend {
    /// Adds `cost` spent at `ts` to the lifetime and to each period window: a window of an
    /// earlier period restarts at this one; a cost from before a window's start (a late
    /// row) counts only in the lifetime.
    pub fn add(&mut self, ts: i64, cost: i64) {
        self.lifetime += cost;
        for p in Period::ALL {
            let start = p.start(ts);
            let w = &mut self.windows[p.index()];
            if start == w.start {
                w.micros += cost;
            } else if start > w.start {
                *w = Window {
                    start,
                    micros: cost,
                };
            }
        }
    }

    /// Sets one window from a stored row when it is at least as new (the larger figure of
    /// the same window wins: rows may still be queued for the store).
    pub fn merge_window(&mut self, period: Period, stored: Window) {
        let w = &mut self.windows[period.index()];
        if stored.start > w.start {
            *w = stored;
        } else if stored.start == w.start {
            w.micros = w.micros.max(stored.micros);
        }
    }

    /// The spend that counts against a budget of `period` at `now`: the current window's
    /// (zero once its period is over), or the lifetime spend without a period.
    pub fn spent(&self, period: Option<Period>, now: i64) -> i64 {
        match period {
            None => self.lifetime,
            Some(p) => {
                let w = self.windows[p.index()];
                if w.start == p.start(now) {
                    w.micros
                } else {
                    0
                }
            }
        }
    }

    pub fn window(&self, period: Period) -> Window {
        self.windows[period.index()]
    }
}

/// A spending cap: micro-dollars per period (or for the holder's lifetime).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    pub limit_micros: i64,
    pub period: Option<Period>,
}

/// A spent budget: what was spent in the period, the cap, and when it resets (`None` for
/// a lifetime cap).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exhausted {
    pub spent_micros: i64,
    pub limit_micros: i64,
    pub resets_at: Option<i64>,
}

/// Whether `budget` is spent by `spend` at `now` (spend at or above the cap).
pub fn exhausted(budget: Budget, spend: &Spend, now: i64) -> Option<Exhausted> {
    let spent = spend.spent(budget.period, now);
    (spent >= budget.limit_micros).then(|| Exhausted {
        spent_micros: spent,
        limit_micros: budget.limit_micros,
        resets_at: budget.period.map(|p| p.end(now)),
    })
}

/// The same in words, naming the holder (`API key 0a1b...`, `tenant \`team-a\``).
pub fn describe(who: &str, e: &Exhausted, period: Option<Period>) -> String {
    let base = format!(
        "Budget exceeded for {who}: spent ${:.6} of ${:.6}",
        e.spent_micros as f64 / 1e6,
        e.limit_micros as f64 / 1e6
    );
    match (period, e.resets_at) {
        (Some(p), Some(at)) => {
            format!("{base} this {} period; it resets at unix {at}.", p.as_str())
        }
        _ => format!("{base}."),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // 2026-12-03 (a Thursday) 04:00 UTC.
    const THU: i64 = 1_796_270_400;

    #[test]
    fn calendar_boundaries_are_utc() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(civil_from_days(days_from_civil(2024, 2, 29)), (2024, 2, 29));
        assert_eq!(civil_from_days(THU / DAY), (2026, 12, 3));
        assert_eq!(Period::Daily.start(THU), THU - 4 * 3600);
        // Monday 2026-11-30.
        assert_eq!(
            Period::Weekly.start(THU),
            days_from_civil(2026, 11, 30) * DAY
        );
        assert_eq!(Period::Weekly.end(THU), days_from_civil(2026, 12, 7) * DAY);
        assert_eq!(
            Period::Monthly.start(THU),
            days_from_civil(2026, 12, 1) * DAY
        );
        assert_eq!(Period::Monthly.end(THU), days_from_civil(2027, 1, 1) * DAY);
        let feb = days_from_civil(2028, 2, 10) * DAY;
        assert_eq!(Period::Monthly.end(feb), days_from_civil(2028, 3, 1) * DAY);
        // A Monday starts its own week.
        let mon = days_from_civil(2026, 11, 30) * DAY;
        assert_eq!(Period::Weekly.start(mon), mon);
        assert_eq!(Period::Weekly.start(mon - 1), mon - 7 * DAY);
        for p in Period::ALL {
            assert_eq!(Period::parse(p.as_str()), Some(p));
            assert!(p.start(THU) <= THU && THU < p.end(THU));
        }
        assert_eq!(Period::parse("hourly"), None);
    }

    #[test]
    fn daily_budget_rolls_over_at_midnight() {
        let budget = Budget {
            limit_micros: 100,
            period: Some(Period::Daily),
        };
        let mut s = Spend::default();
        s.add(THU, 60);
        assert!(exhausted(budget, &s, THU).is_none());
        s.add(THU + 10, 40);
        let e = exhausted(budget, &s, THU + 20).unwrap();
        assert_eq!(e.spent_micros, 100);
        assert_eq!(e.resets_at, Some(Period::Daily.end(THU)));
        // One second before midnight: still spent. At midnight: a new day, nothing spent.
        let midnight = Period::Daily.end(THU);
        assert!(exhausted(budget, &s, midnight - 1).is_some());
        assert!(exhausted(budget, &s, midnight).is_none());
        assert_eq!(s.spent(Some(Period::Daily), midnight), 0);
        // The lifetime keeps counting; the week and month too.
        s.add(midnight + 5, 30);
        assert_eq!(s.spent(None, midnight + 5), 130);
        assert_eq!(s.spent(Some(Period::Daily), midnight + 5), 30);
        assert_eq!(s.spent(Some(Period::Weekly), midnight + 5), 130);
        assert_eq!(s.spent(Some(Period::Monthly), midnight + 5), 130);
        let lifetime = Budget {
            limit_micros: 100,
            period: None,
        };
        assert!(exhausted(lifetime, &s, midnight + 5)
            .unwrap()
            .resets_at
            .is_none());
    }

    #[test]
    fn weekly_and_monthly_roll_over_and_late_rows_count_only_in_the_lifetime() {
        let mut s = Spend::default();
        s.add(THU, 10);
        let next_week = Period::Weekly.end(THU);
        assert_eq!(s.spent(Some(Period::Weekly), next_week - 1), 10);
        assert_eq!(s.spent(Some(Period::Weekly), next_week), 0);
        let next_month = Period::Monthly.end(THU);
        assert_eq!(s.spent(Some(Period::Monthly), next_month), 0);
        s.add(next_month, 5);
        s.add(THU, 7); // a late row of the previous month
        assert_eq!(s.spent(Some(Period::Monthly), next_month), 5);
        assert_eq!(s.lifetime, 22);
    }

    #[test]
    fn merging_stored_windows_keeps_the_newer_and_larger() {
        let mut s = Spend::default();
        s.add(THU, 10);
        let day = Period::Daily.start(THU);
        s.merge_window(
            Period::Daily,
            Window {
                start: day,
                micros: 4,
            },
        );
        assert_eq!(s.window(Period::Daily).micros, 10);
        s.merge_window(
            Period::Daily,
            Window {
                start: day,
                micros: 25,
            },
        );
        assert_eq!(s.window(Period::Daily).micros, 25);
        s.merge_window(
            Period::Daily,
            Window {
                start: day - DAY,
                micros: 99,
            },
        );
        assert_eq!(
            s.window(Period::Daily).micros,
            25,
            "an older window is ignored"
        );
        s.merge_window(
            Period::Daily,
            Window {
                start: day + DAY,
                micros: 3,
            },
        );
        assert_eq!(
            s.window(Period::Daily),
            Window {
                start: day + DAY,
                micros: 3
            }
        );
    }

    #[test]
    fn describe_names_holder_and_reset() {
        let e = Exhausted {
            spent_micros: 2_000_000,
            limit_micros: 1_000_000,
            resets_at: Some(5),
        };
        let text = describe("tenant `a`", &e, Some(Period::Daily));
        assert!(text.contains("tenant `a`") && text.contains("daily") && text.contains("unix 5"));
    }
}
