//! Whether a verify pass pays, measured: speculation's cost model.
//!
//! A verify pass of `rows × width` positions gives each drafting row one
//! token plus the drafts the model agrees with; a plain step gives each row
//! one token. Which is faster per token depends on the device (on a
//! two-core CPU a pass costs about what its positions cost; on a GPU a few
//! more positions are nearly free), the batch and the acceptance, so both
//! costs are measured as the model runs ([`PassCosts`]), and each step
//! takes the width with the most expected tokens per second
//! ([`choose_width`]) — 1 when no width beats a plain step. A width never
//! measured is tried once (that is how it gets measured), and a refusal
//! is revisited now and then, since costs drift with the context and load.

use std::collections::BTreeMap;

/// How much a new measurement moves an estimate.
const WEIGHT: f64 = 0.25;

/// Plain steps in a row that the cost model may refuse before it lets one
/// verify pass through anyway (costs drift; a stale refusal would stick).
/// Each revisit that the cost model then refuses again doubles the wait, up
/// to [`REVISIT_AT_MOST`]; a pass taken on its merits starts it over. A
/// revisit of a wide batch is dear: on an H100 a 16-row pass of 9
/// positions of Qwen2.5-Coder-0.5B took ~49 ms against a ~6 ms step, so one
/// every 64 steps cost the batch ~5%
/// (docs/measurements/h100-2026-12-07c-pipelined-verify.md).
const REVISIT_AFTER: u32 = 64;
const REVISIT_AT_MOST: u32 = 1024;

/// Measured wall time of a model's forward passes (seconds), per kind.
#[derive(Debug, Default)]
pub struct PassCosts {
    /// A plain (pipelined) decode step, by rows.
    plain: BTreeMap<usize, f64>,
    /// A verify pass (synchronous), by positions (rows × width).
    verify: BTreeMap<usize, f64>,
    /// Pass sizes run once, whose first time was not recorded: a GPU
    /// builds kernels for a new shape on its first run (an 8B model's
    /// one-row pass of 9 positions took 23 ms the first time against a
    /// 5.6 ms step on an H200), which is no measure of the pass.
    warmed: std::collections::BTreeSet<usize>,
    /// Plain steps taken since the last verify pass.
    refused: u32,
    /// Refusals before the next revisit (0: [`REVISIT_AFTER`]).
    revisit_after: u32,
}

fn blend(slot: &mut f64, secs: f64) {
    *slot += WEIGHT * (secs - *slot);
}

impl PassCosts {
    /// A plain step of `rows` took `secs`.
    pub fn plain_step(&mut self, rows: usize, secs: f64) {
        self.plain.entry(rows).and_modify(|t| blend(t, secs)).or_insert(secs);
        self.refused = self.refused.saturating_add(1);
    }

    /// A verify pass of `positions` took `secs` (the first of its size is
    /// only noted: see `warmed`).
    pub fn verify_pass(&mut self, positions: usize, secs: f64) {
        // A revisit waits twice as long next time; a pass on its merits
        // (taken before a revisit was due) starts the wait over.
        self.revisit_after = match self.revisit() {
            true => (self.revisit_interval() * 2).min(REVISIT_AT_MOST),
            false => REVISIT_AFTER,
        };
        self.refused = 0;
        if self.warmed.insert(positions) {
            return;
        }
        self.verify.entry(positions).and_modify(|t| blend(t, secs)).or_insert(secs);
    }

    /// The plain step's cost for `rows`, if measured.
    pub fn plain(&self, rows: usize) -> Option<f64> {
        self.plain.get(&rows).copied()
    }

    /// A verify pass's estimated cost for `positions`: measured, or
    /// interpolated between the nearest measured sizes on each side.
    /// `None` without a measured size on each side: a guess beyond what
    /// was measured (scaling by positions, say) is far off on a device
    /// with room to spare, and a wrong guess would stick; such a width is
    /// tried instead.
    pub fn verify(&self, positions: usize) -> Option<f64> {
        let below = self.verify.range(..=positions).next_back();
        let above = self.verify.range(positions..).next();
        match (below, above) {
            (Some((&n, &t)), _) if n == positions => Some(t),
            (Some((&a, &ta)), Some((&b, &tb))) => Some(ta + (tb - ta) * (positions - a) as f64 / (b - a) as f64),
            _ => None,
        }
    }

    /// True when a refusal has stood long enough to try a pass again.
    fn revisit(&self) -> bool {
        self.refused >= self.revisit_interval()
    }

    /// Refusals that make a revisit due now.
    fn revisit_interval(&self) -> u32 {
        match self.revisit_after {
            0 => REVISIT_AFTER,
            n => n,
        }
    }
}

/// Expected tokens accepted from `k` drafted ones when each is accepted
/// with probability `rate` given the ones before it were (the prefix rule):
/// `rate + rate² + … + rateᵏ`.
pub fn expected_accepted(k: usize, rate: f64) -> f64 {
    (1..=k).map(|i| rate.powi(i as i32)).sum()
}

/// A drafting row's view for the choice: the most tokens it would draft,
/// the rate at which its drafts are accepted, and what drafting a token
/// costs it (a draft model's step, measured; 0 for prompt lookup).
#[derive(Debug, Clone, Copy, Default)]
pub struct Drafting {
    pub k: usize,
    pub rate: f64,
    pub draft_secs: f64,
    /// The row has not drafted yet and may take one exploring pass
    /// (`Drafter::explores`).
    pub explore: bool,
}

/// The most positions a batch's revisit verifies. A revisit re-measures a
/// refusal at a width the batch was refusing, so it is mostly a loss:
/// on an H100 a 16-row revisit of 9 positions a row (144) took ~50 ms
/// against a ~6 ms plain step, ~5% of a 16-client burst of code edits
/// (docs/measurements/h100-2026-12-07d-pass-fusion.md). Up to 4 rows still
/// try the widest pass (what pays for a few rows quoting their prompts);
/// wider batches try fewer drafts a row, at least one.
const REVISIT_POSITIONS: usize = 36;

/// The width a batch of `rows` revisits a refusal at: the widest whose
/// positions stay within [`REVISIT_POSITIONS`], at least 2 (one draft a
/// row), at most `widest`.
fn revisit_width(rows: usize, widest: usize) -> usize {
    (REVISIT_POSITIONS / rows.max(1)).clamp(2, widest.max(2))
}

/// The verify pass width (1 + drafted positions per row) with the most
/// expected tokens per second for a batch of `rows` rows of which
/// `drafting` draft; 1 means a plain step. A row alone tries the widest
/// pass when it has no measure of it (or after [`REVISIT_AFTER`]
/// refusals), to measure it. A batch does not: a trial costs every row,
/// and a batch's row count changes as sequences come and go, each count a
/// new pass size (on an H100, 16 clients of SmolLM2 lost 24% to such
/// trials: docs/measurements/h100-2026-12-05c-views-and-speculation.md).
/// Its unmeasured sizes are estimated from the measured ones (beyond the
/// largest, in proportion to positions: what a compute-bound device
/// costs, and more than a GPU's), with nothing measured it takes plain
/// steps, and only a revisit tries a pass ([`revisit_width`]: narrower
/// the more rows there are).
pub fn choose_width(costs: &PassCosts, rows: usize, drafting: &[Drafting]) -> usize {
    let widest = 1 + drafting.iter().map(|d| d.k).max().unwrap_or(0);
    if widest == 1 {
        return 1;
    }
    let batch = rows > 1;
    let Some(plain) = costs.plain(rows) else {
        // A batch's plain step measures it; a row alone measures the pass.
        return if batch { 1 } else { widest };
    };
    // Below the smallest measured pass: between a plain step (`rows`
    // positions) and that pass; in a batch, beyond the largest: in
    // proportion to positions.
    let estimate = |n: usize| {
        costs.verify(n).or_else(|| match costs.verify.range(n..).next() {
            Some((&b, &tb)) => Some(plain + (tb - plain) * (n - rows) as f64 / (b - rows) as f64),
            None if batch => costs.verify.iter().next_back().map(|(&a, &ta)| ta * n as f64 / a as f64),
            None => None,
        })
    };
    let drafting_secs =
        |width: usize| -> f64 { drafting.iter().map(|d| d.k.min(width - 1) as f64 * d.draft_secs).sum() };
    // A revisit re-measures the pass; not where drafting alone costs more
    // than it could gain even if the pass cost a plain step and every
    // draft were accepted (a draft model as large as its target).
    let could_pay = (2..=widest).any(|w| {
        let best: f64 = drafting.iter().map(|d| d.k.min(w - 1) as f64).sum();
        (rows as f64 + best) / (plain + drafting_secs(w)) > rows as f64 / plain
    });
    if !could_pay {
        return 1;
    }
    // A row alone that has never drafted explores once: the pass measures
    // its own acceptance, which the prior may underrate (in a batch, the
    // pass would cost every row; it explores when alone).
    let explores = rows == 1 && drafting.iter().any(|d| d.explore);
    if explores || (!batch && estimate(rows * widest).is_none()) {
        return widest;
    }
    if costs.revisit() {
        return if batch { revisit_width(rows, widest) } else { widest };
    }
    let mut best = (rows as f64 / plain, 1);
    for width in 2..=widest {
        let Some(t) = estimate(rows * width) else { continue };
        let accepted: f64 = drafting.iter().map(|d| expected_accepted(d.k.min(width - 1), d.rate)).sum();
        let rate = (rows as f64 + accepted) / (t + drafting_secs(width));
        if rate > best.0 {
            best = (rate, width);
        }
    }
    best.1
}

#[cfg(test)]
mod tests {
    use super::*;

    fn costs(plain: &[(usize, f64)], verify: &[(usize, f64)]) -> PassCosts {
        let mut c = PassCosts::default();
        for &(n, t) in plain {
            c.plain_step(n, t);
        }
        for &(n, t) in verify {
            c.verify_pass(n, t * 4.0); // the first run of a size: not recorded
            c.verify_pass(n, t);
        }
        c
    }

    #[test]
    fn refused_revisits_come_less_and_less_often_until_a_pass_pays() {
        // A 16-row batch whose 9-wide pass costs 8 steps: never pays.
        let mut c = costs(&[(16, 0.006)], &[(16 * 9, 0.049)]);
        let rows = vec![Drafting { k: 8, rate: 0.8, draft_secs: 0.0, explore: false }; 16];
        let mut gaps = Vec::new();
        for _ in 0..5 {
            let mut gap = 0;
            while choose_width(&c, 16, &rows) == 1 {
                c.plain_step(16, 0.006);
                gap += 1;
            }
            gaps.push(gap);
            c.verify_pass(16 * 9, 0.049);
        }
        assert_eq!(gaps, [64, 128, 256, 512, 1024]);
        // A pass taken on its merits (the pass got cheap) starts over.
        for _ in 0..8 {
            c.verify_pass(16 * 9, 0.007);
        }
        assert!(choose_width(&c, 16, &rows) > 1);
        c.verify_pass(16 * 9, 0.049 * 4.0);
        for _ in 0..8 {
            c.verify_pass(16 * 9, 0.049);
        }
        let mut gap = 0;
        while choose_width(&c, 16, &rows) == 1 {
            c.plain_step(16, 0.006);
            gap += 1;
        }
        assert_eq!(gap, 64);
    }

    #[test]
    fn the_first_pass_of_a_size_is_not_its_cost() {
        let mut c = PassCosts::default();
        c.plain_step(1, 0.006);
        let row = [Drafting { k: 8, rate: 0.9, draft_secs: 0.0, explore: false }];
        c.verify_pass(9, 0.023); // kernels built for the new shape
        assert_eq!(c.verify(9), None, "not measured yet");
        assert_eq!(choose_width(&c, 1, &row), 9, "so it is tried again");
        c.verify_pass(9, 0.0065);
        assert_eq!(c.verify(9), Some(0.0065));
        assert!(choose_width(&c, 1, &row) > 1);
    }

    #[test]
    fn a_row_alone_that_never_drafted_explores_once_where_the_estimate_refuses() {
        let per = |n: usize| (n, 0.004 + 0.006 * n as f64);
        let c = costs(&[per(1), per(2)], &(2..=18).map(per).collect::<Vec<_>>());
        let row = |explore| Drafting { k: 4, rate: 0.3, draft_secs: 0.0, explore };
        assert_eq!(choose_width(&c, 1, &[row(false)]), 1, "the estimate refuses");
        assert_eq!(choose_width(&c, 1, &[row(true)]), 5, "the explorer tries the widest");
        assert_eq!(choose_width(&c, 2, &[row(true), row(false)]), 1, "in a batch it does not");
    }

    #[test]
    fn expected_acceptance_follows_the_prefix_rule() {
        assert_eq!(expected_accepted(0, 0.9), 0.0);
        assert!((expected_accepted(3, 0.5) - 0.875).abs() < 1e-12);
        assert!((expected_accepted(8, 1.0) - 8.0).abs() < 1e-12);
    }

    #[test]
    fn unmeasured_passes_are_tried_and_estimates_interpolate() {
        let c = PassCosts::default();
        let row = [Drafting { k: 4, rate: 0.1, draft_secs: 0.0, explore: false }];
        assert_eq!(choose_width(&c, 1, &row), 5, "nothing measured: try the widest");
        let c = costs(&[(1, 0.010)], &[(2, 0.012), (6, 0.020)]);
        assert_eq!(c.verify(4), Some(0.016));
        assert_eq!(c.verify(12), None, "beyond the largest: not guessed");
        assert_eq!(
            choose_width(&c, 1, &[Drafting { k: 8, rate: 0.1, draft_secs: 0.0, explore: false }]),
            9,
            "so the widest is tried"
        );
        assert_eq!(c.verify(1), None);
        assert_eq!(choose_width(&c, 1, &[]), 1, "no drafting row: a plain step");
        // Only the widest measured: narrower ones lie between it and a plain step.
        let c = costs(&[(1, 0.010)], &[(5, 0.030)]);
        assert_eq!(choose_width(&c, 1, &[Drafting { k: 4, rate: 0.9, draft_secs: 0.0, explore: false }]), 4);
        assert_eq!(choose_width(&c, 1, &[Drafting { k: 4, rate: 0.6, draft_secs: 0.0, explore: false }]), 2);
    }

    #[test]
    fn a_pass_that_costs_what_its_positions_cost_pays_only_with_high_acceptance() {
        // A compute-bound device: a pass costs 4 ms plus 6 ms per position
        // (a purely linear cost never pays: w positions for at most w tokens).
        let per = |n: usize| (n, 0.004 + 0.006 * n as f64);
        let c = costs(&[per(1), per(16)], &(2..=9).map(per).chain((2..=9).map(|w| per(16 * w))).collect::<Vec<_>>());
        // One row: drafts accepted at 0.95 pay; at 0.3 they do not.
        assert!(choose_width(&c, 1, &[Drafting { k: 8, rate: 0.95, draft_secs: 0.0, explore: false }]) > 1);
        assert_eq!(choose_width(&c, 1, &[Drafting { k: 8, rate: 0.3, draft_secs: 0.0, explore: false }]), 1);
        // Sixteen rows, one of them drafting well: the pass would cost 16
        // rows' worth per width for one row's gain. No.
        let rows = [Drafting { k: 8, rate: 0.95, draft_secs: 0.0, explore: false }];
        assert_eq!(choose_width(&c, 16, &rows), 1, "a batch under load stops speculating");
    }

    #[test]
    fn a_pass_nearly_as_cheap_as_a_step_pays_even_with_modest_acceptance() {
        // A bandwidth-bound device: positions are nearly free.
        let c = costs(&[(1, 0.006)], &(2..=9).map(|n| (n, 0.0065 + 0.0001 * n as f64)).collect::<Vec<_>>());
        let w = choose_width(&c, 1, &[Drafting { k: 8, rate: 0.5, draft_secs: 0.0, explore: false }]);
        assert!(w >= 3, "width {w}");
    }

    #[test]
    fn a_draft_models_steps_count_against_the_pass() {
        // The bandwidth-bound device above: with free drafts (prompt
        // lookup) a pass pays at 0.8; a draft model whose token costs as
        // much as the target's step (the same weights) never pays, and a
        // draft model at a tenth of it pays again.
        let c = costs(&[(1, 0.006)], &(2..=9).map(|n| (n, 0.0065 + 0.0001 * n as f64)).collect::<Vec<_>>());
        let drafting = |draft_secs| [Drafting { k: 8, rate: 0.8, draft_secs, explore: false }];
        assert!(choose_width(&c, 1, &drafting(0.0)) > 1);
        assert_eq!(choose_width(&c, 1, &drafting(0.006)), 1);
        assert!(choose_width(&c, 1, &drafting(0.0006)) > 1);
        // Nor is such a draft tried again when a refusal is revisited, nor
        // a pass never measured tried with it.
        let mut c = c;
        for _ in 0..REVISIT_AFTER {
            c.plain_step(1, 0.006);
        }
        assert_eq!(choose_width(&c, 1, &drafting(0.012)), 1);
        assert_eq!(choose_width(&costs(&[(1, 0.006)], &[]), 1, &drafting(0.012)), 1);
    }

    #[test]
    fn a_batch_estimates_unmeasured_passes_instead_of_trying_them() {
        let row = Drafting { k: 8, rate: 0.5, draft_secs: 0.0, explore: false };
        // Nothing measured: a batch takes plain steps (which measure a
        // step); its row count's step unmeasured: a plain step too.
        assert_eq!(choose_width(&PassCosts::default(), 16, &[row; 16]), 1);
        assert_eq!(choose_width(&costs(&[(15, 0.010)], &[]), 16, &[row; 16]), 1);
        assert_eq!(choose_width(&costs(&[(16, 0.010)], &[]), 16, &[row; 16]), 1, "no pass measured");
        // A pass measured at 15 rows × 9: 16 rows × 9 is estimated from it
        // (in proportion, 0.032 s) rather than tried: at 0.5 a narrower
        // pass pays by the estimates, at 0.2 none does.
        let c = costs(&[(16, 0.010)], &[(135, 0.030)]);
        assert_eq!(c.verify(144), None);
        let w = choose_width(&c, 16, &[row; 16]);
        assert!((2..9).contains(&w), "width {w}");
        assert_eq!(choose_width(&c, 16, &[Drafting { rate: 0.2, ..row }; 16]), 1);
        // A cheap measured pass pays by the same estimate.
        let c = costs(&[(16, 0.010)], &[(135, 0.011)]);
        assert!(choose_width(&c, 16, &[row; 16]) > 1);
        // A revisit tries a pass again: one draft a row at 16 rows.
        let mut c = costs(&[(16, 0.010)], &[(135, 0.030)]);
        for _ in 0..REVISIT_AFTER {
            c.plain_step(16, 0.010);
        }
        assert_eq!(choose_width(&c, 16, &[row; 16]), 2);
    }

    #[test]
    fn a_batch_revisits_at_a_width_its_rows_can_afford() {
        let row = Drafting { k: 8, rate: 0.1, draft_secs: 0.0, explore: false };
        let refused = |rows: usize| {
            let mut c = costs(&[(rows, 0.010)], &[(rows * 9, 0.080)]);
            assert_eq!(choose_width(&c, rows, &vec![row; rows]), 1, "{rows} rows refuse");
            for _ in 0..REVISIT_AFTER {
                c.plain_step(rows, 0.010);
            }
            choose_width(&c, rows, &vec![row; rows])
        };
        // Up to 4 rows the widest (4 × 9 = 36 positions); then narrower,
        // down to one draft a row.
        assert_eq!([refused(2), refused(4), refused(8), refused(16), refused(64)], [9, 9, 4, 2, 2]);
        // Never wider than the rows draft.
        let mut c = costs(&[(2, 0.010)], &[(6, 0.080)]);
        for _ in 0..REVISIT_AFTER {
            c.plain_step(2, 0.010);
        }
        assert_eq!(choose_width(&c, 2, &[Drafting { k: 2, ..row }; 2]), 3);
    }

    #[test]
    fn a_long_refusal_is_revisited() {
        let mut c = costs(&[(1, 0.010)], &[(5, 0.050)]);
        let row = [Drafting { k: 4, rate: 0.2, draft_secs: 0.0, explore: false }];
        assert_eq!(choose_width(&c, 1, &row), 1);
        for _ in 0..REVISIT_AFTER {
            c.plain_step(1, 0.010);
        }
        assert_eq!(choose_width(&c, 1, &row), 5, "tried again after {REVISIT_AFTER} plain steps");
        c.verify_pass(5, 0.050);
        assert_eq!(choose_width(&c, 1, &row), 1);
    }
}
