//! The controller's load signal inside `strata up`, read from the router's scraper rather
//! than by a second scrape of every replica: the router reads each `/metrics` page every
//! 50 ms and keeps it whole ([`Router::load_sample`]), so the controller and the dashboard
//! reuse that one reading.

use std::time::Duration;

use strata_controller::autoscale::Load;
use strata_controller::driver::ReplicaInfo;
use strata_controller::signals::{LoadAggregator, SignalSource};
use strata_router::Router;

/// A [`SignalSource`] over the router's last reading of each replica. A replica whose page
/// is older than `max_age` (or never read) makes the tick incomplete, as a failed scrape
/// would.
pub struct RouterSignals {
    router: Router,
    max_age: Duration,
    aggregator: LoadAggregator,
    last_partial: Option<Load>,
}

impl RouterSignals {
    pub fn new(router: Router, max_age: Duration) -> RouterSignals {
        RouterSignals {
            router,
            max_age,
            aggregator: LoadAggregator::default(),
            last_partial: None,
        }
    }
}

impl SignalSource for RouterSignals {
    async fn collect(&mut self, ready: &[ReplicaInfo]) -> Option<Load> {
        let samples: Vec<_> = ready
            .iter()
            .map(|r| {
                let load = self
                    .router
                    .load_sample(&r.url)
                    .filter(|(_, age)| *age <= self.max_age)
                    .map(|(load, _)| load);
                (r.id.as_str(), load)
            })
            .collect();
        match self
            .aggregator
            .aggregate(samples.iter().map(|(id, l)| (*id, l.as_deref())))
        {
            Ok(load) => {
                self.last_partial = None;
                Some(load)
            }
            Err(partial) => {
                self.last_partial = partial;
                None
            }
        }
    }

    fn partial(&self) -> Option<Load> {
        self.last_partial
    }
}
