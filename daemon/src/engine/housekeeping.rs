//! Housekeeping between ticks, every `PRESSURE_POLL`: the idle clocks of
//! models in use restart, keep-alives expire, and under memory pressure one
//! tier at a time is let go (encoder RAM tier, prompt-cache RAM tier, the
//! least recently used unpinned model).

use super::memory;
use super::thread::Engine;
use mlxbc_shared::sync::lock;
use mlxbc_shared::ShedEvent;
use std::time::{Duration, Instant};

/// How often the engine looks at available memory when idle.
pub(super) const PRESSURE_POLL: Duration = Duration::from_secs(2);

/// How many shed events status keeps.
const SHED_HISTORY: usize = 32;

impl Engine {
    /// Keep-alive expiry and memory pressure; publishes status after.
    pub(super) fn housekeeping(&mut self) {
        self.last_housekeeping = Instant::now();
        // Models generating are in use: their idle clocks restart.
        for name in self.scheduler.models_in_use() {
            self.residency.touch(&name, None);
        }
        let speaking: Vec<String> = self.transcriptions.models().map(String::from).collect();
        for name in speaking {
            self.residency.touch(&name, None);
        }
        for name in self.residency.expire() {
            self.prompts.clear_ram();
            tracing::info!(model = %name, "keep-alive expired: unloaded");
        }
        if !self.residency.take_evicted().is_empty() {
            self.prompts.clear_ram();
        }
        self.relieve_memory_pressure();
        // An idle group is asked for its ranks' memory now and then, which
        // also finds a rank that went away while nothing ran.
        if let Some(split) = &self.residency.cluster {
            if self.scheduler.is_empty() {
                split.coordinator.report_if_due();
            }
        }
        self.publish();
    }

    /// Under memory pressure, lets go of one tier at a time — the encoder RAM
    /// tier, then the prompt cache's RAM tier, then the least recently used unpinned
    /// model — re-reading available memory after each, until it recovers.
    fn relieve_memory_pressure(&mut self) {
        loop {
            let Some(available) = memory::available_bytes() else { return };
            if available >= self.low_memory_bytes {
                return;
            }
            let shed = if let Some(n) = self.store.as_ref().map(|s| s.lock().shed_ram()).filter(|&n| n > 0) {
                ("encoder RAM tier", "cached image features".to_string(), n as u64)
            } else if !self.prompts.is_empty() {
                let bytes = self.prompts.ram_usage().1;
                ("prompt cache RAM tier", format!("{} prompt KV blocks", self.prompts.clear_ram()), bytes)
            } else if let Some((name, bytes)) = self.residency.shed_one() {
                self.prompts.clear_ram();
                ("model", name, bytes)
            } else {
                return; // nothing left that may go: pinned models stay
            };
            let _ = mlx_rs::memory::clear_cache();
            let (tier, what, freed_bytes) = shed;
            tracing::warn!(tier, %what, freed_bytes, available, threshold = self.low_memory_bytes, "memory pressure: shed");
            let mut snap = lock(&self.snapshot);
            snap.sheds.push((
                Instant::now(),
                ShedEvent { ago_s: 0, tier: tier.into(), what, freed_bytes, available_bytes: available },
            ));
            let excess = snap.sheds.len().saturating_sub(SHED_HISTORY);
            snap.sheds.drain(..excess);
        }
    }
}
