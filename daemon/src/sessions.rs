//! Named conversations the daemon keeps for shells and editors
//! (`mlxbc chat --session NAME`): one JSON file per session under
//! `<data dir>/sessions/`, written atomically, so a conversation survives
//! daemon restarts. History is text: images of earlier turns are not kept
//! (their features stay in the feature store; ask about them again by sending them).
//!
//! One `SessionStore` serves the whole daemon (engine and connections share
//! it), and it is the only writer of these files: appends and deletes of one
//! session are serialized, and a turn that began before its session was
//! deleted is not written back (which used to resurrect the file).

use mlxbc_shared::sync::lock;
use mlxbc_shared::{ChatMessage, SessionInfo};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Why a session could not be read, written or named.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("bad session name {0:?}: use 1-64 letters, digits, '.', '_' or '-'")]
    BadName(String),
    #[error("session {name} is damaged: {source}")]
    Damaged { name: String, source: serde_json::Error },
    #[error("{doing} session {name}: {source}")]
    Io { doing: &'static str, name: String, source: std::io::Error },
    #[error("session {0} was deleted while this turn was being answered")]
    DeletedMeanwhile(String),
}

impl From<SessionError> for crate::error::EngineError {
    /// Every session failure is the request's: a name, or a file to fix.
    fn from(e: SessionError) -> Self {
        crate::error::EngineError::BadRequest(e.to_string())
    }
}

/// The session directory.
pub struct SessionStore {
    dir: PathBuf,
    /// Per session name, how many times it was deleted; held while a file is
    /// written or removed, so those never interleave.
    epochs: Mutex<HashMap<String, u64>>,
}

/// A session's history as a turn starts, and the epoch to append against.
pub struct Turn {
    pub history: Vec<ChatMessage>,
    epoch: u64,
}

/// Names are file names: letters, digits, `.`, `_`, `-`; 1 to 64 of them.
pub fn check_name(name: &str) -> Result<(), SessionError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c));
    if ok {
        Ok(())
    } else {
        Err(SessionError::BadName(name.to_string()))
    }
}

impl SessionStore {
    pub fn new(dir: &Path) -> Self {
        Self { dir: dir.to_owned(), epochs: Mutex::default() }
    }

    /// The history a new turn of `name` starts from.
    pub fn begin(&self, name: &str) -> Result<Turn, SessionError> {
        let epochs = lock(&self.epochs);
        let epoch = epochs.get(name).copied().unwrap_or(0);
        Ok(Turn { history: self.load(name)?, epoch })
    }

    /// Appends a finished turn, unless the session was deleted since it began.
    pub fn finish(&self, name: &str, turn: &Turn, new: &[ChatMessage]) -> Result<(), SessionError> {
        let epochs = lock(&self.epochs);
        if epochs.get(name).copied().unwrap_or(0) != turn.epoch {
            return Err(SessionError::DeletedMeanwhile(name.to_string()));
        }
        self.write_appended(name, new)
    }

    /// The folder the session files are in.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.json"))
    }

    /// The stored messages (none for a new session).
    pub fn load(&self, name: &str) -> Result<Vec<ChatMessage>, SessionError> {
        check_name(name)?;
        match std::fs::read(self.path(name)) {
            Ok(bytes) => {
                serde_json::from_slice(&bytes).map_err(|source| SessionError::Damaged { name: name.into(), source })
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(vec![]),
            Err(source) => Err(SessionError::Io { doing: "reading", name: name.into(), source }),
        }
    }

    /// Appends messages (their text; images are dropped).
    pub fn append(&self, name: &str, new: &[ChatMessage]) -> Result<(), SessionError> {
        let _writing = lock(&self.epochs);
        self.write_appended(name, new)
    }

    fn write_appended(&self, name: &str, new: &[ChatMessage]) -> Result<(), SessionError> {
        let mut all = self.load(name)?;
        all.extend(new.iter().map(|m| ChatMessage { media: vec![], ..m.clone() }));
        let io = |doing| move |source| SessionError::Io { doing, name: name.into(), source };
        mlxbc_shared::paths::create_private_dir(&self.dir).map_err(io("creating the directory of"))?;
        let tmp = self.dir.join(format!(".{name}.json.tmp"));
        // Messages are plain strings: serializing them cannot fail.
        let json = serde_json::to_vec_pretty(&all).unwrap_or_default();
        write_durably(&tmp, &self.path(name), &json).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            io("saving")(e)
        })
    }

    /// Every session.
    pub fn list(&self) -> Vec<SessionInfo> {
        let mut out: Vec<SessionInfo> = std::fs::read_dir(&self.dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.strip_suffix(".json").map(String::from))
            .filter(|n| check_name(n).is_ok())
            .map(|name| SessionInfo { messages: self.load(&name).unwrap_or_default(), name })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    /// Forgets a session; returns it if it existed.
    pub fn delete(&self, name: &str) -> Result<Option<SessionInfo>, SessionError> {
        let mut epochs = lock(&self.epochs);
        let messages = self.load(name)?;
        match std::fs::remove_file(self.path(name)) {
            Ok(()) => {
                // Only sessions that existed are remembered (a turn in flight
                // must not write them back), so deleting made-up names
                // cannot grow this map.
                *epochs.entry(name.to_string()).or_default() += 1;
                Ok(Some(SessionInfo { name: name.into(), messages }))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(SessionError::Io { doing: "deleting", name: name.into(), source }),
        }
    }
}

/// Writes `bytes` to `tmp` (0600), flushes it to the disk, renames it over
/// `path` and flushes the directory, so that after a crash or power loss the
/// file is either the old one or the new one, whole. A full disk fails here
/// (at the write or the fsync), never silently.
fn write_durably(tmp: &Path, path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(tmp, path)?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// Where named conversations are kept.
pub fn sessions_dir(settings: &mlxbc_shared::settings::Settings) -> std::path::PathBuf {
    settings.paths.home.join("sessions")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn append_reload_list_delete_and_bad_names() {
        let dir = tempfile::tempdir().unwrap();
        let s = SessionStore::new(&dir.path().join("sessions"));
        assert!(s.load("new").unwrap().is_empty());
        s.append("work", &[ChatMessage::user("hi"), ChatMessage::assistant("hello")]).unwrap();
        s.append("work", &[ChatMessage::user("again")]).unwrap();
        let again = SessionStore::new(&dir.path().join("sessions"));
        assert_eq!(again.load("work").unwrap().len(), 3);
        assert_eq!(again.list().iter().map(|i| i.name.as_str()).collect::<Vec<_>>(), ["work"]);
        let turn = again.begin("work").unwrap();
        assert_eq!(turn.history.len(), 3);
        assert!(again.delete("work").unwrap().is_some());
        assert!(again.finish("work", &turn, &[ChatMessage::user("late")]).is_err(), "no resurrection");
        assert!(again.load("work").unwrap().is_empty());
        assert!(again.delete("work").unwrap().is_none());
        for bad in ["", "../x", "a/b", ".hidden", &"x".repeat(65)] {
            assert!(again.load(bad).is_err(), "{bad:?}");
        }
    }
}
