//! ollama's `POST /api/pull`, through the same hub fetch as `mlxbc pull`
//! (`mlxbc_pull`): the model is a Hugging Face repo (`org/name`, or
//! ollama's `hf.co/org/name:QUANT`, whose tag picks the GGUF file), fetched
//! into the shared hub cache where the daemon then finds it by that name.
//! Progress streams as ollama's NDJSON status lines; a client that leaves
//! stops the download (a later pull resumes it).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedSender;

#[derive(Deserialize)]
struct PullBody {
    model: Option<String>,
    name: Option<String>,
    #[serde(default = "super::ollama::yes")]
    stream: bool,
}

/// The repo id and the file patterns a pull name asks for.
fn parse_name(name: &str) -> Result<(String, Vec<String>), String> {
    let bare = name.strip_prefix("hf.co/").or_else(|| name.strip_prefix("huggingface.co/")).unwrap_or(name);
    let (repo, tag) = match bare.split_once(':') {
        Some((repo, tag)) => (repo, Some(tag)),
        None => (bare, None),
    };
    let part_ok = |p: &str| {
        !p.is_empty()
            && p.len() <= 96
            && !p.starts_with('.')
            && p.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    };
    let parts: Vec<&str> = repo.split('/').collect();
    if parts.len() != 2 || !parts.iter().all(|p| part_ok(p)) {
        return Err(format!("pull a Hugging Face repo, \"org/name\" or \"hf.co/org/name:QUANT\", not {name:?}"));
    }
    let include = match tag {
        None | Some("latest") => vec![],
        Some(t) if part_ok(t) => vec![format!("*{t}*.gguf"), format!("*{}*.gguf", t.to_uppercase())],
        Some(t) => return Err(format!("tag {t:?}: a quantization such as Q4_K_M")),
    };
    Ok((repo.to_string(), include))
}

/// Reports a file's download as ollama's progress lines (about every 1%).
#[derive(Clone)]
struct Lines {
    tx: UnboundedSender<Value>,
    file: String,
    total: usize,
    completed: usize,
    reported: usize,
}

impl mlxbc_pull::Progress for Lines {
    async fn init(&mut self, size: usize, filename: &str) {
        (self.total, self.file) = (size, filename.to_string());
        let _ = self.tx.send(json!({"status": format!("pulling {filename}"), "digest": filename, "total": size}));
    }
    async fn update(&mut self, size: usize) {
        self.completed += size;
        if self.completed - self.reported > self.total / 100 {
            self.reported = self.completed;
            let _ = self.tx.send(json!({"status": format!("pulling {}", self.file), "digest": self.file,
                                        "total": self.total, "completed": self.completed}));
        }
    }
    async fn finish(&mut self) {
        let _ = self.tx.send(json!({"status": format!("pulling {}", self.file), "digest": self.file,
                                    "total": self.total, "completed": self.total}));
    }
}

/// Runs a pull, sending its status lines; the last is `success` or an error.
async fn run(repo: String, include: Vec<String>, tx: UnboundedSender<Value>) {
    let _ = tx.send(json!({"status": "pulling manifest"}));
    let result = async {
        let plan = mlxbc_pull::plan(&repo, "main", &include).await?;
        for f in &plan.files {
            if !plan.is_cached(f) {
                let lines = Lines { tx: tx.clone(), file: f.clone(), total: 0, completed: 0, reported: 0 };
                plan.fetch(f, lines).await?;
            }
        }
        anyhow::Ok(plan.model_name)
    }
    .await;
    let _ = tx.send(match result {
        Ok(name) => json!({"status": "success", "model": name}),
        Err(e) => json!({"error": format!("{e:#}")}),
    });
}

/// Aborts the pull's task when its response is dropped (the client left).
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// `POST /api/pull`.
pub async fn pull(body: axum::body::Bytes) -> Response {
    let error = |status: StatusCode, message: String| (status, Json(json!({"error": message}))).into_response();
    let b: PullBody = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("request body: {e}")),
    };
    let Some(name) = b.model.or(b.name).filter(|n| !n.is_empty()) else {
        return error(StatusCode::BAD_REQUEST, "model is required".into());
    };
    let (repo, include) = match parse_name(&name) {
        Ok(p) => p,
        Err(e) => return error(StatusCode::BAD_REQUEST, e),
    };
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let task = AbortOnDrop(tokio::spawn(run(repo, include, tx)).abort_handle());
    // The last line is `success` or an error. The stream ends there, not when
    // every sender is gone: hf-hub's chunk tasks hold clones of the progress
    // reporter, and a stalled one may outlive the pull.
    let is_last = |line: &Value| line["status"] == "success" || !line["error"].is_null();
    if !b.stream {
        let mut last = json!({"error": "the pull stopped"});
        while let Some(line) = rx.recv().await {
            let done = is_last(&line);
            last = line;
            if done {
                break;
            }
        }
        drop(task);
        let status = if last["error"].is_null() { StatusCode::OK } else { StatusCode::BAD_GATEWAY };
        return (status, Json(last)).into_response();
    }
    let lines = futures::stream::unfold((rx, Some(task)), move |(mut rx, task)| async move {
        task.as_ref()?;
        let line = rx.recv().await?;
        let task = if is_last(&line) { None } else { task };
        Some((Ok::<_, std::convert::Infallible>(format!("{line}\n")), (rx, task)))
    });
    ([(axum::http::header::CONTENT_TYPE, "application/x-ndjson")], axum::body::Body::from_stream(lines)).into_response()
}

#[cfg(test)]
mod tests {
    use super::parse_name;

    #[test]
    fn pull_names_are_repos_with_an_optional_quantization() {
        assert_eq!(parse_name("org/model").unwrap(), ("org/model".into(), vec![]));
        let (repo, include) = parse_name("hf.co/org/model-GGUF:q4_k_m").unwrap();
        assert_eq!((repo.as_str(), include[1].as_str()), ("org/model-GGUF", "*Q4_K_M*.gguf"));
        for bad in ["llama3", "a/b/c", "../x/y", "org/.hidden", "org/m:../x", "org/m d"] {
            assert!(parse_name(bad).is_err(), "{bad}");
        }
    }
}
