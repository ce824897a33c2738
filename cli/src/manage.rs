//! The daemon-management commands: models, ps, status, load, unload, cache, prefetch.

use crate::{keep_alive, CacheCmd, Command};
use anyhow::Result;
use mlxbc_client::{CacheCommand, Client};
use std::io::Write;

/// Keep-alives this long are forever for practical purposes (2^63 s was
/// printed as `9223372036854775807s`).
const FOREVER_S: u64 = 100 * 365 * 24 * 3600;

/// Bytes as MiB with one decimal.
fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

pub async fn manage(client: &mut Client, command: Command) -> Result<()> {
    let mut out = std::io::stdout().lock();
    match command {
        Command::Models => {
            writeln!(
                out,
                "{:<48} {:<6} {:<7} {:>12} {:<9} {:<7} ALIASES",
                "NAME", "FORMAT", "KIND", "SIZE", "SOURCE", "LOADED"
            )?;
            for m in client.list_models().await? {
                writeln!(
                    out,
                    "{:<48} {:<6} {:<7} {:>12} {:<9} {:<7} {}",
                    m.name,
                    m.format,
                    m.capability,
                    mib(m.size_bytes),
                    m.source,
                    if m.loaded { "yes" } else { "" },
                    m.aliases.join(",")
                )?;
            }
        }
        Command::Ps => {
            let s = client.status().await?;
            writeln!(
                out,
                "{:<40} {:<10} {:>12} {:<4} {:<10} {:>10} {:>10}  {:<24} WEIGHTS",
                "NAME", "ARCH", "MEMORY", "PIN", "KEEP", "UNLOAD IN", "LAST USE", "SPECULATION"
            )?;
            for m in &s.loaded {
                let until = match m.expires_in_s {
                    Some(s) if s < FOREVER_S => format!("{s}s"),
                    _ => "never".into(),
                };
                writeln!(
                    out,
                    "{:<40} {:<10} {:>12} {:<4} {:<10} {:>10} {:>10}  {:<24} {}",
                    m.name,
                    m.architecture,
                    mib(m.memory_bytes),
                    if m.pinned { "yes" } else { "" },
                    crate::human_duration(m.keep_alive),
                    until,
                    format!("{}s ago", m.idle_s),
                    speculation(m),
                    m.batch_weights
                )?;
                for a in &m.adapters {
                    writeln!(out, "  + adapter {} ({} rank {}, {})", a.name, a.method, a.rank, mib(a.bytes))?;
                }
            }
            if !s.sequences.is_empty() {
                writeln!(
                    out,
                    "\n{:>6} {:<40} {:<8} {:>7} {:>9} {:>6} {:>9} {:>12}",
                    "SEQ", "MODEL", "STATE", "PROMPT", "GENERATED", "BATCH", "AGE", "KV RESERVED"
                )?;
                for q in &s.sequences {
                    writeln!(
                        out,
                        "{:>6} {:<40} {:<8} {:>7} {:>9} {:>6} {:>9} {:>12}",
                        q.id,
                        q.model,
                        q.state,
                        q.prompt_tokens,
                        q.generated_tokens,
                        if q.batch_size > 0 { q.batch_size.to_string() } else { "-".into() },
                        format!("{:.1}s", q.age_ms as f64 / 1000.0),
                        mib(q.reserved_kv_bytes)
                    )?;
                }
            }
            let used: u64 = s.loaded.iter().map(|m| m.memory_bytes).sum();
            let avail = s.available_bytes.map_or("unknown".into(), mib);
            writeln!(
                out,
                "\nmemory: {} of {} budget (models), {} reserved for generations' KV; {avail} available on this machine",
                mib(used),
                mib(s.memory_budget_bytes),
                mib(s.reserved_kv_bytes)
            )?;
            for e in &s.memory_sheds {
                writeln!(
                    out,
                    "shed {}s ago under memory pressure ({} available): {} — {} ({})",
                    e.ago_s,
                    mib(e.available_bytes),
                    e.tier,
                    e.what,
                    mib(e.freed_bytes)
                )?;
            }
        }
        Command::Status { json: true } => {
            let status = client.status().await?;
            let stores = client.cache(mlxbc_client::CacheCommand::Stats).await?;
            writeln!(
                out,
                "{}",
                serde_json::to_string_pretty(&serde_json::json!({"status": status, "stores": stores}))?
            )?;
        }
        Command::Status { json: false } => {
            let s = client.status().await?;
            writeln!(out, "mlxbcd {} (protocol {}), pid {}, up {}s", s.daemon_version, s.protocol, s.pid, s.uptime_s)?;
            writeln!(out, "socket:   {}", client.socket().display())?;
            writeln!(out, "device:   {} (BLAS: {})", s.device, s.blas)?;
            writeln!(
                out,
                "memory:   MLX active {}, peak {}, RSS {}",
                mib(s.mlx_active_bytes),
                mib(s.mlx_peak_bytes),
                mib(s.rss_bytes)
            )?;
            writeln!(out, "loaded:   {}", s.loaded.iter().map(|m| m.name.as_str()).collect::<Vec<_>>().join(", "))?;
            writeln!(
                out,
                "queue:    {} jobs waiting for the engine; {} requests served, {} generations cancelled (client went away)",
                s.queued_jobs, s.requests_served, s.generations_cancelled
            )?;
            let decoding = s.sequences.iter().filter(|q| q.state == "decode").count();
            let largest = s.sequences.iter().map(|q| q.batch_size).max().unwrap_or(0);
            writeln!(
                out,
                "running:  {} generations ({decoding} decoding, largest batch {largest}), {} waiting for admission \
                 (max_batch {}, max_queue {}); {} of KV reserved",
                s.sequences.len().saturating_sub(s.admission_queue as usize),
                s.admission_queue,
                s.max_batch,
                s.max_queue,
                mib(s.reserved_kv_bytes)
            )?;
            writeln!(
                out,
                "clients:  {} connections open (cap {}); {} idle ones closed for room, {} refused (all busy)",
                s.connections_open, s.connections_cap, s.connections_evicted, s.connections_refused
            )?;
            if let Some(c) = &s.cluster {
                writeln!(out, "group:    {} over {}", c.state, c.backend)?;
                for r in &c.ranks {
                    let step = if r.step_ms > 0.0 { format!(", step {:.1} ms", r.step_ms) } else { String::new() };
                    writeln!(out, "  rank {} {} memory {}{step}", r.rank, r.host, mib(r.rss_bytes))?;
                }
                for (model, how) in &c.models {
                    writeln!(out, "  {model}: {how}")?;
                }
                writeln!(
                    out,
                    "  {} calls, {:.2} ms each, of which {:.2} ms sending plans and inputs; one all-reduce of a \
                     4096-wide row {:.0} us",
                    c.calls, c.mean_call_ms, c.mean_message_ms, c.all_sum_us
                )?;
                if let Some(why) = &c.last_break {
                    writeln!(out, "  last break: {why}")?;
                }
            }
            if s.http_connections_cap > 0 {
                writeln!(
                    out,
                    "gateway:  {} HTTP connections open (cap {}); {} idle ones closed for room, {} refused (all busy)",
                    s.http_connections_open,
                    s.http_connections_cap,
                    s.http_connections_evicted,
                    s.http_connections_refused
                )?;
            }
        }
        Command::Cluster { verb: crate::ClusterCmd::Restart } => {
            let s = client.cluster_restart().await?;
            match &s.cluster {
                Some(c) => {
                    writeln!(out, "the group is forming again ({} ranks over {})", c.ranks.len().max(1), c.backend)?
                }
                None => writeln!(out, "this daemon leads no group")?,
            }
        }
        Command::Load { model, keep_alive: ka, sharded } => {
            let mut spinner = crate::progress::Spinner::start(format!("loading {model}"));
            let (name, ms, bytes) = client.load_with(&model, keep_alive(&ka)?, sharded).await?;
            spinner.stop();
            writeln!(out, "loaded {name} in {ms} ms ({})", mib(bytes))?;
        }
        Command::Unload { model } => {
            let was = client.unload(&model).await?;
            writeln!(out, "{}", if was { format!("unloaded {model}") } else { format!("{model} was not loaded") })?;
        }
        Command::Cache { command } => {
            let cmd = match command {
                CacheCmd::Stats => CacheCommand::Stats,
                CacheCmd::Ls => CacheCommand::List,
                CacheCmd::Clear { prompts: false } => CacheCommand::Clear,
                CacheCmd::Clear { prompts: true } => CacheCommand::ClearPrompts,
                CacheCmd::Verify => CacheCommand::Verify,
            };
            let r = client.cache(cmd).await?;
            for e in &r.listing {
                writeln!(out, "{}  tower {}  {}", e.content, e.tower, mib(e.bytes))?;
            }
            match command {
                CacheCmd::Clear { prompts: false } => writeln!(out, "removed {} entries", r.removed)?,
                CacheCmd::Clear { prompts: true } => {
                    writeln!(out, "removed {} prompt KV blocks from disk (and RAM)", r.removed)?
                }
                CacheCmd::Verify => writeln!(out, "{} entries ok, {} damaged entries removed", r.entries, r.removed)?,
                CacheCmd::Ls => {}
                CacheCmd::Stats => {
                    writeln!(out, "store:     {}", r.path)?;
                    writeln!(
                        out,
                        "entries:   {} ({} of {} on disk; {} in RAM, {})",
                        r.entries,
                        mib(r.disk_bytes),
                        mib(r.disk_budget_bytes),
                        r.ram_entries,
                        mib(r.ram_bytes)
                    )?;
                    writeln!(
                        out,
                        "hits:      {} RAM, {} disk; misses {}; evictions {}; corrupt {}",
                        r.ram_hits, r.disk_hits, r.misses, r.evictions, r.corrupt
                    )?;
                    if r.skipped_for_space > 0 {
                        writeln!(
                            out,
                            "disk full: {} entries kept in RAM only (the disk is down to its reserve)",
                            r.skipped_for_space
                        )?;
                    }
                    let p = &r.prompts;
                    writeln!(out, "prompts:   {} ({} tokens per block)", p.path, p.block_tokens)?;
                    writeln!(
                        out,
                        "blocks:    {} on disk ({} of {}); {} in RAM ({} of {})",
                        p.disk_blocks,
                        mib(p.disk_bytes),
                        mib(p.disk_budget_bytes),
                        p.ram_blocks,
                        mib(p.ram_bytes),
                        mib(p.ram_budget_bytes)
                    )?;
                    writeln!(
                        out,
                        "reused:    {} prompt tokens from RAM, {} from disk; {} blocks stored; evictions {} RAM, {} disk; corrupt {}; writes dropped {}",
                        p.ram_hit_tokens, p.disk_hit_tokens, p.stored_blocks, p.ram_evictions, p.disk_evictions, p.corrupt, p.writes_dropped
                    )?;
                    if p.disk_room_bytes < p.disk_budget_bytes.saturating_sub(p.disk_bytes)
                        || p.disk_skipped_for_space > 0
                    {
                        writeln!(
                            out,
                            "disk room: {} more before the filesystem's reserve (disk_reserve_percent, disk_reserve_mib); {} blocks not written for it",
                            mib(p.disk_room_bytes),
                            p.disk_skipped_for_space
                        )?;
                    }
                    if p.disk_skipped_tokens > 0 {
                        writeln!(
                            out,
                            "computed:  {} prompt tokens on disk were prefilled instead of read (measured faster on this device)",
                            p.disk_skipped_tokens
                        )?;
                    }
                }
            }
        }
        Command::Sessions { command } => {
            use crate::SessionsCmd;
            use mlxbc_client::SessionCommand;
            match command.unwrap_or(SessionsCmd::Ls) {
                SessionsCmd::Ls => {
                    for s in client.sessions(SessionCommand::List).await? {
                        writeln!(out, "{:<32} {} messages", s.name, s.messages.len())?;
                    }
                }
                SessionsCmd::Show { name } => {
                    let found = client.sessions(SessionCommand::Show { name: name.clone() }).await?;
                    if found.iter().all(|s| s.messages.is_empty()) {
                        anyhow::bail!("no session {name} (`mlxbc sessions ls` lists them)");
                    }
                    for s in found {
                        for m in s.messages {
                            writeln!(out, "{:?}: {}", m.role, m.content)?;
                        }
                    }
                }
                SessionsCmd::Rm { name } => {
                    let gone = client.sessions(SessionCommand::Delete { name: name.clone() }).await?;
                    writeln!(
                        out,
                        "{}",
                        if gone.is_empty() { format!("no session {name}") } else { format!("forgot {name}") }
                    )?;
                }
            }
        }
        Command::Prefetch { model, files } => {
            let outcome = crate::prefetch::run(client, model.as_deref(), &files).await?;
            write!(out, "{} encoded, {} already stored", outcome.encoded, outcome.cached)?;
            match outcome.failed.len() {
                0 => writeln!(out)?,
                n => writeln!(out, ", {n} failed")?,
            }
            for (path, why) in &outcome.failed {
                eprintln!("mlxbc: {}: {why}", path.display());
            }
            if !outcome.failed.is_empty() {
                anyhow::bail!(crate::Refused(format!(
                    "{} of {} files could not be prefetched (above)",
                    outcome.failed.len(),
                    files.len()
                )));
            }
        }
        Command::Ask(_)
        | Command::Transcribe(_)
        | Command::Embed(_)
        | Command::Rerank(_)
        | Command::Stop
        | Command::Service { .. }
        | Command::Completions { .. }
        | Command::Chat(_)
        | Command::Pull { .. } => {
            unreachable!("handled in run")
        }
    }
    Ok(())
}

/// A model's speculation for `mlxbc ps`: its default mode and, once it has
/// drafted, how many drafted tokens were accepted.
fn speculation(m: &mlxbc_client::LoadedModel) -> String {
    match m.draft_tokens {
        0 => m.speculation.clone(),
        d => format!("{}, {:.0}% of {d} accepted", m.speculation, 100.0 * m.accepted_draft_tokens as f64 / d as f64),
    }
}
