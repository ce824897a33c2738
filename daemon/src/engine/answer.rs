//! Answering a generation that ended: `Done` with its stats (after saving
//! a session's turn, freeing prompt-cache blocks when the disk is full),
//! nothing for a client that left, or its error.

use super::thread::Engine;
use super::{generate, scheduler, SessionTurn};
use crate::error::EngineError;
use crate::sessions;
use mlxbc_shared::Response;
use std::sync::atomic::Ordering;
use tokio::sync::mpsc as tmpsc;

/// What a session turn that found the disk full frees from the prompt
/// cache's disk tier before trying again (a session file is kilobytes; the
/// margin is for whatever else filled the disk meanwhile).
const SESSION_ROOM_BYTES: u64 = 64 << 20;

/// True when both paths are on one filesystem (so freeing one frees room
/// for the other).
fn same_filesystem(a: &std::path::Path, b: &std::path::Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    matches!((std::fs::metadata(a), std::fs::metadata(b)), (Ok(x), Ok(y)) if x.dev() == y.dev())
}

impl Engine {
    /// Answers a generation that ended: `Done` (saving a session's turn
    /// first), nothing for a client that left, or its error.
    pub(super) fn answer(&mut self, (active, outcome): scheduler::Ended) {
        let scheduler::Active { seq, stop, turn, keep_alive, .. } = active;
        self.residency.touch(seq.model_name(), keep_alive);
        self.finish(outcome, seq.events(), &stop, turn);
    }

    pub(super) fn finish(
        &mut self,
        outcome: Result<generate::Finished, EngineError>,
        events: &tmpsc::UnboundedSender<Response>,
        stop: &[String],
        turn: Option<SessionTurn>,
    ) {
        match outcome {
            Ok(generate::Finished::Done(mut stats)) => {
                if let Some(SessionTurn { name, mut messages, started }) = turn {
                    messages.push(mlxbc_shared::ChatMessage::assistant(self.answer_text(&stats, stop)));
                    let mut saved = self.sessions.finish(&name, &started, &messages);
                    if let (Err(sessions::SessionError::Io { source, .. }), Some(disk)) = (&saved, self.prompts.disk())
                    {
                        // Sessions get the disk before the cache: a full
                        // disk gives up cached KV blocks for the turn.
                        if source.kind() == std::io::ErrorKind::StorageFull
                            && same_filesystem(disk.dir(), self.sessions.dir())
                        {
                            let freed = disk.free_for_others(SESSION_ROOM_BYTES);
                            tracing::warn!(
                                freed_bytes = freed,
                                "the disk is full: prompt cache blocks removed so a session turn can be saved"
                            );
                            if freed > 0 {
                                saved = self.sessions.finish(&name, &started, &messages);
                            }
                        }
                    }
                    if let Err(e) = saved {
                        // The answer stands, but the client must know the turn is lost.
                        tracing::warn!(session = %crate::logging::peer(&name), "{}", crate::logging::peer(&e.to_string()));
                        stats.warnings.push(format!("this turn was answered but not saved to session {name}: {e}"));
                    }
                }
                self.metrics.generation(&stats.model, "done", Some(&stats));
                let _ = events.send(Response::Done { stats });
            }
            Ok(generate::Finished::AskedForMedia) => {}
            Ok(generate::Finished::Abandoned) => {
                self.cancelled.fetch_add(1, Ordering::SeqCst);
                self.metrics.generation("", "cancelled", None);
                tracing::info!("generation cancelled: the client went away");
            }
            Err(e) => {
                tracing::warn!(kind = ?e.kind(), message = %crate::logging::peer(&e.to_string()), "generation failed");
                self.metrics.generation("", &format!("{:?}", e.kind()), None);
                let _ = events.send(e.into_response());
            }
        }
    }

    /// The text a finished generation streamed: its tokens decoded, cut
    /// before the first stop string (the stream held those back).
    fn answer_text(&self, stats: &mlxbc_shared::GenerationStats, stop: &[String]) -> String {
        let Some(model) = self.residency.get(&stats.model) else { return String::new() };
        let mut text = model.prompter.tokenizer.decode(&stats.token_ids, true).unwrap_or_default();
        if let Some(cut) = stop.iter().filter_map(|s| text.find(s.as_str())).min() {
            text.truncate(cut);
        }
        text
    }
}
