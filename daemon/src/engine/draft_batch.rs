//! A decode batch's rows that draft with one draft model, drafted together:
//! one batch KV cache of the draft model holds every such row's history
//! (aligned at the ends by left padding, as the target's batch is), and a
//! proposal of `k` tokens for all of them is `k` batched passes of the draft
//! model instead of `k` passes per row. On a GPU a small model's pass costs
//! host time whatever its rows, so drafting 16 rows one by one cost 16 times
//! what drafting them together costs.
//!
//! The cache follows each row's history lazily. After a verify pass a row
//! holds its history up to where it drafted plus the drafts the target
//! accepted; the rejected ones are forgotten at its next proposal (with any
//! other positions to forget, in one [`KvCache::trim_rows`]). A proposal
//! first feeds what each history added since: rows a few tokens behind are
//! fed together, rows that have only just asked are fed their histories in
//! one left-padded batch and joined at once, a row that rested long catches
//! up on its own (its row taken out of the batch, its history fed in
//! chunks, then joined back); rows that do not draft this time are fed a filler
//! they forget again, and one that rested long is parked outside the batch
//! so that it costs no compute until it drafts again.

use super::draft_model::DraftRun;
use super::scheduler::SeqId;
use crate::model::decode_step::DecodeMode;
use crate::model::kv_cache::KvCache;
use crate::model::options::DraftRows;
use crate::model::positions::MediaPositions;
use crate::model::Model;
use anyhow::Result;
use mlx_rs::ops::indexing::argmax_axis;
use mlx_rs::Array;
use std::collections::HashMap;
use std::rc::Rc;
use std::time::Instant;

/// History fed to the draft model per pass when a row catches up alone.
const CATCH_UP_CHUNK: usize = 512;

/// The most tokens a row may be behind and still be fed in the batch: the
/// rows fed together are fed as many tokens as the one furthest behind
/// (the others forget that many and take them again), so a row further
/// behind catches up alone.
const FEED_TOGETHER: usize = 8;

/// Proposals in a row that a row may sit out (fed a filler it forgets)
/// before it is parked outside the batch.
const PARK_AFTER: u32 = 4;

static TOGETHER: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Sets whether a decode batch drafts its rows of one draft model together
/// (the default) or each in a batch of its own, as before batches drafted
/// together (`MLXBC_DRAFT_ROWS=apart`: a diagnostic, for side-by-side runs).
pub fn configure(rows: DraftRows) {
    TOGETHER.store(rows == DraftRows::Together, std::sync::atomic::Ordering::Relaxed);
}

/// A row of the batch cache.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Row {
    seq: SeqId,
    /// Tokens of the sequence's history in the cache (a prefix of it),
    /// once the `forget` positions after them are forgotten.
    fed: usize,
    /// Positions at the row's end to forget before it is fed again:
    /// rejected drafts, a filler fed while it did not draft.
    forget: usize,
    /// Drafts of the last proposal fed after its history (all but the
    /// last one proposed); `fed` counts the history up to them.
    drafts_fed: usize,
    /// Proposals in a row it sat out.
    idle: u32,
}

/// A sequence's request for drafts: its key, its whole history (prompt and
/// answer so far), and how many tokens it wants.
pub struct DraftAsk {
    pub seq: SeqId,
    pub history: Vec<u32>,
    pub k: usize,
}

/// One draft model's rows of a decode batch (see the module's comment).
pub struct DraftBatch {
    model: Rc<Model>,
    /// The one sequence it drafts for, where rows draft apart.
    owner: Option<SeqId>,
    mode: DecodeMode,
    cache: Option<KvCache>,
    rows: Vec<Row>,
    /// Rows that rested long, with their own one-row caches.
    parked: HashMap<SeqId, (KvCache, Row)>,
    /// Token ids at or above this are not the tokenizer's (padding rows of
    /// an embedding): a draft stops before one, since the target's own
    /// embedding may not have such a row.
    vocab: u32,
}

impl DraftBatch {
    /// No rows yet, for `model`; a lone row's steps built as `mode` says.
    pub fn new(model: Rc<Model>, mode: DecodeMode) -> Self {
        let vocab = model.prompter.tokenizer.get_vocab_size(true) as u32;
        let mode = model.decode_mode(mode);
        Self { model, owner: None, mode, cache: None, rows: Vec::new(), parked: HashMap::new(), vocab }
    }

    /// A batch for `seq`'s drafts with `run`'s model: shared by every row
    /// with that model, or (`MLXBC_DRAFT_ROWS=apart`) `seq`'s own.
    pub fn for_row(run: &DraftRun, seq: SeqId, mode: DecodeMode) -> Self {
        let apart = !TOGETHER.load(std::sync::atomic::Ordering::Relaxed);
        Self { owner: apart.then_some(seq), ..Self::new(run.model().clone(), mode) }
    }

    /// Whether sequence `seq`, drafting with `run`'s model, drafts here.
    pub fn serves(&self, run: &DraftRun, seq: SeqId) -> bool {
        Rc::ptr_eq(&self.model, run.model()) && self.owner.is_none_or(|o| o == seq)
    }

    /// True when no sequence has a row here or parked.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty() && self.parked.is_empty()
    }

    /// Forgets the rows of `gone` sequences.
    pub fn remove(&mut self, gone: &[SeqId]) -> Result<()> {
        self.parked.retain(|seq, _| !gone.contains(seq));
        let keep: Vec<usize> = (0..self.rows.len()).filter(|&r| !gone.contains(&self.rows[r].seq)).collect();
        self.keep(&keep)
    }

    /// Keeps rows `keep` of the batch cache, in that order.
    fn keep(&mut self, keep: &[usize]) -> Result<()> {
        if keep.len() == self.rows.len() {
            return Ok(());
        }
        if keep.is_empty() {
            self.cache = None;
            self.rows.clear();
            return Ok(());
        }
        if let Some(cache) = self.cache.as_mut() {
            cache.keep_rows(keep)?;
        }
        self.rows = keep.iter().map(|&r| self.rows[r]).collect();
        Ok(())
    }

    /// Row `r` of the batch cache as a one-row cache of its own (the
    /// positions it had to forget forgotten), taken out of the batch.
    fn take_out(&mut self, r: usize) -> Result<(KvCache, Row)> {
        let mut row = self.rows[r];
        let Some(mut alone) = self.cache.clone() else { anyhow::bail!("a draft row without a cache") };
        alone.keep_rows(&[r])?;
        if row.forget > 0 {
            anyhow::ensure!(alone.trim_rows(&[row.forget as i32])?, "a draft row could not forget its rejected drafts");
            row.forget = 0;
        }
        let keep: Vec<usize> = (0..self.rows.len()).filter(|&i| i != r).collect();
        self.keep(&keep)?;
        Ok((alone, row))
    }

    /// Adds the rows of `cache` (theirs, in order) after the batch's.
    fn put_in(&mut self, cache: KvCache, rows: impl IntoIterator<Item = Row>) -> Result<()> {
        match self.cache.as_mut() {
            Some(mine) => mine.join(cache)?,
            None => self.cache = Some(cache),
        }
        self.rows.extend(rows);
        Ok(())
    }

    /// Feeds a one-row cache `history` after its first `fed` tokens, all
    /// but the last token (which the proposal's first step feeds).
    fn catch_up(&self, cache: &mut KvCache, history: &[u32], fed: usize) -> Result<()> {
        let lm = &self.model.lm;
        for chunk in history[fed..history.len() - 1].chunks(CATCH_UP_CHUNK) {
            let ids = Array::from_slice(chunk, &[1, chunk.len() as i32]);
            lm.forward(&lm.embed(&ids)?, cache, &MediaPositions::default())?;
            mlx_rs::transforms::eval(cache.arrays())?;
        }
        Ok(())
    }

    /// Feeds the histories of `fresh` rows (all but each one's last token)
    /// in one batch, left-padded to the longest, and joins them to the
    /// batch, one behind: a burst of new sequences costs one prefill of the
    /// draft model and one join, not one of each per row.
    fn feed_fresh(&mut self, fresh: &[&DraftAsk]) -> Result<()> {
        use mlx_rs::ops::indexing::IndexOp;
        let Some(longest) = fresh.iter().map(|a| a.history.len() - 1).max() else { return Ok(()) };
        let mut ids = Vec::with_capacity(fresh.len() * longest);
        let mut pads = Vec::with_capacity(fresh.len());
        for a in fresh {
            let fed = &a.history[..a.history.len() - 1];
            pads.push((longest - fed.len()) as i32);
            ids.extend(std::iter::repeat_n(0, longest - fed.len()));
            ids.extend_from_slice(fed);
        }
        let lm = &self.model.lm;
        let ids = Array::from_slice(&ids, &[fresh.len() as i32, longest as i32]);
        let mut cache = KvCache::batch(lm.num_layers(), pads);
        for at in (0..longest).step_by(CATCH_UP_CHUNK) {
            let end = (at + CATCH_UP_CHUNK).min(longest) as i32;
            lm.forward(&lm.embed(&ids.index((.., at as i32..end)))?, &mut cache, &MediaPositions::default())?;
            mlx_rs::transforms::eval(cache.arrays())?;
        }
        let rows =
            fresh.iter().map(|a| Row { seq: a.seq, fed: a.history.len() - 1, forget: 0, drafts_fed: 0, idle: 0 });
        self.put_in(cache, rows)
    }

    /// The draft model's greedy continuations of the asked histories, in
    /// `asks`' order: `k` tokens each (fewer where it picks an id outside
    /// the tokenizer; none for a history too short to draft from), and the
    /// seconds the proposal took. Every row proposed for must hear how its
    /// proposal went ([`Self::verified`]) before the next one.
    pub fn propose(&mut self, asks: &[DraftAsk]) -> Result<(Vec<Vec<u32>>, f64)> {
        let t = Instant::now();
        let k = asks.iter().map(|a| a.k).max().unwrap_or(0);
        let mut out = vec![Vec::new(); asks.len()];
        if k == 0 {
            return Ok((out, 0.0));
        }
        let index = |rows: &[Row], seq: SeqId| rows.iter().position(|r| r.seq == seq);
        // Rows that are parked or too far behind (or, were the history
        // cut, ahead) catch up alone and join the batch one behind; rows
        // new here are fed together, then join it at once.
        let mut fresh = Vec::new();
        for ask in asks.iter().filter(|a| a.history.len() >= 2) {
            let behind = |row: &Row| ask.history.len().checked_sub(row.fed).filter(|&b| b >= 1);
            let (mut alone, row) = match index(&self.rows, ask.seq) {
                Some(r) if behind(&self.rows[r]).is_some_and(|b| b <= FEED_TOGETHER) => continue,
                Some(r) => self.take_out(r)?,
                None => match self.parked.remove(&ask.seq) {
                    Some(parked) => parked,
                    None => {
                        fresh.push(ask);
                        continue;
                    }
                },
            };
            // A history that is not a continuation of what the row holds
            // (never so today): it starts over.
            if behind(&row).is_none() {
                fresh.push(ask);
                continue;
            }
            self.catch_up(&mut alone, &ask.history, row.fed)?;
            self.put_in(alone, [Row { fed: ask.history.len() - 1, forget: 0, drafts_fed: 0, idle: 0, ..row }])?;
        }
        self.feed_fresh(&fresh)?;
        // Rows that do not draft this time and sat out the last ones too
        // are parked.
        let asked = |seq: SeqId| asks.iter().find(|a| a.seq == seq && a.history.len() >= 2);
        let idle: Vec<usize> = (0..self.rows.len())
            .filter(|&r| asked(self.rows[r].seq).is_none() && self.rows[r].idle + 1 >= PARK_AFTER)
            .collect();
        for r in idle.into_iter().rev() {
            let (alone, row) = self.take_out(r)?;
            self.parked.insert(row.seq, (alone, row));
        }
        let Some(cache) = self.cache.as_mut() else { return Ok((out, t.elapsed().as_secs_f64())) };
        // Every asked row is fed the last `width` tokens of its history:
        // what it lacks, after taking back as many as it lacks fewer than
        // the row furthest behind.
        // A row too short to take back that many sits this one out.
        let rows = self.rows.clone();
        let mut ask_of: Vec<Option<&DraftAsk>> = rows.iter().map(|r| asked(r.seq)).collect();
        let behind = |r: &Row, a: &DraftAsk| a.history.len() - r.fed;
        let width = rows.iter().zip(&ask_of).filter_map(|(r, a)| a.map(|a| behind(r, a))).max().unwrap_or(1);
        for (row, ask) in rows.iter().zip(ask_of.iter_mut()) {
            if ask.is_some_and(|a| width - behind(row, a) > row.fed) {
                *ask = None;
            }
        }
        if ask_of.iter().all(Option::is_none) {
            return Ok((out, t.elapsed().as_secs_f64()));
        }
        let mut trim = Vec::with_capacity(rows.len());
        for (row, ask) in rows.iter().zip(&ask_of) {
            let retake = ask.map_or(0, |a| width - behind(row, a));
            trim.push((row.forget + retake) as i32);
        }
        if trim.iter().any(|&n| n > 0) && !cache.trim_rows(&trim)? {
            anyhow::bail!("the draft model's cache could not forget positions (a row held fewer)");
        }
        let mut ids = Vec::with_capacity(rows.len() * width);
        for ask in &ask_of {
            match ask {
                Some(a) => ids.extend_from_slice(&a.history[a.history.len() - width..]),
                // A filler, forgotten after: its row does not draft now.
                None => ids.extend(std::iter::repeat_n(0, width)),
            }
        }
        let lm = &self.model.lm;
        let plain = MediaPositions::default();
        let ids = Array::from_slice(&ids, &[rows.len() as i32, width as i32]);
        if width > 1 {
            use mlx_rs::ops::indexing::IndexOp;
            lm.forward(&lm.embed(&ids.index((.., ..width as i32 - 1)))?, cache, &plain)?;
        }
        // The k steps are one lazy graph, each feeding the previous argmax:
        // the host reads nothing until all k are queued. A lone row steps
        // as a lone sequence does (compiled on a CPU).
        let alone = rows.len() == 1 && !cache.is_padded();
        let mut token = {
            use mlx_rs::ops::indexing::IndexOp;
            ids.index((.., width as i32 - 1..))
        };
        let mut picks = Vec::with_capacity(k);
        for _ in 0..k {
            let logits = match alone {
                true => self.model.decode_logits(&token, cache, &plain, self.mode)?,
                false => lm.logits(&lm.forward(&lm.embed(&token)?, cache, &plain)?)?,
            };
            token = argmax_axis(&logits, -1, None)?.reshape(&[rows.len() as i32, 1])?;
            picks.push(token.clone());
        }
        let all = mlx_rs::ops::concatenate(&picks, 1)?;
        all.eval()?;
        let all = all.as_slice::<u32>();
        // k steps fed each history's last token and the first k - 1 picks
        // (the last pick is not in the cache: nothing followed it yet).
        for (r, (row, ask)) in self.rows.iter_mut().zip(&ask_of).enumerate() {
            match ask {
                Some(a) => {
                    let mut drafts = all[r * k..r * k + a.k].to_vec();
                    if let Some(cut) = drafts.iter().position(|&d| d >= self.vocab) {
                        drafts.truncate(cut);
                    }
                    let i = asks.iter().position(|x| x.seq == a.seq).expect("asked");
                    out[i] = drafts;
                    *row = Row { fed: a.history.len(), forget: 0, drafts_fed: k - 1, idle: 0, ..*row };
                }
                None => *row = Row { forget: width + k - 1, idle: row.idle + 1, ..*row },
            }
        }
        Ok((out, t.elapsed().as_secs_f64()))
    }

    /// The target accepted the first `accepted` drafts of `seq`'s last
    /// proposal (0 also when it was not verified at all): its row will
    /// forget the drafts after them.
    pub fn verified(&mut self, seq: SeqId, accepted: usize) {
        if let Some(row) = self.rows.iter_mut().find(|r| r.seq == seq) {
            let keep = accepted.min(row.drafts_fed);
            row.forget += row.drafts_fed - keep;
            row.fed += keep;
            row.drafts_fed = 0;
        }
    }
}
