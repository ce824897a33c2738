//! `mlxbc prefetch FILE...`: images encoded ahead of time, in batches that
//! fit the daemon's limits (images per request, bytes per frame), so a
//! whole photo folder works: each batch is read from disk only when it is
//! sent (hundreds of photos are never all in memory), progress is printed
//! per batch, and a file the daemon refuses is named with its reason while
//! the rest go on.
//!
//! Found before: every file went in one request, so 480 files failed with
//! "at most 256" and twelve 17 MB photos with a frame-size error.

use anyhow::Result;
use mlxbc_client::{Client, ClientError, MediaRef};
use std::io::{IsTerminal, Write};
use std::path::PathBuf;

/// Images per request: well under the daemon's 256, so one batch's
/// encoding is a short wait and a refusal re-checks few files.
const BATCH_IMAGES: usize = 32;
/// Image bytes per request, under the 64 MiB frame with room for the rest.
const BATCH_BYTES: u64 = 48 << 20;

/// What happened to the files.
#[derive(Debug, Default)]
pub struct Outcome {
    pub encoded: u32,
    pub cached: u32,
    /// Files that could not be prefetched, with why.
    pub failed: Vec<(PathBuf, String)>,
}

/// Splits `files` (with their sizes) into batches of at most
/// [`BATCH_IMAGES`] files and [`BATCH_BYTES`] bytes; a file larger than
/// that goes alone.
pub fn batches(files: &[(PathBuf, u64)]) -> Vec<Vec<(PathBuf, u64)>> {
    let mut out: Vec<Vec<(PathBuf, u64)>> = Vec::new();
    let mut bytes = 0;
    for (path, size) in files {
        let fits = out.last().is_some_and(|b| b.len() < BATCH_IMAGES && bytes + size <= BATCH_BYTES);
        if !fits {
            out.push(Vec::new());
            bytes = 0;
        }
        out.last_mut().expect("just pushed").push((path.clone(), *size));
        bytes += size;
    }
    out
}

/// Prefetches `files` for `model`, printing a line per batch to stderr.
pub async fn run(client: &mut Client, model: Option<&str>, files: &[PathBuf]) -> Result<Outcome> {
    let mut outcome = Outcome::default();
    let mut sized = Vec::new();
    for path in files {
        match std::fs::metadata(path) {
            // Too large for any request: named without being read.
            Ok(m) if m.is_file() && m.len() > mlxbc_client::MAX_FRAME_BYTES as u64 => outcome.failed.push((
                path.clone(),
                format!(
                    "{} MiB: the daemon takes images up to {} MiB",
                    m.len() >> 20,
                    mlxbc_client::MAX_FRAME_BYTES >> 20
                ),
            )),
            Ok(m) if m.is_file() => sized.push((path.clone(), m.len())),
            Ok(_) => outcome.failed.push((path.clone(), "not a file".into())),
            Err(e) => outcome.failed.push((path.clone(), e.to_string())),
        }
    }
    let total = sized.len();
    let mut done = 0;
    let progress = std::io::stderr().is_terminal() || std::env::var_os("MLXBC_PROGRESS").is_some();
    for batch in batches(&sized) {
        let mut media = Vec::new();
        let mut paths = Vec::new();
        for (path, _) in &batch {
            match std::fs::read(path) {
                Ok(bytes) => {
                    media.push(MediaRef::from_bytes(bytes));
                    paths.push(path.clone());
                }
                Err(e) => outcome.failed.push((path.clone(), format!("reading it: {e}"))),
            }
        }
        done += batch.len();
        match client.prefetch(model, media.clone()).await {
            Ok((encoded, cached)) => {
                outcome.encoded += encoded;
                outcome.cached += cached;
            }
            // One bad file refuses its batch: try them one by one, so the
            // good ones are kept and the bad one is named.
            Err(ClientError::Daemon { .. } | ClientError::Frame(_)) if media.len() > 1 => {
                for (m, path) in media.into_iter().zip(paths) {
                    match client.prefetch(model, vec![m]).await {
                        Ok((e, c)) => {
                            outcome.encoded += e;
                            outcome.cached += c;
                        }
                        Err(ClientError::Daemon { message, .. }) => outcome.failed.push((path, message)),
                        Err(e @ ClientError::Frame(_)) => outcome.failed.push((path, too_large(&e))),
                        Err(e) => return Err(e.into()),
                    }
                }
            }
            Err(ClientError::Daemon { message, .. }) => outcome.failed.push((paths[0].clone(), message)),
            Err(e @ ClientError::Frame(_)) => outcome.failed.push((paths[0].clone(), too_large(&e))),
            Err(e) => return Err(e.into()),
        }
        if progress {
            let mut err = std::io::stderr().lock();
            let _ = writeln!(
                err,
                "[{done}/{total}] {} encoded, {} already stored, {} failed",
                outcome.encoded,
                outcome.cached,
                outcome.failed.len()
            );
        }
    }
    Ok(outcome)
}

/// A frame error on one file: the file is larger than a request may be.
fn too_large(e: &ClientError) -> String {
    format!(
        "the file is too large to send ({e}): the daemon takes images up to {} MiB",
        mlxbc_client::MAX_FRAME_BYTES >> 20
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_fit_the_count_and_the_bytes_and_a_big_file_goes_alone() {
        let files: Vec<_> = (0..100).map(|i| (PathBuf::from(format!("{i}.png")), 1000)).collect();
        let b = batches(&files);
        assert_eq!(b.iter().map(Vec::len).collect::<Vec<_>>(), [32, 32, 32, 4]);
        let photos: Vec<_> = (0..12).map(|i| (PathBuf::from(format!("{i}.png")), 17 << 20)).collect();
        let b = batches(&photos);
        assert!(b.iter().all(|b| b.iter().map(|f| f.1).sum::<u64>() <= BATCH_BYTES));
        assert_eq!(b.iter().map(Vec::len).sum::<usize>(), 12);
        let huge = vec![(PathBuf::from("a"), 10), (PathBuf::from("big"), 60 << 20), (PathBuf::from("b"), 10)];
        assert_eq!(batches(&huge).iter().map(Vec::len).collect::<Vec<_>>(), [1, 1, 1]);
        assert!(batches(&[]).is_empty());
    }
}
