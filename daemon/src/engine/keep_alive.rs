//! Residency's decisions on plain data: when a model's keep-alive runs
//! out, which model goes first to make room (the least recently used that
//! is not pinned), and when a model cannot fit at all. `residency` holds the
//! models and carries these out; the rules are unit-tested here.

use mlxbc_shared::KeepAlive;
use std::time::{Duration, Instant};

/// A resident model's clock and size.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    /// MLX memory the load took.
    pub memory_bytes: u64,
    pub keep_alive: KeepAlive,
    pub last_used: Instant,
}

impl Clock {
    /// Kept until unloaded by name (`keep_alive: forever`).
    pub fn pinned(&self) -> bool {
        self.keep_alive == KeepAlive::Forever
    }

    /// When its keep-alive runs out (never for a pinned model).
    pub fn expires_at(&self) -> Option<Instant> {
        match self.keep_alive {
            KeepAlive::Forever => None,
            // A keep-alive past what an Instant can hold (a client may send
            // u64::MAX seconds) never expires; `+` would panic.
            KeepAlive::Seconds(s) => self.last_used.checked_add(Duration::from_secs(s)),
        }
    }
}

/// Models whose keep-alive has run out at `now`, by name.
pub fn expired<'a>(clocks: impl IntoIterator<Item = (&'a String, &'a Clock)>, now: Instant) -> Vec<String> {
    let mut names: Vec<String> =
        clocks.into_iter().filter(|(_, c)| c.expires_at().is_some_and(|t| t <= now)).map(|(n, _)| n.clone()).collect();
    names.sort();
    names
}

/// How long from `now` until the next keep-alive runs out.
pub fn next_expiry<'a>(clocks: impl IntoIterator<Item = (&'a String, &'a Clock)>, now: Instant) -> Option<Duration> {
    clocks.into_iter().filter_map(|(_, c)| c.expires_at()).min().map(|t| t.saturating_duration_since(now))
}

/// The least recently used model that may be unloaded.
pub fn least_recent_unpinned<'a>(clocks: impl IntoIterator<Item = (&'a String, &'a Clock)>) -> Option<String> {
    clocks.into_iter().filter(|(_, c)| !c.pinned()).min_by_key(|(_, c)| c.last_used).map(|(n, _)| n.clone())
}

/// Why one more model cannot be made resident.
#[derive(Debug, PartialEq, Eq)]
pub enum NoRoom {
    /// It needs more than the whole budget.
    OverBudget,
    /// Only pinned models are left, and it does not fit beside them (their
    /// names, and the bytes they use).
    Pinned { pinned: Vec<String>, used: u64 },
}

/// The models to unload, least recently used first, so that one more model
/// of `need` bytes fits both `max_loaded` and `budget` bytes.
pub fn make_room<'a>(
    clocks: impl IntoIterator<Item = (&'a String, &'a Clock)>,
    need: u64,
    budget: u64,
    max_loaded: usize,
) -> Result<Vec<String>, NoRoom> {
    if need > budget {
        return Err(NoRoom::OverBudget);
    }
    let mut left: Vec<(&String, &Clock)> = clocks.into_iter().collect();
    let mut victims = Vec::new();
    loop {
        let used: u64 = left.iter().map(|(_, c)| c.memory_bytes).sum();
        if left.len() < max_loaded && used + need <= budget {
            return Ok(victims);
        }
        let Some(victim) = least_recent_unpinned(left.iter().copied()) else {
            let mut pinned: Vec<String> = left.iter().map(|(n, _)| n.to_string()).collect();
            pinned.sort();
            return Err(NoRoom::Pinned { pinned, used });
        };
        left.retain(|(n, _)| **n != victim);
        victims.push(victim);
    }
}

/// Room for a draft model of `need` bytes beside its target, which uses
/// `own` bytes (its draft models' included; `drafts`: theirs, the least
/// recently used first) among `others`: how many of the target's drafts
/// to give up, oldest first, then which other models to unload. Another
/// model is unloaded only where giving up every older draft is not enough.
pub fn make_room_for_draft<'a>(
    others: impl IntoIterator<Item = (&'a String, &'a Clock)>,
    need: u64,
    own: u64,
    drafts: &[u64],
    budget: u64,
) -> Result<(usize, Vec<String>), NoRoom> {
    let others: Vec<(&String, &Clock)> = others.into_iter().collect();
    let mut own = own;
    for given_up in 0..=drafts.len() {
        let room = make_room(others.iter().copied(), need, budget.saturating_sub(own), usize::MAX);
        match room {
            Ok(victims) if victims.is_empty() => return Ok((given_up, victims)),
            _ if given_up < drafts.len() => own = own.saturating_sub(drafts[given_up]),
            room => return room.map(|victims| (given_up, victims)),
        }
    }
    unreachable!("the last pass returns")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn a_new_draft_takes_the_room_of_its_targets_older_drafts_before_another_models() {
        let now = Instant::now() + Duration::from_secs(1000);
        let others = resident(&[("bystander", 100, Some(300), 50)], now);
        let mib = |m: u64| m << 20;
        // Target 500 MiB with drafts of 30 and 20 (oldest first); a new draft of 40.
        let plan = |budget: u64| make_room_for_draft(&others, mib(40), mib(550), &[mib(30), mib(20)], mib(budget));
        assert_eq!(plan(700), Ok((0, vec![])), "room for everything");
        assert_eq!(plan(660), Ok((1, vec![])), "the oldest draft goes, the bystander stays");
        assert_eq!(plan(640), Ok((2, vec![])), "both drafts go, the bystander stays");
        assert_eq!(plan(600), Ok((2, vec!["bystander".to_string()])), "then the bystander");
        assert_eq!(plan(30), Err(NoRoom::OverBudget));
        let pinned = resident(&[("bystander", 100, None, 50)], now);
        assert!(matches!(
            make_room_for_draft(&pinned, mib(40), mib(550), &[mib(30)], mib(600)),
            Err(NoRoom::Pinned { .. })
        ));
    }

    /// Models `(name, MiB, keep-alive seconds or None for pinned, used s ago)`.
    fn resident(list: &[(&str, u64, Option<u64>, u64)], now: Instant) -> HashMap<String, Clock> {
        list.iter()
            .map(|&(n, mib, ka, ago)| {
                let keep_alive = ka.map_or(KeepAlive::Forever, KeepAlive::Seconds);
                (
                    n.to_string(),
                    Clock { memory_bytes: mib << 20, keep_alive, last_used: now - Duration::from_secs(ago) },
                )
            })
            .collect()
    }

    #[test]
    fn keep_alive_expires_after_the_idle_time_and_never_for_pinned_models() {
        let now = Instant::now() + Duration::from_secs(10_000);
        let m = resident(&[("old", 1, Some(300), 301), ("fresh", 1, Some(300), 10), ("pinned", 1, None, 9000)], now);
        assert_eq!(expired(&m, now), vec!["old"]);
        assert_eq!(next_expiry(&m, now), Some(Duration::ZERO), "the expired one is due now");
        let m = resident(&[("fresh", 1, Some(300), 10), ("pinned", 1, None, 9000)], now);
        assert_eq!(next_expiry(&m, now), Some(Duration::from_secs(290)));
        let m = resident(&[("pinned", 1, None, 9000)], now);
        assert_eq!((expired(&m, now), next_expiry(&m, now)), (vec![], None));
    }

    #[test]
    fn a_keep_alive_past_what_an_instant_holds_never_expires() {
        let now = Instant::now();
        let m = resident(&[("forever-ish", 1, Some(u64::MAX), 0)], now);
        assert!(expired(&m, now + Duration::from_secs(1 << 40)).is_empty());
    }

    #[test]
    fn room_is_made_by_unloading_the_least_recently_used_unpinned_models() {
        let now = Instant::now() + Duration::from_secs(1000);
        let m = resident(&[("a", 400, Some(300), 50), ("b", 400, Some(300), 100), ("pin", 400, None, 900)], now);
        assert_eq!(make_room(&m, 300 << 20, 1500 << 20, 8), Ok(vec![]), "fits as it is");
        assert_eq!(
            make_room(&m, 500 << 20, 1500 << 20, 8),
            Ok(vec!["b".to_string()]),
            "b was used longest ago; pinned stays"
        );
        assert_eq!(make_room(&m, 800 << 20, 1500 << 20, 8), Ok(vec!["b".to_string(), "a".to_string()]));
        assert_eq!(make_room(&m, 100 << 20, 1500 << 20, 3), Ok(vec!["b".to_string()]), "max_loaded counts models");
    }

    #[test]
    fn no_room_beside_pinned_models_or_past_the_whole_budget() {
        let now = Instant::now() + Duration::from_secs(1000);
        let m = resident(&[("pin", 400, None, 900), ("a", 100, Some(300), 1)], now);
        assert_eq!(
            make_room(&m, 700 << 20, 1000 << 20, 8),
            Err(NoRoom::Pinned { pinned: vec!["pin".into()], used: 400 << 20 })
        );
        assert_eq!(make_room(&m, 2000 << 20, 1000 << 20, 8), Err(NoRoom::OverBudget));
    }
}
