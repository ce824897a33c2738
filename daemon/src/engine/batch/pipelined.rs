//! Speculation's verify passes, pipelined: the next pass is built and
//! queued while the last one runs on the device, as plain decode steps are.
//!
//! Unpipelined, a verify pass waits for its token ahead, then the host
//! builds and launches it (hundreds of operations at several µs each),
//! then waits for the device: on an H100 a one-row pass of up to 9
//! positions took ~8-16 ms against a 2.6 ms plain step, whose host work
//! overlaps the device's (docs/measurements/h100-2026-12-07b-kv-verify.md),
//! so speculation there gave 1.7x where the drafts' acceptance allows ~4x.
//!
//! Here the next pass is built on the guess that every row accepts all its
//! drafts: its first input is the running pass's pick after the row's
//! last draft (an array not yet read), its drafts continue the row's
//! history with those drafts ([`Sequence::draft_beyond`]), and its keys
//! and values go after theirs. When the running pass is read, a row that
//! accepted its drafts whole has the next pass right; a row that did not
//! has it wrong, so that pass's picks for it are ignored and its cache
//! forgets that pass's positions with its rejected ones: a pass lost for
//! that row, never a wrong token. Greedy output is the same as without
//! speculation.
//!
//! Batches whose rows all take the argmax of their logits (greedy, no
//! constraint, no log-probabilities) and draft by prompt lookup (or not
//! at all) pipeline; the others verify one pass at a time
//! ([`DecodeBatch::verify_rows`]). `MLXBC_SPEC_PIPELINE=off` turns it off,
//! for measuring against.

use super::{DecodeBatch, RowOutcome};
use crate::decoding::lookup;
use crate::engine::sequence::{Drafts, Sequence};
use crate::error::EngineError;
use crate::model::positions::MediaPositions;
use mlx_rs::ops::indexing::argmax_axis;
use mlx_rs::Array;
use std::time::Instant;

/// Whether verify passes may pipeline (`MLXBC_SPEC_PIPELINE=off`: never; read once).
fn pipelining_on() -> bool {
    static OFF: std::sync::LazyLock<bool> =
        std::sync::LazyLock::new(|| std::env::var("MLXBC_SPEC_PIPELINE").is_ok_and(|v| v.eq_ignore_ascii_case("off")));
    !*OFF
}

/// A row of a pass in flight.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum RowState {
    /// Its input was right (its cache and its first token): its picks count.
    Live,
    /// Its input was wrong (the pass before rejected some of its drafts)
    /// or it joined while the pass ran: its picks are ignored, its cache
    /// is to forget `forget` positions at its end, and `ahead` is its
    /// token ahead (handed over already).
    Stale { forget: i32, ahead: u32 },
    /// Stale, and the pass built after it set the row right.
    Fixed,
}

/// A verify pass queued and not yet read.
pub(super) struct Pass {
    /// The model's pick after each position `[rows, width]` (lazy).
    picks: Array,
    /// Each row's drafts (the positions after its first).
    drafts: Vec<Vec<u32>>,
    rows: Vec<RowState>,
    /// A row's guess of its first token where that is the running pass's
    /// pick ([`Sequence::draft_beyond`]), and whether the guess proved
    /// wrong: such drafts say nothing of how well the row drafts.
    guesses: Vec<Option<u32>>,
    misguessed: Vec<bool>,
    width: usize,
    /// When it began to be built.
    started: Instant,
}

impl Pass {
    /// Keeps the rows `keep` (indices, in order).
    pub(super) fn keep_rows(&mut self, keep: &[usize]) -> Result<(), EngineError> {
        let idx: Vec<i32> = keep.iter().map(|&i| i as i32).collect();
        self.picks =
            self.picks.take_axis(Array::from_slice(&idx, &[idx.len() as i32]), 0).map_err(EngineError::inference)?;
        self.drafts = keep.iter().map(|&i| std::mem::take(&mut self.drafts[i])).collect();
        self.rows = keep.iter().map(|&i| self.rows[i].clone()).collect();
        self.guesses = keep.iter().map(|&i| self.guesses[i]).collect();
        self.misguessed = keep.iter().map(|&i| self.misguessed[i]).collect();
        Ok(())
    }

    /// Rows that joined while it ran, whose token ahead is `first`
    /// (handed over by their prefill): stale in it, nothing to forget.
    pub(super) fn join_rows(&mut self, first: &[u32]) -> Result<(), EngineError> {
        let zeros = mlx_rs::ops::zeros_dtype(&[first.len() as i32, self.width as i32], self.picks.dtype())
            .map_err(EngineError::inference)?;
        self.picks = mlx_rs::ops::concatenate(&[self.picks.clone(), zeros], 0).map_err(EngineError::inference)?;
        self.drafts.extend(first.iter().map(|_| Vec::new()));
        self.rows.extend(first.iter().map(|&ahead| RowState::Stale { forget: 0, ahead }));
        self.guesses.extend(first.iter().map(|_| None));
        self.misguessed.extend(first.iter().map(|_| false));
        Ok(())
    }
}

/// A row's first input in a pass.
#[derive(Clone, Copy)]
enum First {
    /// Known on the host.
    Token(u32),
    /// The running pass's pick after this position of the row.
    Pick(usize),
}

/// What [`DecodeBatch::step_pipelined`] did.
pub(super) enum Pipelined {
    /// A pass was queued or read: the step is taken.
    Stepped(Vec<RowOutcome>),
    /// No pass is running and none was queued: the caller takes a plain
    /// step (the rows that ended on their token ahead).
    Plain(Vec<RowOutcome>),
}

impl DecodeBatch {
    /// Whether this batch's verify passes pipeline (see the module).
    pub(super) fn pipelines(&self, seqs: &[&mut Sequence]) -> bool {
        pipelining_on()
            && self.cache.as_ref().is_some_and(|c| !c.has_states())
            && seqs.iter().all(|s| s.picks_argmax() && s.draft_run().is_none())
    }

    /// A step of a batch that pipelines (or has a pass running): queues
    /// the next verify pass if one pays (built on the running pass, if
    /// any), then reads the running pass and hands its rows' tokens over.
    pub(super) fn step_pipelined(&mut self, seqs: &mut [&mut Sequence]) -> Result<Pipelined, EngineError> {
        let t = Instant::now();
        let n = self.rows.len();
        let mut running = self.pending.take();
        let wants: Vec<bool> = match self.pipelines(seqs) {
            true => seqs.iter_mut().map(|s| s.wants_draft()).collect(),
            false => vec![false; n],
        };
        let width = if wants.contains(&true) { self.pass_width(seqs, &wants) } else { 1 };
        if running.is_none() && width == 1 {
            return Ok(Pipelined::Plain(Vec::new()));
        }
        // With no pass running, the token ahead is read and handed over
        // first (the drafts continue it).
        let mut ended = Vec::new();
        let mut first: Vec<First> = Vec::with_capacity(n);
        match &running {
            Some(p) => first.extend(p.rows.iter().zip(&p.drafts).map(|(state, d)| match state {
                RowState::Stale { ahead, .. } => First::Token(*ahead),
                _ => First::Pick(d.len()),
            })),
            None => {
                let ahead = self.ahead.clone().ok_or_else(|| EngineError::Internal("a batch lost its tokens".into()))?;
                ahead.eval().map_err(EngineError::inference)?;
                let tokens = ahead.as_slice::<u32>();
                for ((row, s), &token) in self.rows.iter_mut().zip(seqs.iter_mut()).zip(tokens) {
                    if !std::mem::replace(&mut row.taken, true) {
                        if let Some(end) = s.accept(token) {
                            ended.push((row.seq, end));
                        }
                    }
                }
                first.extend(tokens.iter().map(|&t| First::Token(t)));
            }
        }
        // The next pass's drafts: after the running pass's (as if all
        // accepted) for its live rows, after the history for the others.
        let mut drafts = vec![Vec::new(); n];
        let mut guesses = vec![None; n];
        if width > 1 {
            for (r, s) in seqs.iter_mut().enumerate() {
                let over = ended.iter().any(|(id, _)| *id == self.rows[r].seq);
                if !wants[r] || over {
                    continue;
                }
                drafts[r] = match (&first[r], &running) {
                    (First::Pick(_), Some(p)) => {
                        let (drafts, guess) = s.draft_beyond(&p.drafts[r], width - 1);
                        guesses[r] = guess;
                        drafts
                    }
                    _ => match s.draft(width - 1) {
                        Drafts::Ready(d) => d,
                        Drafts::Model(_) => Vec::new(),
                    },
                };
            }
        }
        let next_width = 1 + drafts.iter().map(Vec::len).max().unwrap_or(0);
        let mut next = match next_width {
            1 => None,
            _ => Some(self.queue_pass(running.as_mut(), &first, drafts, guesses, next_width)?),
        };
        // Rows that ended on their token ahead leave after this step: the
        // pass's picks for them are never read.
        if let Some(q) = next.as_mut() {
            for (r, row) in self.rows.iter().enumerate() {
                if ended.iter().any(|(id, _)| *id == row.seq) {
                    q.rows[r] = RowState::Stale { forget: 0, ahead: 0 };
                }
            }
        }
        let queued = t.elapsed().as_secs_f64();
        let Some(p) = running else {
            // The first pass of a run: nothing to read yet.
            self.pending = next;
            if self.pending.is_none() {
                return Ok(Pipelined::Plain(ended));
            }
            self.profile.record_pipelined(t, n, queued, 0.0, 0);
            return Ok(Pipelined::Stepped(ended));
        };
        let (over, stale) = self.settle(p, next.as_mut(), seqs)?;
        ended.extend(over);
        let took = t.elapsed().as_secs_f64();
        self.profile.record_pipelined(t, n, queued, took - queued, stale);
        let chained = next.is_some();
        self.pending = next;
        Ok(match chained {
            true => Pipelined::Stepped(ended),
            false => Pipelined::Plain(ended),
        })
    }

    /// Queues a verify pass of `width` positions a row: each row's first
    /// input (`first`: known, or `running`'s pick), then its drafts
    /// (filled with its last token). Rows stale in `running` are set
    /// right first: their cache forgets what it must (they are then
    /// fixed). After the pass, each row's cache forgets its fill, as if
    /// every draft will be accepted.
    fn queue_pass(
        &mut self,
        running: Option<&mut Pass>,
        first: &[First],
        drafts: Vec<Vec<u32>>,
        guesses: Vec<Option<u32>>,
        width: usize,
    ) -> Result<Pass, EngineError> {
        let started = Instant::now();
        let n = first.len();
        let cache = self.cache.as_mut().ok_or_else(|| EngineError::Internal("a batch lost its cache".into()))?;
        let mut picked_from = None;
        if let Some(p) = running {
            let mut forget = vec![0; n];
            for (f, state) in forget.iter_mut().zip(p.rows.iter_mut()) {
                if let RowState::Stale { forget: k, .. } = *state {
                    *f = k;
                    *state = RowState::Fixed;
                }
            }
            trim(cache, &forget)?;
            picked_from = Some(p.picks.clone());
        }
        let known: Vec<u32> = first
            .iter()
            .map(|f| match f {
                First::Token(t) => *t,
                First::Pick(_) => 0,
            })
            .collect();
        let mut column = Array::from_slice(&known, &[n as i32, 1]);
        if let Some(picks) = picked_from.filter(|_| first.iter().any(|f| matches!(f, First::Pick(_)))) {
            let at: Vec<i32> = first
                .iter()
                .map(|f| match f {
                    First::Pick(i) => *i as i32,
                    First::Token(_) => 0,
                })
                .collect();
            let from_pass: Vec<bool> = first.iter().map(|f| matches!(f, First::Pick(_))).collect();
            let picked = picks.take_along_axis(Array::from_slice(&at, &[n as i32, 1]), 1);
            column = picked
                .and_then(|p| mlx_rs::ops::select(&Array::from_slice(&from_pass, &[n as i32, 1]), &p, &column))
                .map_err(EngineError::inference)?;
        }
        let mut rest = Vec::with_capacity(n * (width - 1));
        for (&token, d) in known.iter().zip(&drafts) {
            rest.extend_from_slice(d);
            let fill = d.last().copied().unwrap_or(token);
            rest.extend(std::iter::repeat_n(fill, width - 1 - d.len()));
        }
        let input = mlx_rs::ops::concatenate(&[column, Array::from_slice(&rest, &[n as i32, width as i32 - 1])], 1)
            .map_err(EngineError::inference)?;
        let lm = &self.model.lm;
        let picks = lm
            .embed(&input)
            .and_then(|x| lm.forward(&x, cache, &MediaPositions::default()))
            .and_then(|h| lm.logits_all(&h))
            .and_then(|logits| Ok(argmax_axis(&logits, -1, None)?))
            .map_err(EngineError::inference)?;
        mlx_rs::transforms::async_eval([&picks]).map_err(EngineError::inference)?;
        let fill: Vec<i32> = drafts.iter().map(|d| (width - 1 - d.len()) as i32).collect();
        trim(cache, &fill)?;
        self.plain_before = None;
        Ok(Pass { picks, drafts, rows: vec![RowState::Live; n], guesses, misguessed: vec![false; n], width, started })
    }

    /// Reads pass `p` and hands each live row its accepted drafts and the
    /// model's pick after them. Where `next` was built on `p`, a row that
    /// rejected drafts (or ended) is stale in it; where nothing was, each
    /// row's cache forgets its rejected drafts and its token ahead is set.
    /// Returns the rows that ended and how many rows went stale.
    fn settle(
        &mut self,
        mut p: Pass,
        mut next: Option<&mut Pass>,
        seqs: &mut [&mut Sequence],
    ) -> Result<(Vec<RowOutcome>, usize), EngineError> {
        p.picks.eval().map_err(EngineError::inference)?;
        let n = self.rows.len();
        let width = p.width;
        let all = p.picks.as_slice::<u32>();
        let mut ended = Vec::new();
        let mut forget = vec![0; n];
        let mut ahead = vec![0u32; n];
        let mut stale = 0;
        for r in 0..n {
            let state = std::mem::replace(&mut p.rows[r], RowState::Fixed);
            let (f, token) = match state {
                RowState::Fixed => continue,
                RowState::Stale { forget, ahead } => (forget, ahead),
                RowState::Live => {
                    let d = &p.drafts[r];
                    let picks = &all[r * width..(r + 1) * width];
                    let accepted = lookup::accepted_prefix(d, picks);
                    let token = picks[accepted];
                    // Drafts after a wrong guess were rejected for the guess.
                    if !(p.misguessed[r] && accepted == 0) {
                        seqs[r].verified(d.len(), accepted);
                    }
                    let mut over = false;
                    for &t in d[..accepted].iter().chain(std::iter::once(&token)) {
                        if let Some(end) = seqs[r].accept(t) {
                            ended.push((self.rows[r].seq, end));
                            over = true;
                            break;
                        }
                    }
                    let rejected = (d.len() - accepted) as i32;
                    if let Some(q) = next.as_deref_mut() {
                        if rejected > 0 || over {
                            let forget = rejected + 1 + q.drafts[r].len() as i32;
                            q.rows[r] = RowState::Stale { forget, ahead: token };
                            stale += 1;
                        } else {
                            q.misguessed[r] = q.guesses[r].is_some_and(|g| g != token);
                        }
                        continue;
                    }
                    (rejected, token)
                }
            };
            if next.is_some() {
                return Err(EngineError::Internal("a stale row outlived the pass that was to fix it".into()));
            }
            forget[r] = f;
            ahead[r] = token;
        }
        for row in &mut self.rows {
            row.taken = true;
        }
        // The pass's cost is the time since the pass before it was read
        // (the next one was built in it), or since it was begun.
        let now = Instant::now();
        let since = self.settled.filter(|&s| s > p.started).unwrap_or(p.started);
        self.costs.borrow_mut().verify_pass(n * width, now.duration_since(since).as_secs_f64());
        self.settled = next.is_some().then_some(now);
        if next.is_none() {
            let cache = self.cache.as_mut().ok_or_else(|| EngineError::Internal("a batch lost its cache".into()))?;
            trim(cache, &forget)?;
            self.ahead = Some(Array::from_slice(&ahead, &[n as i32, 1]));
        }
        Ok((ended, stale))
    }
}

/// Each row's cache forgets `forget[r]` positions at its end (nothing
/// when all are 0).
fn trim(cache: &mut crate::model::kv_cache::KvCache, forget: &[i32]) -> Result<(), EngineError> {
    if forget.iter().all(|&f| f == 0) {
        return Ok(());
    }
    match cache.trim_rows(forget).map_err(EngineError::inference)? {
        true => Ok(()),
        false => Err(EngineError::Internal("a verified cache could not forget its rejected drafts".into())),
    }
}
