//! The peers against berth, as ratios: each peer's run divided by berth's
//! run of the same scenario in the same report.

use serde::Serialize;

use super::Run;

/// One peer's figures over berth's, for one scenario. A ratio above 1 means
/// the peer took more (time, requests) than berth; `None` where either side
/// has no figure (a peer that was not driven, a gap a peer has no steps
/// for).
#[derive(Debug, Serialize, PartialEq)]
pub struct Ratio {
    pub scenario: String,
    pub drainer: String,
    /// Peer wall time over berth's.
    pub wall: Option<f64>,
    /// Peer wall time over berth's floor for the scenario.
    pub wall_over_floor: Option<f64>,
    /// Peer requests per drained pod over berth's.
    pub api_requests_per_pod: Option<f64>,
    /// Reads the peer sent while draining, minus berth's.
    pub extra_reads_during_drain: i64,
}

/// The name berth's own runs carry in [`Run::drainer`].
pub const BERTH: &str = "berth";

/// A [`Ratio`] for every run that is not berth's and has a berth run of the
/// same scenario to compare with, in report order.
pub fn ratios(runs: &[Run]) -> Vec<Ratio> {
    runs.iter()
        .filter(|r| r.drainer != BERTH)
        .filter_map(|peer| {
            let base = runs
                .iter()
                .find(|r| r.drainer == BERTH && r.scenario == peer.scenario)?;
            Some(Ratio {
                scenario: peer.scenario.clone(),
                drainer: peer.drainer.clone(),
                wall: over(peer.wall_seconds, base.wall_seconds),
                wall_over_floor: over(peer.wall_seconds, Some(base.floor_seconds)),
                api_requests_per_pod: over(
                    (peer.api_requests_per_pod > 0.0).then_some(peer.api_requests_per_pod),
                    Some(base.api_requests_per_pod),
                ),
                extra_reads_during_drain: i64::from(peer.reads_during_drain)
                    - i64::from(base.reads_during_drain),
            })
        })
        .collect()
}

/// `a / b` rounded to two decimals, when both exist and `b` is not zero.
fn over(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    let (a, b) = (a?, b?);
    (b > 0.0).then(|| (a / b * 100.0).round() / 100.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(scenario: &str, drainer: &str, wall: Option<f64>, per_pod: f64, reads: u32) -> Run {
        Run {
            scenario: scenario.into(),
            drainer: drainer.into(),
            wall_seconds: wall,
            floor_seconds: 30.0,
            api_requests_per_pod: per_pod,
            reads_during_drain: reads,
            ..Default::default()
        }
    }

    #[test]
    fn each_peer_is_divided_by_berth_in_the_same_scenario() {
        let runs = [
            run("stateful", BERTH, Some(30.0), 8.0, 0),
            run("stateless", BERTH, Some(2.0), 2.0, 0),
            run("stateful", "kubectl drain", Some(3.9), 3.3, 22),
            run("stateful", "mcm", Some(48.0), 4.4, 27),
        ];
        let got = ratios(&runs);
        assert_eq!(got.len(), 2, "berth's own runs are not compared: {got:?}");
        assert_eq!(got[0].drainer, "kubectl drain");
        assert_eq!(got[0].wall, Some(0.13));
        assert_eq!(got[0].api_requests_per_pod, Some(0.41));
        assert_eq!(got[0].extra_reads_during_drain, 22);
        assert_eq!(got[1].wall, Some(1.6));
        assert_eq!(got[1].wall_over_floor, Some(1.6));
        assert_eq!(got[1].api_requests_per_pod, Some(0.55));
    }

    #[test]
    fn a_peer_that_was_not_driven_has_no_ratios() {
        let runs = [
            run("stateful", BERTH, Some(30.0), 8.0, 0),
            run("stateful", "mcm", None, 0.0, 0),
        ];
        let got = ratios(&runs);
        assert_eq!(got[0].wall, None);
        assert_eq!(got[0].wall_over_floor, None);
        assert_eq!(got[0].api_requests_per_pod, None);
    }

    #[test]
    fn without_a_berth_run_of_the_scenario_nothing_is_compared() {
        let runs = [run("stateful", "kubectl drain", Some(3.9), 3.3, 22)];
        assert!(ratios(&runs).is_empty());
        let zero_base = [
            run("stateful", BERTH, Some(0.0), 0.0, 0),
            run("stateful", "kubectl drain", Some(3.9), 3.3, 22),
        ];
        assert_eq!(ratios(&zero_base)[0].wall, None, "no division by zero");
    }
}
