//! Ask about an image (async API). The file is read here, with the user's
//! permissions; the daemon gets its hash first and the bytes only if it has
//! never encoded it. `cargo run --example image -- MODEL photo.png "What is this?"`

use mlxbc_client::{Client, ClientError, GenerateRequest, MediaRef, Settings};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), ClientError> {
    let mut args = std::env::args().skip(1);
    let (model, path) = match (args.next(), args.next()) {
        (Some(m), Some(p)) => (m, p),
        _ => {
            eprintln!("usage: image MODEL IMAGE [QUESTION]");
            std::process::exit(2);
        }
    };
    let question = args.next().unwrap_or_else(|| "What is in this picture?".into());
    let bytes = std::fs::read(&path).map_err(|e| ClientError::Unexpected(format!("reading {path}: {e}")))?;
    let mut request = GenerateRequest::ask(question);
    request.model = Some(model);
    request.messages[0].media.push(MediaRef::from_bytes(bytes));
    let mut client = Client::connect_or_start(&Settings::from_env()?).await?;
    let (text, stats) = client.ask(request).await?;
    println!("{text}");
    eprintln!(
        "images: {} from the store, {} encoded ({:.0} ms)",
        stats.encoder_hits, stats.encoder_misses, stats.encode_ms
    );
    Ok(())
}
