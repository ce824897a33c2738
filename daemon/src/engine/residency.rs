//! Which models are resident, and for how long they stay after their last use.

use super::registry::ModelRegistry;
use crate::model::{weights::WeightForm, TextModel};
use mlxbc_shared::{ErrorKind, KeepAlive, LoadedModel};
use std::collections::HashMap;
use std::time::{Duration, Instant};

struct Resident {
    model: TextModel,
    /// MLX memory the load took.
    memory_bytes: u64,
    keep_alive: KeepAlive,
    last_used: Instant,
}

impl Resident {
    fn expires_at(&self) -> Option<Instant> {
        match self.keep_alive {
            KeepAlive::Forever => None,
            KeepAlive::Seconds(s) => Some(self.last_used + Duration::from_secs(s)),
        }
    }
}

/// The resident models and their keep-alive clocks.
pub struct Residency {
    models: HashMap<String, Resident>,
    default_keep_alive: KeepAlive,
}

impl Residency {
    /// No models yet; `default_keep_alive` applies when a request names none.
    pub fn new(default_keep_alive: KeepAlive) -> Self {
        Self { models: HashMap::new(), default_keep_alive }
    }

    /// Resolves `name` and loads it unless resident. Returns the canonical
    /// name and the milliseconds spent loading (0 when already resident).
    pub fn ensure_loaded(
        &mut self,
        registry: &ModelRegistry,
        name: Option<&str>,
        form: WeightForm,
        keep_alive: Option<KeepAlive>,
        fingerprints: Option<&sled::Tree>,
    ) -> Result<(String, f64), (ErrorKind, String)> {
        let resolved = registry.resolve(name).map_err(|m| (ErrorKind::UnknownModel, m))?;
        if self.models.contains_key(&resolved.name) {
            return Ok((resolved.name, 0.0));
        }
        let t = Instant::now();
        tracing::info!(model = %resolved.name, path = %resolved.path.display(), "loading model");
        let before = mlx_rs::memory::active_memory().unwrap_or(0);
        let model = TextModel::load(&resolved.path, form, fingerprints).map_err(|e| {
            (ErrorKind::ModelLoad, format!("loading model {} from {}: {e:#}", resolved.name, resolved.path.display()))
        })?;
        model.warm_up().map_err(|e| {
            (ErrorKind::ModelLoad, format!("running model {} for the first time: {e:#}", resolved.name))
        })?;
        let load_ms = t.elapsed().as_secs_f64() * 1000.0;
        let memory_bytes = mlx_rs::memory::active_memory().unwrap_or(0).saturating_sub(before) as u64;
        tracing::info!(model = %resolved.name, load_ms, memory_bytes, "model loaded");
        self.models.insert(
            resolved.name.clone(),
            Resident {
                model,
                memory_bytes,
                keep_alive: keep_alive.unwrap_or(self.default_keep_alive),
                last_used: Instant::now(),
            },
        );
        Ok((resolved.name, load_ms))
    }

    /// The resident model of that canonical name.
    pub fn get(&self, name: &str) -> Option<&TextModel> {
        self.models.get(name).map(|r| &r.model)
    }

    /// Restarts a model's idle clock, optionally with a new keep-alive.
    pub fn touch(&mut self, name: &str, keep_alive: Option<KeepAlive>) {
        if let Some(r) = self.models.get_mut(name) {
            r.last_used = Instant::now();
            if let Some(ka) = keep_alive {
                r.keep_alive = ka;
            }
        }
    }

    /// MLX memory a resident model took at load.
    pub fn memory_of(&self, name: &str) -> u64 {
        self.models.get(name).map_or(0, |r| r.memory_bytes)
    }

    /// Drops a model; false when it was not resident.
    pub fn unload(&mut self, name: &str) -> bool {
        let was = self.models.remove(name).is_some();
        if was {
            let _ = mlx_rs::memory::clear_cache();
            tracing::info!(model = %name, "unloaded");
        }
        was
    }

    /// How long until the next model's keep-alive runs out.
    pub fn next_expiry(&self) -> Option<Duration> {
        let now = Instant::now();
        self.models.values().filter_map(|r| r.expires_at()).min().map(|t| t.saturating_duration_since(now))
    }

    /// Unloads every model whose keep-alive has run out; returns their names.
    pub fn expire(&mut self) -> Vec<String> {
        let now = Instant::now();
        let gone: Vec<String> = self
            .models
            .iter()
            .filter(|(_, r)| r.expires_at().is_some_and(|t| t <= now))
            .map(|(n, _)| n.clone())
            .collect();
        for name in &gone {
            self.models.remove(name);
        }
        if !gone.is_empty() {
            let _ = mlx_rs::memory::clear_cache();
        }
        gone
    }

    /// Wire descriptions of the resident models.
    pub fn describe(&self) -> Vec<LoadedModel> {
        let now = Instant::now();
        let mut out: Vec<LoadedModel> = self
            .models
            .iter()
            .map(|(name, r)| LoadedModel {
                name: name.clone(),
                architecture: r.model.backbone.architecture().to_string(),
                memory_bytes: r.memory_bytes,
                keep_alive: r.keep_alive,
                expires_in_s: r.expires_at().map(|t| t.saturating_duration_since(now).as_secs()),
                idle_s: now.duration_since(r.last_used).as_secs(),
                context_length: r.model.backbone.context_length(),
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }
}
