//! Prompt-lookup drafts (n-gram speculation without a second model): the
//! tokens that followed the latest earlier occurrence of the sequence's
//! last few tokens, in its prompt or its answer so far. Code edits,
//! refactors, quotations and JSON that repeats keys copy long runs of the
//! prompt, which this finds; llama.cpp's and vLLM's n-gram proposers work
//! the same way.
//!
//! [`Drafter`] also keeps how far drafts go (`k`): it grows while drafts are
//! accepted whole and shrinks to what was accepted when they are not, so a
//! sequence whose drafts keep failing drafts little (a failed draft costs a
//! wider verify pass, not a wrong token).

use crate::model::options::Speculate;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};

/// The process's choice (0 auto, 1 off, 2 ngram, 3 draft), set once at start by `mlxbcd`'s main.
static CHOICE: AtomicU8 = AtomicU8::new(0);

/// Sets whether sequences draft (from `EngineOptions`, at start).
pub fn configure(choice: Speculate) {
    CHOICE.store(
        match choice {
            Speculate::Auto => 0,
            Speculate::Off => 1,
            Speculate::Ngram => 2,
            Speculate::Draft => 3,
        },
        Ordering::Relaxed,
    );
}

/// Whether new sequences draft unless their request says otherwise.
pub fn configured() -> Speculate {
    match CHOICE.load(Ordering::Relaxed) {
        1 => Speculate::Off,
        2 => Speculate::Ngram,
        3 => Speculate::Draft,
        _ => Speculate::Auto,
    }
}

/// The longest suffix tried first; shorter ones after (down to one token).
const MAX_NGRAM: usize = 3;

/// The shortest suffix whose match `auto` drafts from. A match of one token
/// is weak evidence: with Qwen2.5-Coder-0.5B on this bench's code edits,
/// JSON and chat, forced drafts from one-token matches were accepted 0.25
/// tokens a pass (3 of 12 passes accepted anything) against 2.7-4.1 from
/// three-token matches in the code edits
/// (docs/measurements/cpu-2026-12-07d-lookup-matches.md); where a pass
/// costs ~3 plain steps (a GPU) each such pass is a loss. `ngram` (forced)
/// drafts from any match. `MLXBC_LOOKUP_SHORTEST` (1-3) for measuring.
static AUTO_SHORTEST: AtomicUsize = AtomicUsize::new(2);

/// Sets [`AUTO_SHORTEST`] (from `EngineOptions`, at start).
pub fn configure_shortest(n: usize) {
    AUTO_SHORTEST.store(n.clamp(1, MAX_NGRAM), Ordering::Relaxed);
}

/// The most tokens a draft proposes.
pub const MAX_DRAFT: usize = 8;

/// Up to `k` tokens that followed the latest earlier occurrence of the last
/// `n` tokens of `history` (n from [`MAX_NGRAM`] down to `shortest`; the
/// longest match wins). Empty when nothing matches.
pub fn propose(history: &[u32], k: usize, shortest: usize) -> Vec<u32> {
    let len = history.len();
    if k == 0 || len < 2 {
        return Vec::new();
    }
    for n in (shortest.max(1)..=MAX_NGRAM.min(len - 1)).rev() {
        let tail = &history[len - n..];
        // Latest first: the answer's own recent text predicts its next best.
        // A match must leave at least one token after it (`start + n < len`).
        for start in (0..len - n).rev() {
            if &history[start..start + n] == tail {
                let from = start + n;
                let to = (from + k).min(len);
                return history[from..to].to_vec();
            }
        }
    }
    Vec::new()
}

/// The most plain steps a sequence rests between drafting attempts.
const MAX_REST: u32 = 16;

/// One sequence's drafting state: how many tokens to draft next, when to
/// try again after a miss, how often its drafts are accepted, and what
/// they came to.
///
/// A drafting step reads the previous token before it can draft, so it is
/// not pipelined like a plain step: after a step with nothing to draft or
/// nothing accepted the sequence rests (plain, pipelined steps), 1, 2, 4 …
/// up to [`MAX_REST`] steps as misses repeat, and an accepted draft ends
/// the rests. Open-ended text, which rarely repeats, then pays for a
/// drafting attempt about once every 16 tokens.
#[derive(Debug, Clone)]
pub struct Drafter {
    /// Tokens the next draft may propose (1..=MAX_DRAFT).
    k: usize,
    /// Plain steps left before the next attempt, and the last rest's length.
    idle: u32,
    rest: u32,
    /// Recent accepted drafted tokens and rejections (a draft not accepted
    /// whole), decayed: the acceptance rate's evidence.
    recent_accepted: f64,
    recent_rejected: f64,
    /// The rate assumed before this sequence's own drafts say otherwise:
    /// its model's recent acceptance ([`Self::new`]).
    prior: f64,
    /// Drafts not accepted whole, over the sequence (its model's evidence).
    pub rejections: u32,
    /// Drafts every step it can (`ngram` asked for), or where the cost
    /// model expects them to pay (`auto`).
    pub forced: bool,
    /// Tokens drafted and accepted, for the statistics.
    pub drafted: u32,
    pub accepted: u32,
    /// Whether it has proposed a draft yet (see [`Self::explores`]).
    tried: bool,
    /// The most tokens a draft may propose (its request's `draft_max`,
    /// else [`MAX_DRAFT`]).
    limit: usize,
}

impl Default for Drafter {
    fn default() -> Self {
        Self::new(false, 0.5)
    }
}

/// Tokens a sequence generates before its exploring pass ([`Drafter::explores`]):
/// enough for its answer to have begun quoting, if it does.
pub const EXPLORE_AFTER: usize = 8;

/// How fast the acceptance rate forgets old drafts (per verified draft).
const RATE_MEMORY: f64 = 0.8;

impl Drafter {
    /// A sequence's drafter; `forced`: drafts are verified whatever they
    /// cost; `prior`: the acceptance rate assumed before its own drafts
    /// are verified (its model's recent sequences': a fixed guess would
    /// keep `auto` from ever trying where a pass costs more than that
    /// guess pays, as on a long prompt, and so from learning otherwise).
    pub fn new(forced: bool, prior: f64) -> Self {
        Self {
            k: 4,
            idle: 0,
            rest: 0,
            recent_accepted: 0.0,
            recent_rejected: 0.0,
            prior: prior.clamp(0.0, 1.0),
            rejections: 0,
            forced,
            drafted: 0,
            accepted: 0,
            tried: false,
            limit: MAX_DRAFT,
        }
    }

    /// The same, drafting at most `limit` tokens a step (1..=[`MAX_DRAFT`]):
    /// a request's `draft_max`, as llama.cpp's `--draft-max`.
    pub fn limited(mut self, limit: usize) -> Self {
        self.limit = limit.clamp(1, MAX_DRAFT);
        self.k = self.k.min(self.limit);
        self
    }

    /// True when the sequence has not drafted yet but has an answer of
    /// [`EXPLORE_AFTER`] tokens begun (`generated`): a sequence that
    /// repeats its prompt (an agent's edit of a file it was given) is
    /// only known to by its own drafts, and where a pass costs more than
    /// the prior's guess pays (a long prompt on a CPU), `auto` would
    /// never verify one and never learn. One pass, early, settles it.
    pub fn explores(&self, generated: usize) -> bool {
        !self.forced && !self.tried && generated >= EXPLORE_AFTER
    }

    /// True when this step should try to draft (false while resting).
    pub fn try_now(&mut self) -> bool {
        if self.idle > 0 {
            self.idle -= 1;
            return false;
        }
        true
    }

    /// The next draft for `history`, at most `most` tokens (empty: take a
    /// plain step, and rest).
    pub fn draft(&mut self, history: &[u32], most: usize) -> Vec<u32> {
        let shortest = if self.forced { 1 } else { AUTO_SHORTEST.load(Ordering::Relaxed) };
        self.proposed(propose(history, self.most().min(most), shortest))
    }

    /// The most tokens a draft may propose: `k` where drafts are forced;
    /// under `auto` the widest a pass may be ([`MAX_DRAFT`]), since the
    /// cost model chooses the width from the acceptance rate and the
    /// measured pass costs (`crate::engine::draft_costs`), and `k`'s cut
    /// to the last draft's accepted length would hide the wide passes
    /// that pay where a pass costs several plain steps (an H100: a one-row
    /// pass of 9 positions ~3x a step; auto took 26 drafts where forced
    /// drafting took 149 on the same code edit, at 82% acceptance:
    /// docs/measurements/h100-2026-12-07b-kv-verify.md).
    pub fn most(&self) -> usize {
        if self.forced {
            self.k
        } else {
            self.limit
        }
    }

    /// `drafts` proposed elsewhere (a draft model) for the next step: rests
    /// when there are none, as [`Self::draft`] does.
    pub fn proposed(&mut self, drafts: Vec<u32>) -> Vec<u32> {
        self.tried = true;
        if drafts.is_empty() {
            self.missed();
        }
        drafts
    }

    /// Records a verified draft of `drafted` tokens of which the first
    /// `accepted` matched, and adapts `k`: doubled after a draft accepted
    /// whole, else the accepted length (at least one).
    pub fn verified(&mut self, drafted: usize, accepted: usize) {
        self.drafted += drafted as u32;
        self.accepted += accepted as u32;
        self.recent_accepted = self.recent_accepted * RATE_MEMORY + accepted as f64;
        self.recent_rejected = self.recent_rejected * RATE_MEMORY + f64::from(u8::from(accepted < drafted));
        self.rejections += u32::from(accepted < drafted);
        self.k = if accepted == drafted { (self.k * 2).min(self.limit) } else { accepted.max(1) };
        if accepted == 0 {
            self.missed();
        } else {
            self.rest = 0;
        }
    }

    fn missed(&mut self) {
        self.rest = (self.rest * 2).clamp(1, MAX_REST);
        self.idle = self.rest;
    }

    /// Tokens the next draft may propose.
    pub fn k(&self) -> usize {
        self.k
    }

    /// The chance that a drafted token is accepted given the ones before
    /// it were: accepted tokens against rejections in recent drafts, with
    /// two drafts' worth of the prior assumed beforehand (the prior before
    /// any evidence).
    pub fn rate(&self) -> f64 {
        (self.recent_accepted + 2.0 * self.prior) / (self.recent_accepted + self.recent_rejected + 2.0)
    }
}

/// How many leading `drafts` equal the target's own picks `picks` (the
/// target's token after each verified position: `picks[i]` follows the
/// input's position i, so draft i is accepted when it equals `picks[i]`).
pub fn accepted_prefix(drafts: &[u32], picks: &[u32]) -> usize {
    drafts.iter().zip(picks).take_while(|(d, p)| d == p).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_latest_longest_match_proposes_what_followed_it() {
        // "a b c d" ... "a b c" -> "d ..." (the 3-gram wins over later 1-grams).
        let h = [1, 2, 3, 4, 5, 9, 3, 7, 1, 2, 3];
        assert_eq!(propose(&h, 2, 1), vec![4, 5]);
        // The latest occurrence of the 1-gram when no longer one matches.
        let h = [5, 1, 6, 1, 7, 8, 1];
        assert_eq!(propose(&h, 3, 1), vec![7, 8, 1]);
        // Drafts stop at the end of the history.
        let h = [1, 2, 1];
        assert_eq!(propose(&h, 5, 1), vec![2, 1]);
        // Nothing repeats: no draft.
        assert!(propose(&[1, 2, 3, 4], 4, 1).is_empty());
        assert!(propose(&[1], 4, 1).is_empty());
        assert!(propose(&[1, 1, 1], 0, 1).is_empty());
    }

    #[test]
    fn auto_skips_matches_shorter_than_its_shortest() {
        // Only a one-token match ([3] at index 2): drafts from it at 1, none at 2.
        let h = [1, 2, 3, 4, 5, 9, 3];
        assert_eq!(propose(&h, 2, 1), vec![4, 5]);
        assert!(propose(&h, 2, 2).is_empty());
        // A two-token match still drafts at 2.
        let h = [1, 2, 3, 4, 5, 9, 2, 3];
        assert_eq!(propose(&h, 2, 2), vec![4, 5]);
    }

    #[test]
    fn a_suffix_never_matches_itself() {
        // The only occurrence of [7, 8] is the tail: the 1-gram [8] neither.
        assert!(propose(&[1, 2, 7, 8], 3, 1).is_empty());
        // A run of one token proposes more of it.
        assert_eq!(propose(&[4, 4, 4, 4], 2, 1), vec![4]);
    }

    #[test]
    fn k_grows_on_whole_acceptance_and_shrinks_to_what_was_accepted() {
        let mut d = Drafter::default();
        assert_eq!(d.k(), 4);
        d.verified(4, 4);
        assert_eq!(d.k(), 8);
        d.verified(8, 8);
        assert_eq!(d.k(), MAX_DRAFT);
        d.verified(8, 3);
        assert_eq!(d.k(), 3);
        d.verified(3, 0);
        assert_eq!(d.k(), 1);
        assert_eq!((d.drafted, d.accepted), (23, 15));
    }

    /// Forced drafts stay within `k`; under `auto` a draft fills the width
    /// the cost model chose, whatever the last draft's accepted length.
    #[test]
    fn auto_drafts_fill_the_chosen_width_and_forced_drafts_keep_to_k() {
        let history: Vec<u32> = (1..=12).chain(1..=3).collect();
        for (forced, want) in [(true, 1), (false, 6)] {
            let mut d = Drafter::new(forced, 0.5);
            d.verified(8, 1);
            assert_eq!(d.k(), 1);
            assert_eq!(d.draft(&history, 6), (4..=9).take(want).collect::<Vec<u32>>(), "forced: {forced}");
        }
        assert_eq!(Drafter::new(false, 0.5).draft(&history, MAX_DRAFT).len(), MAX_DRAFT);
    }

    #[test]
    fn the_acceptance_rate_follows_recent_drafts() {
        let mut d = Drafter::default();
        assert_eq!(d.rate(), 0.5);
        for _ in 0..10 {
            d.verified(8, 8);
        }
        assert!(d.rate() > 0.9, "{}", d.rate());
        for _ in 0..20 {
            d.verified(4, 0);
        }
        assert!(d.rate() < 0.3, "recent misses outweigh old hits: {}", d.rate());
        assert_eq!(d.rejections, 20);
    }

    #[test]
    fn the_prior_leads_until_the_sequences_own_drafts_outweigh_it() {
        let mut d = Drafter::new(false, 0.9);
        assert!((d.rate() - 0.9).abs() < 1e-9);
        for _ in 0..5 {
            d.verified(4, 0);
        }
        assert!(d.rate() < 0.5, "{}", d.rate());
    }

    #[test]
    fn misses_rest_longer_each_time_and_an_accepted_draft_ends_the_rests() {
        let mut d = Drafter::default();
        let rests = |d: &mut Drafter| (0..40).take_while(|_| !d.try_now()).count();
        assert_eq!(rests(&mut d), 0);
        assert!(d.draft(&[1, 2, 3], MAX_DRAFT).is_empty());
        assert_eq!(rests(&mut d), 1);
        d.verified(4, 0);
        assert_eq!(rests(&mut d), 2);
        for want in [4, 8, 16, 16] {
            assert!(d.draft(&[7, 8, 9], MAX_DRAFT).is_empty());
            assert_eq!(rests(&mut d), want);
        }
        d.verified(2, 1);
        assert!(d.try_now(), "an accepted draft: no rest");
        assert!(d.draft(&[5, 6], MAX_DRAFT).is_empty());
        assert_eq!(rests(&mut d), 1, "the rests start over");
    }

    #[test]
    fn a_sequence_explores_once_its_answer_has_begun_and_not_after_it_drafted() {
        let mut d = Drafter::new(false, 0.1);
        assert!(!d.explores(EXPLORE_AFTER - 1));
        assert!(d.explores(EXPLORE_AFTER));
        d.proposed(Vec::new());
        assert!(!d.explores(EXPLORE_AFTER + 5), "tried, even with nothing to propose");
        assert!(!Drafter::new(true, 0.1).explores(100), "forced rows draft anyway");
    }

    #[test]
    fn a_limit_caps_every_draft() {
        let history: Vec<u32> = (0..40).chain(0..20).collect();
        for limit in 1..=MAX_DRAFT {
            // Forced: k starts at most at the limit and grows no further.
            let mut d = Drafter::new(true, 0.5).limited(limit);
            for _ in 0..4 {
                let k = d.k();
                let drafts = d.draft(&history, MAX_DRAFT);
                assert_eq!(drafts.len(), k, "limit {limit}");
                assert!(k <= limit, "limit {limit}: k {k}");
                d.verified(drafts.len(), drafts.len());
            }
            assert_eq!(d.k(), limit, "grown to the limit, not past it");
            // Auto: as wide as the limit.
            assert_eq!(Drafter::new(false, 0.5).limited(limit).draft(&history, MAX_DRAFT).len(), limit);
        }
        assert_eq!(Drafter::new(true, 0.5).limited(0).most(), 1, "at least one");
        assert_eq!(Drafter::new(false, 0.5).limited(99).most(), MAX_DRAFT);
    }

    #[test]
    fn the_accepted_prefix_ends_at_the_first_disagreement() {
        assert_eq!(accepted_prefix(&[1, 2, 3], &[1, 2, 3, 4]), 3);
        assert_eq!(accepted_prefix(&[1, 5, 3], &[1, 2, 3, 4]), 1);
        assert_eq!(accepted_prefix(&[9], &[1, 2]), 0);
        assert_eq!(accepted_prefix(&[], &[1]), 0);
    }
}
