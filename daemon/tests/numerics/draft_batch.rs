//! A draft model's rows drafted together (`engine::draft_batch`): whatever
//! the rows went through — joining at different lengths, accepting
//! different numbers of drafts (so they fall one or two tokens behind),
//! sitting proposals out, parked after resting long, far behind, gone —
//! each row's proposal is the greedy continuation of its history that the
//! model gives that history alone.

use mlx_rs::ops::indexing::argmax_axis;
use mlx_rs::Array;
use mlxbc_daemon::engine::draft_batch::{DraftAsk, DraftBatch};
use mlxbc_daemon::model::decode_step::DecodeMode;
use mlxbc_daemon::model::kv_cache::KvCache;
use mlxbc_daemon::model::positions::MediaPositions;
use mlxbc_daemon::model::weights::WeightForm;
use mlxbc_daemon::model::Model;
use std::rc::Rc;

use crate::common::*;

const K: usize = 4;

/// The model's greedy continuation of `history` alone, `k` tokens, cut
/// before the first id outside its tokenizer (as a draft is).
fn alone(model: &Model, history: &[u32], k: usize) -> Vec<u32> {
    let lm = &model.lm;
    let plain = MediaPositions::default();
    let mut cache = KvCache::new(lm.num_layers());
    let ids = Array::from_slice(history, &[1, history.len() as i32]);
    let mut logits = lm.logits(&lm.forward(&lm.embed(&ids).unwrap(), &mut cache, &plain).unwrap()).unwrap();
    let mut out = Vec::new();
    for _ in 0..k {
        let y = argmax_axis(&logits, -1, None).unwrap().item_cast::<u32>();
        out.push(y);
        let ids = Array::from_slice(&[y], &[1, 1]);
        logits = lm.logits(&lm.forward(&lm.embed(&ids).unwrap(), &mut cache, &plain).unwrap()).unwrap();
    }
    let vocab = model.prompter.tokenizer.get_vocab_size(true) as u32;
    if let Some(cut) = out.iter().position(|&d| d >= vocab) {
        out.truncate(cut);
    }
    out
}

/// Sequences' histories, and the proposal round that asks some of them.
struct Rows {
    model: Rc<Model>,
    batch: DraftBatch,
    histories: Vec<Vec<u32>>,
    /// A stand-in for the target's picks: any token continues a history.
    next: u32,
}

impl Rows {
    /// Proposals for `asked` (each checked against the row alone); then
    /// the target accepts `accepted[i]` of row i's and adds its own token.
    fn round(&mut self, asked: &[usize], accepted: &[usize], what: &str) {
        let asks: Vec<DraftAsk> =
            asked.iter().map(|&i| DraftAsk { seq: i as u64, history: self.histories[i].clone(), k: K }).collect();
        let (proposals, _) = self.batch.propose(&asks).unwrap_or_else(|e| panic!("{what}: {e:#}"));
        for ((&i, p), &a) in asked.iter().zip(&proposals).zip(accepted) {
            let want = alone(&self.model, &self.histories[i], K);
            assert_eq!(p, &want, "{what}: row {i}'s drafts differ from its history's alone");
            let a = a.min(p.len());
            self.batch.verified(i as u64, a);
            self.histories[i].extend_from_slice(&p[..a]);
            let t = self.take();
            self.histories[i].push(t);
        }
    }

    /// `n` tokens decoded by plain steps for row `i` (it did not draft).
    fn plain(&mut self, i: usize, n: usize) {
        for _ in 0..n {
            let t = self.take();
            self.histories[i].push(t);
        }
    }

    fn take(&mut self) -> u32 {
        self.next = (self.next * 31 + 7) % 500 + 3;
        self.next
    }
}

fn assert_rows_draft_as_alone(rel: &str) {
    let model = Rc::new(
        mlxbc_daemon::families::load(&fixture(rel), WeightForm::DenseF32, None)
            .unwrap_or_else(|e| panic!("loading {rel}: {e:#} (build the fixtures with scripts/test-fixtures)")),
    );
    let histories = vec![
        vec![5, 17, 42, 99, 7, 3, 64, 12, 8],
        vec![11, 23, 31],
        (0..40).map(|i| (i * 13 % 300) + 2).collect(),
        vec![2, 4, 6, 8, 10, 12],
    ];
    let mut rows = Rows { batch: DraftBatch::new(model.clone(), DecodeMode::Eager), model, histories, next: 1 };
    // Two rows join; one accepts every draft (two behind next time).
    rows.round(&[0, 1], &[K, 1], "first proposal");
    rows.round(&[0, 1], &[0, K], "one and two behind");
    // A third joins, longer; then every acceptance differs.
    rows.round(&[0, 1, 2], &[2, 0, K], "a row joining");
    rows.round(&[0, 1, 2], &[1, 3, 0], "different acceptances");
    // Row 1 rests (plain steps) and sits proposals out until parked.
    for r in 0..5 {
        rows.plain(1, 1);
        rows.round(&[0, 2], &[K, 1], &format!("row 1 sitting out ({r})"));
    }
    rows.round(&[0, 1, 2], &[1, 1, 1], "row 1 back from the park");
    // Row 2 falls further behind than rows are fed together, in the batch.
    rows.round(&[0, 1], &[0, 0], "row 2 sitting out once");
    rows.plain(2, 12);
    rows.round(&[0, 1, 2, 3], &[K, 2, 1, 0], "row 2 far behind, row 3 joining");
    // Row 0 ends: the others go on.
    rows.batch.remove(&[0]).unwrap();
    rows.round(&[1, 2, 3], &[K, K, K], "row 0 gone");
    rows.round(&[3], &[2], "one row asking");
    rows.round(&[1, 2, 3], &[0, 1, 2], "all asking again");
}

/// Tiny Qwen3 (random weights) and SmolLM2's MLX directory (real weights).
#[test]
fn rows_drafted_together_draft_what_each_drafts_alone() {
    for rel in ["mlx/tiny-qwen3", "mlx/smollm2-mlx"] {
        assert_rows_draft_as_alone(rel);
    }
}
